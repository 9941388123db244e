"""The trainer -> config mappings (``rlvitals.analyzers.contract.trainers``): one per trainer, beside the batch
contract, read back by its parser; the client integrations re-export them.

The live trainer objects themselves run in the side-env tests (real verl ``ActorConfig`` in
``tests/client/test_client_integrations_verl.py``, TRL's ``GRPOTrainer`` in ``..._trl_real.py``, OpenRLHF's
``PolicyLoss`` in ``..._openrlhf.py``); here: what the mappings promise about their output.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import fields

import pytest
from rlvitals.analyzers import LossConfig
from rlvitals.analyzers.contract import trainers as tc
from rlvitals.analyzers.contract.batch import parse_config
from rlvitals.analyzers.contract.config import GLOBAL_BATCH_FIELDS, NO_DUAL_CLIP, POLICY_LOSS_FIELDS

# a value off verl's default for every LossConfig field (valid together: dro needs dro_beta)
OFF_DEFAULT = {
    "clip_ratio": 0.25,
    "clip_ratio_low": 0.15,
    "clip_ratio_high": 0.35,
    "clip_ratio_c": 4.0,
    "loss_agg_mode": "seq-mean-token-sum-norm",
    "loss_scale_factor": 512.0,
    "dp_size": 4,
    "batch_num_tokens": 4096,
    "global_batch_size": 64,
    "use_kl_loss": True,
    "kl_loss_type": "k2",
    "kl_loss_coef": 0.02,
    "entropy_coeff": 0.003,
    "loss_mode": "dro",
    "clip_cov_ratio": 0.001,
    "clip_cov_lb": 0.5,
    "clip_cov_ub": 6.0,
    "kl_cov_ratio": 0.003,
    "ppo_kl_coef": 0.2,
    "dro_beta": 0.7,
    "tau_pos": 1.5,
    "tau_neg": 2.5,
    "rollout_correction": {"bypass_mode": True, "rollout_is": "token", "rollout_is_threshold": 3.0},
}


def _verl_actor(values: dict) -> dict:
    """An actor section shaped as verl 0.9.1's ``ActorConfig`` holds it (a ``Mapping``)."""
    actor = {k: v for k, v in values.items() if k not in POLICY_LOSS_FIELDS and k not in GLOBAL_BATCH_FIELDS}
    actor["loss_scale_factor"] = values["loss_scale_factor"]
    actor["policy_loss"] = {k: values[k] for k in POLICY_LOSS_FIELDS}
    actor["global_batch_info"] = {k: values[k] for k in ("dp_size", "batch_num_tokens", "global_batch_size")}
    actor.update(strategy="fsdp", ppo_mini_batch_size=16, rollout_n=4)  # verl keys the loss does not read
    return actor


def test_every_loss_config_field_survives_the_verl_mapping_and_the_parse():
    assert set(OFF_DEFAULT) == {f.name for f in fields(LossConfig)}  # a new field needs a value here
    off, default = LossConfig(**OFF_DEFAULT), LossConfig()
    assert all(getattr(off, k) != getattr(default, k) for k in OFF_DEFAULT)
    sent = tc.verl_loss_config(_verl_actor(OFF_DEFAULT))
    loss, _ = parse_config(sent)
    assert loss == LossConfig(**OFF_DEFAULT)
    assert (sent["tau_pos"], sent["tau_neg"]) == (1.5, 2.5)  # SAPO's: actor section, not policy_loss


def test_the_recording_loss_is_never_the_audited_one():
    actor = _verl_actor({**OFF_DEFAULT, "loss_mode": tc.VERL_LOSS_MODE})
    assert tc.verl_loss_config(actor)["policy_loss"]["loss_mode"] == tc.VERL_DELEGATE
    assert tc.verl_loss_config(actor, delegate="gspo")["policy_loss"]["loss_mode"] == "gspo"
    sent = tc.verl_loss_config(actor, "token-sum", loss_mode="cispo")
    assert sent["loss_agg_mode"] == "token-sum" and sent["policy_loss"]["loss_mode"] == "cispo"


def test_rollout_correction_travels_only_in_bypass_mode():
    section = {"loss_mode": "vanilla", "rollout_correction": {"bypass_mode": False, "rollout_is": "token"}}
    assert "rollout_correction" not in tc.verl_policy_loss_section(section)
    section["rollout_correction"]["bypass_mode"] = True
    assert tc.verl_policy_loss_section(section)["rollout_correction"]["rollout_is"] == "token"


class _PolicyLoss:  # the attributes OpenRLHF 0.11's PolicyLoss holds (the real one: the side-env test)
    clip_eps_low, clip_eps_high, dual_clip, token_level_loss, policy_loss_type = 0.2, 0.28, None, True, "ppo"


def test_openrlhf_mapping_parses_as_the_verl_config_it_names():
    loss, _ = parse_config(tc.openrlhf_loss_config(_PolicyLoss(), batch_num_tokens=100.0 / 3, dp_size=2))
    assert (loss.clip_low, loss.clip_high, loss.clip_ratio_c) == (0.2, 0.28, NO_DUAL_CLIP)
    assert (loss.batch_num_tokens, loss.dp_size) == (100, 6)  # total / gas -> (total, dp_size * gas)
    gspo = type("Gspo", (_PolicyLoss,), {"policy_loss_type": "gspo", "token_level_loss": False})()
    assert tc.openrlhf_loss_config(gspo)["policy_loss"]["loss_mode"] == "gspo"
    unknown = type("Other", (_PolicyLoss,), {"policy_loss_type": "reinforce"})()
    with pytest.raises(ValueError, match="loss_mode must be one of"):  # refused, never audited as PPO
        parse_config(tc.openrlhf_loss_config(unknown))


def test_the_trl_loss_owner_is_the_class_below_the_recorder():
    class GRPOTrainer:
        loss_type = "dapo"

        def _compute_loss(self, model, inputs): ...

    class Recorder:  # as the client's RlvitalsGRPOMixin: records, then calls the next _compute_loss
        _rlvitals_records_loss = True

        def _compute_loss(self, model, inputs): ...

    class MyGRPO(GRPOTrainer):
        def _compute_loss(self, model, inputs): ...

    class Plain(Recorder, GRPOTrainer):
        pass

    class Overridden(Recorder, MyGRPO):
        pass

    assert tc.trl._loss_owner(Plain()) is GRPOTrainer and tc.unaudited_reason(Plain(), {}) is None
    assert tc.trl._loss_owner(Overridden()) is MyGRPO
    assert "MyGRPO overrides GRPOTrainer._compute_loss" in tc.unaudited_reason(Overridden(), {})


def test_the_client_integrations_re_export_the_one_mapping():
    from rlvitals.client.integrations import openrlhf, trl, verl

    assert trl.trl_config_for is tc.trl_config_for
    assert trl.unaudited_reason is tc.unaudited_reason
    assert trl.applied_entropy_coef is tc.applied_entropy_coef
    assert openrlhf.openrlhf_loss_config is tc.openrlhf_loss_config
    assert verl.verl_loss_config is tc.verl_loss_config and verl.LOSS_MODE == tc.VERL_LOSS_MODE
    actor = _verl_actor(OFF_DEFAULT)
    assert verl.loss_config(actor) == tc.verl_loss_config(actor)


def test_the_mappings_import_without_torch_or_the_web_stack():
    code = (
        "import sys\n"
        "from rlvitals.analyzers.contract import trainers as tc\n"
        "tc.openrlhf_loss_config(type('L', (), {})())\n"
        "tc.verl_loss_config({'clip_ratio': 0.3, 'policy_loss': {'loss_mode': 'gspo'}})\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'numpy', 'fastapi', 'sqlalchemy', 'pydantic', 'httpx'))\n"
        "assert not heavy, heavy\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr

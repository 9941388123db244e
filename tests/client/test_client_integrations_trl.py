"""TRL integration: the log callback and the GRPOTrainer mixin.

How it is tested:
- The callback's logic (``TrlLogBridge``) with duck-typed ``TrainingArguments``/``TrainerState`` objects
  carrying GRPOTrainer's real log keys, into a real client run on the in-memory API.
- With transformers importable (the verl venv has transformers 5.10.4), ``RlvitalsCallback`` is a real
  ``TrainerCallback`` driven by transformers' own ``CallbackHandler``; without it, the module still imports
  and ``RlvitalsCallback`` raises an ImportError that says what to install.
- The mixin against a base class whose ``_compute_loss`` is GRPOTrainer's (TRL 0.16–0.2x shape: log-probs
  from ``_get_per_token_logps_and_entropies``, ``old_per_token_logps`` only when ``num_iterations > 1``,
  metrics appended to ``self._metrics``); TRL itself is not installable here (its deps pull a GPU stack).
"""

from __future__ import annotations

import importlib.util
import json
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from rlvitals.analyzers import LossConfig, recompute
from rlvitals.client.integrations import trl as rt
from rlvitals.client.testing import FakeServer
from safetensors.torch import load

import rlvitals

GRPO_LOGS = {
    "loss": 0.0123,
    "grad_norm": 0.8,
    "learning_rate": 1e-6,
    "num_tokens": 12345.0,
    "completions/mean_length": 210.5,
    "rewards/accuracy_reward/mean": 0.4,
    "reward": 0.4,
    "reward_std": 0.3,
    "frac_reward_zero_std": 0.25,
    "kl": 0.002,
    "entropy": 0.9,
    "clip_ratio/low_mean": 0.01,
    "clip_ratio/low_min": 0.0,
    "clip_ratio/high_mean": 0.02,
    "clip_ratio/high_max": 0.05,
    "clip_ratio/region_mean": 0.03,
    "epoch": 0.1,
    "note": "not a number",
}


@pytest.fixture
def server_run(tmp_path):
    server = FakeServer()
    run = rlvitals.init(
        project="trl", name="grpo", transport=server.transport, spool_dir=tmp_path / "s", batch_every=1
    )
    yield server, run
    run.finish(timeout=5)


def _args(**extra):
    fields = {"run_name": "grpo", "loss_type": "dr_grpo", "beta": 0.04, "epsilon": 0.2, "epsilon_high": 0.28,
              "num_iterations": 2, "max_completion_length": 256, "gradient_accumulation_steps": 4, **extra}  # fmt: skip
    return SimpleNamespace(to_dict=lambda: dict(fields), **fields)


def test_bridge_sends_grpo_keys_at_global_step_from_rank_zero_only(server_run):
    server, run = server_run
    bridge = rt.TrlLogBridge(run)
    state = SimpleNamespace(global_step=7, is_world_process_zero=True)
    bridge.on_train_begin(_args(), state, None)
    bridge.on_log(_args(), state, None, logs=GRPO_LOGS)
    bridge.on_log(_args(), SimpleNamespace(global_step=8, is_world_process_zero=False), None, logs=GRPO_LOGS)
    run.finish(timeout=5)
    for key in ("clip_ratio/region_mean", "clip_ratio/low_mean", "clip_ratio/high_mean", "kl", "entropy",
                "frac_reward_zero_std", "reward", "loss"):  # fmt: skip
        assert server.series(run.id, key) == {7: GRPO_LOGS[key]}, key
    assert server.series(run.id, "note") == {}


def test_health_rules_read_the_grpo_keys():
    from rlvitals.analyzers import canonical_signals

    signals = canonical_signals({k: v for k, v in GRPO_LOGS.items() if isinstance(v, float)})
    assert signals["pg_clipfrac"] == 0.03  # clip_ratio/region_mean
    assert signals["kl_loss"] == 0.002 and "ppo_kl" not in signals  # TRL's kl is policy vs reference
    assert signals["entropy"] == 0.9


def test_bridge_starts_a_run_named_after_the_trainer_when_none_is_given(tmp_path, monkeypatch):
    monkeypatch.setenv("RLVITALS_SPOOL_DIR", str(tmp_path))
    server = FakeServer()
    original = rlvitals.client.init
    monkeypatch.setattr(rlvitals.client, "init", lambda **kw: original(transport=server.transport, **kw))
    bridge = rt.TrlLogBridge()
    state = SimpleNamespace(global_step=1, is_world_process_zero=True)
    bridge.on_train_begin(_args(), state, None)
    bridge.on_log(_args(), state, None, logs={"kl": 0.1})
    bridge.on_train_end(_args(), state, None)
    [(key, run_id)] = server.runs.items()
    assert key == ("default", "grpo") and server.series(run_id, "kl") == {1: 0.1}


def test_trainer_settings_map_onto_verl_loss_config():
    mask = torch.ones(4, 6)
    mask[3] = 0
    assert rt.loss_config_for(_args(loss_type="grpo"), mask).loss_agg_mode.value == "seq-mean-token-mean"
    assert rt.loss_config_for(_args(loss_type="bnpo"), mask).loss_agg_mode.value == "token-mean"
    dr = rt.loss_config_for(_args(), mask)
    assert dr.loss_agg_mode.value == "seq-mean-token-sum-norm" and dr.loss_scale_factor == 256
    assert dr.global_batch_size == 4  # TRL counts the empty row
    assert (dr.clip_ratio_low, dr.clip_ratio_high, dr.kl_loss_coef, dr.use_kl_loss) == (0.2, 0.28, 0.04, True)
    accumulating = SimpleNamespace(args=_args(loss_type="grpo"), current_gradient_accumulation_steps=4)
    assert rt.loss_config_for(accumulating, mask).global_batch_size == 16
    dapo = rt.loss_config_for(_args(loss_type="dapo"), mask, {"num_items_in_batch": torch.tensor(80)})
    assert dapo.batch_num_tokens == 80
    with pytest.raises(ValueError, match="loss_type must be one of"):
        rt.loss_config_for(_args(loss_type="sapo-x"), mask)


def test_callback_without_or_with_transformers():
    if importlib.util.find_spec("transformers") is None:
        with pytest.raises(ImportError, match="pip install transformers"):
            rt.RlvitalsCallback  # noqa: B018
        return
    from transformers import TrainerCallback, TrainerControl, TrainerState
    from transformers.trainer_callback import CallbackHandler

    server = FakeServer()
    run = rlvitals.init(project="trl", name="real-cb", transport=server.transport, mode="online")
    callback = rt.RlvitalsCallback(run)
    assert isinstance(callback, TrainerCallback)
    handler = CallbackHandler(
        [callback], model=None, processing_class=None, optimizer=None, lr_scheduler=None
    )
    state = TrainerState()
    state.global_step = 3
    handler.on_log(_args(), state, TrainerControl(), logs=dict(GRPO_LOGS))
    handler.on_step_end(_args(), state, TrainerControl())  # every other event is a no-op
    run.finish(timeout=5)
    assert server.series(run.id, "clip_ratio/region_mean") == {3: 0.03}


# ------------------------------------------------------------------------------------------ mixin


class GRPOTrainerShape:
    """GRPOTrainer's loss path (TRL 0.2x), with a tiny linear 'model' over fixed features."""

    def __init__(self, *, num_iterations=2, loss_type="grpo", beta=0.04, epsilon=0.2, epsilon_high=0.28):
        self.num_iterations, self.loss_type, self.beta = num_iterations, loss_type, beta
        self.epsilon_low, self.epsilon_high = epsilon, epsilon_high
        self.max_completion_length = 6
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        self.state = SimpleNamespace(global_step=4)
        self.accelerator = SimpleNamespace(num_processes=1)

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep,
                                           compute_entropy=False):  # fmt: skip
        logits = model(input_ids)[:, -logits_to_keep:]
        logp = torch.log_softmax(logits, -1)
        token_logp = logp.gather(-1, input_ids[:, -logits_to_keep:, None]).squeeze(-1)
        entropy = -(logp.exp() * logp).sum(-1) if compute_entropy else None
        return token_logp, entropy

    def _compute_loss(self, model, inputs):
        prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
        completion_mask = inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        logits_to_keep = completion_ids.size(1)
        per_token_logps, _ = self._get_per_token_logps_and_entropies(
            model, input_ids, None, logits_to_keep, compute_entropy=True
        )
        ref = inputs["ref_per_token_logps"]
        per_token_kl = torch.exp(ref - per_token_logps) - (ref - per_token_logps) - 1
        advantages = inputs["advantages"]
        old = inputs["old_per_token_logps"] if self.num_iterations > 1 else per_token_logps.detach()
        coef_1 = torch.exp(per_token_logps - old)
        coef_2 = torch.clamp(coef_1, 1 - self.epsilon_low, 1 + self.epsilon_high)
        per_token_loss = -torch.min(coef_1 * advantages.unsqueeze(1), coef_2 * advantages.unsqueeze(1))
        per_token_loss = per_token_loss + self.beta * per_token_kl
        loss = ((per_token_loss * completion_mask).sum(-1) / completion_mask.sum(-1).clamp(min=1.0)).mean()
        is_low = (coef_1 < 1 - self.epsilon_low) & (advantages.unsqueeze(1) < 0)
        is_high = (coef_1 > 1 + self.epsilon_high) & (advantages.unsqueeze(1) > 0)
        region = ((is_low | is_high) * completion_mask).sum() / completion_mask.sum()
        self._metrics["train"]["clip_ratio/region_mean"].append(region.item())
        return loss


class RecordingTrainer(rt.RlvitalsGRPOMixin, GRPOTrainerShape):
    pass


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    batch, completion = 4, 6
    mask = torch.ones(batch, completion, dtype=torch.long)
    mask[1, 4:] = 0
    mask[3, 2:] = 0
    return {
        "prompt_ids": torch.randint(0, 10, (batch, 3), generator=g),
        "completion_ids": torch.randint(0, 10, (batch, completion), generator=g),
        "completion_mask": mask,
        "advantages": torch.randn(batch, generator=g),
        "old_per_token_logps": -torch.rand(batch, completion, generator=g) * 3,
        "ref_per_token_logps": -torch.rand(batch, completion, generator=g) * 3,
    }


def test_mixin_captures_the_loss_tensors_and_reported_clip(server_run):
    server, run = server_run
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 10))
    trainer = RecordingTrainer(rlvitals_run=run)
    inputs = _inputs()
    with torch.no_grad():  # a reference close to the policy (verl clamps k3 at 10, TRL does not)
        logps, _ = GRPOTrainerShape._get_per_token_logps_and_entropies(
            trainer, model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1), None, 6
        )
    inputs["ref_per_token_logps"] = logps + 0.1 * torch.randn(
        logps.shape, generator=torch.Generator().manual_seed(3)
    )
    loss = trainer._compute_loss(model, inputs)
    loss.backward()  # the trainer's loss is untouched
    run.finish(timeout=5)
    [payload] = server.batches[run.id]
    tensors = load(payload)
    meta = json.loads(payload[8 : 8 + int.from_bytes(payload[:8], "little")])["__metadata__"]
    assert meta["step"] == "5"  # logged under the step TRL will log these losses at
    logps, entropy = GRPOTrainerShape._get_per_token_logps_and_entropies(
        trainer, model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1), None, 6, True
    )
    assert torch.allclose(tensors["log_prob"], logps.detach())
    assert torch.allclose(tensors["entropy"], entropy.detach())
    assert torch.equal(tensors["old_log_prob"], inputs["old_per_token_logps"])
    assert torch.equal(tensors["advantages"], inputs["advantages"][:, None].expand(4, 6))
    config = LossConfig(**json.loads(meta["config"]))
    assert config.loss_agg_mode.value == "seq-mean-token-mean" and config.clip_ratio_high == 0.28
    reported = json.loads(meta["reported"])
    names = ("log_prob", "old_log_prob", "advantages", "response_mask", "ref_log_prob")
    again = recompute(config, **{k: tensors[k] for k in names})
    assert again["pg_clipfrac"] == pytest.approx(reported["pg_clipfrac"], abs=1e-6)  # same token set
    # TRL's grpo loss is verl's seq-mean-token-mean policy loss plus beta x the k3 KL loss
    assert again["policy_loss"] == pytest.approx(loss.item(), rel=1e-5)


def test_mixin_with_one_iteration_records_log_probs_as_old(server_run):
    server, run = server_run
    trainer = RecordingTrainer(rlvitals_run=run)
    trainer.num_iterations = 1
    inputs = _inputs(1)
    inputs["old_per_token_logps"] = None  # what TRL stores when every batch is used once
    trainer._compute_loss(torch.nn.Sequential(torch.nn.Embedding(10, 10)), inputs)
    run.finish(timeout=5)
    tensors = load(server.batches[run.id][0])
    assert torch.equal(tensors["log_prob"], tensors["old_log_prob"])


def test_mixin_records_nothing_in_eval(server_run):
    server, run = server_run
    trainer = RecordingTrainer(rlvitals_run=run)
    with torch.no_grad():
        trainer._compute_loss(torch.nn.Sequential(torch.nn.Embedding(10, 10)), _inputs())
    run.finish(timeout=5)
    assert server.batches[run.id] == []


def test_a_recording_failure_never_reaches_the_trainer():
    class Broken:
        def log(self, metrics, step):
            raise OSError("disk full")

        def log_batch(self, step, **batch):
            raise OSError("disk full")

    trainer = RecordingTrainer(rlvitals_run=Broken())
    model = torch.nn.Sequential(torch.nn.Embedding(10, 10))
    with pytest.warns(rt.RecordingError, match="disk full"):
        loss = trainer._compute_loss(model, _inputs())
    trainer._compute_loss(model, _inputs())  # counted, not warned again
    assert loss.requires_grad and trainer.rlvitals_failures.count == 2

"""OpenRLHF integration on real OpenRLHF 0.11.2: ``RecordingPolicyLoss`` around its ``PolicyLoss``, inside
its ``ActorPPOTrainer.training_step``, and the logs-dict logger.

The module builds an ``openrlhf`` side env (``openrlhf==0.11.2 --no-deps`` on torch 2.13.0 CPU, plus the
client's numpy/httpx/safetensors; deepspeed, vLLM, ray, flash-attn and the rest of its dependencies are
not installed) and runs ``openrlhf_side.py`` in it once: 4 actor updates per ``PolicyLoss`` setting (PPO,
asymmetric clip + dual clip, per-sequence mean, GSPO, vLLM importance-sampling correction), each update
2 epochs x 4 micro-batches with an optimizer step every 2 (OpenRLHF's ``iter_grad_accum_global_norm``
normalisers), wrapped and unwrapped with the same seed. Inert stubs stand for the modules OpenRLHF imports
at top level but never uses on this path; the model, the optimizer and ``ppo_train``'s 10-line loop are
ours (the real loop needs CUDA), see ``openrlhf_side.py``. No copy of OpenRLHF's code remains.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from rlvitals.analyzers import LossConfig, recompute
from rlvitals.analyzers.contract.batch import AuditBatch
from rlvitals.analyzers.verdicts.batch_audit import audit_batch
from rlvitals.client.integrations import openrlhf as ro
from rlvitals.client.testing import FakeServer
from safetensors.torch import load

import rlvitals
from tests.support.sideenv import TORCH, ensure, rlvitals_path

pytestmark = pytest.mark.timeout(1200)  # a cold side env build + the OpenRLHF runs, on a 2-core machine

OPENRLHF = (
    (TORCH,),
    ("openrlhf==0.11.2", "--no-deps"),
    ("numpy", "httpx", "safetensors", "-c", "{constraints}"),
)
SCRIPT = Path(__file__).with_name("openrlhf_side.py")
AUDITED = ("ppo", "asymmetric_dual_clip", "seq_mean")


def server_audit(config, tensors, reported):
    """What the server does with an upload: the batch contract validates it, then audits it."""
    return audit_batch(AuditBatch.validate(tensors, config=config, reported=reported))


@pytest.fixture(scope="module")
def side(tmp_path_factory) -> dict:
    python = ensure("openrlhf", OPENRLHF)
    out = tmp_path_factory.mktemp("openrlhf-side")
    env = {**os.environ, "PYTHONPATH": str(rlvitals_path())}
    proc = subprocess.run(
        [str(python), str(SCRIPT), str(out)], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-6000:])
    return {path.stem: json.loads(path.read_text()) for path in out.glob("*.json")}


def _decode(payload_hex: str) -> tuple[dict[str, torch.Tensor], dict, dict, dict]:
    payload = bytes.fromhex(payload_hex)
    meta = json.loads(payload[8 : 8 + int.from_bytes(payload[:8], "little")])["__metadata__"]
    return load(payload), meta, json.loads(meta["config"]), json.loads(meta["reported"])


def test_side_env_runs_openrlhf_0_11_2(side):
    assert side["meta"] == {"openrlhf": "0.11.2", "calls_per_step": 8}


@pytest.mark.parametrize("setting", ["ppo", "asymmetric_dual_clip", "seq_mean", "gspo", "vllm_is"])
def test_wrapper_changes_nothing_in_openrlhf_training(side, setting):
    result = side["losses"][setting]
    assert result["hooked"]["table"] == result["plain"]["table"]  # weights after the updates: bit-identical
    assert result["hooked"]["steps"] == result["plain"]["steps"]  # every metric training_step returned


@pytest.mark.parametrize("setting", AUDITED)
def test_sampled_calls_audit_ok_against_what_openrlhf_returned(side, setting):
    result = side["losses"][setting]
    assert result["failures"] == 0 and result["warnings"] == []
    batches = [_decode(p) for p in result["batches"]]
    assert [int(meta["step"]) for _, meta, _, _ in batches] == list(
        range(1, len(result["plain"]["steps"]) + 1)
    )
    for tensors, _, config, reported in batches:
        again = recompute(
            LossConfig.from_verl(config),
            **{k: tensors[k] for k in ("log_prob", "old_log_prob", "advantages", "response_mask")},
        )
        assert again["pg_loss"] == pytest.approx(reported["pg_loss"], rel=1e-5, abs=1e-6)
        assert again["pg_clipfrac"] == pytest.approx(reported["pg_clipfrac"], abs=1e-6)
        assert again["ppo_kl"] == pytest.approx(reported["ppo_kl"], rel=1e-5, abs=1e-6)
        assert server_audit(config, tensors, reported).ok
        # OpenRLHF normalises by the optimizer step's count / gas (a float): sent as count, dp_size x k
        total = "batch_num_tokens" if config["loss_agg_mode"] == "token-mean" else "global_batch_size"
        assert isinstance(config[total], int) and config[total] > 0


def test_asymmetric_clip_and_dual_clip_reach_the_config(side):
    _, _, config, _ = _decode(side["losses"]["asymmetric_dual_clip"]["batches"][0])
    assert (config["clip_ratio_low"], config["clip_ratio_high"], config["clip_ratio_c"]) == (0.2, 0.28, 3.0)
    _, _, config, _ = _decode(side["losses"]["seq_mean"]["batches"][0])
    assert config["loss_agg_mode"] == "seq-mean-token-mean"


def test_audits_rotate_into_later_epochs_where_openrlhf_clips(side):
    batches = [_decode(p) for p in side["losses"]["ppo"]["batches"]]
    # positions 0-3: epoch 0's 4 micro-batches, 4-5: epoch 1's first two
    assert [int(meta["micro_batch"]) for _, meta, _, _ in batches] == [0, 1, 2, 3, 4, 5]
    on_policy = []
    for tensors, _, _, _ in batches:
        mask = tensors["response_mask"].bool()
        on_policy.append(torch.equal(tensors["log_prob"][mask], tensors["old_log_prob"][mask]))
    assert on_policy == [True, True, False, False, False, False]  # the first optimizer step: after 2
    clip = [reported["pg_clipfrac"] for _, _, _, reported in batches]
    assert clip[:2] == [0.0, 0.0] and clip[4] > 0 and clip[5] > 0  # checked exact by the audit test above


def test_rollout_log_probs_are_sent(side):
    for tensors, _, _, _ in (_decode(p) for p in side["losses"]["ppo"]["batches"]):
        sent = tensors["rollout_log_probs"]
        assert sent.shape == tensors["old_log_prob"].shape and not torch.equal(sent, tensors["old_log_prob"])


def test_vllm_is_correction_leaves_the_loss_unaudited_and_audits_clip_and_kl(side):
    result = side["losses"]["vllm_is"]
    assert result["failures"] == 0
    assert len(result["warnings"]) == 1 and "pg_loss is sent unaudited" in result["warnings"][0]
    for tensors, _, config, reported in (_decode(p) for p in result["batches"]):
        assert "pg_loss" not in reported and {"pg_clipfrac", "ppo_kl"} <= set(reported)
        audit = server_audit(config, tensors, reported).to_dict()
        assert audit["ok"], audit


def test_gspo_is_never_audited_as_ppo(side):
    result = side["losses"]["gspo"]
    if result["batches"]:  # analyzers that audit GSPO: it travels under verl's name
        assert all(_decode(p)[2].get("loss_mode") == "gspo" for p in result["batches"])
    else:  # analyzers that cannot yet: the batch is refused, once, naming the mode
        assert result["failures"] == 4 and len(result["warnings"]) == 1
        assert "got 'gspo'" in result["warnings"][0]


# ------------------------------------------------------------------------ no OpenRLHF needed


def _loss(log_probs, old_log_probs, advantages, action_mask=None, **kwargs):
    """A stand-in inner loss (any callable with PolicyLoss's signature): the wrapper's own behaviour."""
    return (log_probs - old_log_probs).mean(), torch.tensor(0.0), torch.tensor(0.0), None, None


def _batch():
    g = torch.Generator().manual_seed(0)
    return (
        (-torch.rand(2, 3, generator=g)).requires_grad_(),
        -torch.rand(2, 3, generator=g),
        torch.randn(2, 3),
    )


@pytest.fixture
def server_run(tmp_path):
    server = FakeServer()
    run = rlvitals.init(
        project="orl", name="ppo", transport=server.transport, spool_dir=tmp_path / "s", batch_every=1
    )
    yield server, run
    run.finish(timeout=5)


def test_nothing_is_recorded_outside_training(server_run):
    server, run = server_run
    wrapped = ro.RecordingPolicyLoss(_loss, run, calls_per_step=1)
    log_probs, old, adv = _batch()
    with torch.no_grad():
        wrapped(log_probs.detach(), old, adv)
    run.finish(timeout=5)
    assert server.batches.get(run.id, []) == []


def test_a_recording_failure_never_reaches_the_trainer():
    class Broken:
        settings = None

        def log(self, metrics, step):
            raise OSError("disk full")

        def log_batch(self, step, **batch):
            raise OSError("disk full")

    wrapped = ro.RecordingPolicyLoss(_loss, Broken(), calls_per_step=1)
    with pytest.warns(ro.RecordingError, match="disk full"):
        for _ in range(10):  # the sampler arms at step 10 (batch_every defaults to 10)
            loss, *_ = wrapped(*_batch())
    assert loss.requires_grad and wrapped.failures.count == 1


def test_logs_dict_logger(server_run):
    server, run = server_run
    logger = ro.OpenRLHFLogger(run)
    sent = logger.log(
        {"train/policy_loss": 0.1, "train/ppo_clip_ratio": 0.2, "train/ppo_kl": 0.01, "train/kl": 0.002,
         "train/reward": torch.tensor(0.5), "train/response_length": 120, "train/note": "x"}, 3,
    )  # fmt: skip
    assert sent == {"policy_loss": 0.1, "ppo_clip_ratio": 0.2, "ppo_kl": 0.01, "kl": 0.002, "reward": 0.5,
                    "response_length": 120}  # fmt: skip
    run.finish(timeout=5)
    assert server.series(run.id, "ppo_clip_ratio") == {3: 0.2}

    from rlvitals.analyzers import canonical_signals

    signals = canonical_signals(sent)
    assert signals["pg_clipfrac"] == 0.2 and signals["ppo_kl"] == 0.01 and signals["kl_loss"] == 0.002

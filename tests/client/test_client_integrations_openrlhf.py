"""OpenRLHF integration: the recording ``PolicyLoss`` wrapper and the logs-dict logger.

OpenRLHF is not installable here (deepspeed, vLLM, ray); the wrapped losses below are OpenRLHF's
``PolicyLoss.forward`` in its two published shapes — ``(loss, clip_ratio)`` (0.8) and
``(loss, clip_ratio, ppo_kl, vllm_kl)`` (0.9) — and the wrapper is checked against the client's real
run on the in-memory API, with ``rlvitals.analyzers.recompute`` reproducing what the loss reported.
"""

from __future__ import annotations

import json

import pytest
import torch
from rlvitals.analyzers import LossConfig, recompute
from rlvitals.client.integrations import openrlhf as ro
from rlvitals.client.testing import FakeServer
from safetensors.torch import load

import rlvitals


def masked_mean(tensor, mask, dim=None):
    if mask is None:
        return tensor.mean(dim) if dim is not None else tensor.mean()
    return (tensor * mask).sum(dim=dim) / mask.sum(dim=dim)


class PolicyLoss08(torch.nn.Module):
    """OpenRLHF 0.8 ``PolicyLoss`` (openrlhf/models/loss.py)."""

    def __init__(self, clip_eps_low=0.2, clip_eps_high=0.2, token_level_loss=True):
        super().__init__()
        self.clip_eps_low, self.clip_eps_high, self.token_level_loss = (
            clip_eps_low,
            clip_eps_high,
            token_level_loss,
        )

    def forward(self, log_probs, old_log_probs, advantages, action_mask=None):
        ratio = (log_probs - old_log_probs).exp()
        surr1 = ratio * advantages
        surr2 = ratio.clamp(1 - self.clip_eps_low, 1 + self.clip_eps_high) * advantages
        loss = -torch.min(surr1, surr2)
        loss = (
            masked_mean(loss, action_mask, dim=None)
            if self.token_level_loss
            else masked_mean(loss, action_mask, dim=-1).mean()
        )
        clip_ratio = masked_mean(torch.lt(surr2, surr1).float(), action_mask, dim=None)
        return loss, clip_ratio


class PolicyLoss09(PolicyLoss08):
    """OpenRLHF 0.9: also ``ppo_kl`` and ``vllm_kl`` (None without vLLM IS correction)."""

    def forward(self, log_probs, old_log_probs, advantages, action_mask=None, rollout_log_probs=None):
        loss, clip_ratio = super().forward(log_probs, old_log_probs, advantages, action_mask)
        ppo_kl = masked_mean(-(log_probs - old_log_probs), action_mask, dim=None)
        return loss, clip_ratio, ppo_kl, None


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(4, 7)
    mask[0, 5:] = 0
    mask[2, 3:] = 0
    return (
        (-torch.rand(4, 7, generator=g) * 2).requires_grad_(),
        -torch.rand(4, 7, generator=g) * 2,
        torch.randn(4, 7, generator=g),
        mask,
    )


@pytest.fixture
def server_run(tmp_path):
    server = FakeServer()
    run = rlvitals.init(
        project="orl", name="ppo", transport=server.transport, spool_dir=tmp_path / "s", batch_every=1
    )
    yield server, run
    run.finish(timeout=5)


@pytest.mark.parametrize(
    ("inner", "mode"),
    [(PolicyLoss08(0.2, 0.28), "token-mean"), (PolicyLoss09(token_level_loss=False), "seq-mean-token-mean")],
)
def test_wrapper_returns_the_inner_result_and_records_the_call(server_run, inner, mode):
    server, run = server_run
    wrapped = ro.RecordingPolicyLoss(inner, run, step_fn=lambda: 12)
    log_probs, old, adv, mask = _batch()
    result = wrapped(log_probs, old, adv, action_mask=mask)
    expected = inner(log_probs, old, adv, mask)
    assert len(result) == len(expected) and torch.equal(result[0], expected[0])
    result[0].backward()
    assert wrapped.clip_eps_low == inner.clip_eps_low  # attributes reach the inner loss

    run.finish(timeout=5)
    [payload] = server.batches[run.id]
    tensors = load(payload)
    meta = json.loads(payload[8 : 8 + int.from_bytes(payload[:8], "little")])["__metadata__"]
    assert meta["step"] == "12"
    assert torch.equal(tensors["log_prob"], log_probs.detach()) and torch.equal(tensors["old_log_prob"], old)
    config = LossConfig(**json.loads(meta["config"]))
    assert config.loss_agg_mode.value == mode
    reported = json.loads(meta["reported"])
    again = recompute(
        config, **{k: tensors[k] for k in ("log_prob", "old_log_prob", "advantages", "response_mask")}
    )
    assert again["pg_loss"] == pytest.approx(reported["pg_loss"], rel=1e-5)
    assert again["pg_clipfrac"] == pytest.approx(reported["pg_clipfrac"], abs=1e-6)
    if "ppo_kl" in reported:
        assert again["ppo_kl"] == pytest.approx(reported["ppo_kl"], rel=1e-5)


def test_wrapper_counts_steps_and_stays_silent_in_eval(server_run):
    server, run = server_run
    wrapped = ro.RecordingPolicyLoss(PolicyLoss08(), run, calls_per_step=2)
    for _ in range(4):
        wrapped(*_batch())
    log_probs, old, adv, mask = _batch()
    with torch.no_grad():  # an evaluation pass: log-probs without a graph
        wrapped(log_probs.detach(), old, adv, mask)
    run.finish(timeout=5)
    steps = sorted(
        json.loads(p[8 : 8 + int.from_bytes(p[:8], "little")])["__metadata__"]["step"]
        for p in server.batches[run.id]
    )
    assert steps == ["1", "2"]  # first micro-batch of each step (the client's default sampling)


def test_a_recording_failure_never_reaches_the_trainer():
    class Broken:
        def log(self, metrics, step):
            raise OSError("disk full")

        def log_batch(self, step, **batch):
            raise OSError("disk full")

    wrapped = ro.RecordingPolicyLoss(PolicyLoss08(), Broken(), calls_per_step=1)
    with pytest.warns(ro.RecordingError, match="disk full"):
        loss, _ = wrapped(*_batch())
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

"""examples/tiny_grpo.py: a real GRPO loop that learns, whose bad knobs the health rules catch, and whose
instrumentation sends what the client API promises (scalars every step, sampled tensor batches that
reproduce the reported loss metrics)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from rlvitals.analyzers import HealthMonitor, LossConfig, recompute
from rlvitals.client.demo import load_tiny_grpo
from rlvitals.client.testing import FakeServer
from safetensors.torch import load

import rlvitals

tiny = load_tiny_grpo()


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _findings(config, history) -> list[tuple[str, str, int]]:
    monitor = HealthMonitor(run_config=config.run_config())
    found = []
    for step, metrics in enumerate(history.metrics, start=1):
        found += [(f.rule, f.state, f.step) for f in monitor.observe(step, metrics)]
    return found


@pytest.mark.heavy
def test_healthy_preset_learns_and_raises_no_finding():
    config = tiny.PRESETS["healthy"]
    history = tiny.train(config)
    first, last = history.reward[:10], history.reward[-10:]
    assert sum(first) / 10 < 0.2  # random play: about one in ten
    assert sum(last) / 10 > sum(first) / 10 + 0.2  # it learned the task
    assert _findings(config, history) == []


@pytest.mark.heavy
def test_unstable_preset_trips_the_health_rules():
    config = dataclasses.replace(tiny.PRESETS["unstable"], steps=30)
    history = tiny.train(config)
    fired = {rule for rule, state, _ in _findings(config, history) if state == "firing"}
    assert {"ppo_kl_drift", "pg_clipfrac_range", "kl_loss_runaway"} <= fired


def test_same_seed_same_run():
    config = dataclasses.replace(tiny.PRESETS["healthy"], steps=3)
    assert tiny.train(config).reward == tiny.train(config).reward


def test_instrumented_run_sends_scalars_every_step_and_sampled_batches(tmp_path):
    server = FakeServer()
    config = dataclasses.replace(tiny.PRESETS["healthy"], steps=10)
    run = rlvitals.init(
        project="tiny", name="grpo", config=config.run_config(), transport=server.transport,
        spool_dir=tmp_path / "spool", batch_every=5,
    )  # fmt: skip
    history = tiny.train(config, run)
    assert run.finish(timeout=10).complete
    rewards = server.series(run.id, "critic/score/mean")
    assert rewards == pytest.approx(dict(enumerate(history.reward, start=1)))
    for name in ("actor/pg_clipfrac", "actor/ppo_kl", "actor/kl_loss", "actor/entropy", "actor/pg_loss"):
        assert sorted(server.series(run.id, name)) == list(range(1, 11)), name

    batches = server.batches[run.id]
    assert len(batches) == 2  # steps 5 and 10, first micro-batch only
    for payload in batches:
        tensors = load(payload)
        meta = json.loads(payload[8 : 8 + int.from_bytes(payload[:8], "little")])["__metadata__"]
        assert meta["step"] in ("5", "10") and meta["micro_batch"] == "0"
        # the first micro-batch of a step is on-policy: old_log_prob == log_prob before any update
        assert torch.allclose(tensors["log_prob"], tensors["old_log_prob"], atol=1e-6)
        reported = json.loads(meta["reported"])
        names = ("log_prob", "old_log_prob", "advantages", "response_mask", "ref_log_prob", "entropy")
        again = recompute(LossConfig(**json.loads(meta["config"])), **{k: tensors[k] for k in names})
        for metric in ("pg_loss", "pg_clipfrac", "ppo_kl", "kl_loss", "entropy_loss", "policy_loss"):
            assert again[metric] == pytest.approx(reported[metric], rel=1e-5, abs=1e-6), metric
        assert tensors["group_index"].shape == (tensors["log_prob"].shape[0],)


def test_hook_overhead_is_measured_and_small():
    result = tiny.bench(tiny.PRESETS["healthy"], steps=30)
    assert result["step_s_without_hook"] > 0 and result["step_s_with_hook"] > 0
    # The target is < 1% (bench/client.py prints it: 0.2-0.5% on an idle machine); on a loaded shared
    # machine the GIL hand-offs to the client's thread add noise, so these are sanity bounds (10x)
    # that still catch a hook doing real work in the caller.
    assert 0 < result["hook_s_per_step"] < 2e-2 and result["hook_pct"] < 50.0
    assert result["overhead_pct"] < 250.0


def test_goes_unstable_audits_clipped_batches_and_misreports_once():
    """The demo's preset: the last update of a step (after every epoch of reuse) is audited too, with
    tokens clipped; one batch is reported under another aggregation mode on purpose."""
    import dataclasses

    from rlvitals.analyzers import LossConfig, audit
    from rlvitals.examples.tiny_grpo import PRESETS, Trainer

    class Recorder:  # what the trainer hands to the client, nothing more
        def __init__(self):
            self.batches = []

        def log_batch(self, step, **kw):
            self.batches.append((step, kw))

        def log(self, metrics, step):
            pass

    config = dataclasses.replace(PRESETS["goes-unstable"], steps=6, misreport_step=4)
    recorder = Recorder()
    Trainer(config, recorder).train()
    assert config.switch_step() == 3
    assert [s for s, _ in recorder.batches] == [s for s in range(1, 7) for _ in range(2)]  # first + last
    clipped = [kw["reported"]["pg_clipfrac"] for _, kw in recorder.batches[1::2]]
    assert all(c > 0 for c in clipped), clipped  # off-policy: something was clipped
    verdicts = []
    for step, kw in recorder.batches:
        tensors = {
            k: kw[k]
            for k in ("log_prob", "old_log_prob", "advantages", "response_mask", "ref_log_prob", "entropy")
        }
        report = audit(LossConfig(**dataclasses.asdict(kw["config"])), tensors, kw["reported"])
        verdicts.append((step, report.ok))
    assert [v for v in verdicts if not v[1]] == [(4, False)], verdicts

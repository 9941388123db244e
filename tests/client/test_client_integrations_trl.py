"""TRL integration: the log callback and the GRPOTrainer mixin.

How it is tested:
- The callback's logic (``TrlLogBridge``) with duck-typed ``TrainingArguments``/``TrainerState`` objects
  carrying GRPOTrainer's real log keys, into a real client run on the in-memory API.
- With transformers importable (the verl venv has transformers 5.10.4), ``RlvitalsCallback`` is a real
  ``TrainerCallback`` driven by transformers' own ``CallbackHandler``; without it, the module still imports
  and ``RlvitalsCallback`` raises an ImportError that says what to install.
- The mixin, the loss recomputation and the refusals run on the real ``trl.GRPOTrainer`` in
  ``test_client_integrations_trl_real.py`` (TRL 1.16 in a side environment); no copy of TRL code here.
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
from rlvitals.client.integrations import trl as rt
from rlvitals.client.testing import FakeServer

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


def test_a_run_handed_to_the_callback_gets_the_grpo_config(server_run):
    server, run = server_run
    bridge = rt.TrlLogBridge(run)
    bridge.on_train_begin(_args(), SimpleNamespace(global_step=0, is_world_process_zero=True), None)
    bridge.on_log(_args(), SimpleNamespace(global_step=1, is_world_process_zero=True), None, logs={"kl": 0.1})
    run.finish(timeout=5)
    assert server.run_configs[run.id]["num_iterations"] == 2 and len(server.runs) == 1


def test_run_name_comes_from_the_environment_before_the_grpo_config(tmp_path, monkeypatch):
    monkeypatch.setenv("RLVITALS_SPOOL_DIR", str(tmp_path))
    monkeypatch.setenv("RLVITALS_RUN_NAME", "from-env")
    server = FakeServer()
    original = rlvitals.client.init
    monkeypatch.setattr(rlvitals.client, "init", lambda **kw: original(transport=server.transport, **kw))
    bridge = rt.TrlLogBridge()
    bridge.on_train_begin(_args(), SimpleNamespace(global_step=0, is_world_process_zero=True), None)
    bridge.on_train_end(_args(), SimpleNamespace(global_step=0, is_world_process_zero=True), None)
    assert list(server.runs) == [("default", "from-env")]


def test_a_secondary_process_without_a_shared_name_starts_no_run(tmp_path, monkeypatch):
    monkeypatch.setenv("RLVITALS_SPOOL_DIR", str(tmp_path))
    monkeypatch.delenv("RLVITALS_RUN_NAME", raising=False)
    bridge = rt.TrlLogBridge()
    bridge.on_train_begin(
        _args(run_name=None), SimpleNamespace(global_step=0, is_world_process_zero=False), None
    )
    assert bridge.run_ref.current is None  # a generated name would make one run per rank


def test_callback_and_mixin_given_two_runs_is_misuse(server_run, tmp_path):
    _, run = server_run
    other = rlvitals.init(project="trl", name="other", mode="offline", spool_dir=tmp_path / "o")
    bridge = rt.TrlLogBridge(run)
    bridge.adopt(run)  # the same run twice is fine
    with pytest.raises(ValueError, match="two different runs"):
        bridge.adopt(other)
    other.finish(timeout=1)


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


def test_training_again_after_the_run_finished_starts_a_fresh_one(tmp_path, monkeypatch):
    monkeypatch.setenv("RLVITALS_SPOOL_DIR", str(tmp_path))
    server = FakeServer()
    original = rlvitals.client.init
    monkeypatch.setattr(rlvitals.client, "init", lambda **kw: original(transport=server.transport, **kw))
    bridge = rt.TrlLogBridge()
    state = SimpleNamespace(global_step=1, is_world_process_zero=True)
    for _ in range(2):
        bridge.on_train_begin(_args(), state, None)
        bridge.on_log(_args(), state, None, logs={"kl": 0.1})
        bridge.on_train_end(_args(), state, None)
    assert bridge.run_ref.current.state.value == "finished" and list(server.runs) == [("default", "grpo")]

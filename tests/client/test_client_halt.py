"""Halting on a critical incident against a real ``rlvitals serve``: ``run.should_stop()`` (a plain loop),
the TRL callback's step-boundary hook, verl's tracking logger; opt-in only, and never a crash."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import httpx
import pytest
from rlvitals.client import ClientSettings
from rlvitals.client.integrations.trl import TrlLogBridge
from rlvitals.client.integrations.verl import TrainingHalted, VerlTrackingLogger, fit

import rlvitals


def _until(predicate, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_a_plain_loop_stops_at_the_step_after_a_critical_incident(serve, tmp_path, caplog):
    server = serve()
    run = rlvitals.init(url=server.url, project="p", name="halt-loop", spool_dir=tmp_path, halt_on="critical")
    stopped_at = None
    with caplog.at_level(logging.WARNING, logger="rlvitals"):
        for step in range(200):
            if run.should_stop():
                stopped_at = step
                break
            run.log({"actor/pg_loss": float("nan") if step >= 5 else 0.1}, step=step)
            time.sleep(0.05)  # a (very short) training step
    run.finish(timeout=10)
    assert stopped_at is not None and 5 < stopped_at <= 10, stopped_at
    reason = run.halt_reason
    assert reason["cause"] == "non_finite" and reason["onset_step"] == 5
    assert any(str(reason["id"]) in r.getMessage() and "non_finite" in r.getMessage() for r in caplog.records)


@pytest.mark.heavy
def test_a_loop_faster_than_its_sender_still_stops_right_after_the_critical_step(serve, tmp_path):
    # no time between steps: the answer to a step would arrive steps later; should_stop() waits for it
    # (at most halt_wait), so the run stops where a slow loop does
    server = serve()
    run = rlvitals.init(url=server.url, project="p", name="halt-fast", spool_dir=tmp_path, halt_on="critical")
    stopped_at = None
    for step in range(200):
        if run.should_stop():
            stopped_at = step
            break
        run.log({"actor/pg_loss": float("nan") if step >= 5 else 0.1}, step=step)
    run.finish(timeout=10)
    assert stopped_at is not None and 5 < stopped_at <= 10, stopped_at
    assert run.halt_reason["onset_step"] == 5


@pytest.mark.heavy
def test_without_halt_on_a_run_never_stops(serve, tmp_path):
    server = serve()
    run = rlvitals.init(url=server.url, project="p", name="no-halt", spool_dir=tmp_path)
    for step in range(12):
        run.log({"actor/pg_loss": float("nan")}, step=step)
    incidents = f"{server.url}/api/v1/incidents?state=open"
    # the server did open a critical incident (the read waits for the rules to reach the writes)
    assert _until(lambda: httpx.get(incidents).json()["count"] == 1, timeout=10)
    assert not run.should_stop() and run.halt_reason is None
    run.finish(timeout=10)


def test_halt_on_names_the_causes_that_stop_the_run():
    settings = ClientSettings(halt_on=("collapse", "grad_norm_spike"))
    assert settings.halts_on({"cause": "collapse", "primary_rule": "entropy_collapse"})
    assert settings.halts_on({"cause": "instability", "primary_rule": "grad_norm_spike"})
    assert not settings.halts_on({"cause": "non_finite", "primary_rule": "non_finite"})
    assert not ClientSettings().halts_on({"cause": "non_finite"})
    with pytest.raises(TypeError):
        ClientSettings(halt_on=("critical", 3))


def test_trl_callback_sets_should_training_stop_and_should_save(serve, tmp_path):
    server = serve()
    run = rlvitals.init(
        url=server.url, project="p", name="halt-trl", spool_dir=tmp_path, halt_on=("critical",)
    )
    bridge = TrlLogBridge(run, save_on_halt=True)
    args, state = SimpleNamespace(), SimpleNamespace(is_world_process_zero=True, global_step=0)
    stopped = None
    for step in range(1, 200):
        control = SimpleNamespace(should_training_stop=False, should_save=False)
        bridge.on_step_end(args, state, control)
        if control.should_training_stop:
            stopped = (step, control.should_save)
            break
        state.global_step = step
        bridge.on_log(args, state, control, logs={"loss": float("nan") if step >= 3 else 0.5})
        time.sleep(0.05)
    run.finish(timeout=10)
    assert stopped is not None and stopped[1] is True and 3 < stopped[0] <= 8, stopped
    assert bridge.halted["cause"] == "non_finite"


@pytest.mark.heavy
def test_verl_logger_raises_training_halted_and_fit_saves_a_checkpoint(serve, tmp_path, monkeypatch):
    server = serve()
    monkeypatch.setenv("RLVITALS_URL", server.url)
    monkeypatch.setenv("RLVITALS_SPOOL_DIR", str(tmp_path))

    class Trainer:  # verl's RayPPOTrainer.fit shape: log each step's metrics at its end
        def __init__(self) -> None:
            self.logger = VerlTrackingLogger(
                "p", "halt-verl", {"trainer": {"n_gpus_per_node": 8}}, halt_on="critical"
            )
            self.saved_at = None
            self.global_steps = 0

        def fit(self) -> None:
            for step in range(1, 200):
                self.global_steps = step
                self.logger.log({"actor/pg_loss": float("nan") if step >= 4 else 0.1}, step=step)
                time.sleep(0.05)

        def _save_checkpoint(self) -> None:
            self.saved_at = self.global_steps

    trainer = Trainer()
    incident = fit(trainer)
    trainer.logger.finish()
    assert incident is not None and incident["cause"] == "non_finite"
    assert trainer.saved_at is not None and 4 <= trainer.saved_at <= 10
    assert issubclass(TrainingHalted, RuntimeError)

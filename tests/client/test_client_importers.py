"""`rlvitals import verl-jsonl|trl-state` and `rlvitals sync`: retroactive diagnosis of real run histories
(the tiny GRPO trainer's healthy and unstable presets, written in verl's and TRL's own formats), local
and through a real ``rlvitals serve`` process."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import subprocess
import sys

import httpx
import pytest
import torch
from rlvitals.client.demo import load_tiny_grpo
from rlvitals.client.importers import read_trl_state, run_import

tiny = load_tiny_grpo()
# TRL GRPOTrainer names for the tiny trainer's verl-named metrics (TRL logs no ppo_kl)
TRL_NAMES = {
    "actor/pg_clipfrac": "clip_ratio/region_mean",
    "actor/kl_loss": "kl",
    "actor/entropy": "entropy",
    "critic/score/mean": "reward",
    "actor/policy_loss": "loss",
}


@pytest.fixture(scope="module")
def histories():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        healthy = tiny.train(dataclasses.replace(tiny.PRESETS["healthy"], steps=40))
        unstable = tiny.train(dataclasses.replace(tiny.PRESETS["unstable"], steps=25))
    finally:
        torch.set_num_threads(threads)
    return {"healthy": healthy.metrics, "unstable": unstable.metrics}


def _write_verl_jsonl(path, metrics_per_step):
    """Exactly what verl's FileLogger writes: one {"step", "data"} object per line."""
    with open(path, "w") as fh:
        for step, metrics in enumerate(metrics_per_step, start=1):
            fh.write(json.dumps({"step": step, "data": {**metrics, "training/epoch": 0}}) + "\n")
    return path


def _write_trl_state(path, metrics_per_step):
    history = []
    for step, metrics in enumerate(metrics_per_step, start=1):
        entry = {TRL_NAMES[k]: v for k, v in metrics.items() if k in TRL_NAMES}
        history.append({**entry, "learning_rate": 1e-6, "epoch": step / 100, "step": step})
    history.append({"train_runtime": 12.5, "train_loss": 0.1, "step": len(metrics_per_step)})
    path.write_text(json.dumps({"global_step": len(metrics_per_step), "log_history": history}))
    return path


def test_verl_jsonl_unstable_run_is_diagnosed_locally(tmp_path, histories, monkeypatch):
    monkeypatch.delenv("RLVITALS_URL", raising=False)
    path = _write_verl_jsonl(tmp_path / "unstable.jsonl", histories["unstable"])
    out = io.StringIO()
    result = run_import("verl-jsonl", path, out=out)
    assert result.steps == 25
    fired = {f.rule for f in result.findings if f.state == "firing"}
    assert {"ppo_kl_drift", "pg_clipfrac_range"} <= fired
    text = out.getvalue()
    assert "ppo_kl_drift firing" in text and "advice:" in text
    assert "diagnosed locally only" in text


def test_verl_jsonl_healthy_run_has_no_findings(tmp_path, histories, monkeypatch):
    monkeypatch.delenv("RLVITALS_URL", raising=False)
    path = _write_verl_jsonl(tmp_path / "healthy.jsonl", histories["healthy"])
    out = io.StringIO()
    result = run_import("verl-jsonl", path, out=out)
    assert result.findings == [] and result.steps == 40
    assert "no health rule is firing" in out.getvalue()


def test_trl_state_merges_entries_of_a_step_and_finds_the_clip_problem(tmp_path, histories):
    path = _write_trl_state(tmp_path / "trainer_state.json", histories["unstable"])
    steps = read_trl_state(path).points
    assert [s for s, _ in steps] == list(range(1, 26))
    # the end-of-training summary entry is not a step of its own, nor merged into the last one
    assert "train_runtime" not in steps[-1][1] and "clip_ratio/region_mean" in steps[-1][1]
    result = run_import("trl-state", path, upload=False, out=io.StringIO())
    assert "pg_clipfrac_range" in {f.rule for f in result.findings if f.state == "firing"}


def test_bad_inputs_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        run_import("verl-jsonl", tmp_path / "missing.jsonl", out=io.StringIO())
    bad = tmp_path / "state.json"
    bad.write_text('{"global_step": 3}')
    with pytest.raises(ValueError, match="no log_history"):
        run_import("trl-state", bad, upload=False, out=io.StringIO())
    with pytest.raises(ValueError, match="unknown import kind"):
        run_import("wandb", bad, out=io.StringIO())


def _cli(*args, env=None, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "rlvitals.cli", *args],
        capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})},
    )  # fmt: skip


def test_cli_import_sends_the_run_to_a_real_server(tmp_path, histories, serve):
    server = serve()
    path = _write_verl_jsonl(tmp_path / "unstable-run.jsonl", histories["unstable"])
    out = _cli("import", "verl-jsonl", str(path), "--url", server.url, "--project", "imports",
               env={"RLVITALS_SPOOL_DIR": str(tmp_path / "spool")})  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "ppo_kl_drift firing" in out.stdout and "sent to" in out.stdout
    runs = httpx.get(f"{server.url}/api/v1/runs", timeout=10).json()["data"]
    [run] = [r for r in runs if r["name"] == "unstable-run"]
    assert run["project"] == "imports" and run["last_step"] == 25
    alerts = httpx.get(f"{server.url}/api/v1/runs/{run['id']}/alerts", timeout=10).json()["data"]
    assert "ppo_kl_drift" in {a["rule"] for a in alerts}  # the server's own rules agree


def test_cli_offline_import_then_sync(tmp_path, histories, serve):
    spool = tmp_path / "spool"
    path = _write_trl_state(tmp_path / "trainer_state.json", histories["healthy"])
    out = _cli("import", "trl-state", str(path), "--offline", "--name", "trl-run",
               env={"RLVITALS_SPOOL_DIR": str(spool)})  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "offline spool" in out.stdout
    server = serve()
    synced = _cli("sync", str(spool), "--url", server.url)
    assert synced.returncode == 0, synced.stdout + synced.stderr
    runs = httpx.get(f"{server.url}/api/v1/runs", timeout=10).json()["data"]
    [run] = [r for r in runs if r["name"] == "trl-run"]
    assert run["last_step"] == 40


def test_cli_errors_exit_2_with_a_message(tmp_path):
    out = _cli("import", "verl-jsonl", str(tmp_path / "nope.jsonl"), "--no-upload")
    assert out.returncode == 2 and "no such file" in out.stderr
    out = _cli("sync", str(tmp_path / "no-spool"))
    assert out.returncode == 2 and "no spool" in out.stderr


def test_follow_keeps_diagnosing_lines_appended_while_the_job_runs(tmp_path, histories):
    import threading
    import time

    path = _write_verl_jsonl(tmp_path / "live.jsonl", histories["unstable"][:2])
    out = io.StringIO()
    result = {}
    follower = threading.Thread(
        target=lambda: result.update(
            d=run_import("verl-jsonl", path, upload=False, follow=True, follow_idle_exit_s=1.5, out=out)
        )
    )
    follower.start()
    time.sleep(0.3)
    with open(path, "a") as fh:  # verl's FileLogger appends a line per step
        for step, metrics in enumerate(histories["unstable"][2:], start=3):
            fh.write(json.dumps({"step": step, "data": metrics}) + "\n")
    follower.join(timeout=30)
    assert not follower.is_alive()
    assert result["d"].steps == 25
    assert "following" in out.getvalue() and "ppo_kl_drift firing" in out.getvalue()

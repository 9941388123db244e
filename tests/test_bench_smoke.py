"""The benchmarks still run and print their tables (tiny sizes; numbers are not asserted here).

Performance is shown by running bench/*.py and reading the tables, not by timed tests; this only
keeps the harnesses from rotting.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.heavy  # runs each benchmark harness in a child process (tens of seconds each)

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str, timeout: float = 240, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=None if env is None else {**os.environ, **env},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_recompute_bench_prints_its_table():
    out = _run("bench/recompute.py", "--repeats", "2", "--rounds", "1")
    assert "| (64, 4096) |" in out and "M tok/s" in out


def test_client_bench_prints_its_table(tmp_path):
    out = _run(
        "bench/client.py", "--steps", "100", "--batches", "1", "--no-tiny-grpo",
        "--trackio-python", str(tmp_path / "no-such-python"),
    )  # fmt: skip
    assert "p99 µs" in out and "log_batch" in out


@pytest.mark.timeout(400)
def test_ingest_bench_runs_rlvitals_quick(tmp_path):
    out = _run(
        "bench/ingest.py", "--quick", "--only", "rlvitals", "--rounds", "1", "--max-seconds", "2",
        "--peer-venvs", str(tmp_path), timeout=380,
    )  # fmt: skip
    assert "rlvitals" in out and "pts/s" in out
    assert "SQLite alone (the ceiling" in out and "| 100 steps (1,200 points) |" in out  # issue 13


def test_ingest_bench_reference_target_turns_every_rule_off(monkeypatch):
    """``rlvitals-no-rules`` (the write path alone, beside the real server) must really run no rule: the
    environment it gives the server, read as the server reads it, leaves no rule enabled."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))  # the bench's modules import each other flat
    from _peers import Rlvitals
    from rlvitals.analyzers.health.monitor import HealthMonitor
    from rlvitals.service.settings import Settings

    reference = Rlvitals(sys.executable, rules_off=True)
    server = reference.server(ROOT, 1)
    assert "reference" in reference.label and set(server.env) == {"RLVITALS_RULES", "RLVITALS_PLUGINS"}
    for name, value in server.env.items():
        monkeypatch.setenv(name, value)
    settings = Settings()
    assert HealthMonitor(settings=settings.rules).rules == () and settings.plugins is False
    assert HealthMonitor().rules  # the plain target keeps them
    assert Rlvitals(sys.executable).server(ROOT, 1).env == {}


def test_upload_bench_prints_its_table():
    out = _run("bench/upload.py", "--sizes", "4", "--repeat", "1", "--phases", "upload")
    assert "| SQLite | upload | 4 |" in out


def test_latency_bench_prints_its_table():
    """The audit and replica rows (the live rows need Chromium: tests/dashboard prints those figures)."""
    out = _run("bench/latency.py", "--only", "audit,replica", "--repeat", "1", timeout=300)
    assert "| audit (64x4096) | SQLite |" in out
    if os.environ.get("RLVITALS_TEST_PG_URL"):
        assert "| replica wake + audit | PostgreSQL, 2 servers |" in out


def test_rollout_correction_bench_prints_its_table():
    out = _run("bench/rollout_correction.py", "--small", "--repeats", "1")
    assert "| (4, 64) | token TIS + token_k1,seq_mean_k3 |" in out and "M tok/s" in out


@pytest.mark.timeout(900)
def test_detection_bench_runs_ours_and_every_peer_on_two_real_runs():
    from bench._detection import MISSING, corpus_dir

    if corpus_dir() is None:
        pytest.skip(MISSING)
    # the peers run in their side environment (built on first use, cached by stamp)
    out = _run(
        "bench/detection.py", "--runs", "trl_qwen2.5-vl-3b_grpo_oct22_1814,trl_chaos-economy_grpo",
        timeout=880,
    )  # fmt: skip
    for detector in ("rlvitals", "rldoctor 0.2.0", "rlwatch 0.5.1", "rlprobe 0.1.0"):
        assert f"| {detector} |" in out, out
    assert "Per incident" in out and "| trl_chaos-economy_grpo | truncation | 5–… |" in out
    assert "rlvitals incident notifications: " in out and "labelled incidents paged" in out, out


def test_detection_bench_scores_the_synthetic_corpus_without_the_real_one(tmp_path):
    # an empty corpus place: --synthetic must not read the real-log corpus at all
    out = _run(
        "bench/detection.py", "--synthetic", "--runs", "healthy,non_finite,clipfrac_below_band",
        env={"RLVITALS_CORPUS_DIR": str(tmp_path)},
    )  # fmt: skip
    assert "Detection on 12 synthetic streams (9 healthy, 3 labelled incidents)" in out, out
    assert (
        "| rlvitals | 3/3 | 0 |" in out and "| rlvitals | `non_finite` | 3 | +0 | 3 | 0 | 0 | 0 |" in out
    ), out
    assert "| rlvitals | `pg_clipfrac_range` | 0 | — | 0 | 0 | 0 | 3 |" in out, out  # info by design
    assert "| non_finite/seed0 | non_finite | 1000–1002 | +0 |" in out and "- rlvitals: none" in out, out


def test_health_rules_bench_prints_its_table():
    out = _run("bench/health_rules.py", "--ref", "HEAD", "--steps", "300", "--repeats", "1")
    assert "| worktree |" in out and "µs / step" in out


def test_mismatch_bench_prints_its_table():
    out = _run("bench/mismatch.py", "--repeats", "1", "--shape", "8x256")
    assert "| (8, 256) | mismatch_report (all of it) |" in out


def test_tenants_bench_prints_its_table():
    out = _run("bench/tenants.py", "--seconds", "1", "--trainers", "1", "--phases", "none,slow-uploads")
    assert "| none |" in out and "| slow-uploads |" in out and "peak RSS MB" in out

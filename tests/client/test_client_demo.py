"""`rlvitals demo`: the real command end to end — a real `rlvitals serve` on SQLite, two real trainers
through the client, the server's own health rules, the dashboard URLs."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import httpx
import pytest

from tests.support.servers import free_port

pytestmark = pytest.mark.heavy  # runs the demo: a real server and two trainers


def test_demo_serves_trains_both_presets_and_reports_alerts(tmp_path):
    port = free_port()
    env = {**os.environ, "HOME": str(tmp_path), "PYTHONWARNINGS": "ignore"}
    env.pop("RLVITALS_URL", None)
    out = subprocess.run(
        [sys.executable, "-m", "rlvitals.cli", "demo", "--no-serve-forever", "--steps", "25", "--port", str(port)],
        capture_output=True, text=True, timeout=420, env=env,
    )  # fmt: skip
    text = out.stdout
    assert out.returncode == 0, text + out.stderr
    assert f"Dashboard: http://127.0.0.1:{port}/" in text
    assert re.search(rf"healthy +http://127\.0\.0\.1:{port}/runs/\d+", text)
    assert re.search(rf"unstable +http://127\.0\.0\.1:{port}/runs/\d+", text)
    assert "healthy: no alerts" in text
    unstable = text.split("\nunstable:", 1)[1]
    assert "ppo_kl_drift" in unstable or "pg_clipfrac_range" in unstable
    # healthy for the first half: every alert starts at or after the switch (step 13 of 25), mid-chart
    switch = int(re.search(r"from step (\d+) lr", text).group(1))
    assert switch == 13
    onsets = [int(s) for s in re.findall(r"\) from step (\d+):", unstable)]
    assert onsets and all(switch <= s < 25 for s in onsets), onsets
    # the deliberate mismatch, explained in the alert's one-sentence summary: the trainer reported another
    # aggregation mode
    assert "audit_mismatch" in unstable
    assert "reported pg_loss equals seq-mean-token-mean; config says token-mean" in unstable
    delivered = re.findall(r"(\d+)/(\d+) points", text)
    assert len(delivered) == 2 and all(sent == total for sent, total in delivered), delivered
    # --no-serve-forever: the server is gone once the command returns
    try:
        httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1.0)
        raise AssertionError("the demo server is still running")
    except httpx.HTTPError:
        pass
    assert list((tmp_path / ".rlvitals" / "demo").glob("demo-*.db"))

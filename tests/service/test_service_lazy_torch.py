"""The server process never imports torch (~180 MiB of RSS): not to serve scalars, and not to check an
uploaded batch (its header and mask are read without it; only the audit worker process loads torch)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import json, sys, tempfile
    from fastapi.testclient import TestClient
    from rlvitals.service.app import create_app
    from rlvitals.service.settings import Settings

    data = tempfile.mkdtemp()
    app = create_app(Settings(database_url=f"sqlite:///{data}/x.db", data_dir=data))
    seen = {}
    with TestClient(app, base_url="http://127.0.0.1") as client:
        run_id = client.post("/api/v1/runs", json={"name": "scalars"}).json()["id"]
        steps = [{"step": s, "metrics": {"actor/entropy": 1.0 - s / 100, "actor/pg_loss": "NaN"}}
                 for s in range(50)]
        assert client.post(f"/api/v1/runs/{run_id}/metrics", json={"steps": steps}).status_code == 200
        series = client.get(f"/api/v1/runs/{run_id}/metrics", params={"max_points": 0}).json()["series"]
        assert len(series["actor/entropy"]["step"]) == 50
        for path in ("/api/v1/runs", f"/api/v1/runs/{run_id}/alerts", "/metrics", "/healthz", "/"):
            assert client.get(path).status_code == 200, path
        seen["scalars"] = "torch" in sys.modules
        if sys.argv[1:] == ["--batch"]:  # an upload, checked in this process, does not load it either
            from safetensors.numpy import save
            import numpy as np
            x = np.zeros((2, 4), dtype=np.float32)
            body = save({"log_prob": x, "old_log_prob": x, "advantages": x, "response_mask": x + 1},
                        metadata={"step": "1"})
            response = client.post(f"/api/v1/runs/{run_id}/batches", content=body,
                                   headers={"content-type": "application/octet-stream"})
            assert response.status_code == 202, response.text
            seen["batch"] = "torch" in sys.modules
    print(json.dumps(seen))
    """
)


def _run(*args: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, *args], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_scalar_only_server_does_not_import_torch():
    assert _run() == {"scalars": False}


@pytest.mark.heavy
def test_a_batch_upload_does_not_import_torch_in_the_server():
    assert _run("--batch") == {"scalars": False, "batch": False}

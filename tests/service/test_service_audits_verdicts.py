"""Every accepted batch ends in a verdict (agree, mismatch, or "not recomputable: <reason>"), never an
'error'; what can never be audited is refused at upload with a 422 in the error shape, the client's
connection still usable; and the reference path decides where the fast path disagrees with the trainer
(the fast-path defect counted on /metrics). On SQLite and PostgreSQL."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from rlvitals.analyzers import LossConfig, recompute
from rlvitals.analyzers.fast import kernels

from tests.service.batchdata import OCTET, make_batch, make_tensors, wait_done

CORE = ("log_prob", "old_log_prob", "advantages", "response_mask")


def _post(api, run_id, body):
    return api.post(f"/api/v1/runs/{run_id}/batches", content=body, headers=OCTET)


def _audit(api, run_id, body) -> dict:
    response = _post(api, run_id, body)
    assert response.status_code == 202, response.text
    audit = wait_done(api, response.json()["id"])
    assert audit["status"] == "done" and audit["error"] is None, audit
    return audit


def _with_extra(body: bytes, name: str, shape: list[int]) -> bytes:
    """``body`` with one more zero-byte tensor in its header, declaring ``shape``."""
    (n,) = struct.unpack("<Q", body[:8])
    header = json.loads(body[8 : 8 + n])
    end = max(info["data_offsets"][1] for key, info in header.items() if key != "__metadata__")
    header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [end, end]}
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + body[8 + n :]


@pytest.mark.parametrize(
    "config",
    [
        {"dp_size": 10**400, "batch_num_tokens": 10**400, "global_batch_size": 5},
        {"batch_num_tokens": 10**400},
        {"loss_mode": "clip_cov", "clip_cov_ratio": 1e308},
        {"loss_mode": "kl_cov", "kl_cov_ratio": 2.0},
    ],
)
def test_settings_outside_verls_domain_are_refused_at_upload(api, config):
    run_id = api.create_run()
    response = _post(api, run_id, make_batch(1, config=config, reported={"pg_loss": 0.1}))
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["code"] and "config" in error["message"]
    assert api.get(f"/api/v1/runs/{run_id}").status_code == 200  # the client goes on


@pytest.mark.parametrize("shape", [[0, 2**70], [0, 2**64], [2**40, 2**40, 0], [2**70]])
def test_zero_size_tensors_declaring_huge_dimensions_are_a_422(api, shape):
    run_id = api.create_run()
    body = _with_extra(make_batch(1, reported={"pg_loss": 0.1}), "extra", shape)
    response = _post(api, run_id, body)
    assert response.status_code == 422, response.text
    assert "extra" in response.json()["error"]["message"]
    tensors = make_tensors(seed=3)
    honest = recompute(LossConfig(), **{k: tensors[k] for k in CORE})
    assert _audit(api, run_id, make_batch(2, tensors=tensors, reported=honest))["verdict"] == "agree"


def test_bypass_mode_without_a_valid_token_is_not_recomputable(api):
    run_id = api.create_run()
    tensors = make_tensors(seed=4)
    tensors["response_mask"] = torch.zeros_like(tensors["response_mask"])
    audit = _audit(api, run_id, make_batch(1, tensors=tensors, config={"loss_mode": "bypass_mode"},
                                           reported={"pg_loss": 0.0}))  # fmt: skip
    assert audit["verdict"].startswith("not recomputable: ") and "valid token" in audit["verdict"]
    assert audit["ok"] is None


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_a_float16_log_prob_of_minus_infinity_ends_in_a_verdict(api, level):
    # every IS weight 0: verl 0.9.1 itself divides by zero for the effective sample size (was an 'error')
    run_id = api.create_run()
    tensors = {k: v.half() if v.is_floating_point() else v for k, v in make_tensors(seed=5).items()}
    tensors["response_mask"] = tensors["response_mask"].bool()
    tensors["rollout_log_probs"] = tensors["old_log_prob"].clone()
    tensors["old_log_prob"] = torch.full_like(tensors["old_log_prob"], float("-inf"))
    config = {"algorithm": {"rollout_correction": {"rollout_is": level}}}
    audit = _audit(api, run_id, make_batch(1, tensors=tensors, config=config, reported={"pg_loss": 0.0}))
    # the loss is audited; the rollout correction is skipped, saying why (verl's trainer raises there)
    assert audit["verdict"] in ("agree", "mismatch") and "divides by zero" in audit["rollout"]["skipped"]
    # one token of -inf is recomputable: a verdict on the numbers
    tensors["old_log_prob"] = tensors["rollout_log_probs"].clone()
    tensors["old_log_prob"][0, 1] = float("-inf")
    audit = _audit(api, run_id, make_batch(2, tensors=tensors, config=config, reported={"pg_loss": 0.0}))
    assert audit["verdict"] in ("agree", "mismatch")


def test_the_reference_path_decides_when_the_fast_path_disagrees(api, monkeypatch):
    vanilla = kernels._FUSED[kernels.pl.compute_policy_loss_vanilla]

    def off_by_one_percent(batch, config):  # a real fast-path defect: a wrong number from the fast pass
        out = vanilla(batch, config)
        return None if out is None else {**out, "pg_loss": out["pg_loss"] * 1.01}

    run_id = api.create_run()
    tensors = make_tensors(8, 64, seed=6)
    honest = recompute(LossConfig(), **{k: tensors[k] for k in CORE})
    monkeypatch.setitem(kernels._FUSED, kernels.pl.compute_policy_loss_vanilla, off_by_one_percent)
    audit = _audit(api, run_id, make_batch(1, tensors=tensors, reported=honest))
    assert audit["verdict"] == "agree" and audit["ok"] is True and audit["decided_by"] == "reference"
    assert audit["verdicts"]["pg_loss"]["ok"] is True
    assert audit["recomputed"]["pg_loss"] == pytest.approx(honest["pg_loss"], rel=1e-5)
    metrics = api.get("/metrics").text
    assert "rlvitals_fast_path_defects_total 1" in metrics.splitlines()
    # a real mismatch is still one, decided by the reference path too
    wrong = {**honest, "pg_loss": honest["pg_loss"] * 3 + 0.5}
    audit = _audit(api, run_id, make_batch(2, tensors=tensors, reported=wrong))
    assert audit["verdict"] == "mismatch" and audit["decided_by"] == "reference"
    assert audit["verdicts"]["pg_loss"]["ok"] is False


def test_an_agreeing_fast_path_decides_alone(api):
    run_id = api.create_run()
    tensors = make_tensors(8, 64, seed=7)
    honest = recompute(LossConfig(), **{k: tensors[k] for k in CORE})
    audit = _audit(api, run_id, make_batch(1, tensors=tensors, reported=honest))
    assert audit["verdict"] == "agree" and audit["decided_by"] == "fast"
    assert "rlvitals_fast_path_defects_total 0" in api.get("/metrics").text.splitlines()


def test_a_huge_declared_dimension_is_a_422_on_a_connection_that_stays_up(serve):
    # a real server (uvicorn): the 422 comes back on the connection, which then serves the next request
    import http.client

    server = serve()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.request(
            "POST",
            "/api/v1/runs",
            body=json.dumps({"name": "huge"}),
            headers={"content-type": "application/json"},
        )
        created = conn.getresponse()
        run_id = json.loads(created.read())["id"]
        sock = conn.sock
        body = _with_extra(make_batch(1, reported={"pg_loss": 0.1}), "extra", [0, 2**70])
        conn.request("POST", f"/api/v1/runs/{run_id}/batches", body=body, headers=OCTET)
        refused = conn.getresponse()
        error = json.loads(refused.read())["error"]
        assert refused.status == 422 and "extra" in error["message"], error
        assert refused.getheader("connection", "").lower() != "close"
        conn.request("GET", f"/api/v1/runs/{run_id}")
        after = conn.getresponse()
        after.read()
        assert after.status == 200 and conn.sock is sock  # the same connection, not a new one
    finally:
        conn.close()

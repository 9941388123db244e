"""Batches in every dtype trainers run in are audited; the rest are refused at upload (issue 13, item 2).

The tensors and the reported numbers are cases of the verl 0.9.1 golden fixture
(tests/analyzers/golden: produced by running verl's own loss functions in that dtype), uploaded
through the API. Before the fix every float16 audit failed: the "no upper clip" counterfactual
clamped with 1 + 1e30, which overflows float16; float8 passed validation and failed in the audit.
"""

from __future__ import annotations

import json
import math
from functools import cache
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.service.batchdata import OCTET, make_batch, make_tensors, wait_done

GOLDEN = Path(__file__).resolve().parents[1] / "analyzers" / "golden"


@cache
def golden() -> tuple[dict, dict[str, torch.Tensor]]:
    return json.loads((GOLDEN / "verl_0_9_1.json").read_text()), load_file(
        str(GOLDEN / "verl_0_9_1.safetensors")
    )


def golden_cases(dtype: str, count: int = 3) -> list[tuple[dict, dict[str, torch.Tensor]]]:
    meta, store = golden()
    cases = [
        c
        for c in meta["loss_cases"]
        if c["dtype"] == dtype and "mask:empty" not in c["tags"] and not c["config"].get("use_kl_loss")
    ][:count]
    out = []
    for case in cases:
        prefix = case["id"] + "."
        out.append((case, {k[len(prefix) :]: v for k, v in store.items() if k.startswith(prefix)}))
    return out


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_batches_in_trainer_dtypes_are_audited_with_counterfactuals(app_client, tmp_path, dtype):
    api = app_client(f"sqlite:///{tmp_path}/dtypes.db")
    run_id = api.create_run(f"dtype-{dtype}")
    cases = golden_cases(dtype)
    assert cases, f"no {dtype} case in the golden fixture"
    for step, (case, tensors) in enumerate(cases):
        assert tensors["log_prob"].dtype == getattr(torch, dtype)
        config = {k: v for k, v in case["config"].items() if v is not None}
        reported = {k: v for k, v in case["expected"].items() if k in ("pg_loss", "pg_clipfrac", "ppo_kl")}
        body = make_batch(step, tensors={k: v for k, v in tensors.items() if k != "ref_log_prob"}, config=config,
                          reported=reported)  # fmt: skip
        response = api.post(f"/api/v1/runs/{run_id}/batches", content=body, headers=OCTET)
        assert response.status_code == 202, response.text
        audit = wait_done(api, response.json()["id"], timeout=30)
        assert audit["status"] == "done", (case["id"], audit.get("error"))
        assert audit["verdicts"] and all(v["ok"] for v in audit["verdicts"].values()), (case["id"], audit)
        counterfactuals = audit["counterfactuals"]
        assert {"pg_clipfrac", "pg_loss_by_clip", "pg_loss_by_agg_mode"} <= set(counterfactuals), (
            counterfactuals
        )
        # "no dual clip" never binds, so it equals the configured loss wherever no token was dual-clipped
        if case["expected"]["pg_clipfrac_lower"] == 0 and not math.isnan(case["expected"]["pg_loss"]):
            by_clip = counterfactuals["pg_loss_by_clip"]
            assert by_clip["no dual clip"] == by_clip["configured"], (case["id"], by_clip)


@pytest.mark.parametrize(
    ("tensor", "dtype"),
    [
        ("log_prob", torch.float8_e4m3fn),
        ("old_log_prob", torch.float8_e5m2),
        ("advantages", torch.int64),
        ("log_prob", torch.int32),
        ("response_mask", torch.float8_e4m3fn),
        ("response_mask", torch.uint16),
        ("entropy", torch.float8_e4m3fn),
    ],
)
def test_other_dtypes_are_refused_at_upload(app_client, tmp_path, tensor, dtype):
    api = app_client(f"sqlite:///{tmp_path}/refused.db")
    run_id = api.create_run("refused")
    tensors = make_tensors()
    tensors["entropy"] = torch.rand(4, 16)
    tensors[tensor] = tensors[tensor].to(dtype)
    response = api.post(
        f"/api/v1/runs/{run_id}/batches", content=make_batch(0, tensors=tensors), headers=OCTET
    )
    assert response.status_code == 422, response.text
    message = response.json()["error"]["message"]
    assert tensor in message and str(dtype).removeprefix("torch.") in message, message
    assert api.get(f"/api/v1/runs/{run_id}/audits").json()["count"] == 0

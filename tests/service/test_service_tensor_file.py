"""The server checks an upload without torch, and it cannot disagree with the audit worker's loading.

The server reads a batch's safetensors header and its ``response_mask`` values through
``rlvitals.service.tensor_file`` (numpy, no torch: the request-serving process stays ~180 MiB
smaller); the audit worker loads the same entries as torch tensors. Here every kind of bad file the
contract refuses (headers, dtypes, shapes, offsets, mask values in every mask dtype, group indices,
token limits) gets the same answer, word for word, from the torch-free check and from the torch path
the server used before (the worker's ``load_tensors`` + ``AuditBatch.validate``); and a real server
process never loads torch while its audit worker does.
"""

from __future__ import annotations

import json
import os
import random
import struct
import time

import httpx
import pytest
import torch
from rlvitals.analyzers.contract.batch import AuditBatch, BatchError, ConfigError, TooManyTokens
from rlvitals.service import batches
from rlvitals.service.errors import InvalidInput, PayloadTooLarge

from tests.service.batchdata import OCTET, make_batch, make_tensors, wait_done
from tests.support.servers import start_server


def _answer(check) -> tuple[str, str, object]:
    try:
        check()
    except (InvalidInput, PayloadTooLarge) as exc:
        return type(exc).__name__, str(exc), getattr(exc, "detail", None)
    return "accepted", "", None


def _torch_path(body: bytes, max_tokens: int | None) -> None:
    """The server's check before it went torch-free: the worker's loading + the torch contract."""
    meta = batches.read_metadata(body)
    tensors = batches.load_tensors(body)
    config = batches._json_object(meta, "config", 64)
    reported = batches._json_object(meta, "reported", 64)
    try:
        AuditBatch.validate(tensors, config=config, reported=reported, max_tokens=max_tokens)
    except TooManyTokens as exc:
        raise PayloadTooLarge(str(exc), detail=exc.detail) from None
    except ConfigError as exc:
        raise batches._config_error(exc) from exc
    except BatchError as exc:
        raise InvalidInput(str(exc), detail=exc.detail) from None
    batches._int_field(meta, "step", required=True)


def _same(body: bytes, max_tokens: int | None = None) -> tuple[str, str, object]:
    server = _answer(lambda: batches.validate(body, max_tokens=max_tokens))
    worker = _answer(lambda: _torch_path(body, max_tokens))
    assert server == worker, (server, worker)
    return server


def _with_header(body: bytes, edit) -> bytes:
    (n,) = struct.unpack("<Q", body[:8])
    header = json.loads(body[8 : 8 + n])
    edit(header)
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + body[8 + n :]


MASK_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
               torch.float16, torch.bfloat16, torch.float32, torch.float64]  # fmt: skip


@pytest.mark.parametrize("dtype", MASK_DTYPES, ids=str)
@pytest.mark.parametrize("odd", [None, 2, -1, 0.5, float("nan"), float("inf"), 0.1, 255, -0.0])
def test_mask_values_are_judged_alike_in_every_mask_dtype(dtype, odd):
    tensors = make_tensors(seed=1)
    mask = tensors["response_mask"].to(dtype)
    if odd is not None:
        try:
            value = torch.tensor([odd, odd]).to(dtype)
        except (RuntimeError, OverflowError):
            pytest.skip("not representable")
        mask[1, 2], mask[3, 0] = value[0], value[1]
    tensors["response_mask"] = mask
    kind, message, _ = _same(make_batch(1, tensors=tensors))
    exact = dtype == torch.bool or odd is None or float(value[0]) in (0.0, 1.0)
    assert kind == ("accepted" if exact else "InvalidInput"), message
    if kind != "accepted":
        assert message.startswith("response_mask must contain only 0 and 1; found 2 other value(s)")


def _cases() -> list[tuple[str, bytes, int | None]]:
    base = make_tensors(seed=2, grpo=True)

    def batch(**changes) -> bytes:
        tensors = {**base, **changes}
        return make_batch(1, tensors={k: v.clone() for k, v in tensors.items() if v is not None})

    good = batch()
    out = [
        ("good", good, None),
        ("too many tokens", good, 63),
        ("float8 log_prob", batch(log_prob=base["log_prob"].to(torch.float8_e4m3fn)), None),
        ("int advantages", batch(advantages=base["advantages"].to(torch.int32)), None),
        ("uint16 mask", batch(response_mask=base["response_mask"].to(torch.uint16)), None),
        ("1-D entropy", batch(entropy=base["log_prob"][0]), None),
        ("3-D old_log_prob", batch(old_log_prob=base["old_log_prob"][None]), None),
        ("short ref", batch(ref_log_prob=base["log_prob"][:, :3]), None),
        ("empty log_prob", batch(log_prob=base["log_prob"][:0]), None),
        ("unknown tensor", batch(extra=base["log_prob"]), None),
        ("missing advantages", batch(advantages=None), None),
        ("int32 group_index", batch(group_index=base["group_index"].to(torch.int32)), None),
        ("2-D group_index", batch(group_index=base["group_index"][None]), None),
        ("group_index alone", batch(token_level_rewards=None), None),
        (
            "float64 and bf16",
            batch(log_prob=base["log_prob"].double(), entropy=base["log_prob"].bfloat16()),
            None,
        ),
        ("bad config", make_batch(1, tensors=base, config={"clip_ratio": "wide"}), None),
        ("bad reported", make_batch(1, tensors=base, reported={"pg_loss": [1]}), None),
        ("no step", make_batch(1, tensors=base, metadata={"step": None}), None),
        ("not safetensors", b"\x00" * 7, None),
        ("header past the body", struct.pack("<Q", 10**6) + b"{}", None),
        ("header not JSON", struct.pack("<Q", 3) + b"{x}", None),
        ("header a list", struct.pack("<Q", 2) + b"[]", None),
        ("metadata not strings", _with_header(good, lambda h: h.update(__metadata__={"step": 1})), None),
    ]
    edits = {
        "dtype unknown": lambda h: h["log_prob"].update(dtype="F128"),
        "dtype a list": lambda h: h["log_prob"].update(dtype=["F32"]),
        "shape a string": lambda h: h["log_prob"].update(shape="44"),
        "shape negative": lambda h: h["log_prob"].update(shape=[-4, -16]),
        "shape huge, zero-size": lambda h: h["log_prob"].update(shape=[0, 2**70]),
        "offsets past the end": lambda h: h["log_prob"].update(data_offsets=[0, 10**9]),
        "offsets reversed": lambda h: h["log_prob"].update(data_offsets=[256, 0]),
        "three offsets": lambda h: h["log_prob"].update(data_offsets=[0, 1, 2]),
        "entry a string": lambda h: h.update(log_prob="F32"),
        "sizes disagree": lambda h: h["log_prob"].update(shape=[4, 15]),
        "overlap": lambda h: h["old_log_prob"].update(data_offsets=h["log_prob"]["data_offsets"]),
        "float shape": lambda h: h["log_prob"].update(shape=[4.5, 16]),
    }
    out += [(what, _with_header(good, edit), None) for what, edit in edits.items()]
    out.append(("bytes after the last tensor", good + b"\x00" * 8, None))
    return out


@pytest.mark.parametrize(
    ("what", "body", "max_tokens"), _cases(), ids=lambda c: c if isinstance(c, str) else ""
)
def test_every_refusal_is_the_same_without_torch(what, body, max_tokens):
    kind, message, _ = _same(body, max_tokens)
    assert (kind == "accepted") == (what in ("good", "float64 and bf16", "float shape")), (
        what,
        kind,
        message,
    )


def test_random_header_mutations_are_judged_alike():
    rng = random.Random(24)
    good = make_batch(1, tensors=make_tensors(seed=3, grpo=True))
    values = [
        0,
        1,
        -1,
        4,
        16,
        2**31,
        2**64,
        1.5,
        "4",
        None,
        [],
        [4, 16],
        [0, 0],
        {},
        "F32",
        "I64",
        "BOOL",
        "BF16",
    ]
    fields = ["dtype", "shape", "data_offsets"]
    for _ in range(400):

        def edit(header):
            for _ in range(rng.randint(1, 3)):
                name = rng.choice([k for k in header if k != "__metadata__"])
                header[name][rng.choice(fields)] = rng.choice(values)

        _same(_with_header(good, edit))


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc/<pid>/maps (Linux)")
def test_a_real_server_never_loads_torch_while_its_audit_worker_does(tmp_path):
    server = start_server(database_url=f"sqlite:///{tmp_path}/t.db", workdir=tmp_path)
    try:
        with httpx.Client(base_url=server.url, timeout=30) as api:
            run_id = api.post("/api/v1/runs", json={"name": "torchless"}).json()["id"]
            response = api.post(f"/api/v1/runs/{run_id}/batches", content=make_batch(1), headers=OCTET)
            assert response.status_code == 202, response.text
            bad = make_tensors()
            bad["response_mask"][0, 0] = 2
            refused = api.post(
                f"/api/v1/runs/{run_id}/batches", content=make_batch(2, tensors=bad), headers=OCTET
            )
            assert refused.status_code == 422 and "only 0 and 1" in refused.json()["error"]["message"]
            audit = wait_done(api, response.json()["id"], timeout=90)
            assert audit["status"] == "done", audit
            worker = int(float(_metric(api.get("/metrics").text, "rlvitals_audit_worker_pid")))
            time.sleep(0.2)
        assert not _maps_torch(server.popen.pid), "the server process loaded torch"
        assert _maps_torch(worker), "the control: the audit worker process did load torch"
    finally:
        server.stop()


def _metric(text: str, name: str) -> str:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return line.split()[1]
    raise AssertionError(f"{name} not on /metrics")


def _maps_torch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as maps:
        return any("libtorch" in line for line in maps)

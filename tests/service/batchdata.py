"""Build safetensors batch uploads for the service tests, and wait for their audits."""

from __future__ import annotations

import json
import time

import torch
from safetensors.torch import save


def make_tensors(
    batch: int = 4, length: int = 16, *, seed: int = 0, grpo: bool = False
) -> dict[str, torch.Tensor]:
    """Tensors of a plausible PPO micro-batch, all ``(batch, length)`` (+ ``group_index`` ``(batch,)``)."""
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, length, generator=gen) * 2 - 0.1
    new = old + 0.05 * torch.randn(batch, length, generator=gen)
    mask = torch.ones(batch, length)
    mask[:, length * 3 // 4 :] = 0  # padding at the end
    tensors = {
        "log_prob": new,
        "old_log_prob": old,
        "advantages": torch.randn(batch, length, generator=gen),
        "response_mask": mask,
    }
    if grpo:
        group = 4 if batch % 4 == 0 else 1
        index = torch.arange(batch, dtype=torch.int64) // group
        rewards = torch.zeros(batch, length)
        rewards[torch.arange(batch), length * 3 // 4 - 1] = (torch.arange(batch) % 2).float()
        tensors["token_level_rewards"] = rewards
        tensors["group_index"] = index
    return tensors


def make_batch(
    step: int = 0,
    *,
    tensors: dict[str, torch.Tensor] | None = None,
    config: dict | None = None,
    reported: dict | None = None,
    metadata: dict[str, str] | None = None,
    **shape,
) -> bytes:
    tensors = tensors if tensors is not None else make_tensors(**shape)
    meta = {"step": str(step), "config": json.dumps(config or {}), "reported": json.dumps(reported or {})}
    if metadata is not None:
        meta.update(metadata)
    meta = {k: v for k, v in meta.items() if v is not None}
    return save({k: v.contiguous() for k, v in tensors.items()}, metadata=meta)


OCTET = {"content-type": "application/octet-stream"}


def wait_done(api, audit_id: int, timeout: float = 10.0) -> dict:
    """Poll ``GET /api/v1/audits/{id}`` until the audit is no longer pending; its JSON."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        audit = api.get(f"/api/v1/audits/{audit_id}").json()
        if audit["status"] != "pending":
            return audit
        time.sleep(0.01)
    raise AssertionError(f"audit {audit_id} still pending after {timeout}s")

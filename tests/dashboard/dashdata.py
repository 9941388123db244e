"""Test data for the dashboard tests: small audited batches."""

from __future__ import annotations

import torch

CONFIG = {"clip_ratio": 0.2, "clip_ratio_high": 0.28, "loss_agg_mode": "token-mean"}
AGG_MODES = [
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "seq-mean-token-mean",
]


def batch(seed: int, rows: int = 8, length: int = 64) -> dict[str, torch.Tensor]:
    """A ``(rows, length)`` batch: log-probs near the old ones, one advantage per sequence, ~80% valid."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(rows, length, generator=g) * 2
    return {
        "log_prob": old + 0.1 * torch.randn(rows, length, generator=g),
        "old_log_prob": old,
        "advantages": torch.randn(rows, 1, generator=g).expand(rows, length).contiguous(),
        "response_mask": (torch.rand(rows, length, generator=g) > 0.2).to(torch.int64),
    }


def reported(tensors: dict[str, torch.Tensor]) -> dict[str, float]:
    """What an honest trainer reports for ``tensors`` under CONFIG."""
    from rlvitals.analyzers import LossConfig, recompute

    return recompute(LossConfig(**CONFIG), **tensors)

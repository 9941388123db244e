"""Regenerate the verl 0.9.1 golden fixture for cancelling rows (test_analyzers_parity.py).

Needs the real verl 0.9.1 in its side environment (never the project's .venv), as
``make_golden_modes.py`` does::

    .venv/bin/python -c "from tests.support.sideenv import ensure, VERL, rlvitals_path; \\
        print(ensure('verl', VERL)); rlvitals_path()"
    PYTHONPATH=.sidenv-src .sidenv/verl/bin/python tests/analyzers/golden/make_golden_cancel.py

Every case goes through verl's own ``ppo_loss`` (``make_golden_modes._verl_metrics``). The batches are
built so that the loss is a small difference of large parts: GRPO advantages of opposite sign on rows
of similar length (the rows' sums cancel), or per-token advantages of either sign (a row's tokens
cancel). There, how verl rounds (each row summed into a float32 tensor, then those rows added) is a
visible part of its result, so a recomputation that sums in another precision disagrees by 1e-4 and
more. The grid: every loss mode x every agg mode x float32/float64 x the two kinds of cancellation,
clip 0.2/0.28 and ``loss_scale_factor`` 16 (the GSPO setting that first showed it), 240 cases, all
checked on every kernel path. Outputs: ``verl_0_9_1_cancel.{safetensors,json}``.
"""

from __future__ import annotations

import itertools
import json
import random
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from make_golden_modes import AGG_MODES, DTYPES, _config, _record, _verl_metrics  # noqa: E402
from verl_loader import load_verl  # noqa: E402

SEED = 20261206


def _cancelling(rng: random.Random, g: torch.Generator, kind: str) -> dict[str, torch.Tensor]:
    """A ragged batch whose loss cancels: ``grpo``: one advantage per row, alternating in sign with
    nearly the same magnitude on rows of nearly the same length; ``token``: per-token advantages."""
    b, t, f64 = rng.randint(2, 6), rng.choice([24, 57, 96]), torch.float64
    base = rng.randint(t // 2, t)
    lengths = torch.tensor([max(1, min(t, base - rng.randint(0, 2))) for _ in range(b)])
    mask = torch.arange(t)[None, :] < lengths[:, None]
    log_prob = -torch.rand(b, t, generator=g, dtype=f64) * 3.0
    old = log_prob + torch.randn(b, t, generator=g, dtype=f64) * rng.choice([0.01, 0.05])
    # the loss is about -A r: the last row's advantage (grpo) or each row's last valid token's (token)
    # is chosen so that sum A r nearly vanishes, over the batch or over each row
    ratio = torch.exp(log_prob - old) * mask
    near_zero = 1e-4 * rng.choice([-1.0, 1.0])
    if kind == "grpo":
        sign = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(b)], dtype=f64)
        adv = sign * rng.uniform(0.5, 2.0) * (1 + 0.1 * torch.rand(b, generator=g, dtype=f64))
        rows = ratio.sum(-1)
        adv[-1] = -(adv[:-1] * rows[:-1]).sum() / rows[-1] * (1 + near_zero)
        adv = adv[:, None].expand(b, t).clone()
    else:
        adv = torch.randn(b, t, generator=g, dtype=f64) * rng.uniform(0.5, 2.0)
        for i, n in enumerate(lengths.tolist()):
            if n > 1:
                rest = (adv[i, : n - 1] * ratio[i, : n - 1]).sum()
                adv[i, n - 1] = -rest / ratio[i, n - 1] * (1 + near_zero)
    return {
        "log_prob": log_prob,
        "old_log_prob": old,
        "advantages": adv,
        "response_mask": mask,
        "ref_log_prob": log_prob + torch.randn(b, t, generator=g, dtype=f64) * 0.05,
        "entropy": torch.rand(b, t, generator=g, dtype=f64) * 3,
    }


def main() -> None:
    verl = load_verl()
    verl[1].no_padding_2_padding = lambda tensor, data: tensor
    modes = list(verl[0].POLICY_LOSS_REGISTRY)
    rng = random.Random(SEED)
    g = torch.Generator().manual_seed(SEED)
    store: dict[str, torch.Tensor] = {}
    cases = []
    grid = itertools.product(modes, AGG_MODES, DTYPES, ("grpo", "token"))
    for i, (mode, agg, dtype_name, kind) in enumerate(grid):
        tensors = _cancelling(rng, g, kind)
        cfg = _config(rng, mode, agg, tensors["response_mask"], use_global=rng.random() < 0.3)
        cfg.update(clip_ratio_low=0.2, clip_ratio_high=0.28, loss_scale_factor=16.0)
        tensors = {k: v.to(DTYPES[dtype_name]) if v.is_floating_point() else v for k, v in tensors.items()}
        seed = rng.randrange(2**31)
        expected = _verl_metrics(verl, cfg, tensors, seed)
        tags = [f"loss_mode:{mode}", f"mode:{agg}", f"dtype:{dtype_name}", f"cancel:{kind}"]
        _record(store, cases, f"cancel{i:04d}", dtype_name, tensors, cfg, seed, expected, tags)
    save_file(store, str(HERE / "verl_0_9_1_cancel.safetensors"))
    meta = {"verl_version": "0.9.1", "torch_version": torch.__version__, "seed": SEED, "cases": cases}
    (HERE / "verl_0_9_1_cancel.json").write_text(json.dumps(meta, indent=0, sort_keys=True) + "\n")
    size = sum((HERE / f).stat().st_size for f in ("verl_0_9_1_cancel.safetensors", "verl_0_9_1_cancel.json"))
    print(f"{len(cases)} cases over {len(modes)} loss modes, {size / 1e6:.2f} MB")


if __name__ == "__main__":
    main()

"""Cost of the mismatch report (``rlvitals.analyzers.verdicts.mismatch.mismatch_report``) per batch, CPU, one
thread, float32, next to what the audit already pays for the rollout correction alone.

Rows: ``rollout_correction`` (verl's token TIS 2.0 and off-policy metrics: what an audit with
``rollout_log_probs`` computes anyway), ``rollout_debug_metrics`` (verl's ``training/*``) and the
whole report (which calls both, then the quantiles and the where-breakdowns). A batch of 64x4096
with ragged lengths (a quarter to all of 4096 valid tokens), 8 groups, a gap that grows with position.
Calls alternate so every row sees the same machine load; times are the thread's CPU time, medians.

    .venv/bin/python bench/mismatch.py [--repeats 15] [--shape 64x4096]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from rlvitals.analyzers.fast.rollout import rollout_correction, rollout_debug_metrics
from rlvitals.analyzers.verdicts.mismatch import mismatch_report


def _batch(b: int, n: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    train = -torch.rand(b, n, generator=gen) * 3
    rollout = train + 0.02 * torch.randn(b, n, generator=gen) * torch.linspace(0.2, 2.0, n)
    lengths = torch.randint(n // 4, n + 1, (b,), generator=gen)
    mask = (torch.arange(n).unsqueeze(0) < lengths.unsqueeze(1)).float()
    return {"train": train, "rollout": rollout, "mask": mask, "group": torch.arange(b) // max(1, b // 8)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--shape", default="64x4096")
    args = ap.parse_args()
    torch.set_num_threads(1)
    b, n = (int(x) for x in args.shape.split("x"))
    t = _batch(b, n)
    rows = {
        "rollout_correction (token TIS 2.0)": lambda: rollout_correction(
            t["train"], t["rollout"], t["mask"], rollout_is="token", rollout_is_threshold=2.0
        ),
        "rollout_debug_metrics (training/*)": lambda: rollout_debug_metrics(
            t["train"], t["rollout"], t["mask"]
        ),
        "mismatch_report (all of it)": lambda: mismatch_report(
            t["train"], t["rollout"], t["mask"], group_index=t["group"]
        ),
    }
    times: dict[str, list[float]] = {name: [] for name in rows}
    for fn in rows.values():
        fn()  # warm-up
    for _ in range(args.repeats):
        for name, fn in rows.items():
            start = time.thread_time()
            fn()
            times[name].append(time.thread_time() - start)
    base = statistics.median(times["rollout_correction (token TIS 2.0)"])
    print(f"| shape | what | median ms | × rollout_correction |  (one thread, {args.repeats} repeats)")
    print("|---|---|---:|---:|")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"| ({b}, {n}) | {name} | {median * 1e3:.1f} | {median / base:.1f}× |")


if __name__ == "__main__":
    main()

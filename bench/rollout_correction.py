"""Throughput of ``rlvitals.analyzers.rollout_correction`` vs verl 0.9.1's own
``compute_rollout_correction_and_rejection_mask``, CPU, one thread, float32.

Both sides compute the same IS weights, rejection mask and ``rollout_corr/*`` metrics (ending in python
floats) from the same tensors in the same process; the bench asserts the metrics agree (rtol 1e-5, atol
1e-6) before timing. Calls alternate (ours, verl's, verl's, ours, ...) so both see the same machine load;
times are the thread's CPU time (on a shared machine wall time also counts other processes' time
slices); the table reports medians and tokens/s (valid and padded tokens alike).

    .venv/bin/python bench/rollout_correction.py            # rlvitals only
    PYTHONPATH=<rlvitals_path()> <verl side env>/bin/python bench/rollout_correction.py   # side by side

(``tests/support/sideenv.py``: ``ensure("verl", VERL)`` builds the side env, ``rlvitals_path()`` the
import path; verl's heavy runtime imports are stubbed by ``tests/analyzers/golden/verl_loader.py``.)
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SHAPES = ((64, 4096), (8, 16384))
RS_ALONE = {  # every rejection option alone (thresholds that keep some tokens and reject others)
    f"rs {option}": {"rollout_rs": option, "rollout_rs_threshold": "0.8_1.25" if option.endswith("k1") else 0.01}
    for option in ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
                   "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
}  # fmt: skip
CONFIGS = {
    "off-policy metrics only": {},
    "token TIS 2.0": {"rollout_is": "token", "rollout_is_threshold": 2.0},
    "token IcePop 0.8_1.2": {"rollout_is": "token", "rollout_is_threshold": "0.8_1.2"},
    "token TIS + batch norm": {
        "rollout_is": "token",
        "rollout_is_threshold": 1.1,
        "rollout_is_batch_normalize": True,
    },
    "sequence TIS 2.0": {"rollout_is": "sequence", "rollout_is_threshold": 2.0},
    "sequence IcePop + batch norm": {
        "rollout_is": "sequence",
        "rollout_is_threshold": "0.5_5.0",
        "rollout_is_batch_normalize": True,
    },
    "token TIS + token_k1,seq_mean_k3": {
        "rollout_is": "token",
        "rollout_rs": "token_k1,seq_mean_k3",
        "rollout_rs_threshold": "0.8_1.25,0.01",
    },
    **RS_ALONE,
    "token IcePop + all 11 options chained": {
        "rollout_is": "token",
        "rollout_is_threshold": "0.8_1.2",
        "rollout_rs": ",".join(o["rollout_rs"] for o in RS_ALONE.values()),
        "rollout_rs_threshold": ",".join(str(o["rollout_rs_threshold"]) for o in RS_ALONE.values()),
    },
}
# the other entry points, beside verl's compute_rollout_corr_metrics_from_logprobs / calculate_debug_metrics
FUNCTIONS = ("rollout_corr_metrics (actor)", "rollout_debug_metrics (training/*)")


def make_batch(batch: int, length: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, length, generator=g) * 3
    rollout = old + 0.05 * torch.randn(batch, length, generator=g)
    lengths = torch.randint(length // 4, length + 1, (batch,), generator=g)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).to(torch.int64)
    return old, rollout, mask


def _verl():
    sys.path.insert(0, str(ROOT / "tests" / "analyzers" / "golden"))
    try:
        from verl_loader import load_verl

        load_verl()
        from verl.trainer.ppo import rollout_corr_helper
        from verl.utils.debug import metrics as debug
    except ImportError:
        return None

    def debug_metrics(old, rollout, mask):
        batch = {"rollout_log_probs": rollout, "old_log_probs": old, "response_mask": mask,
                 "responses": torch.zeros(mask.shape, dtype=torch.int64)}  # fmt: skip
        return debug.calculate_debug_metrics(types.SimpleNamespace(batch=batch))

    return {
        "correction": rollout_corr_helper.compute_rollout_correction_and_rejection_mask,
        FUNCTIONS[0]: rollout_corr_helper.compute_rollout_corr_metrics_from_logprobs,
        FUNCTIONS[1]: debug_metrics,
    }


def _metrics(result):
    return result[2] if isinstance(result, tuple) else result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9, help="timed calls per side and case")
    parser.add_argument("--small", action="store_true", help="tiny shapes (a smoke run)")
    parser.add_argument("--only", help="configurations whose name contains one of these |-separated words")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from rlvitals.analyzers import rollout_corr_metrics, rollout_correction, rollout_debug_metrics

    verl = _verl()
    shapes = ((4, 64),) if args.small else SHAPES
    cases = [(name, rollout_correction, "correction", options) for name, options in CONFIGS.items()]
    cases += [(FUNCTIONS[0], rollout_corr_metrics, FUNCTIONS[0], {})]
    cases += [(FUNCTIONS[1], rollout_debug_metrics, FUNCTIONS[1], {})]
    if args.only:
        cases = [c for c in cases if any(word in c[0] for word in args.only.split("|"))]
    head = "| shape | configuration | rlvitals ms | rlvitals M tok/s |"
    head += " verl ms | speed-up |" if verl else ""
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for batch, length in shapes:
        tensors = make_batch(batch, length)
        for name, ours, key, options in cases:
            sides = {"ours": functools.partial(ours, *tensors, **options)}
            if verl is not None:
                sides["verl"] = functools.partial(verl[key], *tensors, **options)
            times: dict[str, list[float]] = {side: [] for side in sides}
            for fn in sides.values():
                fn()  # warm up
            if verl is not None:  # same numbers first (float32 tolerances of the golden tests)
                ours_m, theirs_m = _metrics(sides["ours"]()), _metrics(sides["verl"]())
                assert set(ours_m) == set(theirs_m), set(ours_m) ^ set(theirs_m)
                for k, value in ours_m.items():
                    other = float(theirs_m[k])
                    std = k.endswith("_std") and not k.endswith("_seq_std")  # sqrt(E[x^2] - E[x]^2): cancels
                    tol = 1e-6 + 1e-5 * abs(other) if not std else 1e-5 + 1e-3 * abs(other)
                    assert abs(value - other) <= tol or value == other, (name, k, value, other)
            for i in range(args.repeats):
                for side in sorted(sides, reverse=i % 2 == 1):  # alternate who goes first
                    start = time.thread_time()
                    sides[side]()
                    times[side].append(time.thread_time() - start)
            mine = statistics.median(times["ours"])
            row = f"| {(batch, length)} | {name} | {mine * 1e3:.1f} | {batch * length / mine / 1e6:.1f} |"
            if verl is not None:
                other = statistics.median(times["verl"])
                row += f" {other * 1e3:.1f} | {other / mine:.2f}x |"
            print(row, flush=True)


if __name__ == "__main__":
    main()

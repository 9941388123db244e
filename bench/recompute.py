"""Throughput of ``rlvitals.analyzers.recompute`` vs verl 0.9.1's own loss functions, CPU, one thread.

Both sides compute the same numbers from the same float32 tensors in the same process: the clipped
policy loss with dual clip (pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower), the entropy term and the
low_var_kl KL term, token-mean, ending in python floats. verl's side is ``compute_policy_loss_vanilla``
+ ``agg_loss`` + ``kl_penalty`` exactly as its ``ppo_loss`` calls them. Calls alternate (ours, verl's,
verl's, ours, ...) so both see the same machine load; the table reports medians. Also times a full ``audit`` (with
counterfactuals) of the (64, 4096) batch.

    .venv/bin/python bench/recompute.py                     # rlvitals only
    /work/verl-venv/bin/python bench/recompute.py           # side by side (verl importable there;
                                                            #  pip install -e . --no-deps first)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SHAPES = ((64, 4096), (8, 16384))


def make_batch(batch: int, length: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    log_prob = -torch.rand(batch, length, generator=g) * 3
    lengths = torch.randint(length // 4, length + 1, (batch,), generator=g)
    return {
        "log_prob": log_prob,
        "old_log_prob": log_prob + torch.randn(batch, length, generator=g) * 0.3,
        "advantages": torch.randn(batch, 1, generator=g).expand(batch, length).contiguous(),
        "response_mask": torch.arange(length)[None, :] < lengths[:, None],
        "ref_log_prob": log_prob + torch.randn(batch, length, generator=g) * 0.1,
        "entropy": torch.rand(batch, length, generator=g) * 2,
    }


def load_verl():
    sys.path.insert(0, str(ROOT / "tests" / "analyzers" / "golden"))
    try:
        from verl_loader import load_verl as _load
    except ImportError:
        return None
    try:
        return _load()
    except ImportError:
        return None


def verl_step(core_algos, actor, t: dict[str, torch.Tensor]) -> dict[str, float]:
    """What verl's ppo_loss computes for these tensors (without its TensorDict plumbing)."""
    mask = t["response_mask"]
    pg_loss, metrics = core_algos.compute_policy_loss_vanilla(
        t["old_log_prob"], t["log_prob"], t["advantages"], mask, "token-mean", actor
    )
    entropy_loss = core_algos.agg_loss(t["entropy"], mask, "token-mean", **actor.global_batch_info)
    kld = core_algos.kl_penalty(t["log_prob"], t["ref_log_prob"], "low_var_kl")
    kl_loss = core_algos.agg_loss(kld, mask, "token-mean", **actor.global_batch_info)
    policy_loss = pg_loss - 0.01 * entropy_loss + kl_loss * 0.001
    return {
        **metrics,
        "pg_loss": pg_loss.item(),
        "entropy_loss": entropy_loss.item(),
        "kl_loss": kl_loss.item(),
        "policy_loss": policy_loss.item(),
    }


def interleaved_timings(fns: list, repeats: int) -> list[list[float]]:
    """Seconds per call of each function, run alternately (a, b, b, a, ...) so that machine load hits
    all of them alike; one warm-up call each first."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for i in range(repeats):
        order = range(len(fns)) if i % 2 == 0 else reversed(range(len(fns)))
        for j in order:
            start = time.perf_counter()
            fns[j]()
            times[j].append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the median over all runs")
    args = parser.parse_args()
    torch.set_num_threads(1)

    from rlvitals.analyzers import LossConfig, audit, recompute

    config = LossConfig(use_kl_loss=True, entropy_coeff=0.01, kl_loss_type="low_var_kl")
    verl = load_verl()
    actor = None
    if verl is not None:
        from verl.workers.config import FSDPActorConfig

        actor = FSDPActorConfig(
            strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio_c=3.0
        )

    print(f"torch {torch.__version__}, 1 thread, float32, median of {args.repeats * args.rounds} runs")
    if verl is None:
        print("verl 0.9.1 not importable here: rlvitals column only")
    print(
        "| shape | tokens | rlvitals recompute | verl 0.9.1 | speed-up (medians) | speed-up (best runs) "
        "| full audit + counterfactuals |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for batch, length in SHAPES:
        t = make_batch(batch, length)
        tokens = batch * length
        reported = recompute(config, **t)
        if verl is not None:  # same numbers before timing anything
            theirs_metrics = verl_step(verl[0], actor, t)
            for key, value in reported.items():
                other = theirs_metrics.get(key, theirs_metrics.get(f"actor/{key}"))
                assert abs(value - other) <= 1e-6 + 1e-5 * abs(other), (key, value, other)
        fns = [lambda t=t: recompute(config, **t)]
        if verl is not None:
            fns.append(lambda t=t: verl_step(verl[0], actor, t))
        timings = interleaved_timings(fns, args.repeats * args.rounds)
        ours = statistics.median(timings[0])
        audit_s = statistics.median(
            interleaved_timings([lambda t=t, r=reported: audit(config, t, r)], max(5, args.repeats // 3))[0]
        )
        ours_col = f"{tokens / ours / 1e6:.1f} M tok/s ({ours * 1e3:.2f} ms)"
        if verl is not None:
            theirs = statistics.median(timings[1])
            verl_col = f"{tokens / theirs / 1e6:.1f} M tok/s ({theirs * 1e3:.2f} ms)"
            ratio = f"{theirs / ours:.2f}x"
            best = f"{min(timings[1]) / min(timings[0]):.2f}x"
        else:
            verl_col = ratio = best = "n/a"
        print(
            f"| ({batch}, {length}) | {tokens} | {ours_col} | {verl_col} | {ratio} | {best} | {audit_s * 1e3:.1f} ms |"
        )


if __name__ == "__main__":
    main()

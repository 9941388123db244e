"""Throughput of ``rlvitals.analyzers.recompute`` vs verl 0.9.1's own loss functions, CPU, one thread.

Both sides compute the same numbers from the same float32 tensors in the same process (asserted, rtol
1e-5 / atol 1e-6, before timing): the policy loss of each ``loss_mode`` with its metrics, the entropy term
and the low_var_kl KL term, token-mean, ending in python floats. verl's side is its registered policy loss
function + ``agg_loss`` + ``kl_penalty`` exactly as its ``ppo_loss`` calls them. Calls alternate (ours,
verl's, verl's, ours, ...) so both see the same machine load; times are the thread's CPU time (wall time
on a shared machine also counts other processes' time slices); the table reports medians. For vanilla it
also times each side in a block of its own ("alone") and a full ``audit`` (with counterfactuals). The
machine's one-thread memory bandwidth comes from a 256 MiB tensor copy; "bandwidth used" is the input
bytes read once / ``recompute``'s time / that bandwidth (every input byte: the sparse passes do not read
the masked groups of tokens, so they move less than that). ``--explain`` walks, one change at a time, from a
plain timing (vanilla alone, scattered 80 % mask, no entropy) to this benchmark's setting.

    .venv/bin/python bench/recompute.py                     # rlvitals only
    PYTHONPATH=.sidenv-src <sidenv>/verl/bin/python bench/recompute.py --explain   # side by side (the
        # verl side env of tests/support/sideenv.py; .sidenv-src maps this checkout onto rlvitals)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# CPU time of this thread: on a shared machine wall time also counts the time the scheduler gives
# other processes, which says nothing about either side (both sides run in this one thread)
clock = time.thread_time
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


def verl_step(core_algos, actor, t: dict[str, torch.Tensor], mode: str = "vanilla") -> dict[str, float]:
    """What verl's ppo_loss computes for these tensors (without its TensorDict plumbing)."""
    mask = t["response_mask"]
    pg_loss, metrics = core_algos.get_policy_loss_fn(mode)(
        old_log_prob=t["old_log_prob"],
        log_prob=t["log_prob"],
        advantages=t["advantages"],
        response_mask=mask,
        loss_agg_mode="token-mean",
        config=actor,
        rollout_is_weights=None,
    )
    entropy_loss = core_algos.agg_loss(t["entropy"], mask, "token-mean", **actor.global_batch_info)
    kld = core_algos.kl_penalty(t["log_prob"], t["ref_log_prob"], "low_var_kl")
    kl_loss = core_algos.agg_loss(kld, mask, "token-mean", **actor.global_batch_info)
    policy_loss = pg_loss - 0.01 * entropy_loss + kl_loss * 0.001
    return {
        **{k.split("/")[-1] if not k.startswith("rollout_corr/") else k: v for k, v in metrics.items()},
        "pg_loss": pg_loss.item(),
        "entropy_loss": entropy_loss.item(),
        "kl_loss": kl_loss.item(),
        "policy_loss": policy_loss.item(),
    }


def verl_actor(mode: str):
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.workers.config import FSDPActorConfig
    from verl.workers.config.actor import PolicyLossConfig

    extra = {"dro_beta": 0.1} if mode == "dro" else {}
    if mode == "bypass_mode":  # nothing rejected, no weights: the settings rlvitals computes without h11roll
        extra["rollout_correction"] = RolloutCorrectionConfig(rollout_is=None)
    return FSDPActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio_c=3.0,
        policy_loss=PolicyLossConfig(loss_mode=mode, **extra),
    )


def our_config(mode: str):
    from rlvitals.analyzers import LossConfig

    extra = {"dro_beta": 0.1} if mode == "dro" else {}
    if mode == "bypass_mode":
        extra["rollout_correction"] = {"rollout_is": None}
    return LossConfig(
        use_kl_loss=True, entropy_coeff=0.01, kl_loss_type="low_var_kl", loss_mode=mode, **extra
    )


COPY_BYTES = 256 << 20  # far larger than any cache: the copy streams from and to DRAM


def memory_bandwidth(nbytes: int = COPY_BYTES, repeats: int = 7) -> float:
    """Bytes per second moved (read + written) by one thread copying a ``nbytes`` tensor: the
    machine's one-thread memory bandwidth (median of ``repeats`` copies, CPU time)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch
    times = []
    for _ in range(repeats):
        start = clock()
        dst.copy_(src)
        times.append(clock() - start)
    return 2 * nbytes / statistics.median(times)


def interleaved_timings(fns: list, repeats: int) -> list[list[float]]:
    """Seconds per call of each function, run alternately (a, b, b, a, ...) so that machine load hits
    all of them alike; one warm-up call each first."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for i in range(repeats):
        order = range(len(fns)) if i % 2 == 0 else reversed(range(len(fns)))
        for j in order:
            start = clock()
            fns[j]()
            times[j].append(clock() - start)
    return times


def block_timings(fn, repeats: int) -> list[float]:
    fn()
    out = []
    for _ in range(repeats):
        start = clock()
        fn()
        out.append(clock() - start)
    return out


def scattered_batch(batch: int, length: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """The plain timing's batch: 80 % of the tokens valid, scattered, per-row advantages, no entropy."""
    t = make_batch(batch, length, seed)
    g = torch.Generator().manual_seed(seed + 1)
    t["response_mask"] = torch.rand(batch, length, generator=g) < 0.8
    del t["entropy"]
    return t


def verl_plain(core_algos, actor, t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
    """The plain timing's verl side: compute_policy_loss_vanilla + kl_penalty + agg_loss, tensors out."""
    mask = t["response_mask"]
    pg_loss, metrics = core_algos.compute_policy_loss_vanilla(
        old_log_prob=t["old_log_prob"],
        log_prob=t["log_prob"],
        advantages=t["advantages"],
        response_mask=mask,
        loss_agg_mode="token-mean",
        config=actor,
    )
    kld = core_algos.kl_penalty(t["log_prob"], t["ref_log_prob"], "low_var_kl")
    return pg_loss + 0.001 * core_algos.agg_loss(kld, mask, "token-mean", **actor.global_batch_info), metrics


def explain(verl, n: int) -> None:
    """From the plain timing's setting to the benchmark's, one change at a time, vanilla 64x4096."""
    from rlvitals.analyzers import recompute

    config, actor = our_config("vanilla"), verl_actor("vanilla")
    core = verl[0]
    plain, bench = scattered_batch(64, 4096), make_batch(64, 4096)
    no_entropy = {k: v for k, v in bench.items() if k != "entropy"}
    steps = [
        (
            "plain: 80 % scattered mask, no entropy, verl's tensors not read, each side alone",
            plain,
            "plain",
            False,
        ),
        ("+ verl's metrics read as floats (.item())", plain, "floats", False),
        ("+ the benchmark's mask (valid prefix, ~62 % valid)", no_entropy, "floats", False),
        ("+ the entropy term on both sides", bench, "bench", False),
        ("+ calls alternating (the benchmark)", bench, "bench", True),
    ]
    print()
    print("What the benchmark adds to a plain timing (vanilla, (64, 4096), medians, same run):")
    print("| setting | rlvitals ms | verl ms | speed-up |")
    print("|---|---:|---:|---:|")
    for label, t, side, alternate in steps:
        ours = lambda t=t: recompute(config, **t)  # noqa: E731
        if side == "plain":
            theirs = lambda t=t: verl_plain(core, actor, t)  # noqa: E731
        elif side == "floats":
            theirs = lambda t=t: {k: float(v) for k, v in verl_plain(core, actor, t)[1].items()}  # noqa: E731
        else:
            theirs = lambda t=t: verl_step(core, actor, t)  # noqa: E731
        if alternate:
            a, b = (statistics.median(x) for x in interleaved_timings([ours, theirs], n))
        else:
            a, b = statistics.median(block_timings(ours, n)), statistics.median(block_timings(theirs, n))
        print(f"| {label} | {a * 1e3:.2f} | {b * 1e3:.2f} | {b / a:.2f}× |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds; the median over all runs")
    parser.add_argument("--modes", default="all", help="comma-separated loss modes (default: every one)")
    parser.add_argument(
        "--explain",
        action="store_true",
        help="also time the plain timing's setting step by step (needs verl)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)

    from rlvitals.analyzers import audit, recompute
    from rlvitals.analyzers.reference.policy_losses import LossMode

    modes = [m.value for m in LossMode] if args.modes == "all" else args.modes.split(",")
    verl = load_verl()
    n = args.repeats * args.rounds
    print(
        f"torch {torch.__version__}, 1 thread, float32, token-mean + entropy + low_var_kl, median of {n} runs"
    )
    print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} cores")
    from rlvitals.analyzers.fast import native

    print(f"rlvitals token passes: {native.STATUS}")
    if verl is None:
        print("verl 0.9.1 not importable here: rlvitals column only")
    copy_bw = memory_bandwidth()
    print(
        f"memory bandwidth (one thread, {COPY_BYTES >> 20} MiB tensor copy, read + write): "
        f"{copy_bw / 1e9:.1f} GB/s; bandwidth used = input bytes read once / time / that "
        "(all of them: the sparse passes skip the masked groups)"
    )
    print(
        "| shape | loss_mode | rlvitals recompute | verl 0.9.1 | speed-up (medians) | target | bandwidth used |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    notes = []
    for batch, length in SHAPES:
        t = make_batch(batch, length)
        tokens = batch * length
        # the bytes a single pass must read: five float32 inputs and the bool mask
        nbytes = sum(v.numel() * v.element_size() for v in t.values())
        valid = float(t["response_mask"].float().mean())
        notes.append(
            f"({batch}, {length}): {nbytes / tokens:.0f} input bytes per token: the bandwidth bound is "
            f"{copy_bw / nbytes * tokens / 1e6:.0f} M tok/s; {valid:.0%} of the tokens are valid, and the "
            "sparse passes (vanilla, gpg, dro, cispo, the entropy / KL loop) leave the masked groups unread"
        )
        for mode in modes:
            config = our_config(mode)
            ours_metrics = recompute(config, **t)
            fns = [lambda t=t, c=config: recompute(c, **t)]
            if verl is not None:
                actor = verl_actor(mode)
                torch.manual_seed(0)
                theirs_metrics = verl_step(verl[0], actor, t, mode)
                torch.manual_seed(0)
                ours_metrics = recompute(config, **t)
                if mode == "bypass_mode" and set(ours_metrics) < set(theirs_metrics):
                    notes.append(
                        f"({batch}, {length}) bypass_mode: rollout_corr/* metrics not timed "
                        "(rlvitals.analyzers.reference.rollout is another module)"
                    )
                    theirs_metrics = {k: theirs_metrics[k] for k in ours_metrics}
                assert set(ours_metrics) == set(theirs_metrics), (
                    mode,
                    set(ours_metrics) ^ set(theirs_metrics),
                )
                for key, value in ours_metrics.items():
                    other = theirs_metrics[key]
                    assert abs(value - other) <= 1e-6 + 1e-5 * abs(other), (mode, key, value, other)
                fns.append(lambda t=t, a=actor, m=mode: verl_step(verl[0], a, t, m))
            timings = interleaved_timings(fns, n)
            ours = statistics.median(timings[0])
            ours_col = f"{tokens / ours / 1e6:.1f} M tok/s ({ours * 1e3:.2f} ms)"
            used = f"{nbytes / ours / copy_bw:.1%}"
            target = "5×" if mode == "vanilla" else "3×"
            if verl is not None:
                theirs = statistics.median(timings[1])
                verl_col = f"{tokens / theirs / 1e6:.1f} M tok/s ({theirs * 1e3:.2f} ms)"
                ratio = f"{theirs / ours:.2f}×"
            else:
                verl_col = ratio = "n/a"
            print(f"| ({batch}, {length}) | {mode} | {ours_col} | {verl_col} | {ratio} | {target} | {used} |")
            if mode == "vanilla":
                alone = statistics.median(block_timings(fns[0], n))
                line = f"({batch}, {length}) vanilla alone (no verl calls in between): {alone * 1e3:.2f} ms"
                if verl is not None:
                    theirs_alone = statistics.median(block_timings(fns[1], n))
                    line += f", verl alone {theirs_alone * 1e3:.2f} ms = {theirs_alone / alone:.2f}×"
                notes.append(line)
                reported = recompute(config, **t)
                audit_s = statistics.median(
                    block_timings(lambda t=t, r=reported, c=config: audit(c, t, r), 5)
                )
                notes.append(
                    f"({batch}, {length}) full audit + counterfactuals (vanilla): {audit_s * 1e3:.1f} ms"
                )
    print()
    for line in notes:
        print(line)
    if args.explain and verl is not None:
        explain(verl, n)


if __name__ == "__main__":
    main()

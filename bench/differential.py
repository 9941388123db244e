"""The long differential run: the fast (compiled) path against the reference path (verl's op sequence)
over the whole settings space (tests/analyzers/differential.py's strategy), many more examples than the
test suite's bounded run. Prints the seed of every run and a summary; a disagreement prints its case
and the command that replays it.

    .venv/bin/python bench/differential.py                  # 2000 examples, a random seed
    .venv/bin/python bench/differential.py --examples 20000 --seed 12345
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hypothesis import HealthCheck, given, seed, settings  # noqa: E402

from tests.analyzers.differential import cases, disagreements  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    run_seed = random.SystemRandom().randrange(2**32) if args.seed is None else args.seed
    print(f"seed {run_seed} ({args.examples} examples); replay: bench/differential.py --seed {run_seed}")
    seen: Counter = Counter()
    bad: list = []

    @seed(run_seed)
    @settings(
        max_examples=args.examples, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(cases())
    def run(case) -> None:
        config, tensors = case
        seen[(config.loss_mode, str(config.loss_agg_mode), str(tensors["log_prob"].dtype))] += 1
        found = disagreements(config, tensors)
        if found:
            bad.append((config, found))
            raise AssertionError(found)

    started = time.perf_counter()
    with contextlib.suppress(AssertionError):  # hypothesis re-raises the shrunk case: printed below
        run()
    elapsed = time.perf_counter() - started
    print(f"{sum(seen.values())} cases ({len(seen)} loss mode x agg mode x dtype cells) in {elapsed:.0f} s")
    if bad:
        config, found = bad[-1]
        print(f"DISAGREEMENT (seed {run_seed}): {config}\n  {found}")
        return 1
    print("fast and reference paths agree on every case")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One process of a two-process ``torch.distributed`` (gloo) training loop with ``halt_on``.

    python halt_ranks.py RANK PORT URL OUT.json MODE     # MODE: agree (should_stop()) or local
                                                         #   (should_stop(all_ranks=False))

Rank 0 logs a NaN loss from step 5 (a critical ``non_finite`` incident); both ranks log every step (the
client sends scalars from rank 0 only) and all-reduce a tensor each step, as a data-parallel step does.
Each writes the step it stopped at (None: it ran all steps) and its ``halt_reason``."""

from __future__ import annotations

import json
import sys
import tempfile
import time

import torch
import torch.distributed as dist

import rlvitals

STEPS = 40


def main(rank: int, port: int, url: str, out: str, mode: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    stopped = None
    with tempfile.TemporaryDirectory() as spool:
        run = rlvitals.init(
            url=url, project="ranks", name=f"halt-{mode}", spool_dir=spool, halt_on="critical"
        )
        for step in range(STEPS):
            if run.should_stop(all_ranks=(mode == "agree")):
                stopped = step
                break
            run.log({"actor/pg_loss": float("nan") if step >= 5 else 0.1}, step=step)
            if mode == "agree":
                grad = torch.ones(1)
                dist.all_reduce(grad)  # the step's collective: a rank that stopped alone would hang it
            time.sleep(0.05)
        run.finish(timeout=30)
    with open(out, "w") as fh:
        json.dump({"rank": rank, "stopped": stopped, "halt_reason": run.halt_reason}, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])

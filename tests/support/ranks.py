"""Two processes of one job, as a launcher starts them: the same command with ``RANK`` 0 and 1."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence


def run_two_ranks(cmd: Sequence[str], env: Mapping[str, str], timeout: float = 900) -> None:
    """Run ``cmd`` as rank 0 and rank 1 at once (``RANK`` set, ``{rank}`` in an argument replaced,
    ``env`` over ``os.environ``) and wait for both; fails with the tails of a failing rank's output. A
    rank past ``timeout`` is killed."""
    procs = [
        subprocess.Popen(
            [part.replace("{rank}", str(rank)) for part in cmd],
            env={**os.environ, **env, "RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        outputs = [proc.communicate(timeout=timeout) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    for rank, (proc, (out, err)) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, (f"rank {rank}", out[-3000:], err[-6000:])

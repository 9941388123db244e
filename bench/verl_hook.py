"""What the verl integration's recording ``ppo_loss`` costs per step, on verl 0.9.1's real ``ppo_loss``.

    .venv/bin/python bench/verl_hook.py                       # builds/reuses the verl side env, ~1 min
    .venv/bin/python bench/verl_hook.py --batch 16 --resp 1024 --reps 100 --batch-every 10

Runs ``tests/client/verl_side.py``'s ``overhead`` scenario in the verl side env (``tests/support/sideenv.py``,
one torch thread): the same micro-batch (``--batch`` x (64 + ``--resp``) tokens, no-padding layout, KL and
entropy terms on) through ``verl.workers.utils.losses.ppo_loss`` and through
``rlvitals.client.integrations.verl.ppo_loss`` (which calls it), interleaved, ``--reps`` times each. Every
call is its own step, so with ``--batch-every N`` one wrapped call in N is sampled and captured (the batch
copied and queued for a background sender to an in-memory server); the others pay only the sampling
decision. Prints medians (machines are noisy) and the ratio against verl measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.sideenv import VERL, ensure, rlvitals_path  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--resp", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=100)
    parser.add_argument("--batch-every", type=int, default=10)
    args = parser.parse_args()
    python = ensure("verl", VERL)
    options = {
        "overhead": {
            "batch": args.batch,
            "resp": args.resp,
            "reps": args.reps,
            "batch_every": args.batch_every,
        }
    }
    env = {
        **os.environ,
        "PYTHONPATH": str(rlvitals_path()),
        "VERL_USE_EXTERNAL_MODULES": "rlvitals.client.integrations.verl",
        "RLVITALS_VERL_SIDE_OPTIONS": json.dumps(options),
        "OMP_NUM_THREADS": "1",
    }
    with tempfile.TemporaryDirectory() as out:
        script = ROOT / "tests" / "client" / "verl_side.py"
        proc = subprocess.run(
            [str(python), str(script), out, "overhead"], env=env, capture_output=True, text=True
        )
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr[-4000:])
            return proc.returncode
        result = json.loads((Path(out) / "overhead.json").read_text())
    verl, hooked = result["timings"]["verl"], result["timings"]["rlvitals"]
    every = result["batch_every"]
    sampled = [t for i, t in enumerate(hooked) if (i + 1) % every == 0]
    unsampled = [t for i, t in enumerate(hooked) if (i + 1) % every != 0]
    base = statistics.median(verl)
    b, r = result["shape"]
    print(f"verl 0.9.1 ppo_loss, {b} x {r} response tokens, {len(verl)} calls each, batch_every={every}, "
          f"{result['sent']} batches sent")  # fmt: skip
    print("| call | median ms | vs verl |")
    print("|---|---:|---:|")
    rows = [
        ("verl ppo_loss", verl),
        ("rlvitals ppo_loss, every call", hooked),
        ("rlvitals ppo_loss, not sampled", unsampled),
        ("rlvitals ppo_loss, sampled (captured)", sampled),
    ]
    for name, values in rows:
        median = statistics.median(values) if values else float("nan")
        print(f"| {name} | {median * 1e3:.3f} | {median / base:.3f}x |")
    per_step = statistics.median(hooked) - base
    print(f"added per call (median): {per_step * 1e3:.3f} ms; per sampled call: "
          f"{(statistics.median(sampled) - base) * 1e3:.3f} ms")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

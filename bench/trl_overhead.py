"""What the TRL integration costs a real ``trl.GRPOTrainer`` step (TRL 1.16, CPU, the tiny offline model of
``tests/support/trl_tiny.py``), with and without the README recipe in the same run.

    .venv/bin/python bench/trl_overhead.py              # ~3-5 minutes on 2 cores (builds the side env once)
    .venv/bin/python bench/trl_overhead.py --steps 8 --json out.json

Prints, per optimizer step (gradient_accumulation_steps=2, num_iterations=2, grpo with beta=0.04), medians:
the wall time of the plain trainer and of the recipe at ``batch_every`` 10 (default) and 1 (a capture every
step), and the time spent inside rlvitals code itself (the mixin around ``_compute_loss`` minus TRL's own
time, plus the callback's ``on_log``), which is what the wall-time difference estimates, minus the noise.
Runs alternate plain / recipe twice so machine load hits both alike.
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

from tests.support.sideenv import TRL, ensure, rlvitals_path  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per training run")
    parser.add_argument("--json", type=Path, help="also write the raw step times here")
    args = parser.parse_args()
    python = ensure("trl", TRL)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "overhead.json"
        env = {
            **os.environ,
            "PYTHONPATH": str(rlvitals_path()),
            "HF_HUB_OFFLINE": "1",
            "OMP_NUM_THREADS": "1",
        }
        script = ROOT / "tests" / "support" / "trl_tiny.py"
        subprocess.run([str(python), str(script), "overhead", str(out), str(args.steps)], env=env, check=True,
                       stdout=subprocess.DEVNULL)  # fmt: skip
        data = json.loads(out.read_text())
    if args.json:
        args.json.write_text(json.dumps(data, indent=1))
    plain = statistics.median(data["plain"]["step_s"])
    print(
        f"TRL 1.16 GRPOTrainer, tiny Llama on CPU: median per optimizer step over {len(data['plain']['step_s'])} steps"
    )
    print(f"{'':18} {'step (ms)':>10} {'vs plain':>9} {'in rlvitals (ms)':>17} {'share of step':>14}")
    for label, entry in data.items():
        step = statistics.median(entry["step_s"])
        own = statistics.median(entry["rlvitals_s"]) if label != "plain" else 0.0
        print(f"{label:18} {step * 1e3:10.1f} {step / plain:8.3f}x {own * 1e3:17.2f} {own / step:13.2%}")


if __name__ == "__main__":
    main()

"""What the TRL integration costs a real ``trl.GRPOTrainer`` step (TRL 1.16, CPU, the tiny offline model of
``tests/support/trl_tiny.py``), with and without the README recipe in the same run.

    .venv/bin/python bench/trl_overhead.py              # ~3-5 minutes on 2 cores (builds the side env once)
    .venv/bin/python bench/trl_overhead.py --steps 8 --json out.json

Prints, per optimizer step (gradient_accumulation_steps=2, num_iterations=2, grpo with beta=0.04), medians:
the wall time of the plain trainer and of the recipe at ``batch_every`` 10 (default) and 1 (a capture every
step), and the time spent inside rlvitals code itself (the mixin around ``_compute_loss`` minus TRL's own
time, plus the callback's ``on_log``) as wall time and as the trainer thread's CPU time (``thread_time``:
what rlvitals costs the step, without the preemption a shared machine adds). The background sender's work
is on its own thread and not counted.
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
    print(f"{'':16} {'step (ms)':>10} {'vs plain':>9} {'rlvitals wall (ms)':>19} {'rlvitals CPU (ms)':>18} "
          f"{'CPU max (ms)':>13} {'captured':>9}")  # fmt: skip
    for label, entry in data.items():
        step = statistics.median(entry["step_s"])
        own = cpu = worst = 0.0
        if label != "plain":
            own = statistics.median(entry["rlvitals_s"])
            cpu = statistics.median(entry["rlvitals_cpu_s"])
            worst = max(entry["rlvitals_cpu_s"])
        print(f"{label:16} {step * 1e3:10.1f} {step / plain:8.3f}x {own * 1e3:19.2f} {cpu * 1e3:18.2f} "
              f"{worst * 1e3:13.2f} {entry['captured']:9d}")  # fmt: skip


if __name__ == "__main__":
    main()

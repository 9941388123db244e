"""How far ahead the covariance forecast warns of an entropy collapse, on real TRL runs that collapse on purpose.

Each run is a real TRL 1.16 ``GRPOTrainer`` on the tiny offline Llama of ``tests/support/trl_tiny.py`` (CPU,
nothing downloaded), trained at a high learning rate on a reward that pays one word: the policy learns to
repeat that word and its token entropy collapses. The rlvitals TRL integration captures every micro-batch
(``batch_every=1``) and the step metrics, exactly as it sends them to a server. Then, in this process, each
step goes through what the server does with it: the metrics into a ``HealthMonitor``, each captured batch
through the server's audit (``audit_batch``, which adds ``Cov(log π, A)``) into ``observe_audit`` and the
group diagnostics into ``observe_groups``.

Measured per run: the step the ``entropy_forecast`` warning fires, the step the entropy curve's own alert
(``entropy_collapse``, warning or worse) fires, the lead between them (steps, positive = the forecast was
earlier), and how the one-step predictions ``rlvitals/entropy_forecast`` compare with the entropy observed
next (mean absolute error, against the naive "no change" prediction).

    python bench/forecast.py                 # the default runs (3 learning rates x 2 seeds), a table
    python bench/forecast.py --json OUT.json # also the per-run numbers
    python bench/forecast.py --quick         # one run, fewer steps (what the test runs)

The TRL side environment is built on first use (tests/support/sideenv.py).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# (name, GRPOConfig overrides, seed): high learning rates on a reward that pays the word "a"; the tiny
# model's entropy (2.7 nats at the start) collapses within 10-25 steps at these rates
RUNS: tuple[tuple[str, dict[str, Any], int], ...] = tuple(
    (f"lr{lr:g}_seed{seed}", {"learning_rate": lr}, seed) for lr in (0.005, 0.01, 0.02) for seed in (0, 1)
)
STEPS = 30
QUICK = (("lr0.02_seed0", {"learning_rate": 0.02}, 0),)
QUICK_STEPS = 16


# ----------------------------------------------------------------------------- inside the TRL side env


def _train(out_path: str, runs: list[list[Any]], steps: int) -> None:
    """Train each run with the rlvitals TRL callback against an in-memory server; write what it received."""
    import torch
    from rlvitals.client.integrations.trl import RlvitalsCallback
    from rlvitals.client.settings import ClientSettings
    from rlvitals.client.testing import FakeServer

    import rlvitals
    from tests.support.trl_tiny import make_trainer, trainer_classes

    Recipe, _ = trainer_classes()
    out = {}
    for name, overrides, seed in runs:
        torch.manual_seed(seed)
        server = FakeServer()
        with tempfile.TemporaryDirectory() as tmp:
            run = rlvitals.init(project="forecast", name=name, transport=server.transport, spool_dir=tmp,
                                settings=ClientSettings(batch_every=1, batch_micro_batches="all"))  # fmt: skip
            config = {"max_steps": steps, "seed": seed, "max_completion_length": 8, **overrides}
            trainer = make_trainer(Recipe, config, tmp, callbacks=[RlvitalsCallback(run)])
            trainer.train()
            run.finish(timeout=60)
        points: dict[int, dict[str, float | None]] = {}
        for (step, key), value in server.points[run.id].items():
            points.setdefault(step, {})[key] = value
        out[name] = {
            "points": sorted(points.items()),
            "batches": [base64.b64encode(p).decode() for p in server.batches.get(run.id, [])],
            "config": server.run_configs.get(run.id) or {},
        }
    Path(out_path).write_text(json.dumps(out))


# ----------------------------------------------------------------------------- here


def train(runs, steps: int) -> dict[str, Any]:
    from tests.support.sideenv import TRL, ensure, rlvitals_path

    python = ensure("trl", TRL)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "runs.json"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(rlvitals_path()), str(ROOT)])}
        spec = json.dumps([list(r) for r in runs])
        subprocess.run(
            [str(python), __file__, "--inner", str(out), "--spec", spec, "--steps", str(steps)],
            check=True,
            env=env,
            cwd=ROOT,
        )
        return json.loads(out.read_text())


def _decode(payload: bytes):
    from safetensors.torch import load

    header = json.loads(payload[8 : 8 + int.from_bytes(payload[:8], "little")])["__metadata__"]
    return load(payload), header


def replay(recorded: dict[str, Any]) -> dict[str, Any]:
    """Feed one recorded run through the monitor as the server would; the forecast's numbers."""
    from rlvitals.analyzers.contract.batch import AuditBatch
    from rlvitals.analyzers.contract.series import COV_SERIES, FORECAST_SERIES
    from rlvitals.analyzers.health import HealthMonitor
    from rlvitals.analyzers.verdicts.batch_audit import audit_batch
    from rlvitals.client.values import decode_value

    batches: dict[int, list[Any]] = {}
    for text in recorded["batches"]:
        tensors, meta = _decode(base64.b64decode(text))
        batches.setdefault(int(meta["step"]), []).append((tensors, meta))
    monitor = HealthMonitor(run_config=recorded["config"])
    findings, predicted, entropy, covs = [], {}, {}, {}
    for step, metrics in recorded["points"]:
        step = int(step)
        for tensors, meta in sorted(batches.get(step, []), key=lambda b: int(b[1]["micro_batch"])):
            reported = {k: decode_value(v) for k, v in json.loads(meta["reported"]).items()}
            batch = AuditBatch.stored(tensors, config=json.loads(meta["config"]), reported=reported)
            audited = audit_batch(batch, run_config=recorded["config"])
            findings += monitor.observe_audit(step, audited.result)
            if audited.groups is not None:
                findings += monitor.observe_groups(step, audited.groups)
            for name, at, value in monitor.audit_series(step):
                if name == FORECAST_SERIES:
                    predicted.setdefault(at, value)
                elif name == COV_SERIES:
                    covs.setdefault(at, value)
        findings += monitor.observe(step, metrics)
        if metrics.get("entropy") is not None:
            entropy[step] = float(metrics["entropy"])

    def first(rule: str, warning: bool = True) -> int | None:
        steps = [
            f.step
            for f in findings
            if f.rule == rule and f.state == "firing" and (not warning or f.severity.value != "info")
        ]
        return min(steps) if steps else None

    forecast, collapse = first("entropy_forecast"), first("entropy_collapse")
    errors = [abs(predicted[s] - entropy[s]) for s in predicted if s in entropy]
    naive = [abs(entropy[s] - entropy[s - 1]) for s in predicted if s in entropy and s - 1 in entropy]
    series = sorted(entropy.items())
    return {
        "steps": len(recorded["points"]),
        "entropy_first": series[0][1] if series else None,
        "entropy_last": series[-1][1] if series else None,
        "forecast_step": forecast,
        "collapse_step": collapse,
        "collapse_info_step": first("entropy_collapse", warning=False),
        "lead": None if forecast is None or collapse is None else collapse - forecast,
        "forecast_mae": statistics.fmean(errors) if errors else None,
        "naive_mae": statistics.fmean(naive) if naive else None,
        "forecast_message": next((f.message for f in findings if f.rule == "entropy_forecast"), None),
        "entropy": series,
        "predicted": sorted(predicted.items()),
        "cov": sorted(covs.items()),
    }


def measure(runs, steps: int) -> dict[str, dict[str, Any]]:
    recorded = train(runs, steps)
    return {name: replay(recorded[name]) for name, _, _ in runs}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", help="also write the per-run numbers here")
    parser.add_argument("--quick", action="store_true", help="one run, fewer steps")
    parser.add_argument(
        "--runs", help="comma-separated learning rates x seeds as lr:seed (default: the table's)"
    )
    parser.add_argument("--record", help="keep the recorded runs here (JSON), to replay without training")
    parser.add_argument("--replay", help="replay recorded runs from here instead of training")
    parser.add_argument("--inner", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=STEPS, help=f"training steps per run (default {STEPS})")
    args = parser.parse_args()
    if args.inner:
        _train(args.inner, json.loads(args.spec), args.steps)
        return
    runs, steps = (QUICK, QUICK_STEPS) if args.quick else (RUNS, args.steps)
    if args.runs:
        pairs = [item.split(":") for item in args.runs.split(",")]
        runs = tuple(
            (f"lr{float(lr):g}_seed{seed}", {"learning_rate": float(lr)}, int(seed)) for lr, seed in pairs
        )
    if args.replay:
        recorded = json.loads(Path(args.replay).read_text())
        runs = tuple((name, {}, 0) for name in recorded)
    else:
        recorded = train(runs, steps)
        if args.record:
            Path(args.record).write_text(json.dumps(recorded))
    results = {name: replay(recorded[name]) for name, _, _ in runs}
    print(
        f"{'run':<16} {'H first':>8} {'H last':>8} {'forecast':>9} {'collapse':>9} {'lead':>5} {'MAE':>7} {'naive':>7}"
    )
    for name, r in results.items():
        print(
            f"{name:<16} {_f(r['entropy_first']):>8} {_f(r['entropy_last']):>8} {_i(r['forecast_step']):>9} "
            f"{_i(r['collapse_step']):>9} {_i(r['lead']):>5} {_f(r['forecast_mae']):>7} {_f(r['naive_mae']):>7}"
        )
    leads = [r["lead"] for r in results.values() if r["lead"] is not None]
    if leads:
        print(f"lead: median {statistics.median(leads):g} steps, min {min(leads)}, max {max(leads)} "
              f"({len(leads)}/{len(results)} runs with both alerts)")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _i(x: int | None) -> str:
    return "-" if x is None else str(x)


if __name__ == "__main__":
    main()

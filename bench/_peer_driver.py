"""Runs one peer monitor over corpus runs, inside the peers' side environment (never imports rlvitals).

stdin: ``{"peer": "rldoctor"|"rlwatch"|"rlprobe", "runs": [{"id", "format", "algorithm", "config",
"points": [[step, {name: value}], ...]}]}``; stdout: ``{run id: [[rule, step, severity], ...]}`` with
severities spelled ``info``/``warning``/``critical`` (with ``"timing": true`` in the request, also
``"__seconds__": {run id: CPU seconds of its live loop}``, for bench/health_rules.py). Each peer is driven through the path it documents
for a live run, fed the points one at a time in step order, as its trainer integration would:

- rldoctor 0.2.0: ``rl_doctor.live.LiveMonitor.log(metrics, step)``; it announces findings that are new
  or newly worse. Run with ``check_every=1`` and ``min_steps=8`` (its smallest) so that it may speak
  as early as it can on 40-point runs (its defaults, 25 and 60, would keep it silent on most of them).
- rlwatch 0.5.1: ``RLWatch.log_step`` reached through its own integrations: the veRL tracking backend
  (``RLWatchVerLTracker.log(data, step)``) for verl logs, the TRL ``TrainerCallback.on_log`` for TRL
  logs. Alerts are the ones it sends (after its cooldown and rate limits).
- rlprobe 0.1.0: its TRL callback's key map (``rlprobe.integrations.trl._map_logs``) into
  ``StepRecord``s and ``diagnose_view`` after every point, reporting each new (signature, severity)
  as its live callback does. It has no verl reader: verl logs go through the same map.

``transformers`` is not installed here: rlwatch and rlprobe import only ``TrainerCallback`` from it, so
an inert stand-in module provides that name.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any


def _stub_transformers() -> None:
    if "transformers" not in sys.modules:
        module = types.ModuleType("transformers")
        module.TrainerCallback = type("TrainerCallback", (), {})  # type: ignore[attr-defined]
        sys.modules["transformers"] = module


def _severity(value: Any) -> str:
    text = str(getattr(value, "name", value)).lower()
    return {"warn": "warning", "crit": "critical"}.get(text, text)


def run_rldoctor(run: dict) -> list[list]:
    from rl_doctor.detectors.base import Severity
    from rl_doctor.live import LiveMonitor

    alerts: list[list] = []
    step_now = [0]

    def collect(finding: Any) -> None:
        alerts.append([finding.detector, step_now[0], _severity(finding.severity)])

    monitor = LiveMonitor(
        config=run["config"] or None, check_every=1, min_steps=8, alert_at=Severity.INFO, on_finding=collect
    )
    for step, metrics in run["points"]:
        step_now[0] = step
        monitor.log(metrics, step=step)
    return alerts


def run_rlwatch(run: dict, workdir: Path) -> list[list]:
    from rlwatch.config import RLWatchConfig
    from rlwatch.core import RLWatch

    config = RLWatchConfig(run_id=run["id"], framework="manual")
    config.storage.log_dir = str(workdir / run["id"])
    monitor = RLWatch(config)
    monitor.start()
    sent: list[Any] = []
    log_step = monitor.log_step

    def recording(step: int, **metrics: Any) -> list:
        out = log_step(step, **metrics)
        sent.extend(out)
        return out

    monitor.log_step = recording  # type: ignore[method-assign]
    if run["format"].startswith("verl"):
        from rlwatch.integrations.verl_tracking import RLWatchVerLTracker

        tracker = RLWatchVerLTracker(monitor)
        for step, metrics in run["points"]:
            tracker.log(metrics, step)
    else:
        _stub_transformers()
        from rlwatch.core import _build_trl_callback

        callback = _build_trl_callback(monitor)()
        for step, metrics in run["points"]:
            callback.on_log(None, types.SimpleNamespace(global_step=step), None, logs=metrics)
    monitor.stop()
    return [[a.detector, int(a.step), _severity(a.severity)] for a in sent]


def run_rlprobe(run: dict) -> list[list]:
    _stub_transformers()
    from datetime import datetime, timezone

    from rlprobe.doctor.engine import diagnose_view
    from rlprobe.doctor.runview import RunView
    from rlprobe.integrations.trl import _map_logs
    from rlprobe.schemas import RunManifest, StepRecord

    manifest = RunManifest(
        run_id=run["id"],
        created_at=datetime.now(timezone.utc).isoformat(),
        algorithm=run["algorithm"],
        trainer_config=run["config"],
    )
    records: list[Any] = []
    reported: set[tuple[str, str]] = set()
    alerts: list[list] = []
    for step, metrics in run["points"]:
        records.append(StepRecord(step=step, **_map_logs(metrics)))
        for finding in diagnose_view(RunView(manifest, list(records))):
            key = (finding.signature_id, finding.severity)
            if key not in reported:
                reported.add(key)
                alerts.append([finding.signature_id, step, _severity(finding.severity)])
    return alerts


def main() -> None:
    request = json.load(sys.stdin)
    logging.disable(logging.CRITICAL)
    out: dict[str, Any] = {}
    seconds: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(sys.stderr):
        for run in request["runs"]:
            started = time.process_time()
            if request["peer"] == "rldoctor":
                out[run["id"]] = run_rldoctor(run)
            elif request["peer"] == "rlwatch":
                out[run["id"]] = run_rlwatch(run, Path(tmp))
            elif request["peer"] == "rlprobe":
                out[run["id"]] = run_rlprobe(run)
            else:
                raise SystemExit(f"unknown peer {request['peer']!r}")
            seconds[run["id"]] = time.process_time() - started
    if request.get("timing"):  # bench/health_rules.py: the time of each run's live loop
        out["__seconds__"] = seconds
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()

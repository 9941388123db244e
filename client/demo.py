"""``rlvitals demo``: the product end to end on one machine.

Starts ``rlvitals serve`` as a subprocess on an embedded SQLite file (a fresh one per demo), trains the
healthy and then the unstable preset of ``examples/tiny_grpo.py`` against it through the client, prints
what the server's health rules raised for each run and the dashboard URLs, and keeps serving until
Ctrl-C (``--no-keep-serving`` stops right after, for scripts and tests).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import TextIO

import httpx
from rlvitals.client.settings import ClientSettings

DEFAULT_PORT = 8000
# (the label printed and used in run names, the tiny_grpo preset)
DEMO_PRESETS = {"healthy": "healthy", "unstable": "goes-unstable"}
EVERY = 5  # audit a batch every EVERY steps


def load_tiny_grpo() -> ModuleType:
    """``examples/tiny_grpo.py``, installed as ``rlvitals.examples.tiny_grpo`` (see setup.py)."""
    return importlib.import_module("rlvitals.examples.tiny_grpo")


def _port_free(host: str, port: int) -> bool:
    """Whether ``rlvitals serve`` could bind ``port``. SO_REUSEADDR as uvicorn binds: a port whose last
    connections sit in TIME_WAIT (the previous demo, just stopped) is free; one that listens is not."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class DemoServer:
    """A ``rlvitals serve`` subprocess in its own session, logging to a file."""

    def __init__(self, *, host: str, port: int, database_url: str, log_path: Path) -> None:
        self.host, self.port, self.database_url, self.log_path = host, port, database_url, log_path
        self.url = f"http://{host}:{port}"
        self.popen: subprocess.Popen | None = None

    def start(self, timeout: float = 60.0) -> DemoServer:
        cmd = [sys.executable, "-m", "rlvitals.cli", "serve", "--host", self.host, "--port", str(self.port),
               "--database-url", self.database_url]  # fmt: skip
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"rlvitals serve exited with {self.popen.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/healthz", timeout=1.0).status_code == 200:
                    return self
            time.sleep(0.1)
        raise TimeoutError(f"rlvitals serve not ready after {timeout:.0f}s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def wait(self) -> None:
        if self.popen is not None:
            self.popen.wait()

    def stop(self) -> None:
        if self.popen is None:
            return
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(timeout=10)
        _remove_serve_lock(self.database_url)


def _remove_serve_lock(database_url: str) -> None:
    """Delete the ``<db>.serve.lock`` our stopped server leaves beside a SQLite file, unless a server holds
    it (its lock is an ``flock`` on the open file: taking it proves no process serves that database)."""
    if not database_url.startswith("sqlite:///"):
        return
    import fcntl

    path = Path(os.path.abspath(database_url.removeprefix("sqlite:///")) + ".serve.lock")  # as serve names it
    try:
        handle = path.open("r+")
    except OSError:
        return  # never created, or already gone
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return  # another server serves this file now: its lock stays
        path.unlink(missing_ok=True)


def run_demo(
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    database_url: str | None = None,
    steps: int | None = None,
    keep_serving: bool = True,
    workdir: Path | None = None,
    out: TextIO = sys.stdout,
) -> int:
    """Serve, train both presets, report; returns the process exit code."""
    import torch

    import rlvitals

    tiny = load_tiny_grpo()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    workdir = workdir or Path.home() / ".rlvitals" / "demo"
    workdir.mkdir(parents=True, exist_ok=True)
    if port is None:
        port = DEFAULT_PORT if _port_free(host, DEFAULT_PORT) else _free_port(host)
    database_url = database_url or f"sqlite:///{workdir / f'demo-{stamp}.db'}"
    server = DemoServer(
        host=host, port=port, database_url=database_url, log_path=workdir / f"serve-{stamp}.log"
    )
    print(f"rlvitals demo: starting the server on {server.url} ({database_url})", file=out, flush=True)
    with _sigterm_as_interrupt():
        return _serve_and_train(server, tiny, torch, rlvitals, stamp, workdir, steps, keep_serving, out)


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """SIGTERM (`kill`, a container stopping, a CI job cancelled) unwinds like Ctrl-C, so the server in
    its own session is stopped by the ``finally`` below instead of being left running."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _serve_and_train(server, tiny, torch, rlvitals, stamp, workdir, steps, keep_serving, out) -> int:
    serving = False
    try:
        try:
            server.start()
        except (RuntimeError, TimeoutError) as exc:
            print(f"rlvitals demo: {exc}", file=out)
            return 1
        torch.set_num_threads(1)  # a tiny model: threads only add overhead
        run_ids = {}
        for preset in DEMO_PRESETS:
            config = tiny.PRESETS[DEMO_PRESETS[preset]]
            if steps is not None:
                config = dataclasses.replace(config, steps=steps)
            if config.misreport_step and config.switch_step():  # the first audited step after the switch
                config = dataclasses.replace(config, misreport_step=-(-config.switch_step() // EVERY) * EVERY)
            run = rlvitals.init(
                url=server.url,
                project="demo",
                name=f"tiny-grpo-{preset}-{stamp}",
                config=config.run_config(),
                spool_dir=workdir / "spool",
                # both audited updates of a sampled step: the on-policy first and the clipped last
                settings=ClientSettings(batch_every=EVERY, batch_micro_batches="all"),
            )
            print(
                f"\n== {preset}: lr {config.lr:g}, ppo_epochs {config.ppo_epochs}, {config.steps} steps"
                + (
                    f"; from step {config.switch_step()} lr {config.then.lr:g}, ppo_epochs "
                    f"{config.then.ppo_epochs}, clip {config.then.clip_ratio:g}; step {config.misreport_step}'s "
                    f"audited batch reported as {config.misreport_agg_mode} (a trainer bug on purpose)"
                    if config.then is not None
                    else ""
                ),
                file=out,
            )
            history = tiny.train(config, run, progress=_progress(out))
            report = run.finish(timeout=30)
            first, last = history.reward[:10], history.reward[-10:]
            print(
                f"reward {sum(first) / len(first):.2f} (first 10 steps) -> {sum(last) / len(last):.2f} "
                f"(last 10); {report}",
                file=out,
            )
            run_ids[preset] = run.run_id
        for run_id in run_ids.values():  # the audits run in their own process, behind the writes
            _wait_for_audits(server.url, run_id)
        time.sleep(0.5)  # the rules run on what was committed; let them read the audits' series
        print("", file=out)
        for preset, run_id in run_ids.items():
            _print_alerts(server.url, preset, run_id, out)
        print(f"\nDashboard: {server.url}/", file=out)
        for preset, run_id in run_ids.items():
            if run_id is not None:
                print(f"  {preset:9s} {server.url}/runs/{run_id}", file=out)
        print(f"  alerts    {server.url}/alerts", file=out, flush=True)
        if keep_serving:
            print("\nServing until Ctrl-C.", file=out, flush=True)
            serving = True
            server.wait()
        return 0
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM, at any point
        print("\nrlvitals demo: interrupted; stopping the server", file=out, flush=True)
        return 0 if serving else 130  # stopping a serving demo is how it ends; mid-training is not
    finally:
        server.stop()


def _progress(out: TextIO):
    def progress(step: int, metrics: dict[str, float]) -> None:
        if step == 1 or step % 10 == 0:
            print(
                f"  step {step:3d}  reward {metrics['critic/score/mean']:.2f}  "
                f"pg_clipfrac {metrics['actor/pg_clipfrac']:.3f}  ppo_kl {metrics['actor/ppo_kl']:+.4f}  "
                f"entropy {metrics['actor/entropy']:.2f}",
                file=out,
                flush=True,
            )

    return progress


def _wait_for_audits(url: str, run_id: str | None, timeout: float = 120.0) -> None:
    """Until no audit of the run is pending (at most ``timeout`` s): the alerts printed next include
    what the audits found."""
    if run_id is None:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            audits = httpx.get(f"{url}/api/v1/runs/{run_id}/audits", timeout=10).json()["data"]
        except (httpx.HTTPError, ValueError, KeyError):
            return  # the alerts read says what is wrong
        if all(audit.get("status") != "pending" for audit in audits):
            return
        time.sleep(0.2)


def _print_alerts(url: str, preset: str, run_id: str | None, out: TextIO) -> None:
    if run_id is None:
        print(f"{preset}: the run never reached the server (see the spool)", file=out)
        return
    try:
        alerts = httpx.get(f"{url}/api/v1/runs/{run_id}/alerts", timeout=10).json()["data"]
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        print(f"{preset}: could not read alerts: {exc}", file=out)
        return
    if not alerts:
        print(f"{preset}: no alerts", file=out)
        return
    print(f"{preset}: {len(alerts)} alert(s)", file=out)
    for alert in sorted(alerts, key=lambda a: a["first_step"]):
        print(
            f"  [{alert['severity']}] {alert['rule']} ({alert['state']}) from step {alert['first_step']}: "
            f"{alert['message']}",
            file=out,
        )

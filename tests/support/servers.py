"""Start and stop real ``rlvitals serve`` processes on loopback for integration and fault tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ServerProcess:
    """A ``rlvitals serve`` subprocess; ``restart()`` keeps its port and database."""

    database_url: str
    port: int
    workdir: Path
    env: dict[str, str] = field(default_factory=dict)
    args: tuple[str, ...] = ()
    popen: subprocess.Popen | None = None
    log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> ServerProcess:
        self.log_path = self.workdir / f"server-{self.port}.log"
        env = {**os.environ, **self.env}
        cmd = [
            sys.executable, "-m", "rlvitals.cli", "serve",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--database-url", self.database_url, *self.args,
        ]  # fmt: skip
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child owns it
        self.popen = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.workdir, start_new_session=True
        )
        log.close()
        try:
            self.wait_ready(timeout)
        except BaseException:
            self.kill()  # never leak a half-started server
            raise
        return self

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen is not None and self.popen.poll() is not None:
                raise RuntimeError(f"server exited with {self.popen.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"server not ready after {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""

    def kill(self) -> None:
        """SIGKILL: no shutdown handlers run (the fault tests' 'server died')."""
        self._signal(signal.SIGKILL)

    def stop(self) -> None:
        self._signal(signal.SIGTERM)

    def restart(self, timeout: float = 30.0) -> ServerProcess:
        self.stop()
        return self.start(timeout)

    def _signal(self, sig: int) -> None:
        if self.popen is None or self.popen.poll() is not None:
            return
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            return
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(timeout=10)


def start_server(
    *,
    database_url: str,
    workdir: Path,
    port: int | None = None,
    env: dict[str, str] | None = None,
    args: tuple[str, ...] = (),
    timeout: float = 30.0,
) -> ServerProcess:
    proc = ServerProcess(
        database_url=database_url, port=port or free_port(), workdir=workdir, env=env or {}, args=args
    )
    return proc.start(timeout)

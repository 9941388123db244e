"""scripts/services.sh brings PostgreSQL up from any state, on a throwaway cluster of its own.

The machine's own server (5432, other test runs use it) is never touched: the script takes a port and
a cluster name, so the test points it at a cluster that does not exist yet and walks every branch a
plain Debian machine hits: no cluster, not running, loopback asking for a password (Debian's default
pg_hba.conf), no ``test`` database; then "installed but stopped"; then "nothing to do". The branch
that installs packages is shown by the dry run (apt-get is not run twice on a shared machine).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.heavy  # creates and starts a PostgreSQL cluster

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "services.sh"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _services(port: int, cluster: str, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "RLVITALS_PG_PORT": str(port), "RLVITALS_PG_CLUSTER": cluster, **env}
    return subprocess.run(["bash", str(SCRIPT)], env=full, capture_output=True, text=True, timeout=300)


def _psql(port: int, sql: str) -> subprocess.CompletedProcess:
    cmd = ["psql", "-w", "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", "-d", "test", "-Atc", sql]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30)


def _version() -> str:
    return sorted(os.listdir("/etc/postgresql"), key=lambda v: [int(p) for p in v.split(".")])[-1]


def test_dry_run_on_a_missing_cluster_says_every_step_and_changes_nothing():
    port, cluster = _free_port(), f"rlvdry{os.getpid()}"
    out = _services(port, cluster, RLVITALS_SERVICES_DRY_RUN="1")
    assert out.returncode == 0, out.stderr
    for step in ("pg_createcluster --port", "start", "trusting 127.0.0.1", "creating database test"):
        assert step in out.stderr, out.stderr
    assert not Path(f"/etc/postgresql/{_version()}/{cluster}").exists()


def test_a_fresh_cluster_is_created_started_trusted_and_given_a_test_database():
    assert shutil.which("pg_createcluster"), "services.sh installs postgresql; run it once first"
    port, cluster, version = _free_port(), f"rlvtest{os.getpid()}", _version()
    if os.geteuid() != 0:  # without root the script stops at the first step and names it
        out = _services(port, cluster)
        assert out.returncode == 1 and "needs root: pg_createcluster" in out.stderr, out.stderr
        return
    try:
        first = _services(port, cluster)
        assert first.returncode == 0, first.stderr
        assert f"creating cluster {version}/{cluster}" in first.stderr
        # Debian's pg_hba.conf asked for a password on loopback; the script added trust.
        assert "trusting 127.0.0.1" in first.stderr
        assert _psql(port, "select current_database()").stdout.strip() == "test"

        subprocess.run(["pg_ctlcluster", version, cluster, "stop"], check=True, timeout=60)
        assert _psql(port, "select 1").returncode != 0
        stopped = _services(port, cluster)
        assert stopped.returncode == 0, stopped.stderr
        assert "starting PostgreSQL" in stopped.stderr and "creating cluster" not in stopped.stderr
        assert _psql(port, "select 1").stdout.strip() == "1"

        again = _services(port, cluster)
        assert again.returncode == 0 and "PostgreSQL" not in again.stderr, again.stderr
    finally:
        subprocess.run(["pg_dropcluster", "--stop", version, cluster], capture_output=True, timeout=60)

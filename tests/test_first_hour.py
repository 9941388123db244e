"""What a new user meets in the first hour: the CLI's messages, the client's warnings, the demo's
lifecycle and `make run`. Real processes, real sockets, the real PostgreSQL."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import httpx
import pytest
from rlvitals.client import ClientSettings, ClientWarning, RetryPolicy, init
from rlvitals.client.demo import _port_free
from rlvitals.client.testing import FakeServer
from rlvitals.service.settings import Settings

from tests.support.servers import free_port, start_server
from tests.support.sideenv import rlvitals_path

REPO = Path(__file__).resolve().parents[1]


# --- the CLI -------------------------------------------------------------------------------------


def _closure(requirements: list[str]) -> set[str]:
    """Distribution names the requirements pull in (extras and environment markers ignored: extras
    are what a plain install leaves out)."""
    from importlib.metadata import distribution

    from packaging.requirements import Requirement

    seen: set[str] = set()
    todo = [Requirement(r).name for r in requirements]
    while todo:
        name = todo.pop().lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        for req in distribution(name).requires or []:
            parsed = Requirement(req)
            if parsed.marker is None or parsed.marker.evaluate({"extra": ""}):
                todo.append(parsed.name)
    return seen


def _client_only_python(tmp_path: Path) -> tuple[str, dict[str, str]]:
    """A fresh venv that sees this checkout's rlvitals and exactly the distributions a plain
    `pip install rlvitals` brings (its dependencies without extras, and theirs, linked from this venv)."""
    from importlib.metadata import distribution

    venv = tmp_path / "client-only"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    deps = tmp_path / "client-deps"
    deps.mkdir()
    for name in _closure(["rlvitals"]) - {"rlvitals"}:
        dist = distribution(name)
        for top in {Path(str(f)).parts[0] for f in dist.files or []}:
            source = Path(str(dist.locate_file(top)))
            if source.exists() and not (deps / top).exists() and not top.endswith(".."):
                (deps / top).symlink_to(source)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PYTHONPATH"] = f"{rlvitals_path()}{os.pathsep}{deps}"
    return str(venv / "bin" / "python"), env


@pytest.mark.heavy
def test_server_commands_on_a_client_only_install_say_what_to_install(tmp_path):
    python, env = _client_only_python(tmp_path)
    probe = subprocess.run([python, "-c", "import pydantic"], env=env, capture_output=True, timeout=60)
    assert probe.returncode != 0, "the client-only venv should not see pydantic"
    assert (
        subprocess.run([python, "-m", "rlvitals.cli", "--help"], env=env, capture_output=True).returncode == 0
    )
    for argv in (["serve"], ["keys", "list"], ["keys", "create"]):
        out = subprocess.run(
            [python, "-m", "rlvitals.cli", *argv], env=env, capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 2, out.stderr
        assert "Traceback" not in out.stderr, out.stderr
        assert "pip install 'rlvitals[server]'" in out.stderr and "pydantic" in out.stderr
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_help_texts_carry_no_rst_markup():
    for argv in ([], ["serve"], ["keys"], ["sync"], ["import"], ["demo"]):
        out = subprocess.run(
            [sys.executable, "-m", "rlvitals.cli", *argv, "--help"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0 and "``" not in out.stdout, out.stdout


@pytest.mark.parametrize("scheme", ["postgres", "postgresql", "postgresql+psycopg"])
def test_postgres_urls_without_a_driver_mean_psycopg_3(scheme):
    url = Settings(database_url=f"{scheme}://u:pw@db.example:5432/rlv").resolved_database_url
    assert url == "postgresql+psycopg://u:pw@db.example:5432/rlv"
    assert Settings(database_url="sqlite:///x.db").resolved_database_url == "sqlite:///x.db"


@pytest.mark.heavy
def test_serve_takes_a_libpq_url_and_prints_the_dashboard_and_the_database(pg_url, tmp_path):
    libpq = pg_url.replace("postgresql+psycopg://", "postgresql://")
    server = start_server(database_url=libpq, workdir=tmp_path, timeout=60)
    try:
        assert httpx.get(f"{server.url}/api/v1/runs", timeout=5).status_code == 200
        log = server.log()
    finally:
        server.stop()
    assert "Traceback" not in log
    assert f"rlvitals: dashboard http://127.0.0.1:{server.port}/" in log
    assert f"rlvitals: database {pg_url}" in log


def test_serve_on_sqlite_prints_the_database_file(tmp_path):
    db = tmp_path / "where.db"
    server = start_server(database_url=f"sqlite:///{db}", workdir=tmp_path)
    server.stop()
    assert f"rlvitals: database sqlite:///{db}" in server.log()


def test_serve_hides_the_database_password(pg_url, tmp_path):
    from rlvitals.service.cli import _banner

    banner = _banner(Settings(host="0.0.0.0", port=9, database_url="postgresql://u:secret@h/db"))
    assert "secret" not in banner and "postgresql+psycopg://u:***@h/db" in banner
    assert "http://127.0.0.1:9/" in banner


# --- the client ----------------------------------------------------------------------------------

_UNREACHABLE = """
import rlvitals
from rlvitals.client import ClientSettings, RetryPolicy
run = rlvitals.init(url="http://127.0.0.1:{port}", project="p", name="r", spool_dir={spool!r},
                    settings=ClientSettings(flush_interval=0.01, retry=RetryPolicy(initial=0.01, maximum=0.02)))
for step in range(5):
    run.log({{"x": 1.0}}, step=step)
run.finish(timeout=0.5)
"""


def test_a_client_warning_prints_once_as_one_line(tmp_path):
    code = _UNREACHABLE.format(port=free_port(), spool=str(tmp_path / "spool"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    create = [line for line in lines if "create run failed" in line]
    assert len(create) == 1, out.stderr  # not a log line plus a warnings line
    assert "ClientWarning" not in out.stderr and "warnings.warn" not in out.stderr, out.stderr
    # a filter that asks for the warning still gets it
    ask = "import warnings\nfrom rlvitals.client import ClientWarning\nwarnings.simplefilter('always', ClientWarning)\n"
    strict = subprocess.run(
        [sys.executable, "-c", ask + code],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert "ClientWarning: rlvitals: create run failed" in strict.stderr, strict.stderr


def test_a_step_that_goes_backwards_is_sent_and_warns_once(tmp_path):
    fake = FakeServer()
    settings = ClientSettings(flush_interval=0.01, retry=RetryPolicy(initial=0.01, maximum=0.05))
    run = init(url="http://fake", project="p", name="r", spool_dir=tmp_path, transport=fake.transport,
               settings=settings)  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ClientWarning)
        for step in (0, 1, 2, 1, 0, 3):
            run.log({"x": float(step), f"y{step}": 1.0}, step=step)
        report = run.finish(timeout=5)
    ours = [str(w.message) for w in caught if issubclass(w.category, ClientWarning)]
    assert len(ours) == 1 and "step 1 after step 2" in ours[0], ours
    assert run._problems.counts["step_backwards"] == 2
    assert report.complete
    assert fake.series(run.run_id, "x") == {0: 0.0, 1: 1.0, 2: 2.0, 3: 3.0}  # the first value of each step


def test_log_after_finish_raises_runtime_error_as_the_docs_say(tmp_path):
    run = init(url="http://fake", project="p", name="r", spool_dir=tmp_path, transport=FakeServer().transport)
    run.finish(timeout=5)
    with pytest.raises(RuntimeError, match="open run"):
        run.log({"x": 1.0}, step=0)
    client_doc = (REPO / "docs" / "client.md").read_text()
    assert "`RuntimeError`: `log()` after `finish()`" in client_doc


# --- the demo --------------------------------------------------------------------------------------


def test_a_port_in_time_wait_is_free_for_the_next_demo_but_a_listening_one_is_not():
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = listener.accept()
    assert not _port_free("127.0.0.1", port)  # listening
    conn.close()  # the server side closes first: its end of the connection enters TIME_WAIT
    time.sleep(0.05)
    client.close()
    listener.close()
    time.sleep(0.05)
    # what the probe did before: TIME_WAIT made it move off the port
    with socket.socket() as plain, pytest.raises(OSError):
        plain.bind(("127.0.0.1", port))
    assert _port_free("127.0.0.1", port)


@pytest.mark.heavy
def test_sigterm_stops_the_demo_and_its_server(tmp_path):
    port = free_port()
    env = {**os.environ, "HOME": str(tmp_path), "PYTHONWARNINGS": "ignore", "PYTHONUNBUFFERED": "1"}
    demo = subprocess.Popen(
        [sys.executable, "-m", "rlvitals.cli", "demo", "--steps", "2", "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    seen = []
    try:
        deadline = time.monotonic() + 300
        for line in demo.stdout:
            seen.append(line)
            if "Serving until Ctrl-C" in line or time.monotonic() > deadline:
                break
        assert "Serving until Ctrl-C" in "".join(seen), "".join(seen)
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200
        demo.send_signal(signal.SIGTERM)
        assert demo.wait(timeout=30) == 0
        rest = demo.stdout.read()
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait(timeout=30)
        demo.stdout.close()
    assert "stopping the server" in rest, rest
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1)
    demo_dir = tmp_path / ".rlvitals" / "demo"
    assert list(demo_dir.glob("demo-*.db")), list(demo_dir.iterdir())  # the run's data stays
    assert not list(demo_dir.glob("*.serve.lock")), "the stopped demo left its server's lock behind"


def test_the_demo_leaves_a_lock_that_a_live_server_holds(tmp_path):
    import fcntl

    from rlvitals.client.demo import _remove_serve_lock

    db = tmp_path / "demo.db"
    lock = tmp_path / "demo.db.serve.lock"
    with lock.open("a+") as held:  # what a running `rlvitals serve` holds
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        _remove_serve_lock(f"sqlite:///{db}")
        assert lock.exists()
    _remove_serve_lock(f"sqlite:///{db}")  # nobody holds it now
    assert not lock.exists()
    _remove_serve_lock(f"sqlite:///{db}")  # already gone: nothing to do
    _remove_serve_lock("postgresql+psycopg://u@h/db")


def test_make_run_installs_the_server_extra_not_dev():
    out = subprocess.run(["make", "-n", "run"], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert re.search(r"RLVITALS_EXTRAS=server bash scripts/bootstrap.sh", out.stdout), out.stdout
    assert "EXTRA=${RLVITALS_EXTRAS:-dev}" in (REPO / "scripts" / "bootstrap.sh").read_text()

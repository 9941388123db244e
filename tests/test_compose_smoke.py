"""docker-compose.yml under the Compose Specification and real Compose tools (docs/deploy.md).

Three checks, cheapest first:

- always: the file validates against the Compose Specification's JSON schema (the copy that
  ``check-jsonschema`` ships), and the same schema rejects a misspelt key, so the check bites;
- where Docker Compose v2 is installed (``docker compose``, or a v2 ``docker-compose``; no engine
  needed): ``config`` accepts the file and resolves it as docs/deploy.md says (the project and volume
  names whatever the folder is called, the published port, the health-gated start), and rejects the
  misspelt copy;
- opt-in, with a working engine: ``RLVITALS_TEST_COMPOSE=1`` and Docker with Compose v2
  (``docker compose``) or podman with ``podman-compose`` (``RLVITALS_TEST_COMPOSE_CMD`` picks one
  explicitly, e.g. ``podman-compose`` or ``docker-compose``). It builds the image from the checkout, then
  does what docs/deploy.md says: starts PostgreSQL, creates an API key with
  ``compose run --rm rlvitals keys create``, brings the stack up, waits for ``/healthz`` to report
  PostgreSQL, sends a run with three steps and one tensor batch through the real client, and reads them
  back **in PostgreSQL** (``psql`` in the postgres container): the run, its points and the batch's audit,
  which must agree. Under Docker both containers' health checks must report healthy (podman runs health
  checks only under systemd). A unique project name, a free port, and ``down -v`` at the end leave
  nothing behind. Building the image takes minutes (CPU torch).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import time
import uuid
from importlib import resources
from pathlib import Path

import httpx
import jsonschema
import pytest
import torch
import yaml

from tests.support.servers import free_port

REPO = Path(__file__).resolve().parents[1]
COMPOSE_FILE = REPO / "docker-compose.yml"
OPT_IN = "RLVITALS_TEST_COMPOSE"


def _misspelt(text: str) -> str:
    """The compose file with both services' ``healthcheck`` key misspelt: what every check must reject."""
    bad = text.replace("\n    healthcheck:\n", "\n    healthchek:\n")
    assert bad.count("healthchek:") == 2, "the compose file's healthcheck keys moved: update _misspelt"
    return bad


def test_the_file_follows_the_compose_specification():
    """The Compose Specification's own JSON schema (as check-jsonschema ships it) accepts the file."""
    schema = json.loads(
        (resources.files("check_jsonschema.builtin_schemas") / "vendor" / "compose-spec.json").read_text()
    )
    validator = jsonschema.validators.validator_for(schema)(schema)

    def errors(text: str) -> list[str]:
        return [
            f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in validator.iter_errors(yaml.safe_load(text))
        ]

    text = COMPOSE_FILE.read_text()
    assert errors(text) == []
    rejected = errors(_misspelt(text))
    assert len(rejected) == 2 and all("healthchek" in e for e in rejected), rejected


def compose_v2_cli() -> list[str] | None:
    """A Docker Compose v2 CLI: ``docker compose``, else a standalone ``docker-compose`` v2; or None."""
    for command in (["docker", "compose"], ["docker-compose"]):
        if not shutil.which(command[0]):
            continue
        try:
            out = subprocess.run([*command, "version", "--short"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.returncode == 0 and re.match(r"v?2\.", out.stdout.strip()):
            return command
    return None


def test_docker_compose_v2_accepts_and_resolves_the_file(tmp_path):
    command = compose_v2_cli()
    if command is None:
        pytest.skip("Docker Compose v2 is not installed (docs/deploy.md, 'Compose versions')")
    # a checkout under another folder name, with none of the file's variables set
    checkout = tmp_path / "some-checkout"
    checkout.mkdir()
    (checkout / "docker-compose.yml").write_text(COMPOSE_FILE.read_text())
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RLVITALS_", "POSTGRES_", "TORCH_", "COMPOSE_"))
    }

    def config(*args: str, **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*command, "config", *args], cwd=checkout, env={**env, **extra}, capture_output=True, text=True,
            timeout=60,
        )  # fmt: skip

    out = config("--format", "json")
    assert out.returncode == 0, out.stderr
    resolved = json.loads(out.stdout)
    assert resolved["name"] == "rlvitals"
    assert {v["name"] for v in resolved["volumes"].values()} == {"rlvitals_pgdata", "rlvitals_rlvitals-data"}
    server = resolved["services"]["rlvitals"]
    assert server["depends_on"]["postgres"]["condition"] == "service_healthy"
    ports = [(p["host_ip"], str(p["published"]), p["target"]) for p in server["ports"]]
    assert ports == [("127.0.0.1", "8000", 8000)]
    assert server["build"]["args"] == {"TORCH_INDEX_URL": "https://download.pytorch.org/whl/cpu"}
    url = "postgresql+psycopg://rlvitals:rlvitals@postgres:5432/rlvitals"
    assert server["environment"]["RLVITALS_DATABASE_URL"] == url and server["command"][-1] == url
    moved = json.loads(config("--format", "json", RLVITALS_PUBLISH="0.0.0.0:9000").stdout)
    assert [(p["host_ip"], str(p["published"])) for p in moved["services"]["rlvitals"]["ports"]] == [
        ("0.0.0.0", "9000")
    ]
    (checkout / "docker-compose.yml").write_text(_misspelt(COMPOSE_FILE.read_text()))
    out = config("--quiet")
    assert out.returncode != 0 and "healthchek" in out.stderr, (out.returncode, out.stderr)


def compose_command() -> list[str] | None:
    """The compose CLI to use, or None when no working engine is here."""
    if os.environ.get("RLVITALS_TEST_COMPOSE_CMD"):
        return shlex.split(os.environ["RLVITALS_TEST_COMPOSE_CMD"])
    candidates = []
    if shutil.which("docker"):  # a daemon that answers, and the Compose v2 plugin
        candidates.append(([["docker", "info"], ["docker", "compose", "version"]], ["docker", "compose"]))
    if shutil.which("podman") and shutil.which("podman-compose"):
        candidates.append(([["podman", "info"]], ["podman-compose"]))
    for probes, command in candidates:
        try:
            if all(
                subprocess.run(probe, capture_output=True, timeout=30).returncode == 0 for probe in probes
            ):
                return command
        except (OSError, subprocess.TimeoutExpired):
            continue
    return None


opt_in = pytest.mark.skipif(os.environ.get(OPT_IN) != "1", reason=f"opt-in: set {OPT_IN}=1 (docs/deploy.md)")


@pytest.fixture(scope="module")
def stack():
    command = compose_command()
    if command is None:
        pytest.skip("no working container engine: docker with Compose v2, or podman with podman-compose")
    project = f"rlvitals-smoke-{uuid.uuid4().hex[:8]}"
    port = free_port()
    env = {**os.environ, "RLVITALS_PUBLISH": f"127.0.0.1:{port}", "POSTGRES_PASSWORD": uuid.uuid4().hex}
    base = [*command, "-p", project, "-f", str(COMPOSE_FILE)]

    def compose(*args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        out = subprocess.run(
            [*base, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
        )
        if check:
            assert out.returncode == 0, f"{' '.join(args)}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
        return out

    try:
        built = compose("build", timeout=2400)
        # podman-compose 1.0 exits 0 when the build fails: ask the engine for the image itself
        engine = "podman" if "podman" in Path(command[0]).name else "docker"
        image = subprocess.run(
            [engine, "image", "inspect", "rlvitals:latest"], capture_output=True, timeout=60
        )
        assert image.returncode == 0, (
            f"the build made no rlvitals:latest:\n{built.stdout[-3000:]}\n{built.stderr[-3000:]}"
        )
        compose("up", "-d", "postgres", timeout=300)
        # `compose run` waits for the service_healthy dependency with Docker Compose; podman-compose
        # does not (nor does podman run health checks without systemd): wait for PostgreSQL here
        deadline = time.monotonic() + 180
        while _psql_rows(compose, "SELECT 1")[0] != ["1"]:
            assert time.monotonic() < deadline, compose("logs", "postgres", check=False).stdout[-3000:]
            time.sleep(1)
        created = compose("run", "--rm", "rlvitals", "keys", "create", "--name", "smoke", timeout=300)
        keys = re.findall(r"^(rlv_\S+)$", created.stdout, flags=re.MULTILINE)
        assert len(keys) == 1, (
            f"keys create printed no key:\n{created.stdout[-3000:]}\n{created.stderr[-3000:]}"
        )
        (key,) = keys
        compose("up", "-d", timeout=300)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while True:
            try:
                health = httpx.get(f"{url}/healthz", timeout=3)
                if health.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, compose("logs", "--tail", "50").stdout
            time.sleep(1)
        version = compose("version", check=False).stdout
        yield {
            "url": url, "key": key, "health": health.json(), "compose": compose,
            "docker_compose": version.startswith("Docker Compose version"),
        }  # fmt: skip
    finally:
        subprocess.run([*base, "down", "-v"], cwd=REPO, env=env, capture_output=True, timeout=300)


# psql's rows, each tagged, then "ok" once psql succeeded: what the compose CLI prints around them
# (podman-compose 1.0 echoes its podman commands on stdout) is left out, and a failed query is caught
# where the CLI does not pass the exit status on (podman-compose 1.0's exec does not).
_PSQL = (
    'out=$(psql -U rlvitals -d rlvitals -tA -v ON_ERROR_STOP=1 -c "$1") '
    '&& printf "%s\\n" "$out" | sed "s/^/psql| /" && echo "psql| ok"'
)


def _psql_rows(compose, sql: str) -> tuple[list[str] | None, subprocess.CompletedProcess]:
    """psql's output lines for ``sql``, or None when psql failed; and the compose command's result."""
    out = compose("exec", "-T", "postgres", "sh", "-c", _PSQL, "sh", sql, check=False)
    rows = [line.removeprefix("psql| ") for line in out.stdout.splitlines() if line.startswith("psql| ")]
    return (rows[:-1] if rows and rows[-1] == "ok" else None), out


def _psql(compose, sql: str) -> str:
    rows, out = _psql_rows(compose, sql)
    assert rows is not None, f"psql failed on {sql!r}:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
    return "\n".join(rows).strip()


@pytest.mark.docker
@pytest.mark.timeout(3600)
@opt_in
def test_a_run_with_a_batch_lands_in_postgresql(stack, tmp_path):
    import rlvitals

    assert stack["health"] == {"status": "ok", "database": "postgresql"}
    torch.manual_seed(0)
    log_prob = torch.randn(4, 8) * 0.1
    mask = torch.ones(4, 8)
    advantages = torch.randn(4, 1).expand(4, 8).contiguous()
    config = {"loss_mode": "vanilla", "loss_agg_mode": "token-mean", "clip_ratio": 0.2}
    reported = {"pg_loss": float(-(advantages * mask).sum() / mask.sum()), "pg_clipfrac": 0.0, "ppo_kl": 0.0}
    run = rlvitals.init(
        url=stack["url"], api_key=stack["key"], project="smoke", name="compose", config=config,
        spool_dir=tmp_path / "spool", batch_every=1,
    )  # fmt: skip
    for step in range(3):
        run.log({"actor/pg_loss": reported["pg_loss"], "actor/entropy": 1.0}, step=step)
    run.log_batch(0, log_prob=log_prob, old_log_prob=log_prob, advantages=advantages, response_mask=mask,
                  config=config, reported=reported)  # fmt: skip
    report = run.finish(timeout=60)
    assert report.complete, report
    compose = stack["compose"]
    assert _psql(compose, "SELECT name, last_step FROM runs WHERE project = 'smoke'") == "compose|2"
    trainer_points = (
        "SELECT count(*) FROM points p JOIN runs r ON r.id = p.run_id "
        "WHERE r.project = 'smoke' AND p.name IN ('actor/pg_loss', 'actor/entropy')"
    )  # the audit adds its own series (rlvitals/...) beside them when it is done
    assert _psql(compose, trainer_points) == "6"
    deadline = time.monotonic() + 120
    while (status := _psql(compose, "SELECT status FROM audits")) not in ("done", "error"):
        assert time.monotonic() < deadline, f"audit still {status!r}"
        time.sleep(1)
    assert status == "done"
    audit = httpx.get(
        f"{stack['url']}/api/v1/runs/{run.run_id}/audits", headers={"Authorization": f"Bearer {stack['key']}"}
    ).json()["data"][0]
    assert all(v["ok"] for v in audit["verdicts"].values()), audit


@pytest.mark.docker
@pytest.mark.timeout(600)
@opt_in
def test_docker_reports_both_containers_healthy(stack):
    """The two health checks (pg_isready; the image's /healthz probe) pass in the containers themselves."""
    if not stack["docker_compose"]:
        pytest.skip("podman runs health checks only under systemd; Docker Compose runs them")
    compose = stack["compose"]
    deadline = time.monotonic() + 180
    while (health := _health(compose)) != {"postgres": "healthy", "rlvitals": "healthy"}:
        assert time.monotonic() < deadline, (health, compose("logs", "--tail", "50", check=False).stdout)
        time.sleep(2)


def _health(compose) -> dict[str, str]:
    """Each service's health as ``compose ps`` reports it (one JSON object a line; older v2: one array)."""
    out = compose("ps", "--format", "json").stdout.strip()
    rows = json.loads(out) if out.startswith("[") else [json.loads(line) for line in out.splitlines() if line]
    return {row["Service"]: row.get("Health", "") for row in rows}

"""docker-compose.yml and the Dockerfile agree with the CLI, the settings and the docs.

No Docker engine runs here, so the files are read as Docker would read them: the compose file with
PyYAML plus compose's ``${VAR:-default}`` interpolation, the Dockerfile's final stage instruction by
instruction. The server command the container would run (ENTRYPOINT + compose ``command``) is parsed
by ``rlvitals.cli.build_parser()``; every ``RLVITALS_*`` variable must be a ``Settings`` field and
validate; ports, volumes and health checks must line up; and the same command, with only the
address and database swapped for this machine's, starts a real server on the real PostgreSQL.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping
from importlib.metadata import entry_points
from pathlib import Path

import httpx
import pytest
import yaml
from rlvitals.service.settings import Settings
from sqlalchemy.engine import make_url

from rlvitals.cli import build_parser
from tests.support.servers import start_server

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "Dockerfile"
DEPLOY_DOC = REPO / "docs" / "deploy.md"

_VAR = re.compile(r"\$(?:(\$)|\{(\w+)(?:(:?[-?])([^}]*))?\}|(\w+))")


def interpolate(text: str, env: Mapping[str, str]) -> str:
    """Compose's variable substitution: $$, $VAR, ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?err}."""

    def sub(m: re.Match) -> str:
        escaped, name, op, arg, bare = m.groups()
        if escaped:
            return "$"
        name = name or bare
        value = env.get(name)
        if op == ":-":
            return value if value else arg
        if op == "-":
            return value if value is not None else arg
        if op in (":?", "?") and not value:
            raise ValueError(f"{name} is required: {arg}")
        return value or ""

    return _VAR.sub(sub, text)


def resolve(node, env: Mapping[str, str]):
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [resolve(v, env) for v in node]
    if isinstance(node, dict):
        return {k: resolve(v, env) for k, v in node.items()}
    return node


def compose(env: Mapping[str, str] | None = None) -> dict:
    return resolve(yaml.safe_load(COMPOSE.read_text()), env or {})


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of every stage, continuation lines joined, comments dropped."""
    out, current = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        stripped = raw.strip()
        if stripped.startswith("#") or not (stripped or current):
            continue  # Docker drops comment lines, even inside a continued instruction
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        line, current = current + stripped, ""
        op, _, args = line.partition(" ")
        out.append((op.upper(), args.strip()))
    return out


def dockerfile_final_stage() -> list[tuple[str, str]]:
    instructions = dockerfile_instructions()
    last_from = max(i for i, (op, _) in enumerate(instructions) if op == "FROM")
    return instructions[last_from:]


def instruction(op: str) -> str:
    found = [args for name, args in dockerfile_final_stage() if name == op]
    assert found, f"the Dockerfile's final stage has no {op}"
    return found[-1]


def exec_form(op: str) -> list[str]:
    value = json.loads(instruction(op))
    assert isinstance(value, list), f"{op} should use the exec (JSON) form so signals reach the server"
    return value


def dockerfile_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for name, args in dockerfile_final_stage():
        if name == "ENV":
            for item in shlex.split(args):
                key, _, value = item.partition("=")
                env[key] = value
    return env


def server_argv(env: Mapping[str, str] | None = None) -> list[str]:
    return exec_form("ENTRYPOINT") + compose(env)["services"]["rlvitals"]["command"]


def parse_serve(argv: list[str]):
    assert argv[0] == "rlvitals"
    args = build_parser().parse_args(argv[1:])
    assert args.command == "serve"
    return args


def test_entrypoint_is_the_packaged_console_script() -> None:
    assert exec_form("ENTRYPOINT") == ["rlvitals"]
    (script,) = entry_points(group="console_scripts", name="rlvitals")
    assert script.value == "rlvitals.cli:main"


def test_compose_command_is_a_valid_serve_command_on_postgresql() -> None:
    args = parse_serve(server_argv())
    assert args.host == "0.0.0.0"
    assert args.port == 8000
    url = make_url(args.database_url)
    assert url.drivername == "postgresql+psycopg"


@pytest.mark.parametrize("env", [{}, {"POSTGRES_PASSWORD": "s3cret-Pw"}], ids=["defaults", "password-set"])
def test_database_url_points_at_the_postgres_service(env: dict[str, str]) -> None:
    doc = compose(env)
    pg_env = doc["services"]["postgres"]["environment"]
    url = make_url(parse_serve(server_argv(env)).database_url)
    assert url.host == "postgres" and (url.port or 5432) == 5432
    assert url.username == pg_env["POSTGRES_USER"]
    assert url.password == pg_env["POSTGRES_PASSWORD"] == env.get("POSTGRES_PASSWORD", url.password)
    assert url.database == pg_env["POSTGRES_DB"]
    # One-off commands (`docker compose run --rm rlvitals keys create`) reach the same database.
    assert doc["services"]["rlvitals"]["environment"]["RLVITALS_DATABASE_URL"] == str(
        url.render_as_string(hide_password=False)
    )


def test_default_image_command_serves_on_the_exposed_port() -> None:
    args = parse_serve(exec_form("ENTRYPOINT") + exec_form("CMD"))
    assert args.host == "0.0.0.0"
    assert str(args.port) in instruction("EXPOSE").split()


def test_published_port_health_checks_and_expose_match_the_serve_port() -> None:
    doc = compose()
    port = parse_serve(server_argv()).port
    (mapping,) = doc["services"]["rlvitals"]["ports"]
    host_side, _, container_port = mapping.rpartition(":")
    assert int(container_port) == port
    assert host_side.startswith("127.0.0.1:"), "publish on loopback by default; RLVITALS_PUBLISH widens it"
    assert str(port) in instruction("EXPOSE").split()
    compose_check = " ".join(doc["services"]["rlvitals"]["healthcheck"]["test"])
    assert f"127.0.0.1:{port}/healthz" in compose_check
    assert f"127.0.0.1:{port}/healthz" in instruction("HEALTHCHECK")


def test_environment_variables_are_settings_fields_and_validate(monkeypatch: pytest.MonkeyPatch) -> None:
    env = dict(compose()["services"]["rlvitals"]["environment"])
    env.update({k: v for k, v in dockerfile_env().items() if k.startswith("RLVITALS_")})
    fields = set(Settings.model_fields)
    for key in env:
        assert key.startswith("RLVITALS_"), key
        assert key.removeprefix("RLVITALS_").lower() in fields, f"{key} is not a Settings field"
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    settings = Settings()
    assert settings.database_url == env["RLVITALS_DATABASE_URL"]
    assert settings.insecure is False, "writes must need an API key unless RLVITALS_INSECURE=true"
    assert settings.webhook_urls == [] and settings.slack_webhook_urls == []
    assert str(settings.data_dir) == dockerfile_env()["RLVITALS_DATA_DIR"]


def test_insecure_and_webhooks_come_from_the_shell(monkeypatch: pytest.MonkeyPatch) -> None:
    shell = {
        "RLVITALS_INSECURE": "true",
        "RLVITALS_WEBHOOK_URLS": "http://hooks.internal/a,http://hooks.internal/b",
    }
    for key, value in compose(shell)["services"]["rlvitals"]["environment"].items():
        monkeypatch.setenv(key, value)
    settings = Settings()
    assert settings.insecure is True
    assert settings.webhook_urls == ["http://hooks.internal/a", "http://hooks.internal/b"]


def test_server_waits_for_a_healthy_postgres_on_a_named_volume() -> None:
    doc = compose()
    server, pg = doc["services"]["rlvitals"], doc["services"]["postgres"]
    assert server["depends_on"]["postgres"]["condition"] == "service_healthy"
    check = " ".join(pg["healthcheck"]["test"])
    assert "pg_isready" in check
    assert f"-U {pg['environment']['POSTGRES_USER']}" in check
    volume, _, target = pg["volumes"][0].partition(":")
    assert target == "/var/lib/postgresql/data" and volume in doc["volumes"]


def test_server_data_volume_is_the_images_data_dir() -> None:
    doc = compose()
    volume, _, target = doc["services"]["rlvitals"]["volumes"][0].partition(":")
    assert volume in doc["volumes"]
    assert json.loads(instruction("VOLUME")) == [target]
    assert dockerfile_env()["RLVITALS_DATA_DIR"] == target == instruction("WORKDIR")


def test_image_runs_as_a_non_root_user() -> None:
    assert instruction("USER") not in ("root", "0")


def test_dockerfile_copies_only_existing_sources_that_dockerignore_keeps() -> None:
    ignored = {
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert {".venv", ".git", "**/*.db"} <= ignored
    copies = [
        shlex.split(args) for op, args in dockerfile_instructions() if op == "COPY" and "--from" not in args
    ]
    assert copies
    for *sources, _dest in copies:
        for src in sources:
            assert (REPO / src).exists(), f"COPY {src}: no such path"
            assert src not in ignored, f"COPY {src} but .dockerignore excludes it"


def documented_commands() -> list[list[str]]:
    """Every `docker compose run --rm rlvitals ...` line in the compose file and the deploy doc."""
    found = []
    for path in (COMPOSE, DEPLOY_DOC):
        for m in re.finditer(r"docker compose run --rm rlvitals ([^\n`]+)", path.read_text()):
            found.append(["rlvitals", *shlex.split(m.group(1), comments=True)])
    return found


def test_documented_one_off_commands_parse() -> None:
    commands = documented_commands()
    assert any(argv[1:3] == ["keys", "create"] for argv in commands), (
        "document how to create the first API key"
    )
    for argv in commands:
        build_parser().parse_args(argv[1:])


def test_deploy_doc_explains_keys_and_insecure() -> None:
    text = DEPLOY_DOC.read_text()
    for needle in (
        "docker compose up",
        "RLVITALS_INSECURE",
        "--insecure",
        "Authorization: Bearer",
        "/healthz",
    ):
        assert needle in text, f"docs/deploy.md should mention {needle!r}"


@pytest.mark.heavy
def test_compose_server_command_starts_on_postgresql(pg_url: str, tmp_path: Path) -> None:
    """The exact compose command, with this machine's loopback address and database, serves /healthz."""
    argv = server_argv()
    args = parse_serve(argv)
    rest = list(argv[2:])
    for flag in ("--host", "--port", "--database-url"):
        i = rest.index(flag)
        del rest[i : i + 2]
    env = {
        k: v
        for k, v in compose()["services"]["rlvitals"]["environment"].items()
        if k != "RLVITALS_DATABASE_URL"
    }
    assert make_url(args.database_url).drivername == make_url(pg_url).drivername
    server = start_server(database_url=pg_url, workdir=tmp_path, env=env, args=tuple(rest), timeout=60)
    try:
        assert httpx.get(f"{server.url}/healthz", timeout=5).status_code == 200
    finally:
        server.stop()

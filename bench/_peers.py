"""The servers bench/ingest.py compares, each driven through its own public HTTP API.

Each target turns the same workload into the requests its own client would send:

- rlvitals: ``POST /api/v1/runs/{id}/metrics`` with ``{"steps": [...]}``; history from
  ``GET /api/v1/runs/{id}/metrics?names=...&max_points=0&format=binary`` (every point, one request
  for all names, decoded by the client's ``rlvitals.client.history.decode_series`` into arrays, as
  ``read_series`` does); the JSON form of the same read is timed beside it.
- MLflow (tracking server, SQLite backend, uvicorn as ``mlflow server`` starts it):
  ``POST /api/2.0/mlflow/runs/log-batch``, split at 1,000 metrics per request as MLflow's client does;
  history from ``GET /api/2.0/mlflow/metrics/get-history`` per metric, paged at 25,000 like
  ``MlflowClient.get_metric_history``.
- trackio (its own Starlette server as ``trackio.show()`` starts it, SQLite): ``POST /api/bulk_log``
  with the entries its ``Run._batch_sender`` queues (project, run, run_id, metrics, step, config,
  log_id) and the write token header; history from ``POST /api/get_metric_values`` per metric, its
  only read that returns every point (``get_logs``/``get_logs_batch`` cap at 3,000/10,000 points).

Every request is checked: a non-2xx answer, an error body or a short history aborts the benchmark
rather than being counted as work done.
"""

from __future__ import annotations

import http.client
import json
import secrets
import subprocess
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote, urlencode

from _servers import Server

# (step, {name: value}, wall_time seconds)
Step = tuple[int, Mapping[str, float], float]

MLFLOW_MAX_METRICS_PER_BATCH = 1000  # mlflow.utils.validation.MAX_METRICS_PER_BATCH
MLFLOW_HISTORY_PAGE = 25_000  # mlflow.store.tracking.GET_METRIC_HISTORY_MAX_RESULTS


class BenchError(RuntimeError):
    """A server answered something other than success; the numbers would be meaningless."""


@dataclass(frozen=True)
class Req:
    method: str
    path: str
    body: bytes | None = None
    headers: Mapping[str, str] = field(default_factory=dict)


class Conn:
    """One keep-alive HTTP/1.1 connection, as a trainer's client holds one.

    http.client sends headers and a bytes body in one ``send()``, so the client side never waits on
    Nagle's algorithm; any delayed-ACK stall measured here comes from the server's side.
    """

    def __init__(self, port: int, timeout: float = 120.0) -> None:
        self.port = port
        self.timeout = timeout
        self._conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)

    def call(self, req: Req) -> bytes:
        headers = dict(req.headers)
        if req.body is not None:
            headers.setdefault("Content-Type", "application/json")
        for attempt in range(2):
            try:
                self._conn.request(req.method, req.path, body=req.body, headers=headers)
                resp = self._conn.getresponse()
                data = resp.read()
                break
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                # The server closed an idle keep-alive connection before reading the request.
                self._conn.close()
                if attempt:
                    raise
        if not 200 <= resp.status < 300:
            raise BenchError(f"{req.method} {req.path} -> {resp.status}: {data[:300]!r}")
        return data

    def close(self) -> None:
        self._conn.close()


def _json(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


@dataclass
class RunRef:
    name: str
    id: str


class Target:
    """A server under test. Subclasses build its command and its requests."""

    label: str
    kind: str  # "rlvitals" | "mlflow" | "trackio"

    def server(self, workdir: Path, port: int) -> Server:
        raise NotImplementedError

    def create_run(self, conn: Conn, name: str) -> RunRef:
        raise NotImplementedError

    def log_requests(self, run: RunRef, steps: Sequence[Step]) -> list[Req]:
        """The HTTP requests that send ``steps`` (one logical request; MLflow may need several)."""
        raise NotImplementedError

    def history(self, conn: Conn, run: RunRef, names: Sequence[str]) -> dict[str, int]:
        """Fetch every point of ``names``; returns the number of points per name."""
        raise NotImplementedError

    def probe_path(self) -> str:
        """A cheap GET, for the keep-alive latency probe."""
        raise NotImplementedError


@dataclass
class Rlvitals(Target):
    python: str
    workers: int | None = None
    postgres: bool = False  # False: an embedded SQLite file in the work dir
    database_url: str | None = None  # the PostgreSQL database, set by the caller when postgres
    # a reference, not a configuration to run: every health rule disabled (RLVITALS_RULES, and no
    # plugins), so the write path (parse, validate, insert, HTTP) is measured without the rules' CPU
    rules_off: bool = False
    kind: str = "rlvitals"

    @property
    def label(self) -> str:  # type: ignore[override]
        label = "rlvitals" if self.workers is None else f"rlvitals --workers {self.workers}"
        if self.rules_off:
            label += ", every rule off (reference)"
        return f"{label} (PostgreSQL)" if self.postgres else label

    def server(self, workdir: Path, port: int) -> Server:
        argv = [
            self.python, "-m", "rlvitals.cli", "serve",
            "--host", "127.0.0.1", "--port", str(port),
            "--database-url", self.database_url if self.postgres else f"sqlite:///{workdir / 'rlvitals.db'}",
        ]  # fmt: skip
        if self.workers is not None:
            argv += ["--workers", str(self.workers)]
        # no plugin's rule either: the reference runs no rule at all
        env = (
            {"RLVITALS_RULES": _every_rule_off(self.python), "RLVITALS_PLUGINS": "false"}
            if self.rules_off
            else {}
        )
        return Server(name="rlvitals", argv=argv, port=port, workdir=workdir, ready_path="/healthz", env=env)

    def create_run(self, conn: Conn, name: str) -> RunRef:
        body = _json({"name": name, "project": "bench", "config": {"algorithm": "grpo"}, "tags": ["bench"]})
        data = json.loads(conn.call(Req("POST", "/api/v1/runs", body)))
        return RunRef(name=name, id=str(data["id"]))

    def log_requests(self, run: RunRef, steps: Sequence[Step]) -> list[Req]:
        payload = {"steps": [{"step": s, "metrics": dict(m), "wall_time": t} for s, m, t in steps]}
        return [Req("POST", f"/api/v1/runs/{run.id}/metrics", _json(payload))]

    def history(
        self, conn: Conn, run: RunRef, names: Sequence[str], *, as_json: bool = False
    ) -> dict[str, int]:
        """Every point, as a user of the client reads them: ``format=binary`` decoded by
        ``rlvitals.client.history.decode_series`` (the arrays ``read_series`` returns; here on the
        bench's keep-alive connection). ``as_json``: the default JSON answer, parsed with ``json``."""
        if as_json:
            query = urlencode({"names": ",".join(names), "max_points": 0})
            data = json.loads(conn.call(Req("GET", f"/api/v1/runs/{run.id}/metrics?{query}")))
            series = data["series"]
            return {name: len(series.get(name, {}).get("step", ())) for name in names}
        from rlvitals.client.history import decode_series

        query = urlencode({"names": ",".join(names), "max_points": 0, "format": "binary"})
        decoded = decode_series(conn.call(Req("GET", f"/api/v1/runs/{run.id}/metrics?{query}")))
        return {name: len(decoded[name].value) if name in decoded else 0 for name in names}

    def probe_path(self) -> str:
        return "/healthz"


def _every_rule_off(python: str) -> str:
    """``RLVITALS_RULES`` for the server at ``python``: every rule it registers, disabled."""
    code = (
        "import json; from rlvitals.analyzers.health.registry import RuleId; "
        "print(json.dumps({rule.value: {'enabled': False} for rule in RuleId}))"
    )
    return subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


@dataclass
class Mlflow(Target):
    python: str
    workers: int | None = None
    kind: str = "mlflow"

    @property
    def label(self) -> str:  # type: ignore[override]
        return "MLflow (default: 4 workers)" if self.workers is None else f"MLflow --workers {self.workers}"

    def server(self, workdir: Path, port: int) -> Server:
        argv = [
            self.python, "-m", "mlflow", "server",
            "--backend-store-uri", f"sqlite:///{workdir / 'mlflow.db'}",
            "--default-artifact-root", str(workdir / "artifacts"),
            "--host", "127.0.0.1", "--port", str(port),
        ]  # fmt: skip
        if self.workers is not None:
            argv += ["--workers", str(self.workers)]
        env = {"MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "1"}
        return Server(name="mlflow", argv=argv, port=port, workdir=workdir, ready_path="/health", env=env)

    def create_run(self, conn: Conn, name: str) -> RunRef:
        body = _json({"experiment_id": "0", "run_name": name, "start_time": int(time.time() * 1000)})
        data = json.loads(conn.call(Req("POST", "/api/2.0/mlflow/runs/create", body)))
        return RunRef(name=name, id=data["run"]["info"]["run_id"])

    def log_requests(self, run: RunRef, steps: Sequence[Step]) -> list[Req]:
        metrics = [
            {"key": k, "value": v, "timestamp": int(t * 1000), "step": s}
            for s, m, t in steps
            for k, v in m.items()
        ]
        return [
            Req(
                "POST",
                "/api/2.0/mlflow/runs/log-batch",
                _json({"run_id": run.id, "metrics": metrics[i : i + MLFLOW_MAX_METRICS_PER_BATCH]}),
            )
            for i in range(0, len(metrics), MLFLOW_MAX_METRICS_PER_BATCH)
        ]

    def history(self, conn: Conn, run: RunRef, names: Sequence[str]) -> dict[str, int]:
        out = {}
        for name in names:
            count, token = 0, None
            while True:
                params = {"run_id": run.id, "metric_key": name, "max_results": MLFLOW_HISTORY_PAGE}
                if token:
                    params["page_token"] = token
                data = json.loads(
                    conn.call(Req("GET", f"/api/2.0/mlflow/metrics/get-history?{urlencode(params)}"))
                )
                count += len(data.get("metrics", ()))
                token = data.get("next_page_token")
                if not token:
                    break
            out[name] = count
        return out

    def probe_path(self) -> str:
        return "/health"


@dataclass
class Trackio(Target):
    python: str
    kind: str = "trackio"
    label: str = "trackio"
    token: str = field(default_factory=lambda: secrets.token_urlsafe(16))

    def server(self, workdir: Path, port: int) -> Server:
        code = (
            f"import trackio; trackio.show(host='127.0.0.1', server_port={port}, open_browser=False, "
            "block_thread=True, share=False)"
        )
        env = {
            "TRACKIO_DIR": str(workdir / "trackio"),
            "TRACKIO_WRITE_TOKEN": self.token,
            "HF_HUB_OFFLINE": "1",
            "GRADIO_ANALYTICS_ENABLED": "False",
            "DO_NOT_TRACK": "1",
        }
        return Server(
            name="trackio",
            argv=[self.python, "-c", code],
            port=port,
            workdir=workdir,
            ready_path="/version",
            env=env,
        )

    def _api(self, name: str, **kwargs: object) -> Req:
        body = _json({"args": [], "kwargs": {**kwargs, "hf_token": None}})
        return Req("POST", f"/api/{quote(name)}", body, {"x-trackio-write-token": self.token})

    def create_run(self, conn: Conn, name: str) -> RunRef:
        # trackio creates a run with its first bulk_log; its client names it with a uuid4 hex id.
        return RunRef(name=name, id=uuid.uuid4().hex)

    def log_requests(self, run: RunRef, steps: Sequence[Step]) -> list[Req]:
        logs = [
            {
                "project": "bench",
                "run": run.name,
                "run_id": run.id,
                "metrics": dict(m),
                "step": s,
                "config": {"algorithm": "grpo"} if s == 0 else None,
                "log_id": uuid.uuid4().hex,
            }
            for s, m, _t in steps
        ]
        return [self._api("bulk_log", logs=logs)]

    def history(self, conn: Conn, run: RunRef, names: Sequence[str]) -> dict[str, int]:
        out = {}
        for name in names:
            req = self._api(
                "get_metric_values", project="bench", run=run.name, run_id=run.id, metric_name=name
            )
            data = json.loads(conn.call(req))
            if data.get("error"):
                raise BenchError(f"trackio get_metric_values: {data['error']}")
            out[name] = len(data["data"])
        return out

    def probe_path(self) -> str:
        return "/version"


def check_bulk_reply(target: Target, data: bytes) -> None:
    """trackio answers 200 with ``{"error": ...}`` on a refused write; treat that as a failure."""
    if target.kind == "trackio" and data:
        body = json.loads(data)
        if isinstance(body, dict) and body.get("error"):
            raise BenchError(f"trackio bulk_log: {body['error']}")

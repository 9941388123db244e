"""Fuzz the in-process app from its own OpenAPI schema: no input makes it answer 5xx, and every
error it does answer has the one JSON error shape ``{"error": {"code", "message", "detail"}}``.

Schemathesis turns ``/openapi.json`` into Hypothesis strategies per operation: *positive* cases fit
the schema (they reach the domain code), *negative* cases break it in one place (wrong types,
missing fields, out-of-range numbers, garbage bodies) and must be refused with a 4xx. Path ids are
drawn half the time from runs and audits that exist, so the fuzzer gets past the 404 into real
ingest, query and audit code. Runs on the real app (lifespan, schema, audit pool) over SQLite;
the number of examples per operation is bounded so the file runs in well under two minutes (a quarter
of them in ``make test-fast``).

The SSE stream (``GET /api/v1/runs/{id}/events``) stays open by design, so it is fuzzed only with
unknown run ids (an immediate 404); its live behaviour has its own tests.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.core.failures import FailureGroup
from schemathesis.core.parameters import ParameterLocation
from schemathesis.specs.openapi.checks import negative_data_rejection

from tests.service.batchdata import make_batch
from tests.support.budget import examples

# per operation and mode (about 25 s for the file); `make test-fast` draws a quarter (tests/support/budget.py)
MAX_EXAMPLES = examples(75)
SSE_PATH = "/api/v1/runs/{run_id}/events"
UNKNOWN_ID = 10**9


def error_shape_problem(response: httpx.Response) -> str | None:
    """Why ``response`` (a 4xx/5xx) is not in the error shape, or None when it is."""
    try:
        body = response.json()
    except ValueError:
        return f"body is not JSON: {response.text[:200]!r}"
    if not isinstance(body, dict) or set(body) != {"error"}:
        return f"top level must be exactly {{'error': ...}}, got {body!r:.200}"
    err = body["error"]
    if not isinstance(err, dict) or set(err) != {"code", "message", "detail"}:
        return f"error must have exactly code, message, detail; got {err!r:.200}"
    if (
        not isinstance(err["code"], str)
        or not err["code"]
        or not isinstance(err["message"], str)
        or not err["message"]
    ):
        return f"code and message must be non-empty strings; got {err!r:.200}"
    return None


def send(api, case) -> httpx.Response:
    """Send a schemathesis case through the app's in-process httpx client."""
    kwargs = case.as_transport_kwargs(base_url="http://127.0.0.1")
    body = {}
    if "json" in kwargs:
        body["json"] = kwargs["json"]
    elif isinstance(kwargs.get("data"), (bytes, str)):
        body["content"] = kwargs["data"]
    elif kwargs.get("data") is not None:
        body["data"] = kwargs["data"]
    return api.request(
        kwargs["method"],
        kwargs["url"],
        params=kwargs.get("params") or None,
        headers=kwargs.get("headers") or None,
        cookies=kwargs.get("cookies") or None,
        **body,
    )


@pytest.fixture
def fuzz_api(app_client, tmp_path):
    """The app on SQLite, with two runs (one with metrics, one with an audited batch)."""
    api = app_client(f"sqlite:///{tmp_path / 'fuzz.db'}")
    runs = [api.create_run("fuzz-metrics", config={"algorithm": "grpo"}), api.create_run("fuzz-batches")]
    steps = [
        {"step": s, "metrics": {"actor/pg_clipfrac": 0.2, "actor/ppo_kl": "NaN", "loss": None}}
        for s in range(20)
    ]
    assert api.log(runs[0], steps).status_code == 200
    posted = api.post(
        f"/api/v1/runs/{runs[1]}/batches",
        content=make_batch(3),
        headers={"Content-Type": "application/octet-stream"},
    )
    assert posted.status_code == 202, posted.text
    api.ids = {"run_id": runs, "audit_id": [posted.json()["id"]]}
    return api


def operations(api):
    schema = schemathesis.openapi.from_dict(api.get("/openapi.json").json())
    # Unknown query parameters are ignored, as most HTTP APIs (and FastAPI) do; not a negative case.
    schema.config.generation.update(allow_extra_parameters=False)
    return [result.ok() for result in schema.get_all_operations()]


def fuzz(api, mode: GenerationMode, check: Callable[[object, httpx.Response], str | None]) -> list[str]:
    """Run every operation through ``check``; returns the problems found (one line each)."""
    problems: list[str] = []
    for op in operations(api):
        if mode == GenerationMode.NEGATIVE and not _has_inputs(op):
            continue  # nothing to break (GET /healthz, GET /metrics)
        _fuzz_operation(api, op, mode, check, problems)()
    return problems


def _has_inputs(op) -> bool:
    return any(len(group) for group in (op.query, op.path_parameters, op.headers, op.body))


def _fuzz_operation(api, op, mode: GenerationMode, check, problems: list[str]) -> Callable[[], None]:
    strategy = op.as_strategy(mode)
    sse = op.path == SSE_PATH

    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(data=st.data())
    def run(data) -> None:
        case = data.draw(strategy)
        broken_path = case.meta is not None and case.meta.is_negative_at(ParameterLocation.PATH)
        for name in list(case.path_parameters or {}):
            if sse:
                case.path_parameters[name] = UNKNOWN_ID
            elif name in api.ids and not broken_path and data.draw(st.booleans()):
                case.path_parameters[name] = data.draw(st.sampled_from(api.ids[name]))
        try:
            response = send(api, case)
        except Exception as exc:  # the app raised past its error handlers: a 500 for a real client
            kwargs = case.as_transport_kwargs(base_url="http://127.0.0.1")
            problems.append(
                f"{op.method.upper()} {kwargs['url']} params={kwargs.get('params')}: raised {exc!r}"
            )
            return
        problem = check(case, response)
        if problem:
            request = response.request
            body = (request.content or b"")[:200]
            problems.append(f"{op.method.upper()} {request.url} body={body!r}: {problem}")

    return run


def no_5xx_and_error_shape(case, response: httpx.Response) -> str | None:
    if response.status_code >= 500:
        return f"{response.status_code}: {response.text[:300]}"
    if response.status_code >= 400:
        problem = error_shape_problem(response)
        return f"{response.status_code} {problem}" if problem else None
    return None


def test_positive_cases_never_fail_the_server(fuzz_api) -> None:
    problems = fuzz(fuzz_api, GenerationMode.POSITIVE, no_5xx_and_error_shape)
    assert not problems, f"{len(problems)} bad responses:\n" + "\n".join(problems[:20])


def test_negative_cases_are_refused_with_a_4xx_in_the_error_shape(fuzz_api) -> None:
    def check(case, response: httpx.Response) -> str | None:
        problem = no_5xx_and_error_shape(case, response)
        if problem:
            return problem
        try:  # a request that breaks the schema must not be accepted (schemathesis' own judgement)
            case.validate_response(response, checks=[negative_data_rejection])
        except FailureGroup as exc:
            return f"{response.status_code}: {exc}"[:400]
        return None

    problems = fuzz(fuzz_api, GenerationMode.NEGATIVE, check)
    assert not problems, f"{len(problems)} bad responses:\n" + "\n".join(problems[:20])


def test_no_write_gets_through_without_the_api_key(fuzz_api) -> None:
    """Once a key exists, fuzzed writes without it are refused (401, or 4xx for bad input) in the
    error shape, and nothing they carried is stored."""
    from rlvitals.service.auth import create_key

    create_key(fuzz_api.services.db, name="fuzz")
    time.sleep(fuzz_api.services.auth.ttl + 0.2)  # a new key takes effect within the auth cache's ttl
    writes = [op for op in operations(fuzz_api) if op.method.upper() == "POST"]
    assert writes
    before = fuzz_api.get("/api/v1/runs").json()["count"]

    def check(case, response: httpx.Response) -> str | None:
        if response.status_code < 400:
            return f"write accepted without a key: {response.status_code} {response.text[:200]}"
        return no_5xx_and_error_shape(case, response)

    problems: list[str] = []
    for op in writes:
        _fuzz_operation(fuzz_api, op, GenerationMode.POSITIVE, check, problems)()
    assert not problems, f"{len(problems)} bad responses:\n" + "\n".join(problems[:20])
    assert fuzz_api.get("/api/v1/runs").json()["count"] == before


def test_every_api_operation_is_in_the_schema_and_fuzzed(fuzz_api) -> None:
    fuzzed = {(op.method.upper(), op.path) for op in operations(fuzz_api)}
    for expected in [
        ("POST", "/api/v1/runs"),
        ("GET", "/api/v1/runs"),
        ("GET", "/api/v1/runs/{run_id}"),
        ("POST", "/api/v1/runs/{run_id}/metrics"),
        ("GET", "/api/v1/runs/{run_id}/metrics"),
        ("POST", "/api/v1/runs/{run_id}/batches"),
        ("GET", "/api/v1/runs/{run_id}/audits"),
        ("GET", "/api/v1/audits/{audit_id}"),
        ("GET", "/api/v1/runs/{run_id}/alerts"),
        ("GET", "/api/v1/alerts"),
        ("GET", SSE_PATH),
        ("GET", "/healthz"),
    ]:
        assert expected in fuzzed, f"{expected} is missing from /openapi.json"


def test_error_shape_checker_rejects_other_shapes() -> None:
    """The checker above can fail: FastAPI's default shape and a bare string do not pass."""
    request = httpx.Request("GET", "http://127.0.0.1/x")
    default = httpx.Response(422, json={"detail": [{"loc": ["body"], "msg": "x"}]}, request=request)
    bare = httpx.Response(404, text="Not Found", request=request)
    partial = httpx.Response(400, json={"error": {"code": "bad_request", "message": "x"}}, request=request)
    ours = httpx.Response(
        400,
        content=json.dumps({"error": {"code": "bad_request", "message": "x", "detail": None}}),
        request=request,
    )
    assert error_shape_problem(default) and error_shape_problem(bare) and error_shape_problem(partial)
    assert error_shape_problem(ours) is None

"""The client's only door to the server: HTTP API v1 over httpx, with an injectable transport.

Errors are converted at this boundary into two kinds the sender understands::

    TransportError                 base: carries the operation and a one-line cause
    ├── RetryableError             connection errors, timeouts, 5xx, 429 (with ``retry_after``), 401/403
    └── RejectedError              any other 4xx: resending the same bytes cannot succeed
        └── RunNotFoundError       404 on a run path: the run must be created (again) first

Unit tests pass ``transport=httpx.MockTransport(handler)``; everything else uses real sockets.
"""

from __future__ import annotations

import json
from typing import Any

import httpx

API = "/api/v1"


class TransportError(Exception):
    def __init__(self, operation: str, cause: str, *, status: int | None = None) -> None:
        super().__init__(f"{operation}: {cause}")
        self.operation = operation
        self.cause = cause
        self.status = status


class RetryableError(TransportError):
    def __init__(
        self, operation: str, cause: str, *, status: int | None = None, retry_after: float | None = None
    ) -> None:
        super().__init__(operation, cause, status=status)
        self.retry_after = retry_after


class RejectedError(TransportError):
    pass


class RunNotFoundError(RejectedError):
    pass


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None  # an HTTP-date; the backoff policy decides instead


def _message(response: httpx.Response) -> str:
    try:
        body = response.json()
        return str(body["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:200] or response.reason_phrase


def encode_record(record: dict) -> bytes:
    """A step record (``{"step", "metrics", "wall_time"}``, values already API-encoded) as JSON bytes."""
    return json.dumps(record, allow_nan=False, separators=(",", ":")).encode()


def _timeout(seconds: float | None) -> dict:
    if seconds is None:
        return {}
    seconds = max(0.05, seconds)
    return {"timeout": httpx.Timeout(seconds, connect=min(seconds, 3.0))}


class HttpApi:
    """One ``httpx.Client`` per sender; not shared across threads that run concurrently or across fork."""

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        timeout: float = 15.0,
        connect_timeout: float = 3.0,
        transport: httpx.BaseTransport | None = None,
        wait_rules: bool = False,
    ) -> None:
        """``wait_rules``: metrics writes wait for the server's health rules to evaluate their points
        and bring back the run's open critical incidents (``?wait=rules``; a run with ``halt_on``)."""
        headers = {"User-Agent": "rlvitals-client/0.1"}
        self._metrics_params = {"wait": "rules"} if wait_rules else None
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self.url = url.rstrip("/")
        self._client = httpx.Client(
            base_url=self.url,
            headers=headers,
            timeout=httpx.Timeout(timeout, connect=connect_timeout),
            transport=transport,
        )

    def close(self) -> None:
        self._client.close()

    def _request(self, operation: str, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self._client.request(method, path, **kwargs)
        except httpx.TimeoutException as exc:
            raise RetryableError(operation, f"timed out ({type(exc).__name__})") from exc
        except httpx.TransportError as exc:
            raise RetryableError(
                operation, f"server unreachable at {self.url} ({exc or type(exc).__name__})"
            ) from exc
        # The body is already read. Dropping the stream breaks httpx's Response <-> stream reference cycle,
        # so a request leaves no cyclic garbage: collecting ~45 objects per request cost the trainer's
        # thread up to ~1 ms GC pauses at high logging rates.
        response.stream = None
        status = response.status_code
        if status < 400:
            return response
        cause = f"HTTP {status}: {_message(response)}"
        if status == 429 or status >= 500 or status in (401, 403, 408):
            raise RetryableError(operation, cause, status=status, retry_after=_retry_after(response))
        if status == 404 and "/runs/" in path:
            raise RunNotFoundError(operation, cause, status=status)
        raise RejectedError(operation, cause, status=status)

    def create_run(
        self, *, project: str, name: str, config: dict, tags: list[str], timeout: float | None = None
    ) -> str:
        """``POST /api/v1/runs``: creates or resumes (project, name); returns the run id as a string."""
        body = {"name": name, "project": project, "config": config, "tags": tags}
        content = json.dumps(body, allow_nan=False, default=str).encode()
        response = self._request(
            "create run",
            "POST",
            f"{API}/runs",
            content=content,
            headers={"Content-Type": "application/json"},
            **_timeout(timeout),
        )
        try:
            return str(response.json()["id"])
        except (ValueError, KeyError, TypeError):
            raise RejectedError(
                "create run", f"{self.url} answered {response.status_code} without a run id: is it rlvitals?"
            ) from None

    critical_incidents: list[dict] = []  # noqa: RUF012 - replaced, never mutated

    def post_metrics(self, run_id: str, lines: list[bytes], timeout: float | None = None) -> int:
        """``POST /api/v1/runs/{id}/metrics`` with step records already encoded as JSON objects (bytes);
        returns ``accepted`` (with ``wait_rules``, the answer's ``critical_incidents`` go to
        ``self.critical_incidents``).
        """
        content = b'{"steps":[' + b",".join(lines) + b"]}"
        response = self._request(
            "send metrics",
            "POST",
            f"{API}/runs/{run_id}/metrics",
            params=self._metrics_params,
            content=content,
            headers={"Content-Type": "application/json"},
            **_timeout(timeout),
        )
        try:
            answer = response.json()
            critical = answer.get("critical_incidents")
            # the run's open critical incidents once the rules saw this write (what run.should_stop() reads)
            self.critical_incidents = (
                [i for i in critical if isinstance(i, dict)] if isinstance(critical, list) else []
            )
            return int(answer.get("accepted", 0))
        except (ValueError, AttributeError, TypeError):
            return 0

    def post_batch(self, run_id: str, payload: list[bytes], timeout: float | None = None) -> str:
        """``POST /api/v1/runs/{id}/batches`` with safetensors bytes (given as chunks); returns the batch id."""
        size = sum(len(chunk) for chunk in payload)
        response = self._request(
            "send tensor batch",
            "POST",
            f"{API}/runs/{run_id}/batches",
            content=payload,
            headers={"Content-Type": "application/octet-stream", "Content-Length": str(size)},
            **_timeout(timeout),
        )
        try:
            return str(response.json().get("id", ""))
        except (ValueError, AttributeError):
            return ""

"""Who may reach the server, checked for every request before routing (and before the ingest fast
lane): the Host allowlist, reads behind API keys, and security headers for the OpenAPI pages.

- **Host allowlist** (DNS rebinding: a web page whose name the attacker re-points at 127.0.0.1 talks
  to a local server from the victim's browser, same-origin; its requests carry the attacker's name
  in ``Host``). Accepted: no Host, loopback names, any IP address literal (a rebinding page always
  has a name), the bind address, and ``Settings.allowed_hosts`` (exact names, ``.suffix`` for
  subdomains, ``*`` for any). Anything else -> 403 ``forbidden``.
- **Reads** (every method but POST) need an active key where ``Settings.reads_need_key`` and a key
  exists (``Authenticator.check_read``). Open: ``/healthz`` (probes), and the page shells that hold
  no data (dashboard pages and assets, ``/docs``, the OpenAPI schema: the dashboard asks for the key
  and sends it with every data request). Writes are checked by the routes (``WriteAuth``).
- ``/docs``, ``/redoc`` and their helpers get a Content-Security-Policy (the dashboard's pages set
  their own) that forbids framing and limits scripts to the CDN FastAPI's pages load from.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import MutableMapping
from typing import Any

from rlvitals.service.errors import ServiceError, error_response
from rlvitals.service.settings import LOOPBACK_NAMES, Settings

DOCS_PATHS = frozenset({"/docs", "/redoc", "/docs/oauth2-redirect"})
DOCS_CSP = (
    "default-src 'none'; script-src 'self' 'unsafe-inline' https://cdn.jsdelivr.net; "
    "style-src 'self' 'unsafe-inline' https://cdn.jsdelivr.net; img-src 'self' data: "
    "https://fastapi.tiangolo.com; connect-src 'self'; font-src https://fonts.gstatic.com; "
    "frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
)
DOCS_HEADERS = [
    (b"content-security-policy", DOCS_CSP.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"same-origin"),
]
OPEN_PATHS = frozenset({"/healthz", "/", "/alerts", "/compare", "/openapi.json", *DOCS_PATHS})
OPEN_PATTERN = re.compile(r"/static/.*|/runs/[0-9]+(/audits)?")  # dashboard shells and assets


def host_name(value: str) -> str:
    """The name part of a Host header: ``[::1]:8000`` -> ``::1``, ``Example.com:80`` -> ``example.com``."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:].partition("]")[0]
    if value.count(":") == 1:
        return value.partition(":")[0]
    return value  # a bare IPv6 address or a name without a port


class AccessPolicy:
    def __init__(self, settings: Settings, auth):
        self.settings = settings
        self.auth = auth
        self.any_host = "*" in settings.allowed_hosts
        names = {h.lower() for h in settings.allowed_hosts if not h.startswith(".")}
        self.names = frozenset(names | LOOPBACK_NAMES | {settings.host.lower().strip("[]")})
        self.suffixes = tuple(h.lower() for h in settings.allowed_hosts if h.startswith("."))
        self._seen: dict[bytes, bool] = {}

    def host_allowed(self, raw: bytes) -> bool:
        hit = self._seen.get(raw)
        if hit is None:
            hit = self._judge(raw.decode("latin-1"))
            if len(self._seen) < 1024:  # the few names clients use; never grows without bound
                self._seen[raw] = hit
        return hit

    def _judge(self, value: str) -> bool:
        if self.any_host:
            return True
        name = host_name(value)
        if name in self.names or name.endswith(self.suffixes or ("\0",)):
            return True
        try:
            ipaddress.ip_address(name)
        except ValueError:
            return False
        return True

    def refusal(self, scope: MutableMapping[str, Any]):
        """The error reply for a request that may not go on, or None."""
        host = authorization = None
        for name, value in scope["headers"]:
            if name == b"host":
                host = value if host is None else host
            elif name == b"authorization":
                authorization = value if authorization is None else authorization
        if host is not None and not self.host_allowed(host):
            return error_response(
                403,
                "forbidden",
                f"Host {host_name(host.decode('latin-1'))!r} is not served here; add it to allowed_hosts "
                "(RLVITALS_ALLOWED_HOSTS) if a proxy or a DNS name should reach this server",
                None,
            )
        if scope["type"] != "http" or scope["method"] == "POST" or not self.settings.reads_need_key:
            return None
        if scope["path"] in OPEN_PATHS or OPEN_PATTERN.fullmatch(scope["path"]):
            return None
        try:
            self.auth.check_read(authorization.decode("latin-1") if authorization is not None else None)
        except ServiceError as exc:
            return error_response(exc.status, exc.code, exc.message, exc.detail, exc.headers)
        except Exception:  # the key table unreadable: refuse rather than open reads
            return error_response(
                503, "unavailable", "the database is unavailable; retry shortly", None, {"Retry-After": "1"}
            )
        return None


def with_docs_headers(send):
    async def send_with_headers(message):
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), *DOCS_HEADERS]}
        await send(message)

    return send_with_headers

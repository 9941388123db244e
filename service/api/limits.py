"""Request limits: JSON bodies over ``max_request_bytes`` are refused with 413 before parsing
(``BodyLimitMiddleware``; batch uploads are exempt, their route enforces ``max_batch_bytes``), and
``UploadGate`` admits at most ``max_concurrent_uploads`` batch uploads holding at most
``max_upload_bytes_in_flight`` declared bytes at once, and at most ``max_uploads_per_client`` of
them from one client (its API key, or without keys its address) to one run and all slots but one
across its runs, so one party cannot hold every slot (429 + Retry-After beyond); a client under its
share of the slots is admitted past the limit while another holds more than its share, up to twice
the limit.

``ParseGate`` caps the request bodies being received and parsed at once, JSON and uploads together
(``max_parsing_bytes``): a JSON body counts ``JSON_WEIGHT`` times its declared size (parsing one into
Python objects costs about that much memory; without a Content-Length, ``max_request_bytes``), an
upload its declared size (spooled to disk, then mapped while validated). Beyond it: 429 + Retry-After
in the one error shape. A request is always admitted when nothing else is held, so the largest
allowed body is never refused for ever, and so is a small one (``SMALL_BODY`` weighted bytes: a
trainer's per-step write never waits behind a large upload). Each client (``client_of``: an API key
the server has accepted, else the address) has a fair share of the budget, so one client's parallel
large bodies cannot hold it all.
"""

from __future__ import annotations

from contextlib import contextmanager

from rlvitals.service.auth import Authenticator, hash_key
from rlvitals.service.errors import Busy, error_response
from rlvitals.service.fair_share import OVER_LIMIT, OVER_SHARE, fair_share
from starlette.exceptions import HTTPException


class _TooLarge(HTTPException):
    """An HTTPException so FastAPI's body reader passes it on to the error handlers as a 413."""

    def __init__(self, limit: int):
        super().__init__(413, f"body exceeds the limit of {limit} bytes")


RUNS_PATH = "/api/v1/runs"


def run_body_limit(max_run_config_bytes: int) -> int:
    """The body ``POST /api/v1/runs`` may have: room for its config twice over (a client's JSON may be
    indented or escaped differently from the compact form the config limit counts) plus name and tags."""
    return 2 * max_run_config_bytes + 256 * 1024


class BodyLimitMiddleware:
    """413 for a JSON body over ``limit``; ``POST /api/v1/runs`` bodies over ``run_limit`` get the
    config size refusal (422) without being read or parsed."""

    def __init__(self, app, *, limit: int, run_limit: int | None = None, run_config_limit: int | None = None):
        self.app = app
        self.limit = limit
        self.run_limit = run_limit
        self.run_config_limit = run_config_limit

    async def __call__(self, scope, receive, send):
        if (
            scope["type"] != "http"
            or scope["method"] in ("GET", "HEAD")
            or scope["path"].endswith("/batches")
        ):
            await self.app(scope, receive, send)
            return
        limit = self.limit
        if self.run_limit is not None and scope["path"] == RUNS_PATH:
            limit = min(limit, self.run_limit)
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                if value.isdigit() and int(value) > limit:
                    await self._reject(scope, receive, send, int(value))
                    return
                break
        seen = 0
        started = False

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise _TooLarge(limit)
            return message

        async def tracking_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _TooLarge:
            if started:
                raise
            await self._reject(scope, receive, send, None)

    async def _reject(self, scope, receive, send, size):
        what = f"body of {size} bytes" if size is not None else "body"
        if self.run_limit is not None and scope["path"] == RUNS_PATH and (size is None or size <= self.limit):
            response = error_response(
                422,
                "invalid_input",
                f"{what} is too large for a run: its config may hold at most {self.run_config_limit} bytes of "
                "JSON (max_run_config_bytes); keep the trainer's settings there, not its data",
                {"field": "config", "limit": self.run_config_limit},
            )
            await response(scope, receive, send)
            return
        response = error_response(
            413, "payload_too_large", f"{what} exceeds the limit of {self.limit} bytes", {"limit": self.limit}
        )
        await response(scope, receive, send)


class UploadGate:
    """Counts the batch uploads being received (one event loop: no lock needed). A party (an API key,
    or without one an address) may hold at most ``per_client`` uploads to one run, and at most all
    slots but one across its runs, so another party always finds one."""

    def __init__(self, *, max_uploads: int, max_bytes: int, per_client: int | None = None):
        self.max_uploads, self.max_bytes = max_uploads, max_bytes
        self.per_client = per_client or max_uploads
        self.per_party = max(1, max_uploads - 1)
        self.uploads = self.bytes = 0
        self.held: dict[tuple[str, object], int] = {}

    @contextmanager
    def admit(self, nbytes: int, client: str = "", run: object = None):
        mine = self.held.get((client, run), 0)
        parties: dict[str, int] = {}
        for (who, _), n in self.held.items():
            parties[who] = parties.get(who, 0) + n
        party = parties.get(client, 0)
        if mine >= self.per_client or party >= self.per_party:
            limit = self.per_client if mine >= self.per_client else self.per_party
            raise Busy(
                f"this client has {party} batch uploads being received ({mine} to this run); the limit is "
                f"{self.per_client} per run (max_uploads_per_client) and {self.per_party} in all "
                "(max_concurrent_uploads - 1): retry shortly",
                detail={"uploads": party, "run_uploads": mine, "limit": limit},
            )
        # every slot taken: a client under its share of the slots is admitted while another holds more
        # than its own, up to twice the slots (without it a client uploading non-stop from several
        # threads keeps all but one slot, and every other client collides on that one); the per-client
        # limits above, not the share, cap what one client holds
        if fair_share(self.max_uploads, parties, client, 1, cap_share=False).refused:
            raise Busy(
                f"{self.uploads} batch uploads are being received; the limit is {self.max_uploads} "
                "(max_concurrent_uploads): retry shortly",
                detail={"uploads": self.uploads, "limit": self.max_uploads},
            )
        if self.uploads and self.bytes + nbytes > self.max_bytes:
            raise Busy(
                f"uploads in flight hold {self.bytes} bytes; {nbytes} more would pass the limit of "
                f"{self.max_bytes} (max_upload_bytes_in_flight): retry shortly",
                detail={"bytes": self.bytes, "limit": self.max_bytes},
            )
        self.uploads += 1
        self.bytes += nbytes
        self.held[(client, run)] = mine + 1
        try:
            yield
        finally:
            self.uploads -= 1
            self.bytes -= nbytes
            left = self.held[(client, run)] - 1
            if left:
                self.held[(client, run)] = left
            else:
                del self.held[(client, run)]


JSON_WEIGHT = 8  # a JSON body's parse peak over its size (measured: 26.7 MB -> ~210 MB)
SMALL_BODY = 1024 * 1024  # weighted bytes always admitted (a trainer's per-step write: ~1-100 KB)


def client_of(scope, auth: Authenticator | None = None) -> str:
    """Who a request counts against: its bearer key (hashed), or the peer address without one. With
    ``auth``, a key counts as a client of its own only where ``auth.counts_as_client`` says so (on a
    server with keys: one it has seen accepted), so keys made up on the spot cannot make one sender
    look like many and win it a share each; such a request counts against its address."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization" and value:
            scheme, _, token = value.decode("latin-1").partition(" ")
            token = token.strip()
            if scheme.lower() == "bearer" and token:
                digest = hash_key(token)
                if auth is None or auth.counts_as_client(digest):
                    return "key:" + digest[:16]
            break
    client = scope.get("client")
    return "addr:" + (client[0] if client else "?")


class ParseGate:
    """Weighted bytes of the bodies being parsed, in all and per client (one event loop: no lock
    needed). Each client holding bodies has a share, ``limit // clients holding`` (the asking one
    counted): a client already holding a body is refused one more that would pass its share, so one
    client's parallel floods cannot take the budget from the others. A client's body that fits its
    share is admitted past the limit while another client holds more than its share (it took the
    budget before this one came), up to twice the limit; and, as ever, a body of at most
    ``SMALL_BODY`` weighted bytes, and any body when nothing is held."""

    def __init__(self, *, limit: int):
        self.limit = limit
        self.held = 0
        self.clients: dict[str, int] = {}

    def try_hold(self, nbytes: int, client: str = "") -> Busy | None:
        """Hold ``nbytes`` for ``client`` -> None, or the refusal (nothing held)."""
        refusal = self._refusal(nbytes, client)
        if refusal is None:
            self.held += nbytes
            self.clients[client] = self.clients.get(client, 0) + nbytes
        return refusal

    def _refusal(self, nbytes: int, client: str) -> Busy | None:
        if nbytes <= SMALL_BODY or not self.held:
            return None
        decision = fair_share(self.limit, self.clients, client, nbytes, min_share=0)
        if decision.refused == OVER_SHARE:
            mine, share, clients = decision.mine, decision.share, decision.parties
            return Busy(
                f"this client's request bodies of {mine} (weighted) bytes are being parsed; {nbytes} more "
                f"would pass its share of max_parsing_bytes ({share} of {self.limit}, shared by {clients} "
                "clients): retry shortly",
                detail={
                    "held": self.held,
                    "limit": self.limit,
                    "request": nbytes,
                    "client_held": mine,
                    "client_share": share,
                },
            )
        if decision.refused == OVER_LIMIT:
            return Busy(
                f"request bodies of {self.held} (weighted) bytes are being parsed; {nbytes} more would "
                f"pass the limit of {self.limit} (max_parsing_bytes): retry shortly",
                detail={"held": self.held, "limit": self.limit, "request": nbytes},
            )
        return None

    def release(self, nbytes: int, client: str = "") -> None:
        self.held -= nbytes
        left = self.clients[client] - nbytes
        if left:
            self.clients[client] = left
        else:
            del self.clients[client]

    @contextmanager
    def hold(self, nbytes: int, client: str = ""):
        refusal = self.try_hold(nbytes, client)
        if refusal is not None:
            raise refusal
        try:
            yield
        finally:
            self.release(nbytes, client)

    def json_weight(self, scope, max_request_bytes: int) -> int:
        """What a JSON request (not a batch upload) holds: its declared size, capped, times the weight."""
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                if value.isdigit():
                    return min(int(value), max_request_bytes) * JSON_WEIGHT
                break
        return max_request_bytes * JSON_WEIGHT

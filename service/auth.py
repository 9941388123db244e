"""API keys: ``rlvitals keys create`` prints a key once; the database keeps only its SHA-256.

While no key was ever created the server is open (and refuses to bind a non-loopback address unless
``--insecure``). Once one was, every write (POST) needs ``Authorization: Bearer <key>`` of an active
key — also after the last key is revoked: writes open again only with ``rlvitals keys open``, which
forgets the revoked keys (and refuses while an active one exists). A revoked key never works again.
Reads need a key too where ``Settings.reads_need_key`` (by default: bound off loopback); for reads
``Authorization: Basic`` with the key as password is accepted as well (``curl -u :KEY``, Prometheus'
basic_auth); writes stay Bearer-only (a browser replays cached Basic credentials cross-site, which
would let any page write). Lookups are cached for ``ttl`` seconds, so a key
created or revoked from the CLI takes effect on a running server within a second.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import secrets
import threading
import time

from rlvitals.service.errors import Unauthorized
from rlvitals.service.storage import repository as repo
from rlvitals.service.storage.database import Database

KEY_PREFIX = "rlv_"


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def create_key(db: Database, *, name: str) -> tuple[int, str]:
    """A new key: ``(id, key)``. The key itself is never stored; show it to the user once."""
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    with db.write() as session:
        key_id = repo.insert_key(
            session=session, name=name, prefix=key[:12], key_hash=hash_key(key), now=time.time()
        )
    return key_id, key


def revoke_key(db: Database, *, ident: str) -> int:
    """Revoke by id or by the printed prefix; the number of keys revoked."""
    with db.write() as session:
        if ident.isdigit():
            return repo.revoke_key(session=session, key_id=int(ident), now=time.time())
        return repo.revoke_key(session=session, prefix=ident, now=time.time())


def list_keys(db: Database) -> list[dict]:
    with db.read() as session:
        return repo.list_keys(session=session)


def keys_exist(db: Database) -> bool:
    """Whether writes are closed: a key was ever created (an active or a revoked one)."""
    with db.read() as session:
        return repo.any_key(session=session)


def open_writes(db: Database) -> int:
    """``rlvitals keys open``: forget the revoked keys so writes are open again; the number
    forgotten. Refused (``ValueError``) while an active key exists."""
    with db.write() as session:
        if repo.any_active_key(session=session):
            raise ValueError("active keys exist; revoke them first (`rlvitals keys list`)")
        return repo.delete_revoked_keys(session=session)


class Authenticator:
    def __init__(self, db: Database, *, ttl: float = 1.0):
        self.db = db
        self.ttl = ttl
        self._lock = threading.Lock()
        self._enabled: tuple[float, bool] | None = None
        self._valid: dict[str, float] = {}

    def invalidate(self) -> None:
        with self._lock:
            self._enabled = None
            self._valid.clear()

    def enabled(self) -> bool:
        now = time.monotonic()
        with self._lock:
            cached = self._enabled
        if cached is not None and now - cached[0] < self.ttl:
            return cached[1]
        value = keys_exist(self.db)
        with self._lock:
            self._enabled = (now, value)
        return value

    def counts_as_client(self, digest: str) -> bool:
        """Whether a request bearing the key of SHA-256 ``digest`` counts as a client of its own before
        it is authenticated (``api.limits.client_of``): on a server with keys, only a key this process
        has seen accepted; on an open one (or before the first look at the keys), any. It never reads
        the database: the event loop asks it for every write."""
        with self._lock:
            return digest in self._valid or self._enabled is None or not self._enabled[1]

    def check_write(self, authorization: str | None) -> None:
        """Raise ``Unauthorized`` unless writes are open or the bearer key is active."""
        if not self.enabled():
            return
        if not authorization:
            raise Unauthorized("this server requires an API key: send Authorization: Bearer <key>")
        scheme, _, token = authorization.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise Unauthorized("malformed Authorization header: expected 'Bearer <key>'")
        self._check_key(token)

    def check_read(self, authorization: str | None) -> None:
        """Raise ``Unauthorized`` unless keys are off or the key, sent as ``Bearer <key>`` or as the
        password of ``Basic``, is active. (No ``WWW-Authenticate: Basic`` challenge: the browser's
        own prompt would pop up over the dashboard's key dialog on every 401.)"""
        if not self.enabled():
            return
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        if scheme.lower() == "basic" and token:
            try:
                token = base64.b64decode(token, validate=True).decode("utf-8").partition(":")[2]
            except (binascii.Error, UnicodeDecodeError):
                token = ""
        elif scheme.lower() != "bearer":
            token = ""
        if not token:
            raise Unauthorized(
                "reads on this server need an API key: send Authorization: Bearer <key> "
                "(the dashboard asks for it: the Key button)"
            )
        self._check_key(token)

    def _check_key(self, token: str) -> None:
        digest = hash_key(token)
        now = time.monotonic()
        with self._lock:
            seen = self._valid.get(digest)
        if seen is not None and now - seen < self.ttl:
            return
        with self.db.read() as session:
            ok = repo.active_key_id(session=session, key_hash=digest) is not None
        if not ok:
            raise Unauthorized("unknown or revoked API key")
        with self._lock:
            if len(self._valid) > 10_000:
                self._valid.clear()
            self._valid[digest] = now

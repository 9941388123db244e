"""API keys: ``rlvitals keys create`` prints a key once; the database keeps only its SHA-256.

While no active key exists the server is open (and refuses to bind a non-loopback address unless
``--insecure``). Once one exists every write (POST) needs ``Authorization: Bearer <key>``. Reads
stay open. Lookups are cached for ``ttl`` seconds, so a key created or revoked from the CLI takes
effect on a running server within a second.
"""

from __future__ import annotations

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
    with db.read() as session:
        return repo.any_active_key(session=session)


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

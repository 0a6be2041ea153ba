"""The session registry on disk, so a restart keeps who references what.

Without it, a restarted server would know only the sessions that came back: deleting one
of them could then drop a prefix that a session not yet back also uses. One SQLite file
beside the entry index (`sessions.sqlite3`), one row per session, its hash lists packed as
bytes; ids are column values only, never part of a path. Written in the background every
few seconds (only what changed) and at shutdown; a crash loses at most that interval of
changes, which costs sharing information for new entries, never a wrong answer.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import struct
import threading
from pathlib import Path

from engine_bridge.cache.hashing import HASH_BYTES
from engine_bridge.cache.session_registry import SessionKey, SessionRecord, SessionRegistry
from engine_bridge.cache.ssd.index import Scope

log = logging.getLogger(__name__)

STORE_NAME = "sessions.sqlite3"
_POS = struct.Struct("<Q")
_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    tenant TEXT NOT NULL,
    model TEXT NOT NULL,
    session TEXT NOT NULL,
    scope_model TEXT NOT NULL,
    scope_tenant TEXT NOT NULL,
    block_size INTEGER NOT NULL,
    last_used REAL NOT NULL,
    pinned INTEGER NOT NULL,
    chains BLOB NOT NULL,
    blocks BLOB NOT NULL,
    checkpoints BLOB NOT NULL,
    PRIMARY KEY (tenant, model, session)
) WITHOUT ROWID;
"""


def _pack_chains(chains: list[list[bytes]]) -> bytes:
    return b"".join(_POS.pack(len(c)) + b"".join(c) for c in chains)


def _unpack_chains(raw: bytes) -> list[list[bytes]]:
    chains, i = [], 0
    while i < len(raw):
        (n,) = _POS.unpack_from(raw, i)
        i += _POS.size
        chains.append([raw[i + j * HASH_BYTES : i + (j + 1) * HASH_BYTES] for j in range(n)])
        i += n * HASH_BYTES
    return chains


def _split(raw: bytes, width: int) -> list[bytes]:
    assert len(raw) % width == 0, f"{len(raw)} bytes is not a multiple of {width}"
    return [raw[i : i + width] for i in range(0, len(raw), width)]


class SessionStore:
    """Load once at start, then `save` what the registry marked changed."""

    def __init__(self, root: Path) -> None:
        self.path = Path(root) / STORE_NAME
        self._conn: sqlite3.Connection | None = None
        self._lock = threading.Lock()  # the janitor's saves and the one at shutdown
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # Private, like the index: ids may name people (an email as OpenAI `user`).
            # SQLite gives its -wal and -shm files the main file's mode.
            os.close(os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))
            conn = sqlite3.connect(str(self.path), timeout=5.0, check_same_thread=False)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.executescript(_SCHEMA)
            self._conn = conn
        except (OSError, sqlite3.Error) as e:
            log.warning("session registry not kept across restarts (%s): %s", self.path, e)

    def load(self, registry: SessionRegistry) -> int:
        if self._conn is None:
            return 0
        n = 0
        try:
            rows = self._conn.execute("SELECT * FROM sessions ORDER BY last_used").fetchall()
        except sqlite3.Error as e:
            log.warning("session registry at %s unreadable, starting empty: %s", self.path, e)
            return 0
        for tenant, model, session, s_model, s_tenant, bs, used, pinned, ch, bl, ck in rows:
            try:
                rec = SessionRecord(
                    SessionKey(tenant, model, session), Scope(s_model, s_tenant), bs, used
                )
                rec.pinned = bool(pinned)
                rec.chains = _unpack_chains(ch)
                rec.blocks = dict.fromkeys(_split(bl, HASH_BYTES))
                for item in _split(ck, HASH_BYTES + _POS.size):
                    key = item[:HASH_BYTES]
                    rec.checkpoints[key] = None
                    rec.positions[key] = _POS.unpack_from(item, HASH_BYTES)[0]
            except (ValueError, AssertionError, struct.error) as e:
                log.warning("session %r in %s is damaged, skipped: %s", session, self.path, e)
                continue
            registry.add(rec)
            n += 1
        return n

    def save(self, registry: SessionRegistry) -> int:
        """Write the records changed since the last save; returns how many rows changed."""
        with self._lock:
            return self._save(registry)

    def _save(self, registry: SessionRegistry) -> int:
        if self._conn is None:
            return 0
        changed, removed = registry.take_dirty()
        if not changed and not removed:
            return 0
        rows = [
            (
                *(r.key.tenant, r.key.model, r.key.session, r.scope.model, r.scope.tenant),
                r.block_size,
                r.last_used,
                int(r.pinned),
                _pack_chains(r.chains),
                b"".join(r.blocks),
                b"".join(k + _POS.pack(r.positions.get(k, 0)) for k in r.checkpoints),
            )
            for r in changed
        ]
        try:
            with self._conn:
                self._conn.executemany(
                    "DELETE FROM sessions WHERE tenant=? AND model=? AND session=?",
                    [(k.tenant, k.model, k.session) for k in removed],
                )
                self._conn.executemany(
                    "INSERT OR REPLACE INTO sessions VALUES (?,?,?,?,?,?,?,?,?,?,?)", rows
                )
        except sqlite3.Error as e:
            log.warning("saving the session registry to %s failed: %s", self.path, e)
            return 0
        return len(rows) + len(removed)

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None


def forget_sessions(root: Path, model: str | None = None) -> int:
    """Drop the records of one model fingerprint, or all, when `cache clear` deletes their
    entries offline; returns how many. SQLite's locking makes this safe beside a server."""
    path = Path(root) / STORE_NAME
    if not path.is_file():
        return 0
    try:
        conn = sqlite3.connect(str(path), timeout=5.0)
        try:
            with conn:
                if model is None:
                    return conn.execute("DELETE FROM sessions").rowcount
                return conn.execute("DELETE FROM sessions WHERE scope_model=?", (model,)).rowcount
        finally:
            conn.close()
    except sqlite3.Error as e:
        log.warning("could not clear the session registry at %s: %s", path, e)
        return 0

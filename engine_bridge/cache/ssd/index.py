"""The SSD tier's index: which entries are on disk, their size, and when each was last used.

SQLite in WAL mode (stdlib sqlite3), not a directory scan plus a journal file, because:
- opening it is O(1): the store is ready in milliseconds whatever the entry count, and
  the full index-vs-files reconcile can run behind it on the writer thread;
- every change is one atomic transaction, so a kill -9 leaves either the old or the new
  row, never a half-written journal line to repair;
- `ORDER BY last_access` (LRU eviction) and `last_access < ?` (TTL) are indexed queries;
- WAL lets the offline CLI (`cache stats|ls|clear`) read and delete while a server
  writes, with SQLite's locking instead of ours.
The index is derived data: every field is also in the entry file's header, so a lost or
damaged index is rebuilt by reconcile. One connection, shared by threads under a lock;
each call holds it for well under a millisecond, and never across file I/O.
"""

from __future__ import annotations

import hashlib
import os
import re
import sqlite3
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from engine_bridge.cache.kinds import EntryKind

INDEX_NAME = "index.sqlite3"
SCHEMA_VERSION = 1
# Top-level names under the cache root that are not model folders.
RESERVED_NAMES = frozenset({"models", "quarantine"})
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# Client-chosen tenant names that are used as they are; others are hashed.
_SAFE_TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_IN_CHUNK = 500  # keys per `IN (...)` query, well under SQLite's variable limit

_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    model TEXT NOT NULL,
    tenant TEXT NOT NULL,
    kind TEXT NOT NULL,
    key BLOB NOT NULL,
    size INTEGER NOT NULL,
    tokens INTEGER NOT NULL,
    created REAL NOT NULL,
    last_access REAL NOT NULL,
    tags TEXT NOT NULL,
    PRIMARY KEY (model, tenant, kind, key)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS entries_by_access ON entries (last_access);
-- Running totals kept by triggers: O(1) to read, exact across processes (a `cache clear`
-- from the CLI included), where a SUM over 100k rows would cost ~10 ms per write.
CREATE TABLE IF NOT EXISTS totals (
    id INTEGER PRIMARY KEY CHECK (id = 0),
    entries INTEGER NOT NULL,
    bytes INTEGER NOT NULL
);
INSERT OR IGNORE INTO totals SELECT 0, count(*), coalesce(sum(size), 0) FROM entries;
CREATE TRIGGER IF NOT EXISTS entries_insert AFTER INSERT ON entries BEGIN
    UPDATE totals SET entries = entries + 1, bytes = bytes + NEW.size WHERE id = 0;
END;
CREATE TRIGGER IF NOT EXISTS entries_delete AFTER DELETE ON entries BEGIN
    UPDATE totals SET entries = entries - 1, bytes = bytes - OLD.size WHERE id = 0;
END;
CREATE TRIGGER IF NOT EXISTS entries_resize AFTER UPDATE OF size ON entries BEGIN
    UPDATE totals SET bytes = bytes - OLD.size + NEW.size WHERE id = 0;
END;
"""
_COLUMNS = "model, tenant, kind, key, size, tokens, created, last_access, tags"


def is_valid_name(name: str) -> bool:
    return bool(_NAME.fullmatch(name)) and name not in RESERVED_NAMES


@dataclass(frozen=True, slots=True)
class Scope:
    """Whose entries: a model fingerprint and a tenant. Both become folder names."""

    model: str
    tenant: str = "default"

    def __post_init__(self) -> None:
        for name in (self.model, self.tenant):
            if not is_valid_name(name):
                raise ValueError(
                    f"scope name {name!r} must match {_NAME.pattern} and not be one of "
                    f"{sorted(RESERVED_NAMES)}"
                )

    @classmethod
    def of(cls, model: str, tenant: str) -> Scope:
        """Tenant names come from clients: anything not plainly safe as a folder is hashed."""
        if not _SAFE_TENANT.fullmatch(tenant) or tenant in RESERVED_NAMES:
            tenant = "t-" + hashlib.sha256(tenant.encode()).hexdigest()[:24]
        return cls(model, tenant)


@dataclass(frozen=True, slots=True)
class EntryRow:
    scope: Scope
    kind: EntryKind
    key: bytes
    size: int  # file size in bytes
    tokens: int
    created: float
    last_access: float
    tags: str

    @property
    def rid(self) -> RawId:
        return (self.scope.model, self.scope.tenant, self.kind, self.key)


# (model, tenant, kind, key): how the index names an entry, plain values so that sets of
# them diff cheaply during reconcile.
RawId = tuple[str, str, str, bytes]


def index_path(root: Path) -> Path:
    return root / INDEX_NAME


class Index:
    """Thread-safe wrapper over one SQLite connection."""

    def __init__(self, conn: sqlite3.Connection, *, read_only: bool = False) -> None:
        self._conn = conn
        self._lock = threading.Lock()
        self.read_only = read_only

    @classmethod
    def open(cls, root: Path) -> Index:
        """Open or create the index under `root` (which must exist). Raises sqlite3.Error/OSError."""
        path = index_path(root)
        # SQLite gives its -wal and -shm files the main file's mode, so create that 0600.
        os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))
        conn = _connect(str(path), uri=False)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            # NORMAL in WAL mode: no fsync per commit; a power cut may lose the newest rows
            # but never corrupts the database, and reconcile re-adopts their files.
            conn.execute("PRAGMA synchronous=NORMAL")
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version not in (0, SCHEMA_VERSION):
                # Derived data from an incompatible release: rebuild it from the files.
                conn.executescript("DROP TABLE IF EXISTS entries; DROP TABLE IF EXISTS totals;")
            conn.executescript(_SCHEMA)
            conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        except BaseException:
            conn.close()
            raise
        return cls(conn)

    @classmethod
    def open_readonly(cls, root: Path) -> Index | None:
        """Open an existing index for reading only; None if there is none."""
        path = index_path(root)
        if not path.is_file():
            return None
        return cls(_connect(f"{path.resolve().as_uri()}?mode=ro", uri=True), read_only=True)

    @classmethod
    def open_existing(cls, root: Path) -> Index | None:
        """Open an existing index for reading and writing, without creating one."""
        path = index_path(root)
        if not path.is_file():
            return None
        return cls(_connect(f"{path.resolve().as_uri()}?mode=rw", uri=True))

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def present(self, scope: Scope, kind: str, keys: Sequence[bytes]) -> set[bytes]:
        found: set[bytes] = set()
        with self._lock:
            for i in range(0, len(keys), _IN_CHUNK):
                chunk = list(keys[i : i + _IN_CHUNK])
                marks = ",".join("?" * len(chunk))
                cur = self._conn.execute(
                    "SELECT key FROM entries WHERE model=? AND tenant=? AND kind=? "
                    f"AND key IN ({marks})",
                    (scope.model, scope.tenant, kind, *chunk),
                )
                found.update(row[0] for row in cur)
        return found

    def select(self, scope: Scope, kind: str, keys: Sequence[bytes]) -> list[EntryRow]:
        """The rows of those keys that exist, in no particular order."""
        out: list[EntryRow] = []
        for i in range(0, len(keys), _IN_CHUNK):
            chunk = list(keys[i : i + _IN_CHUNK])
            marks = ",".join("?" * len(chunk))
            out += self._rows(
                f"SELECT {_COLUMNS} FROM entries WHERE model=? AND tenant=? AND kind=? "
                f"AND key IN ({marks})",
                (scope.model, scope.tenant, kind, *chunk),
            )
        return out

    def checkpoints_between(self, scope: Scope, lo: int, hi: int) -> list[tuple[int, bytes]]:
        """(position, key) of every checkpoint of `scope` at a position in (lo, hi], any
        chain's, deepest first: one query however far apart lo and hi are. A read fault
        is read as none (a miss), as the store reads every index fault."""
        try:
            with self._lock:
                return self._conn.execute(
                    "SELECT tokens, key FROM entries WHERE model=? AND tenant=? AND kind=? "
                    "AND tokens > ? AND tokens <= ? ORDER BY tokens DESC",
                    (scope.model, scope.tenant, EntryKind.CHECKPOINT.value, lo, hi),
                ).fetchall()
        except sqlite3.Error:
            return []

    def size_of(self, scope: Scope, kind: str, key: bytes) -> int | None:
        with self._lock:
            row = self._conn.execute(
                "SELECT size FROM entries WHERE model=? AND tenant=? AND kind=? AND key=?",
                (scope.model, scope.tenant, kind, key),
            ).fetchone()
        return None if row is None else row[0]

    def add(self, rows: Iterable[EntryRow]) -> None:
        params = [(*r.rid, r.size, r.tokens, r.created, r.last_access, r.tags) for r in rows]
        # An upsert rather than INSERT OR REPLACE: REPLACE deletes without firing the
        # delete trigger, which would corrupt the totals.
        with self._lock, self._conn:
            self._conn.executemany(
                f"INSERT INTO entries ({_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?) "
                "ON CONFLICT (model, tenant, kind, key) DO UPDATE SET size=excluded.size, "
                "tokens=excluded.tokens, created=excluded.created, "
                "last_access=excluded.last_access, tags=excluded.tags",
                params,
            )

    def remove(self, rids: Iterable[RawId]) -> int:
        """Delete rows; returns how many existed."""
        with self._lock, self._conn:
            cur = self._conn.executemany(
                "DELETE FROM entries WHERE model=? AND tenant=? AND kind=? AND key=?", list(rids)
            )
            return cur.rowcount

    def remove_scope(self, scope: Scope) -> int:
        """Delete every row of one model and tenant; returns how many there were."""
        with self._lock, self._conn:
            return self._conn.execute(
                "DELETE FROM entries WHERE model=? AND tenant=?", (scope.model, scope.tenant)
            ).rowcount

    def has_scope(self, scope: Scope) -> bool:
        with self._lock:
            row = self._conn.execute(
                "SELECT 1 FROM entries WHERE model=? AND tenant=? LIMIT 1",
                (scope.model, scope.tenant),
            ).fetchone()
        return row is not None

    def scopes(self) -> list[Scope]:
        """Every model and tenant with at least one row."""
        with self._lock:
            raw = self._conn.execute("SELECT DISTINCT model, tenant FROM entries").fetchall()
        out = []
        for model, tenant in raw:
            try:
                out.append(Scope(model, tenant))
            except ValueError:
                continue  # not a name we write (see `_rows`)
        return out

    def probe_write(self) -> None:
        """One write transaction that changes nothing; raises sqlite3.Error if writes fail."""
        with self._lock, self._conn:
            self._conn.execute("UPDATE totals SET entries = entries WHERE id = 0")

    def touch(self, accesses: Iterable[tuple[RawId, float]]) -> None:
        params = [(t, *rid) for rid, t in accesses]
        with self._lock, self._conn:
            self._conn.executemany(
                "UPDATE entries SET last_access=max(last_access, ?) "
                "WHERE model=? AND tenant=? AND kind=? AND key=?",
                params,
            )

    def totals(self) -> tuple[int, int]:
        """(entries, bytes) over the whole root."""
        with self._lock:
            row = self._conn.execute("SELECT entries, bytes FROM totals WHERE id = 0").fetchone()
        return (0, 0) if row is None else (row[0], row[1])

    def least_recent(self, limit: int, before: float | None = None) -> list[EntryRow]:
        """Rows in LRU order, optionally only those last used before `before`."""
        where, args = ("WHERE last_access < ?", (before,)) if before is not None else ("", ())
        return self._rows(
            f"SELECT {_COLUMNS} FROM entries {where} ORDER BY last_access, created LIMIT ?",
            (*args, limit),
        )

    def rows(self, model: str | None = None) -> list[EntryRow]:
        if model is None:
            return self._rows(f"SELECT {_COLUMNS} FROM entries", ())
        return self._rows(f"SELECT {_COLUMNS} FROM entries WHERE model=?", (model,))

    def all_ids(self) -> set[RawId]:
        with self._lock:
            return set(self._conn.execute("SELECT model, tenant, kind, key FROM entries"))

    def groups(self) -> list[dict[str, object]]:
        """Per model and tenant: entries, blocks, checkpoints, bytes, tokens, last access."""
        with self._lock:
            cur = self._conn.execute(
                "SELECT model, tenant, count(*), sum(kind=?), sum(kind=?), "
                "sum(size), sum(tokens), max(last_access) FROM entries "
                "GROUP BY model, tenant ORDER BY model, tenant",
                (EntryKind.BLOCK.value, EntryKind.CHECKPOINT.value),
            )
            names = ("model", "tenant", "entries", "blocks", "checkpoints", "bytes")
            return [dict(zip(names + ("tokens", "last_access"), row, strict=True)) for row in cur]

    def _rows(self, sql: str, args: tuple) -> list[EntryRow]:
        with self._lock:
            raw = self._conn.execute(sql, args).fetchall()
        out = []
        for model, tenant, kind, key, size, tokens, created, last_access, tags in raw:
            try:
                scope, entry_kind = Scope(model, tenant), EntryKind(kind)
            except ValueError:
                continue  # written by hand or by a future release; reconcile ignores it too
            out.append(EntryRow(scope, entry_kind, key, size, tokens, created, last_access, tags))
        return out


def _connect(target: str, *, uri: bool) -> sqlite3.Connection:
    # Default isolation: each `with conn:` block is one transaction (BEGIN before the first
    # write, COMMIT at exit). The busy timeout covers a `cache clear` from another process.
    return sqlite3.connect(target, timeout=5.0, check_same_thread=False, uri=uri)

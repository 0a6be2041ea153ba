"""Shared tier: cache entries in a Redis or Valkey that several machines point at.

Blocks are content-addressed and their hashes carry the model fingerprint and the tenant,
so the same prompt gives the same keys on every machine. A value is exactly the bytes of
the SSD tier's file for that entry (`ssd_format.encode`), checked on read by the same code
(`ssd_format.decode`): a torn, truncated or foreign value is a miss, never a payload.

Reads run on the caller's thread, one round trip per run of entries (a pipeline); writes
go through one thread behind a queue bounded by bytes that drops rather than blocks, and
batch what is queued into one pipeline. Every fault of the store (down, slow, full, a
wrong password, a corrupt value) degrades to a miss or a dropped write, counted by kind
and logged once per outage; while the store is down or refusing us, calls skip the
network until a retry is due, so a dead store costs a request nothing but a flag test.
Redis is used as it ships: eviction is its `maxmemory-policy`, expiry a TTL per key.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from engine_bridge.cache.kinds import EntryKind
from engine_bridge.cache.shared.config import (
    BYTES_BUCKETS,
    LATENCY_BUCKETS_S,
    SharedConfig,
    redacted,
)
from engine_bridge.cache.shared.faults import FAULTS, Fault, Health, fault_of
from engine_bridge.cache.ssd.format import FormatError, decode, encode
from engine_bridge.cache.ssd.index import Scope
from engine_bridge.cache.ssd.store import SSDEntry
from engine_bridge.cache.tensors import HostTensor

log = logging.getLogger(__name__)

# Redis refuses bulk strings over proto-max-bulk-len (512 MB by default).
MAX_VALUE_BYTES = 512 << 20
# Bounds of the size memo: sizes learnt by lookups, used to reserve RAM before a read.
_SIZE_MEMO = 1 << 16
_LATENCY_WINDOW = 1024
# One write round trip carries at most this many entries, or this many bytes.
_BATCH_ENTRIES = 64
_BATCH_BYTES = 64 << 20
PutOutcome = Literal["queued", "duplicate", "dropped", "disabled"]


@dataclass(slots=True)
class SharedStats:
    """Counters since this process started. A promotion is one read round trip (a run)."""

    url: str = ""  # without its password
    namespace: str = ""
    write_policy: str = ""
    available: bool = True  # false while a fault keeps calls off the network
    promotions: int = 0
    promoted_entries: int = 0
    bytes_read: int = 0
    promotion_ms_mean: float = 0.0
    promotion_ms_p95: float = 0.0
    last_promotion_bytes: int = 0
    last_promotion_ms: float = 0.0
    lookups: int = 0  # presence round trips
    hits: int = 0  # entries found by lookups
    writes: int = 0
    bytes_written: int = 0
    write_skips: int = 0  # already in the store (another machine wrote it)
    queued: int = 0
    queue_drops: int = 0
    oversize_drops: int = 0
    fault_drops: int = 0  # writes dropped while the store was failing
    unavailable_skips: int = 0  # calls answered locally while the store was failing
    errors: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAULTS, 0))
    # Cumulative histogram counts per LATENCY_BUCKETS_S / BYTES_BUCKETS (plus +Inf).
    promotion_seconds_buckets: list[int] = field(default_factory=list)
    promotion_seconds_sum: float = 0.0
    promotion_bytes_buckets: list[int] = field(default_factory=list)


@dataclass(slots=True)
class _Job:
    key: str
    tensors: dict[str, HostTensor]
    meta: dict[str, str]
    tokens: int
    nbytes: int
    skip: Callable[[], bool] | None


_KIND_TAGS = {EntryKind.BLOCK: "b", EntryKind.CHECKPOINT: "c", EntryKind.FEATURES: "f"}


class SharedStore:
    """One Redis/Valkey connection pool: pipelined reads, a bounded background writer."""

    def __init__(self, config: SharedConfig, *, client: redis.Redis | None = None) -> None:
        self.config = config
        self.url = redacted(config.url)
        self.client = client or _connect(config)
        self.health = Health(config.retry_s, config.retry_max_s, self.url)
        self._ttl_ms = None if config.ttl_s is None else int(config.ttl_s * 1000)
        self._lock = threading.Lock()
        self._sizes: OrderedDict[str, int] = OrderedDict()
        self._c = SharedStats(
            url=self.url, namespace=config.namespace, write_policy=config.write_policy.value
        )
        self._c.promotion_seconds_buckets = [0] * (len(LATENCY_BUCKETS_S) + 1)
        self._c.promotion_bytes_buckets = [0] * (len(BYTES_BUCKETS) + 1)
        self._latencies: deque[float] = deque(maxlen=_LATENCY_WINDOW)
        # The writer: jobs by key (dedupe), their bytes, and deletes of corrupt values.
        self._jobs: OrderedDict[str, _Job] = OrderedDict()
        self._deletes: list[str] = []
        self._queued_bytes = 0
        self._in_flight = 0  # entries of the batch being sent
        self._closing = False
        self._wake = threading.Condition(self._lock)
        self._thread = threading.Thread(target=self._run, name="shared-writer", daemon=True)
        self._thread.start()

    def key(self, scope: Scope, kind: EntryKind, key: bytes) -> str:
        # Scope names are plain ([A-Za-z0-9._-]), so ':' separates fields unambiguously.
        kind_tag = _KIND_TAGS[kind]
        return f"{self.config.namespace}:{scope.model}:{scope.tenant}:{kind_tag}:{key.hex()}"

    # ---- reads (the caller's thread) ------------------------------------------------

    def sizes(self, scope: Scope, kind: EntryKind, keys: Sequence[bytes]) -> list[int]:
        """Each entry's size in the store, 0 where absent: one round trip, no value read."""
        if not keys:
            return []
        names = [self.key(scope, kind, k) for k in keys]
        replies = self._pipeline(lambda p: [p.strlen(n) for n in names])
        if replies is None:
            return [0] * len(keys)
        with self._lock:
            # A value found corrupt is a miss until its delete has gone out.
            bad = set(self._deletes)
            sizes = [
                r if isinstance(r, int) and n not in bad else 0
                for n, r in zip(names, replies, strict=True)
            ]
            self._c.lookups += 1
            self._c.hits += sum(1 for s in sizes if s)
            for name, size in zip(names, sizes, strict=True):
                if size:
                    self._sizes[name] = size
                    self._sizes.move_to_end(name)
            while len(self._sizes) > _SIZE_MEMO:
                self._sizes.popitem(last=False)
        return sizes

    def get_many(
        self,
        scope: Scope,
        kind: EntryKind,
        keys: Sequence[bytes],
        *,
        reserve: Callable[[int], bool] | None = None,
        release: Callable[[int], None] | None = None,
    ) -> list[SSDEntry | None]:
        """Read and verify a run of entries in one round trip, in order.

        Each entry's RAM is reserved before the read (sizes from the lookup that found it);
        the run stops at the first refusal. An entry that fails to read or verify is None,
        and its reservation goes back through `release`.
        """
        out: list[SSDEntry | None] = [None] * len(keys)
        if not keys:
            return out
        names = [self.key(scope, kind, k) for k in keys]
        sizes = self._known_sizes(scope, kind, keys, names)
        take = 0
        for size in sizes:
            if not size or size > MAX_VALUE_BYTES or (reserve is not None and not reserve(size)):
                break
            take += 1
        if take == 0:
            return out
        start = time.perf_counter()
        ttl = self._ttl_ms
        values = self._pipeline(
            lambda p: [p.getex(n, px=ttl) if ttl else p.get(n) for n in names[:take]]
        )
        seconds = time.perf_counter() - start
        got = 0
        for i in range(take):
            value = values[i] if values is not None else None
            entry = self._verify(names[i], keys[i], value) if isinstance(value, bytes) else None
            if entry is None:
                if release is not None:
                    release(sizes[i])
                continue
            out[i] = entry
            got += len(value)
        if got:
            self._note_promotion(sum(e is not None for e in out), got, seconds)
        return out

    def _known_sizes(
        self, scope: Scope, kind: EntryKind, keys: Sequence[bytes], names: list[str]
    ) -> list[int]:
        with self._lock:
            sizes = [self._sizes.get(n, 0) for n in names]
        if all(sizes):
            return sizes
        return self.sizes(scope, kind, keys)  # not looked up lately: one more round trip

    def _verify(self, name: str, key: bytes, value: bytes) -> SSDEntry | None:
        try:
            header, tensors = decode(value, key)
        except FormatError as e:
            self._fault("corrupt", FormatError(f"{name}: {e}"))
            with self._lock:
                self._sizes.pop(name, None)
                self._deletes.append(name)
                self._wake.notify()
            return None
        return SSDEntry(tensors, dict(header.meta))

    def _note_promotion(self, entries: int, nbytes: int, seconds: float) -> None:
        c = self._c
        with self._lock:
            c.promotions += 1
            c.promoted_entries += entries
            c.bytes_read += nbytes
            c.last_promotion_bytes = nbytes
            c.last_promotion_ms = seconds * 1000
            c.promotion_seconds_sum += seconds
            self._latencies.append(seconds * 1000)
            _observe(c.promotion_seconds_buckets, LATENCY_BUCKETS_S, seconds)
            _observe(c.promotion_bytes_buckets, BYTES_BUCKETS, nbytes)

    # ---- writes (queued; the writer thread sends them) ------------------------------

    def put(
        self,
        scope: Scope,
        kind: EntryKind,
        key: bytes,
        tensors: Mapping[str, HostTensor],
        meta: Mapping[str, str],
        *,
        tokens: int,
        skip: Callable[[], bool] | None = None,
    ) -> PutOutcome:
        """Queue an entry; never blocks, never raises. The tensors' bytes must not change
        afterwards. `skip()`, asked just before sending, drops an entry that became useless."""
        name = self.key(scope, kind, key)
        nbytes = sum(t.nbytes for t in tensors.values())
        with self._lock:
            if self._closing:
                return "disabled"
            if not self.health.writes_ok():
                self._c.fault_drops += 1
                return "disabled"
            if name in self._jobs:
                return "duplicate"
            if nbytes >= MAX_VALUE_BYTES:
                self._c.oversize_drops += 1
                return "dropped"
            if self._queued_bytes + nbytes > self.config.queue_max_bytes:
                self._c.queue_drops += 1
                return "dropped"
            self._jobs[name] = _Job(name, dict(tensors), dict(meta), tokens, nbytes, skip)
            self._queued_bytes += nbytes
            self._wake.notify()
        return "queued"

    def accepts(self, nbytes: int) -> bool:
        """Whether `put` would queue an entry of about `nbytes` now (callers check before
        they pay for turning a payload into host bytes)."""
        with self._lock:
            return (
                not self._closing
                and self.health.writes_ok()
                and self._queued_bytes + nbytes <= self.config.queue_max_bytes
            )

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued write is sent or dropped; False on timeout."""
        end = time.monotonic() + timeout_s
        with self._wake:
            while self._jobs or self._deletes or self._in_flight:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._wake.wait(left)
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued for at most `timeout_s`, drop the rest, close the pool."""
        self.flush(timeout_s)
        with self._wake:
            self._closing = True
            self._wake.notify_all()
        self._thread.join(max(0.1, self.config.timeout_s * 2))
        self.client.close()

    def _run(self) -> None:
        self._probe()  # a store down at start is known before the first request asks it
        while True:
            with self._wake:
                while not (self._jobs or self._deletes or self._closing or self._probe_due()):
                    self._wake.wait(self.health.probe_in())  # None: until there is work
                if self._closing:
                    self._c.queue_drops += len(self._jobs)
                    self._jobs.clear()
                    self._wake.notify_all()
                    return
                probe = self._probe_due()
                if not probe:
                    batch, deletes = self._take_batch()
                    self._in_flight = max(1, len(batch))
            if probe:
                self._probe()
                continue
            try:
                self._send(batch, deletes)
            except Exception:
                log.exception("shared cache: the writer failed on a batch")
            finally:
                with self._wake:
                    self._in_flight = 0
                    self._queued_bytes -= sum(j.nbytes for j in batch)
                    self._wake.notify_all()

    def _probe_due(self) -> bool:
        return self.health.probe_in() == 0

    def _probe(self) -> None:
        """One question in the namespace (so an ACL that forbids its keys fails too)."""
        try:
            self.client.exists(f"{self.config.namespace}:probe")
        except Exception as e:  # redis-py raises OSError subclasses and its own
            self._fault(fault_of(e), e)
            return
        self.health.succeeded()

    def _take_batch(self) -> tuple[list[_Job], list[str]]:
        batch: list[_Job] = []
        nbytes = 0
        while self._jobs and len(batch) < _BATCH_ENTRIES and (not batch or nbytes < _BATCH_BYTES):
            _, job = self._jobs.popitem(last=False)
            batch.append(job)
            nbytes += job.nbytes
        return batch, list(self._deletes)

    def _send(self, batch: list[_Job], deletes: list[str]) -> None:
        if deletes:
            self._pipeline(lambda p: [p.delete(n) for n in deletes])
            with self._lock:
                self._deletes = [n for n in self._deletes if n not in deletes]
        batch = [j for j in batch if j.skip is None or not j.skip()]
        if not batch:
            return
        if not self.health.writes_ok():
            self._count("fault_drops", len(batch))
            return
        # Ask first, then send only what is missing: another machine may have written the
        # same prefix already, and a value is far larger than the question.
        present = self._pipeline(lambda p: [p.exists(j.key) for j in batch])
        if present is None:
            self._count("fault_drops", len(batch))
            return
        todo = [j for j, there in zip(batch, present, strict=True) if there != 1]
        self._count("write_skips", len(batch) - len(todo))
        values = [self._encode(j) for j in todo]
        ttl = self._ttl_ms
        replies = self._pipeline(
            lambda p: [p.set(j.key, v, px=ttl) for j, v in zip(todo, values, strict=True)]
        )
        if replies is None:
            self._count("fault_drops", len(todo))
            return
        written = [len(v) for v, r in zip(values, replies, strict=True) if r is True]
        with self._lock:
            self._c.writes += len(written)
            self._c.bytes_written += sum(written)
            self._c.fault_drops += len(todo) - len(written)

    def _encode(self, job: _Job) -> bytes:
        key = bytes.fromhex(job.key.rpartition(":")[2])
        head, chunks = encode(
            key, job.tensors, job.meta, tokens=job.tokens, tags="", created=time.time()
        )
        return b"".join([head, *chunks])

    # ---- faults and stats -----------------------------------------------------------

    def _pipeline(self, commands: Callable[[redis.client.Pipeline], object]) -> list | None:
        """Run `commands` in one round trip; None when the store failed (counted, warned
        once). Replies that are errors (an OOM refusing one SET) are counted, not raised."""
        if not self.health.reads_ok():
            self._count("unavailable_skips", 1)
            return None
        try:
            pipe = self.client.pipeline(transaction=False)
            commands(pipe)
            replies = pipe.execute(raise_on_error=False)
        except Exception as e:  # redis-py raises OSError subclasses and its own
            self._fault(fault_of(e), e)
            return None
        errors = [r for r in replies if isinstance(r, Exception)]
        for e in errors[:1]:
            self._fault(fault_of(e), e)
        if len(errors) < len(replies) or not errors:
            self.health.succeeded()
        return [None if isinstance(r, Exception) else r for r in replies]

    def _fault(self, kind: Fault, e: BaseException) -> None:
        self.health.failed(kind, e)
        with self._wake:
            self._c.errors[kind] += 1
            self._wake.notify()  # the writer schedules its probe

    def _count(self, name: str, n: int) -> None:
        with self._lock:
            setattr(self._c, name, getattr(self._c, name) + n)

    def stats(self) -> SharedStats:
        with self._lock:
            c = self._c
            lat = sorted(self._latencies)
            return SharedStats(
                **{
                    **{f: getattr(c, f) for f in c.__slots__},
                    "available": self.health.reads_ok(),
                    "queued": len(self._jobs) + self._in_flight,
                    "errors": dict(c.errors),
                    "promotion_ms_mean": sum(lat) / len(lat) if lat else 0.0,
                    "promotion_ms_p95": lat[math.ceil(0.95 * len(lat)) - 1] if lat else 0.0,
                    "promotion_seconds_buckets": list(c.promotion_seconds_buckets),
                    "promotion_bytes_buckets": list(c.promotion_bytes_buckets),
                }
            )


def _observe(counts: list[int], bounds: Sequence[float], value: float) -> None:
    """Add `value` to cumulative (Prometheus) bucket counts; the last one is +Inf."""
    for i, bound in enumerate(bounds):
        if value <= bound:
            counts[i] += 1
    counts[-1] += 1


def _connect(config: SharedConfig) -> redis.Redis:
    """A client that never retries on its own (the store's backoff decides) and waits at
    most `timeout_s` to connect and for each reply."""
    options: dict[str, object] = {
        "socket_timeout": config.timeout_s,
        "socket_connect_timeout": config.timeout_s,
        "retry": Retry(NoBackoff(), 0),
        "max_connections": 32,
        "client_name": "mlx-prompt-cache",
    }
    if config.username is not None:
        options["username"] = config.username
    if config.password is not None:
        options["password"] = config.password
    if urlsplit(config.url).scheme == "rediss":
        options["ssl_ca_certs"] = config.tls_ca
        options["ssl_certfile"] = config.tls_cert
        options["ssl_keyfile"] = config.tls_key
        options["ssl_cert_reqs"] = "required" if config.tls_verify else "none"
        options["ssl_check_hostname"] = config.tls_verify
    return redis.Redis.from_url(config.url, **options)

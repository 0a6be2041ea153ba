"""The shared tier's settings ([cache.shared]), apart from the client so that the config
can be checked, and the engine configured, without the `redis` package (the `shared`
extra) being imported until a url is set."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from urllib.parse import urlsplit, urlunsplit

from engine_bridge.cache.ssd.index import is_valid_name

# Histogram buckets of a promotion (stats and /metrics): loopback to a slow LAN, and
# from one block to a long prompt's state.
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
BYTES_BUCKETS = tuple(float(1 << s) for s in range(12, 34, 2))  # 4 KiB .. 8 GiB


class SharedWritePolicy(StrEnum):
    """Which entries go to the shared store (see shared/tier.py for when)."""

    ALL = "all"  # everything stored
    SECOND_USE = "second-use"  # what a later request reused once: saves bandwidth
    FIRST_N = "first-n"  # the first N blocks of each chain: shared system prompts and tools


@dataclass(frozen=True, slots=True, repr=False)
class SharedConfig:
    url: str  # redis://[user:password@]host[:port][/db] or rediss://… (TLS)
    namespace: str = "mlx-prompt-cache"
    timeout_s: float = 1.0  # connect, and each wait for a reply
    write_policy: SharedWritePolicy = SharedWritePolicy.SECOND_USE
    first_n: int = 32  # blocks of a chain written under first-n
    ttl_s: float | None = 7 * 86400.0  # per entry, renewed by every read; None: no expiry
    username: str | None = None  # override the url's
    password: str | None = None
    tls_ca: str | None = None  # a CA file to trust (rediss://)
    tls_cert: str | None = None  # a client certificate and key (mutual TLS)
    tls_key: str | None = None
    tls_verify: bool = True  # check the server's certificate and host name
    queue_max_bytes: int = 256 << 20  # entries waiting for the writer, in bytes
    retry_s: float = 1.0  # first retry after the store failed; then doubling
    retry_max_s: float = 30.0

    def __repr__(self) -> str:
        # Settings get logged; the password (its own field, or in the url) must not be.
        shown = {f: getattr(self, f) for f in self.__slots__ if f != "password"}
        shown["url"] = redacted(self.url)
        return f"SharedConfig({', '.join(f'{k}={v!r}' for k, v in shown.items())})"

    def __post_init__(self) -> None:
        scheme = urlsplit(self.url).scheme
        if scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"url {redacted(self.url)!r} is not redis://, rediss:// or unix://")
        if not is_valid_name(self.namespace) or ":" in self.namespace:
            raise ValueError(f"namespace {self.namespace!r} must be a plain name (no ':')")
        if not (self.timeout_s > 0 and self.first_n > 0 and self.queue_max_bytes > 0):
            raise ValueError("timeout, first_n and the queue bound must be positive")
        if self.ttl_s is not None and self.ttl_s < 1:
            raise ValueError(f"ttl {self.ttl_s}s is under a second")


def redacted(url: str) -> str:
    """The url without its password, for logs and stats."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))

"""`[cache.shared]`: the optional Redis/Valkey tier several machines share (issue 14).

Off unless `url` is set. The checks here name the key at fault; `shared_settings` turns
the section into the engine's `SharedConfig`.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine_bridge.engine_settings import SharedConfig, SharedWritePolicy
from proxy.config.units import parse_duration, parse_size

EXTRA_HINT = "the shared tier needs the redis package: pip install 'mlx-prompt-cache[shared]'"


@dataclass(slots=True)
class SharedCacheConfig:
    # A Redis or Valkey that several machines share: "redis://host:6379/0", or
    # "rediss://host:6380/0" for TLS; a user and password may ride in it. Unset: off.
    url: str | None = None
    # Prefix of every key, so several teams or setups can share one Redis.
    namespace: str = "mlx-prompt-cache"
    # Connecting, and each wait for a reply; a slower store is treated as down for a while.
    timeout: str | float = "1s"
    # "second-use" (what a later request reuses), "all", or "first-n" (the first
    # `first_n` blocks of each prompt: shared system prompts and tools).
    write_policy: str = "second-use"
    first_n: int = 32
    # Each entry expires after this long unused ("7d", "12h", seconds); unset: never, and
    # Redis's maxmemory-policy alone evicts.
    ttl: str | float | None = "7d"
    username: str | None = None
    # Better set as MLX_PROMPT_CACHE_CACHE_SHARED_PASSWORD than in the file.
    password: str | None = None
    # TLS (rediss:// only): a CA file to trust, a client certificate and key.
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_verify: bool = True
    # Entries waiting to be sent, in bytes; beyond it new writes are dropped.
    queue_max: str | int = "256MB"


def shared_settings(c: SharedCacheConfig) -> SharedConfig | None:
    """The engine's settings for the shared tier; None when it is off. ValueError names
    what is wrong (validate_shared has said which key already)."""
    if not c.url:
        return None
    return SharedConfig(
        url=c.url,
        namespace=c.namespace,
        timeout_s=parse_duration(c.timeout),
        write_policy=_policy(c.write_policy),
        first_n=c.first_n,
        ttl_s=None if c.ttl is None else parse_duration(c.ttl),
        username=c.username,
        password=c.password,
        tls_ca=c.tls_ca,
        tls_cert=c.tls_cert,
        tls_key=c.tls_key,
        tls_verify=c.tls_verify,
        queue_max_bytes=parse_size(c.queue_max),
    )


def validate_shared(
    c: SharedCacheConfig,
    check: Callable[[str, bool, str], None],
    parses: Callable[[str, Any, Any], None],
) -> None:
    """Check each key of a set-up shared tier, naming the one at fault."""
    if c.url is None:
        return
    check("cache.shared.url", bool(c.url.strip()), "is empty: remove it to turn the tier off")
    check(
        "cache.shared.url",
        c.url.split("://")[0] in ("redis", "rediss", "unix"),
        f"{c.url.split('://')[0]!r} is not redis://, rediss:// (TLS) or unix://",
    )
    parses("cache.shared.timeout", _positive_duration, c.timeout)
    parses("cache.shared.write_policy", _policy, c.write_policy)
    check("cache.shared.first_n", c.first_n > 0, f"must be at least 1 block, got {c.first_n}")
    if c.ttl is not None:
        parses("cache.shared.ttl", _positive_duration, c.ttl)
        check("cache.shared.ttl", parse_duration(c.ttl) >= 1, "must be at least 1 second")
    parses("cache.shared.queue_max", parse_size, c.queue_max)
    check("cache.shared.queue_max", parse_size(c.queue_max) > 0, "must be positive")
    tls = c.tls_ca or c.tls_cert or c.tls_key or not c.tls_verify
    check(
        "cache.shared.url",
        not tls or c.url.startswith("rediss://"),
        "the tls_* settings need a rediss:// url",
    )
    check("cache.shared.tls_key", not c.tls_key or bool(c.tls_cert), "needs tls_cert too")
    parses(
        "cache.shared.namespace", lambda v: SharedConfig(url="redis://x", namespace=v), c.namespace
    )
    check("cache.shared.url", importlib.util.find_spec("redis") is not None, EXTRA_HINT)


def _policy(value: str) -> SharedWritePolicy:
    try:
        return SharedWritePolicy(value)
    except ValueError:
        known = ", ".join(repr(p.value) for p in SharedWritePolicy)
        raise ValueError(f"{value!r} is not one of {known}") from None


def _positive_duration(value: str | float) -> float:
    seconds = parse_duration(value)
    if seconds <= 0:
        raise ValueError(f"{value!r} must be more than 0 seconds")
    return seconds

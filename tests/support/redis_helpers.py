"""A real `redis-server` for the shared tier's tests (bench/scenarios/shared_redis.py starts it).

Tests skip, saying why, only when the binary is absent (`.ci/run` installs Debian's
package; on a Mac, `brew install redis`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.scenarios.shared_redis import REDIS_SERVER, RedisServer
from tests.support import required

__all__ = ["REDIS_SERVER", "RedisServer", "redis_fixture", "redis_server_fixture"]
SKIP_REASON = required.reason(
    "redis-server is not installed (apt-get install redis-server; brew install redis)"
)


def redis_fixture(tmp_path: Path, *args: str) -> Iterator[RedisServer]:
    if REDIS_SERVER is None:
        pytest.skip(SKIP_REASON)
    server = RedisServer(tmp_path, args=args).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(name="redis_server")
def redis_server_fixture(tmp_path) -> Iterator[RedisServer]:
    """A fresh redis-server for one test."""
    yield from redis_fixture(tmp_path)

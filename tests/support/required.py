"""Parts of the test machine CI must have: Debian's chromium, redis-server and the pinned
agent CLIs. Where one is missing, its tests skip on a developer's machine and fail in CI
(`CI=true`, which .ci/run sets), so a green CI cannot hide tests that never ran."""

from __future__ import annotations

import os

# Every skip reason for a required part starts with this; tests/conftest.py's report hook
# turns such a skip into a failure in CI.
MARK = "missing a required part: "


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def reason(text: str) -> str:
    """A skip reason for a missing required part: a failure in CI."""
    return MARK + text

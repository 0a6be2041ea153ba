"""In CI (`CI=true`), a test skipped for a missing required part fails; elsewhere it skips.

A real pytest runs a throwaway test file under this repo's conftest, once as CI and once
not: the hook in tests/conftest.py is what decides, not a copy of it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.support import required

CASES = """
import pytest
from tests.support import required

def test_required_part_missing():
    pytest.skip(required.reason("redis-server is not installed"))

def test_optional_part_missing():
    pytest.skip("the real chat templates are not here")
"""


@pytest.mark.parametrize("ci", ["true", ""])
def test_a_required_part_missing_fails_in_ci_and_skips_elsewhere(tmp_path, ci):
    folder = REPO / "tests" / "ops" / f"_required_probe_{os.getpid()}_{bool(ci)}"
    folder.mkdir()
    try:
        (folder / "test_probe.py").write_text(CASES)
        env = {**os.environ, "CI": ci}
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", str(folder)],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    finally:
        for f in folder.iterdir():
            f.unlink()
        folder.rmdir()
    out = done.stdout
    if ci:
        assert "1 failed, 1 skipped" in out, out
        assert "FAILED" in out and required.MARK in out, out
    else:
        assert "2 skipped" in out and "failed" not in out, out


def test_the_required_parts_name_themselves_so():
    from tests.support import clients, redis_helpers

    assert redis_helpers.SKIP_REASON.startswith(required.MARK)
    missing = clients.find_cli("claude", "NO_SUCH_ENV_VAR_SET", "CLAUDE_CODE_VERSION")
    if missing.path is None:
        assert missing.why_missing.startswith(required.MARK)

"""SSD tier, crash safety: a writer killed with SIGKILL at random points never leaves a torn
or unindexed entry behind."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time

from engine_bridge.cache.kinds import EntryKind
from engine_bridge.cache.ssd import files as ssd_files
from engine_bridge.cache.tensors import HostTensor
from tests.support.ssd_helpers import (
    REPO,
    SCOPE,
    as_bytes,
    index_rows,
    key,
    open_store,
    quarantined,
    temp_files,
    tensors,
)

CHILD = """
import sys
from pathlib import Path
sys.path.insert(0, {repo!r})
from engine_bridge.cache.ssd.index import Scope
from engine_bridge.cache.kinds import EntryKind
from engine_bridge.cache.ssd.store import SSDConfig, SSDStore
{helpers}
SCOPE = Scope("model-a")
store = SSDStore(SSDConfig(root=Path(sys.argv[1])))
start = int(sys.argv[2])
for i in range(start, start + 100_000):
    n = i if i % 3 else i - 7  # every third put repeats an older entry
    store.put(SCOPE, EntryKind.BLOCK, key(n), crash_payload(n), {{"i": str(n)}}, tokens=n)
    if i == start + 2:
        store.flush()
        print("ready", flush=True)
    if i % 2:
        store.flush()
"""


def crash_payload(n: int) -> dict[str, HostTensor]:
    """Sizes from 1 KB to 256 KB, so that some kills land inside a write."""
    return tensors(n, 1024 << (n % 9))


def test_kill_9_never_leaves_a_torn_or_unindexed_entry(tmp_path):
    import inspect

    helpers = "".join(inspect.getsource(f) for f in (key, tensors, crash_payload))
    child = CHILD.format(
        repo=str(REPO),
        helpers=f"import hashlib, random\nfrom engine_bridge.cache.tensors import HostTensor\n{helpers}",
    )
    root = tmp_path / "root"
    rng = random.Random(20240601)
    fixed = {"rows_dropped": 0, "adopted": 0, "temps_removed": 0}
    for round_ in range(10):
        with open(tmp_path / "child.err", "wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-c", child, str(root), str(1000 * round_ + 10)],
                stdout=subprocess.PIPE,
                stderr=err,
            )
            if round_ % 3:  # else kill during import, startup or its background reconcile
                assert proc.stdout.readline() == b"ready\n", (tmp_path / "child.err").read_text()
            time.sleep(rng.uniform(0.0, 0.25))
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            proc.stdout.close()

        store = open_store(root)
        for name in fixed:
            fixed[name] += getattr(store.last_reconcile, name)
        rows = index_rows(root)
        on_disk = {f.rid for f in ssd_files.walk_entries(root)}
        assert {r.rid for r in rows} == on_disk  # index and files agree exactly
        assert temp_files(root) == [] and quarantined(root) == []
        for row in rows:
            entry = store.get(SCOPE, EntryKind.BLOCK, row.key)
            assert entry is not None, row.key.hex()
            n = int(entry.meta["i"])
            assert row.key == key(n) and row.tokens == n
            assert as_bytes(entry.tensors) == as_bytes(crash_payload(n))
        assert store.stats().quarantined == 0
        store.close()
    assert rows
    print(f"{len(rows)} entries after 10 kills; reconcile fixed {fixed}")

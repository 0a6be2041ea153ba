"""The cache folder deleted, or made unwritable, while the proxy serves (issue 11, item 6).

Deleted: SQLite keeps writing into an unlinked index and every write "succeeds", so nothing
fails by itself; the store must notice, make the folder again and get what RAM still holds
written again. Unwritable: writes fail with EACCES; the tier goes RAM-only with one
warning and comes back once a probe succeeds. Either way every answer equals the
`x-prompt-cache: bypass` answer and nothing RAM held is lost across a restart.

The first tests drive a real SSDStore and TieredCache (real K/V payloads, no model); the
last two run real proxies. A permission change needs a process that mode bits bind: as
root (CI) the server runs through `setpriv` without CAP_DAC_OVERRIDE, so it stays uid 0
(and can read the interpreter under /root) but obeys a chmod like any user.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import pytest

from engine_bridge import kv
from engine_bridge.cache.hashing import Chain
from engine_bridge.cache.kinds import CheckpointReason, EntryKind
from engine_bridge.cache.ram.manager import CacheManager
from engine_bridge.cache.ssd.index import Scope
from engine_bridge.cache.ssd.store import SSDConfig, SSDStore
from engine_bridge.cache.tier_writes import REWRITE_TRIES
from engine_bridge.cache.tiers import TieredCache
from tests.conftest import fresh_cache_dir, start_server
from tests.support.ssd_server_helpers import (
    HYBRID,
    LLAMA,
    NO_UPSTREAM,
    QUESTIONS,
    Conversation,
    chat,
    system_prompt,
)
from tests.support.ssd_server_helpers import drained as drained_ssd
from tests.support.ssd_server_helpers import stats as server_stats

BS = 4
SCOPE = Scope("model-f")
TOKENS = list(range(300, 330))  # 7 full blocks and 2 tokens
LOGGER = "engine_bridge.cache.ssd"  # the tier's modules: store, health (the folder), writer


def block(i: int) -> kv.BlockPayload:
    x = mx.full((1, 1, BS, 8), float(i), dtype=mx.float16)
    return kv.BlockPayload(i * BS, BS, (kv.DenseKV(x, x),))


def checkpoint(position: int) -> kv.CheckpointPayload:
    x = mx.full((1, 1, position % BS, 8), float(position), dtype=mx.float16)
    state = kv.ArraysState((mx.full((1, 3), float(position)), None))
    return kv.CheckpointPayload(position, BS, (kv.DenseKV(x, x),), (state,))


def chain(tokens: list[int] = TOKENS) -> Chain:
    return Chain(tokens, BS, (("model", SCOPE.model), ("tenant", SCOPE.tenant)))


def open_tiers(root: Path, *, write_through: bool = True, idle_checks: bool = False) -> TieredCache:
    """Tiers over a fresh store. Without `idle_checks` the writer looks for its folder only
    before a write (and when asked), so a test's own rmtree never races a recreation."""
    check_s = 0.02 if idle_checks else 3600.0
    ssd = SSDStore(SSDConfig(root=root, reconcile="sync", check_interval_s=check_s, retry_s=0.05))
    return TieredCache(
        CacheManager(1 << 30, block_size=BS), ssd, kv.HostCodec(), write_through=write_through
    )


def on_disk(root: Path, c: Chain, positions: tuple[int, ...] = (9,)) -> list[bool]:
    """What a fresh store on `root` (as after a restart) finds of the chain's blocks and
    checkpoints."""
    ssd = SSDStore(SSDConfig(root=root, reconcile="sync"))
    try:
        keys = [c.checkpoint_key(p) for p in positions]
        return ssd.contains_many(SCOPE, EntryKind.BLOCK, c.hashes) + ssd.contains_many(
            SCOPE, EntryKind.CHECKPOINT, keys
        )
    finally:
        ssd.close()


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def wait_for(predicate, timeout: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


# -- deleted while serving: store and tiers -------------------------------------------------


@pytest.mark.parametrize("deleted", ["cache folder", "index", "model folder"])
def test_deleted_folder_is_made_again_and_what_ram_holds_is_written_again(
    tmp_path, caplog, deleted
):
    root = tmp_path / "cache"
    t = open_tiers(root)
    c = chain()
    t.store_blocks(c, SCOPE, {i: block(i) for i in range(7)})
    t.store_checkpoint(c, SCOPE, 9, checkpoint(9), CheckpointReason.BOUNDARY)
    assert t.ssd.flush()
    written = t.ssd.stats()
    assert (written.entries, written.writes) == (8, 8)

    with caplog.at_level(logging.INFO, logger=LOGGER):
        if deleted == "cache folder":
            shutil.rmtree(root)
        elif deleted == "index":
            (root / "index.sqlite3").unlink()
        else:
            shutil.rmtree(root / SCOPE.model)
        # The next request stores the first message boundary of another prompt: its write
        # finds the loss (a hybrid model's blocks wait for a checkpoint; this one goes at once).
        other = chain(list(range(900, 904)))
        t.store_checkpoint(other, SCOPE, 3, checkpoint(3), CheckpointReason.BOUNDARY)
        assert t.ssd.flush()
        # RAM still answers in full, and the next request puts the lost entries again.
        assert request(t, c) == 28
        assert t.ssd.flush()
        stats = t.ssd.stats()
        t.close(5.0)

    lost = [m for m in warnings(caplog) if "deleted while serving" in m]
    assert len(lost) == 1, warnings(caplog)
    what = {
        "cache folder": f"cache folder {root} was deleted while serving; made it again",
        "index": f"the index {root / 'index.sqlite3'} was deleted while serving; made it again",
        "model folder": f"folder {root / SCOPE.model / SCOPE.tenant} was deleted while serving",
    }[deleted]
    assert what in lost[0], lost[0]
    assert "the 9 entries" in lost[0] and "will be written again" in lost[0], lost[0]
    assert stats.folder_losses == 1 and not stats.disabled, stats
    # Only the index was lost: its files were adopted again, so nothing was rewritten.
    assert stats.writes == (1 + 8 if deleted == "index" else 1 + 8 + 8), stats
    assert on_disk(root, c) == [True] * 8
    assert on_disk(root, other, (3,)) == [False, True]  # no block stored, the checkpoint


def test_spill_only_tier_spills_again_what_the_deleted_folder_held(tmp_path):
    """Without write-through, entries reach the disk when RAM evicts them: RAM's copies of
    lost entries are not put at once, but spill again on eviction (their mark is cleared)."""
    root = tmp_path / "cache"
    t = open_tiers(root, write_through=False)
    c = chain()
    t.store_blocks(c, SCOPE, {i: block(i) for i in range(7)})
    t.ram.set_budget(0)
    assert t.ssd.flush() and t.ssd.stats().spills == 7
    t.ram.set_budget(1 << 30)
    assert t.promote(t.lookup(c, SCOPE, needs_checkpoint=False))  # in RAM, marked on SSD

    shutil.rmtree(root)
    t.ssd.check_folder()
    assert request(t, c) == 28
    assert t.ssd.flush() and t.ssd.stats().writes == 7  # nothing put before eviction
    t.ram.set_budget(0)
    assert t.ssd.flush() and t.ssd.stats().spills == 14
    t.close(5.0)
    assert on_disk(root, c, ()) == [True] * 7


def request(t: TieredCache, c: Chain) -> int:
    """What a request does first, as CacheSession.restore: its writes (lost entries put
    again), then its lookup; how far RAM reaches."""
    t.catch_up(SCOPE, needs_checkpoint=False)
    return t.lookup(c, SCOPE, needs_checkpoint=False).ram_length


def lost_backlog(root: Path, monkeypatch, failing) -> TieredCache:
    """Tiers whose 7 blocks of TOKENS were written, then lost with the deleted folder (so
    RAM's copies wait to be put again); `failing(key)` makes the store's put raise."""
    t = open_tiers(root)
    c = chain()
    t.store_blocks(c, SCOPE, {i: block(i) for i in range(7)})
    assert t.ssd.flush() and t.ssd.stats().writes == 7
    real_put = t.ssd.put

    def put(scope, kind, key, *args, **kwargs):
        if failing(key):
            raise OSError(errno.EIO, "injected: the put failed")
        return real_put(scope, kind, key, *args, **kwargs)

    monkeypatch.setattr(t.ssd, "put", put)
    shutil.rmtree(root)
    t.ssd.check_folder()
    assert t.writes.stats().rewrites_pending == 7
    return t


def test_a_put_fault_on_every_entry_leaves_the_rewrite_backlog_for_later(tmp_path, monkeypatch):
    """One request's rewrite meets a fault every put hits: it stops there, and the backlog
    (all but nothing) is written once the fault is gone, instead of dropped in one go."""
    root = tmp_path / "cache"
    fault = threading.Event()
    fault.set()
    t = lost_backlog(root, monkeypatch, lambda key: fault.is_set())
    c = chain()
    assert request(t, c) == 28
    assert t.writes.stats().rewrites_pending == 7  # before the fix: 0, all dropped
    fault.clear()
    assert request(t, c) == 28
    assert t.ssd.flush()
    assert t.writes.stats() == replace(t.writes.stats(), rewrites_pending=0, rewrite_failures=0)
    t.close(5.0)
    assert on_disk(root, c, ()) == [True] * 7


def test_one_entry_whose_put_keeps_failing_is_given_up_and_counted(tmp_path, monkeypatch, caplog):
    root = tmp_path / "cache"
    c = chain()
    bad = c.hashes[2]
    t = lost_backlog(root, monkeypatch, lambda key: key == bad)
    pending = []
    with caplog.at_level(logging.DEBUG, logger="engine_bridge.cache.tier_writes"):
        for _ in range(REWRITE_TRIES + 1):  # one request each
            assert request(t, c) == 28
            pending.append(t.writes.stats().rewrites_pending)
    assert t.ssd.flush()
    stats = t.writes.stats()
    t.close(5.0)
    # The first request put the blocks ahead of block 2 in the backlog, then 2 failed and
    # went behind the rest, which the second request put; the third gave 2 up.
    assert 1 < pending[0] < 7 and pending[1:] == [1, 0, 0], pending
    assert (stats.rewrites_pending, stats.rewrite_failures) == (0, 1)
    assert on_disk(root, c, ()) == [True, True, False, True, True, True, True]
    given_up = [
        r
        for r in caplog.records
        if r.name == "engine_bridge.cache.tier_writes" and r.levelno >= logging.WARNING
    ]
    assert [r.getMessage() for r in given_up] == [
        "ssd: gave up writing a lost block again after 3 failed puts (RAM still holds it; "
        "1 given up so far): OSError(5, 'injected: the put failed')"
    ]


# -- unwritable while serving: store and tiers ----------------------------------------------


def test_writes_resume_after_a_permission_error_and_catch_up(tmp_path, monkeypatch, caplog):
    """EACCES from the file system (faked here: tests may run as root); the real chmod is
    the server test below."""
    root = tmp_path / "cache"
    t = open_tiers(root, idle_checks=True)  # the probes run on the idle writer's checks
    c = chain()
    t.store_blocks(c, SCOPE, {i: block(i) for i in range(3)})
    assert t.ssd.flush()
    denied = threading.Event()
    real_open = os.open

    def no_create(path, flags, *args, **kw):
        if denied.is_set() and str(path).startswith(str(root)) and flags & os.O_CREAT:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, flags, *args, **kw)

    monkeypatch.setattr(os, "open", no_create)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        denied.set()
        t.store_blocks(c, SCOPE, {i: block(i) for i in range(3, 7)})
        assert t.ssd.flush()
        during = t.ssd.stats()
        assert request(t, c) == 28  # RAM serves
        time.sleep(0.3)  # a few probes fail meanwhile, quietly
        denied.clear()
        wait_for(lambda: not t.ssd.stats().disabled, what="writes to resume")
        request(t, c)  # the next request puts what was missed
        assert t.ssd.flush()
        after = t.ssd.stats()
        t.close(5.0)

    assert during.disabled and "Permission denied" in during.disabled_reason, during
    assert (during.writes, during.entries) == (3, 3)
    disabled = [m for m in warnings(caplog) if "SSD cache disabled" in m]
    assert len(disabled) == 1, warnings(caplog)
    assert "(permission denied)" in disabled[0] and f"cache folder {root}" in disabled[0]
    assert [r.levelname for r in caplog.records if "again (after:" in r.getMessage()] == ["INFO"]
    assert (after.resumes, after.disabled, after.writes, after.entries) == (1, False, 7, 7), after
    assert on_disk(root, c, ()) == [True] * 7


# -- real servers --------------------------------------------------------------------------


def drained(server) -> dict:
    return drained_ssd(server, timeout=30.0)


def restart_hits_ssd_like_bypass(cache_dir: Path, log_path: Path, convs: list[Conversation]):
    """A new server on the folder: each conversation's next turn resumes from SSD, and its
    answer equals the bypass answer."""
    server = start_server(cache_dir, *NO_UPSTREAM, log_path=log_path)
    try:
        for conv in convs:
            conv.messages.append({"role": "user", "content": QUESTIONS[3]})
            cached = chat(server.url, conv.model, conv.prompt())
            cold = chat(server.url, conv.model, conv.prompt(), bypass=True)
            assert cached.source == "ssd", (conv.model, cached)
            assert cached.cached / cached.prompt_tokens >= 0.9, (conv.model, cached)
            assert cached.text == cold.text, conv.model
    finally:
        server.stop()


def ask_like_bypass(url: str, conv: Conversation, question: str):
    reply = conv.ask(url, question)
    cold = chat(url, conv.model, conv.prompt()[:-1], bypass=True)
    assert reply.text == cold.text, (conv.model, reply)
    return reply


def test_cache_folder_deleted_while_serving_loses_nothing_ram_holds(demo_root, tmp_path):
    cache_dir = fresh_cache_dir(demo_root, tmp_path / "cache")
    # The default log lives in the cache folder, which this test deletes.
    server = start_server(cache_dir, *NO_UPSTREAM, log_path=tmp_path / "first.log")
    try:
        convs = [Conversation(model, system_prompt("deleted")) for model in (LLAMA, HYBRID)]
        for conv in convs:
            conv.ask(server.url, QUESTIONS[0])
        before = drained(server)
        # The whole folder moved to the Trash and emptied: entries, index, and the demo
        # models with them (loaded models keep serving; a restart builds the demo models
        # again, identical). Moved first, so it vanishes at once: a plain rmtree would race
        # the server making it again, and fail with "Directory not empty".
        trash = tmp_path / "trash"
        cache_dir.rename(trash)
        shutil.rmtree(trash)
        for conv in convs:
            reply = ask_like_bypass(server.url, conv, QUESTIONS[1])
            assert reply.source == "ram" and reply.cached > 0, reply
        after = drained(server)
        log = server.log()
    finally:
        server.stop()
    assert after["folder_losses"] == 1 and not after["disabled"], after
    # Written again while serving (the next request's lookup puts them), not only at exit.
    assert after["entries"] > before["entries"] > 0, (before, after)
    lost = [line for line in log.splitlines() if "deleted while serving" in line]
    assert len(lost) == 1 and f"cache folder {cache_dir} was deleted while serving" in lost[0]
    assert "Traceback" not in log
    restart_hits_ssd_like_bypass(cache_dir, tmp_path / "second.log", convs)


def unprivileged(tmp_path: Path) -> tuple[str, ...]:
    """A command prefix under which a chmod binds the server: none unless root; as root,
    setpriv dropping CAP_DAC_OVERRIDE (the user stays uid 0, so the interpreter under /root
    stays readable). Skips where neither works."""
    if os.geteuid() != 0:
        return ()
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: a chmod would not stop the server")
    caps = "-dac_override,-dac_read_search"
    prefix = (setpriv, f"--inh-caps={caps}", f"--bounding-set={caps}", "--")
    folder = tmp_path / "read-only"
    folder.mkdir(mode=0o500)
    target = str(folder / "x")
    check = f"try:\n open({target!r}, 'w')\nexcept PermissionError:\n print('denied')"
    done = subprocess.run([*prefix, sys.executable, "-c", check], capture_output=True, text=True)
    folder.chmod(0o700)
    if done.stdout.strip() != "denied":
        pytest.skip(f"cannot drop CAP_DAC_OVERRIDE here: {done.stderr.strip() or done.stdout}")
    return prefix


def test_permission_change_while_serving_goes_ram_only_then_resumes(demo_root, tmp_path):
    prefix = unprivileged(tmp_path)
    cache_dir = fresh_cache_dir(demo_root, tmp_path / "cache")
    server = start_server(cache_dir, *NO_UPSTREAM, log_path=tmp_path / "first.log", prefix=prefix)
    try:
        first = Conversation(LLAMA, system_prompt("perm"))
        first.ask(server.url, QUESTIONS[0])
        written = drained(server)
        # `chmod -R a-w` on the cache (models/ aside): no folder takes a new file.
        folders = [cache_dir] + [
            p
            for p in cache_dir.rglob("*")
            if p.is_dir() and p.relative_to(cache_dir).parts[0] != "models"
        ]
        for folder in folders:
            folder.chmod(0o500)
        during = [first, Conversation(HYBRID, system_prompt("denied"))]
        for conv in during:
            ask_like_bypass(server.url, conv, QUESTIONS[1])
        denied = drained(server)
        for folder in folders:
            folder.chmod(0o700)
        wait_for(
            lambda: not server_stats(server)["ssd"]["disabled"], timeout=40, what="writes to resume"
        )
        # The next request puts again what RAM took in while the folder was read-only.
        ask_like_bypass(server.url, Conversation(LLAMA, system_prompt("resumed")), QUESTIONS[0])
        resumed = drained(server)
        log = server.log()
    finally:
        for folder in [cache_dir, *cache_dir.rglob("*")]:
            if folder.is_dir():
                folder.chmod(0o700)
        server.stop()
    assert denied["disabled"] and "Permission denied" in denied["disabled_reason"], denied
    assert denied["entries"] == written["entries"], "nothing written meanwhile, nothing lost"
    warned = [line for line in log.splitlines() if "SSD cache disabled" in line]
    assert len(warned) == 1, warned
    assert "(permission denied)" in warned[0] and f"cache folder {cache_dir}," in warned[0]
    assert f"writing to {cache_dir} again" in log
    assert resumed["resumes"] == 1 and resumed["entries"] > denied["entries"], resumed
    assert "Traceback" not in log
    restart_hits_ssd_like_bypass(cache_dir, tmp_path / "second.log", during)

"""Damaged SSD files and failing disks under real server processes: a flipped, truncated
or deleted file is quarantined or ignored and a corrupt deepest checkpoint falls back to a
shallower one; a full disk or read-only folder leaves the server on RAM with one warning.

Every cached answer is compared with a bypass answer. Disk faults reach the server process
through tests/ssd_faults/sitecustomize.py (loaded via PYTHONPATH), since tests run as root
and a chmod would not stop a write.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.conftest import fresh_cache_dir, start_server
from tests.support.ssd_server_helpers import (
    HYBRID,
    LLAMA,
    NO_UPSTREAM,
    QUESTIONS,
    Conversation,
    assert_whole,
    chat,
    drained,
    entry_files,
    fault_env,
    quarantined,
    reconcile_reports,
    scripted,
    stats,
    system_prompt,
    temp_files,
)

# -- 1. corruption -----------------------------------------------------------------------------


def _flip_data_bytes(path: Path) -> None:
    """Invert 16 bytes in the middle of the tensor data (past the safetensors header)."""
    raw = bytearray(path.read_bytes())
    data_start = 8 + int.from_bytes(raw[:8], "little")
    mid = (data_start + len(raw)) // 2
    raw[mid : mid + 16] = bytes(b ^ 0xFF for b in raw[mid : mid + 16])
    path.write_bytes(raw)


def test_flipped_truncated_and_deleted_files_are_quarantined_or_ignored(demo_root, tmp_path):
    cache_dir = fresh_cache_dir(demo_root, tmp_path)
    # Checkpoints written as they are made, so the ones damaged below are the ones read.
    env = {"MLX_PROMPT_CACHE_CACHE_SSD_CHECKPOINT_WRITE_DELAY": "0"}
    server = start_server(cache_dir, *NO_UPSTREAM, env=env)
    # One conversation per kind of damage, so each damaged file is on some request's path.
    prompts = {
        "flip": (LLAMA, scripted(system_prompt("flip"), 2)),
        "truncate": (LLAMA, scripted(system_prompt("truncate"), 2)),
        "delete": (LLAMA, scripted(system_prompt("delete"), 2)),
        "checkpoints": (HYBRID, scripted(system_prompt("checkpoints"), 2)),
    }
    new_files: dict[str, list[Path]] = {}
    for name, (model, messages) in prompts.items():
        before = set(entry_files(cache_dir))
        chat(server.url, model, messages)
        drained(server)
        kind = "checkpoints" if name == "checkpoints" else "blocks"
        new_files[name] = sorted(set(entry_files(cache_dir, kind)) - before)
        assert new_files[name], name
    expected = {
        name: chat(server.url, m, msgs, bypass=True).text for name, (m, msgs) in prompts.items()
    }
    server.stop()

    flipped = new_files["flip"][len(new_files["flip"]) // 2]
    truncated = new_files["truncate"][len(new_files["truncate"]) // 2]
    deleted = new_files["delete"][len(new_files["delete"]) // 2]
    _flip_data_bytes(flipped)
    os.truncate(truncated, truncated.stat().st_size // 2)
    deleted.unlink()
    for path in new_files["checkpoints"]:
        _flip_data_bytes(path)

    server = start_server(cache_dir, *NO_UPSTREAM, env=env)
    try:
        (report,) = reconcile_reports(server)
        assert report["rows_dropped"] == 1, report  # the deleted file's row
        replies = {name: chat(server.url, m, msgs) for name, (m, msgs) in prompts.items()}
        for name, reply in replies.items():
            assert reply.text == expected[name], (name, reply)
        ssd = stats(server)["ssd"]
    finally:
        server.stop()
    moved = quarantined(cache_dir)
    print(
        f"\n[corruption] quarantined {ssd['quarantined']}: {[r.source for r in replies.values()]}"
    )
    assert ssd["quarantined"] == len(moved) >= 3, (ssd, moved)
    assert any(flipped.name in p.name for p in moved) and any(
        truncated.name in p.name for p in moved
    )
    assert any(".checkpoints." in p.name for p in moved), moved
    # Blocks in front of the damage still come from the SSD; those behind it are recomputed.
    assert replies["delete"].source == "ssd" or deleted == new_files["delete"][0]
    # The recomputed blocks were written again, whole, under the same names.
    for path in (flipped, truncated, deleted):
        assert_whole(path)


def test_corrupt_deepest_checkpoint_falls_back_to_a_shallower_one(demo_root, tmp_path):
    """A hybrid model needs a checkpoint: losing the deepest one must cost one step, not all."""
    from safetensors import safe_open

    cache_dir = fresh_cache_dir(demo_root, tmp_path)
    server = start_server(cache_dir, *NO_UPSTREAM)
    convo = Conversation(HYBRID, system_prompt("fallback"))
    for q in QUESTIONS[:3]:
        convo.ask(server.url, q)
    convo.messages.append({"role": "user", "content": QUESTIONS[3]})
    expected = chat(server.url, HYBRID, convo.prompt(), bypass=True).text
    drained(server)
    server.stop()
    # A copy to learn which checkpoint the next turn resumes from, untouched.
    probe_dir = tmp_path / "probe"
    shutil.copytree(cache_dir, probe_dir)
    probe = start_server(probe_dir, *NO_UPSTREAM)
    try:
        used = chat(probe.url, HYBRID, convo.prompt())
    finally:
        probe.stop()
    assert used.source == "ssd" and used.cached > 0, used

    def position(path: Path) -> int:
        with safe_open(str(path), "np") as f:
            return int(f.metadata()["mpc.tokens"])

    (resumed_from,) = [
        p for p in entry_files(cache_dir, "checkpoints") if position(p) == used.cached
    ]
    _flip_data_bytes(resumed_from)

    server = start_server(cache_dir, *NO_UPSTREAM)
    try:
        reply = chat(server.url, HYBRID, convo.prompt())
        ssd = stats(server)["ssd"]
    finally:
        server.stop()
    assert reply.text == expected == used.text
    assert reply.source == "ssd"
    assert 0 < reply.cached < used.cached
    assert ssd["quarantined"] == 1, ssd


# -- 2. full disk and read-only folder ---------------------------------------------------------


@pytest.mark.parametrize(
    ("fault", "errno_text"), [("enospc", "No space left on device"), ("erofs", "Read-only")]
)
def test_disk_fault_falls_back_to_ram_only_with_one_warning(demo_root, tmp_path, fault, errno_text):
    cache_dir = fresh_cache_dir(demo_root, tmp_path / "cache")
    trigger = tmp_path / "fault"
    server = start_server(cache_dir, *NO_UPSTREAM, env=fault_env(cache_dir, trigger))
    try:
        before = Conversation(LLAMA, system_prompt("before"))
        before.ask(server.url, QUESTIONS[0])
        written = drained(server)
        assert written["entries"] > 0 and not written["disabled"], written

        trigger.write_text(fault)
        conversations = [
            before,
            Conversation(LLAMA, system_prompt("after")),
            Conversation(HYBRID, system_prompt("after")),
        ]
        for turn in range(1, 3):
            for conv in conversations:
                reply = conv.ask(server.url, QUESTIONS[turn])
                cold = chat(server.url, conv.model, conv.prompt()[:-1], bypass=True)
                assert reply.text == cold.text, (conv.model, turn)
        ssd = drained(server)
        log = server.log()
    finally:
        server.stop()
    assert ssd["disabled"] is True and errno_text in ssd["disabled_reason"], ssd
    assert ssd["entries"] == written["entries"], "entries written before the fault stay"
    warnings = [line for line in log.splitlines() if "SSD cache disabled" in line]
    assert len(warnings) == 1, warnings
    assert ("(disk full)" in warnings[0]) == (fault == "enospc")
    assert temp_files(cache_dir) == []
    assert "Traceback" not in log

"""The miss reason `tier_late` (issue 33): a tier below RAM missed its read-ahead deadline
(`LookupReport.late`), so it was a miss for the request, and the prompt would have got more
from it. The classifier's rules on made-up lookups, then a hung SSD under an in-process
Engine on demo-llama, as GET /v1/cache/requests and /metrics would list it.
"""

from __future__ import annotations

import asyncio
import time

from engine_bridge.cache.ssd import store as ssd_store
from engine_bridge.ops.request_log import classify, summarize
from engine_bridge.prompt_cache import LookupReport
from engine_bridge.types import GenerationRequest, Message
from tests.cache.test_tier_io_off_thread import WAITING, empty_ram, make_engine, text_of
from tests.conftest import fresh_cache_dir

BS = 64
PROMPT = list(range(1000, 1300))  # 300 tokens: 4 full blocks and 44


def summary(tokens: list[int]):
    req = GenerationRequest(model="m", messages=[Message("user", "hi")])
    return summarize(req, tokens, [7, 8], [0], [0])


def report(restored: int, *, late=(), late_reach=0, lost=None) -> LookupReport:
    return LookupReport(restored, None, BS, False, 1024, lost, tuple(late), late_reach)


def reason(rep: LookupReport, prev=None) -> str:
    return classify(summary(PROMPT), len(PROMPT), prev, rep, True)


def test_a_late_tier_that_would_have_given_more_is_named():
    # Its own plan said it reached further than the hit: the prompt's first request too.
    assert reason(report(64, late=("ssd",), late_reach=256)) == "tier_late"
    assert reason(report(64, late=("shared",), late_reach=256)) == "tier_late"
    # RAM evicted what came next, and the SSD (which a spill writes to) was not asked.
    assert reason(report(64, late=("ssd",), lost="evicted_ram")) == "tier_late"
    # The session's previous request left more than the cache gave, and a tier was late.
    prev = summary(PROMPT)
    assert reason(report(64, late=("ssd",)), prev) == "tier_late"
    assert reason(report(64), prev) == "partial"  # no tier late: no record says why


def test_a_late_tier_with_nothing_more_to_give_changes_no_reason():
    prev = summary(PROMPT)
    assert reason(report(299, late=("ssd",), late_reach=299), prev) == "hit"
    # It reached no further than the hit (what it had, RAM had too).
    assert reason(report(256, late=("ssd",), late_reach=256)) == "hit"
    # Nothing says it held any of a first request's prompt.
    assert reason(report(0, late=("ssd",))) == "new_session"
    # The store was late, and RAM's eviction record stands: it spills to the SSD, not there.
    assert reason(report(64, late=("shared",), lost="evicted_ram")) == "evicted_ram"
    assert reason(report(64, late=("ssd",), lost="evicted_ssd")) == "evicted_ssd"
    # The previous request (same messages, other tokens) left nothing this prompt could
    # resume from: the reason is the one without a late tier.
    other = summary([5] + PROMPT[1:])
    assert reason(report(0, late=("ssd",)), other) == reason(report(0), other)
    assert reason(report(0), other) == "template_changed"


def test_a_hung_ssd_is_the_reason_a_request_missed(demo_root, tmp_path, monkeypatch):
    """WAITING's blocks are on the SSD only when its second turn comes, and every entry
    file read hangs: the read-ahead leaves the SSD behind, the request prefills its prompt,
    and the log says the SSD was late. Before: "evicted_ram" (RAM evicted the blocks, and
    the SSD, never asked, was taken to lack them)."""
    engine = make_engine(fresh_cache_dir(demo_root, tmp_path / "cache"))
    runner = asyncio.Runner()
    try:
        runner.run(text_of(engine, WAITING))  # stored, and written through to the SSD
        assert engine.tiers.ssd.flush(30)
        runner.run(engine.scheduler.run(empty_ram, engine))
        real_read = ssd_store.read_file

        def hung_read(*args, **kwargs):
            time.sleep(2.0)
            return real_read(*args, **kwargs)

        monkeypatch.setattr(ssd_store, "read_file", hung_read)
        engine.tiers.reads.ssd_stall_s = 0.3
        runner.run(text_of(engine, WAITING))
        (record,) = engine.request_log.recent(1)
        assert record.reason == "tier_late", record
        assert record.hit_tokens < record.prompt_tokens - BS, record
        assert engine.request_log.reason_totals()[WAITING.model, "tier_late"] == 1
        assert engine.tiers.reads.stats().late_ssd == 1
    finally:
        runner.run(engine.close())
        runner.close()

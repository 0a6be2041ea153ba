"""What `TieredCache.pin` leaves behind: a fault after it lets go of the pin, and the
resume point it notes keeps no chain alive.

RAM never evicts a pinned entry: a pin that outlived its request would hold its bytes for
good, and enough of them fill the tier. Each step between `TieredCache.pin` and the
release in `CacheSession.restore` raises once on a real in-process Engine: the request
fails with that error, nothing stays pinned, and the next request hits as deep as before.
"""

from __future__ import annotations

import gc

import pytest

from engine_bridge import kv
from engine_bridge.cache.hashing import Chain
from engine_bridge.cache.ram.manager import CacheManager
from engine_bridge.cache.resume_points import ResumePointStats
from engine_bridge.cache.ssd.index import Scope
from engine_bridge.cache.tiers import TieredCache
from engine_bridge.models.demo import ensure_demo_model
from engine_bridge.prompt_cache import CacheSession
from engine_bridge.types import GenerationFailed
from tests.support.cache_driver import Driver, HitModel
from tests.support.tier_payloads import BS, make_chain

MODELS = ("demo-llama", "demo-hybrid")  # paged layers; snapshot (Gated DeltaNet) layers
PROMPT = (
    "The workshop repairs clocks, radios and bicycles. A new chain is 18 euros, a clock "
    "spring 12 euros and a radio valve 25 euros; the shop opens at nine and closes at six, "
    "except on Sundays, and never promises a repair for the same day after four o'clock."
)
# Where a fault strikes, in the order restore meets them: the tier writes `pin` makes
# once the match is pinned, then the session's own steps up to the copy.
FAULTS = (
    "writes.reused",
    "writes.resumed",
    "session._report",
    "session._log_divergence",
    "session._note",
    "kv.restore",
)


class Injected(Exception):
    """The fault this test raises; any other error is the code under test failing."""


@pytest.fixture(scope="module")
def models_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("pin-faults")
    for model in MODELS:
        ensure_demo_model(model, root)
    return root


@pytest.fixture
def driver(models_root, model):
    """An Engine of its own per case, so a pin one case leaks cannot fail the next."""
    d = Driver(models_root, [model], ssd_enabled=False)
    yield d
    d.close()


def pinned_bytes(driver: Driver) -> int:
    return driver.engine.stats()["ram"]["pinned_bytes"]


def fail_once(monkeypatch, driver: Driver, where: str, pinned_then: list[int]) -> None:
    """Make `where` raise `Injected` the first time it is called, noting the bytes pinned
    at that moment (a fault with nothing pinned would prove nothing)."""
    owner_name, name = where.split(".")
    owner = {"writes": driver.engine.tiers.writes, "session": CacheSession, "kv": kv}[owner_name]
    real = getattr(owner, name)
    ram = driver.engine.tiers.ram

    def faulty(*args, **kwargs):
        if not pinned_then:
            pinned_then.append(ram.stats().pinned_bytes)
            raise Injected(where)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, faulty)


@pytest.mark.parametrize("where", FAULTS)
@pytest.mark.parametrize("model", MODELS)
def test_a_fault_after_the_pin_leaves_nothing_pinned_and_the_next_request_hits(
    driver, monkeypatch, model, where
):
    hits = HitModel(driver.has_snapshots(model), ssd=False)
    first = driver.generate(model, prompt=PROMPT)
    hits.record(first)
    assert pinned_bytes(driver) == 0
    nxt = first.tokens + first.out + first.tokens[:40]  # the conversation goes on
    expected = hits.expected(nxt)
    assert expected > 0, f"{model}: the second request would not hit, so pin nothing"

    pinned_then: list[int] = []
    with monkeypatch.context() as patch:
        fail_once(patch, driver, where, pinned_then)
        with pytest.raises(GenerationFailed) as failed:
            driver.generate(model, tokens=nxt)
    assert isinstance(failed.value.__cause__, Injected), failed.value.__cause__
    assert pinned_then[0] > 0  # the fault struck while the hit was pinned
    assert pinned_bytes(driver) == 0

    again = driver.generate(model, tokens=nxt)
    assert (again.cached, again.source) == (expected, "ram")
    assert again.text == driver.bypass(model, tokens=nxt).text
    assert pinned_bytes(driver) == 0


# ---- resume points --------------------------------------------------------------------

SCOPE = Scope("model-p")
EXTRA = (("model", "model-p"), ("tenant", "default"))


def resume(t: TieredCache, tokens: list[int]):
    """A request's restore as far as the tiers go: look up, pin (which notes where its
    prefill resumes), let go. Returns its chain, which the request holds while it runs."""
    c = make_chain(tokens, EXTRA)
    match = t.pin(t.lookup(c, SCOPE, needs_checkpoint=True), promoted=False)
    if match.pinned:
        t.ram.release(match)
    return c


def tiers() -> TieredCache:
    ram = CacheManager(1 << 30, block_size=BS)
    return TieredCache(ram, None, kv.HostCodec(), periodic_write_every=16)


def live_chains() -> int:
    gc.collect()
    return sum(isinstance(o, Chain) for o in gc.get_objects())


def test_a_finished_requests_chain_is_not_kept_for_its_resume_point():
    t = tiers()
    before = live_chains()
    for i in range(2048):  # requests one after another, each on a long prompt of its own
        resume(t, [i] * 2048)
    # Before: the last 1,024 chains stayed (2,048 tokens and 512 block hashes each).
    assert live_chains() - before == 0


def test_resume_points_are_bounded_and_name_that_very_chain():
    t = tiers()
    points = t.writes.resume_points
    assert t.writes.stats().resume_points == ResumePointStats(0, 1024)
    running = [resume(t, [i] * 64) for i in range(1024 + 5)]  # all running at once
    assert t.writes.stats().resume_points == ResumePointStats(1024, 1024)
    assert [points.get(c) for c in running[4:6]] == [None, 0]  # the oldest 5 forgotten
    # The same tokens in another request's chain are not the prefill that resumed.
    assert points.get(make_chain(list(running[-1].tokens), EXTRA)) is None
    del running
    keep = resume(t, [7, 7, 7])  # the next request: those done leave first
    assert t.writes.stats().resume_points == ResumePointStats(1, 1024)
    assert points.get(keep) == 0


def test_the_resume_points_bound_is_in_the_cache_stats(models_root):
    d = Driver(models_root, ["demo-llama"], ssd_enabled=True)
    try:
        d.generate("demo-llama", prompt=PROMPT)
        assert d.engine.stats()["writes"]["resume_points"] == {"entries": 1, "max_entries": 1024}
    finally:
        d.close()

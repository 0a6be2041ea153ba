"""An image's features read back from the SSD off the MLX thread (issue 33): a request's
read-ahead reads them on the tiers' I/O threads under the SSD's deadline, and the MLX
thread, which asks the feature cache during the prefill, does no tier I/O. A hung SSD read
costs only the request that waits for it: a request decoding meanwhile keeps its pace,
and the waiting one runs the encoder and answers as the bypass does.

An in-process Engine on demo-vision; the fault sits below the code under test (the SSD's
entry-file reads hang), and SQLite statements and file reads are recorded by thread.
"""

from __future__ import annotations

import asyncio
import io
import threading
import time

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_vlm")

from PIL import Image  # noqa: E402

from engine_bridge.cache.kinds import EntryKind  # noqa: E402
from engine_bridge.cache.ram.manager import CacheManager  # noqa: E402
from engine_bridge.cache.ssd import store as ssd_store  # noqa: E402
from engine_bridge.cache.ssd.index import Scope  # noqa: E402
from engine_bridge.cache.ssd.store import SSDConfig, SSDStore  # noqa: E402
from engine_bridge.engine import Engine, EngineSettings  # noqa: E402
from engine_bridge.types import (  # noqa: E402
    GenerationRequest,
    ImageInput,
    Message,
    Sampling,
    TokenEvent,
)
from engine_bridge.vision.features import FeatureCache  # noqa: E402
from engine_bridge.warm_ahead import WarmAheadSettings  # noqa: E402
from tests.cache.test_mlx_thread_io import IndexCalls  # noqa: E402
from tests.conftest import fresh_cache_dir  # noqa: E402

MODEL = "demo-vision"
SSD_READ_S = 3.0  # how long each hung entry-file read takes
SSD_STALL_S = 0.3  # the SSD phase's deadline in the test (default 2 s)
DECODE_TOKENS = 3000
WARM_EVENTS = 20


def png(seed: int, width: int = 200, height: int = 150) -> bytes:
    pixels = (np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8")
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


IMAGE = ImageInput(png(40), "image/png", "messages[1].content[0]")


def request(system: str, *, use_cache: bool = True, image: bool = True) -> GenerationRequest:
    question = "What is in the picture?"
    user = Message("user", question, parts=(IMAGE, question)) if image else Message("user", system)
    return GenerationRequest(
        model=MODEL,
        messages=[Message("system", system), user],
        max_tokens=DECODE_TOKENS if not image else 8,
        sampling=Sampling(temperature=0.0),
        use_cache=use_cache,
    )


@pytest.fixture(scope="module")
def vision_root(tmp_path_factory):
    from engine_bridge.models.demo import ensure_demo_model

    root = tmp_path_factory.mktemp("vision-io")
    ensure_demo_model(MODEL, root)
    return root


async def text_of(engine: Engine, req: GenerationRequest) -> str:
    stream = await engine.start(req)
    return "".join([e.text async for e in stream if isinstance(e, TokenEvent)])


async def beside_a_decode(engine: Engine, req: GenerationRequest) -> tuple[str, list[float]]:
    """`req` run to its end while a long text request decodes; its text, and the gaps
    between the decoding request's tokens while `req` ran."""
    times: list[float] = []
    flowing = asyncio.Event()
    decoding = await engine.start(request("Tell a long story about the sea. " * 3, image=False))

    async def consume() -> None:
        async for event in decoding:
            if isinstance(event, TokenEvent):
                times.append(time.perf_counter())
                if len(times) == WARM_EVENTS:
                    flowing.set()

    consumer = asyncio.create_task(consume())
    await flowing.wait()
    sent = time.perf_counter()
    text = await text_of(engine, req)
    done = time.perf_counter()
    assert not consumer.done(), "the decoding request ended before the other one did"
    consumer.cancel()
    await asyncio.gather(consumer, return_exceptions=True)
    await decoding.aclose()
    pairs = zip(times, times[1:], strict=False)
    return text, [b - a for a, b in pairs if a < done and b > sent]


def vision_stats(engine: Engine) -> dict:
    return engine.stats()["vision"]


def test_features_on_the_ssd_are_read_ahead_and_a_hung_read_costs_only_that_request(
    vision_root, tmp_path, monkeypatch
):
    sql = IndexCalls(monkeypatch)
    engine = Engine(
        EngineSettings(
            cache_dir=fresh_cache_dir(vision_root, tmp_path / "cache"),
            model_specs=[MODEL],
            ram_budget_bytes=1 << 30,
            warm_ahead=WarmAheadSettings(enabled=False),
        )
    )
    runner = asyncio.Runner()
    try:
        # The answers without the cache; the encoder runs once, its output kept and written.
        bypass = {s: runner.run(text_of(engine, request(s, use_cache=False))) for s in "BC"}
        assert vision_stats(engine)["encoder_runs"] == 1
        assert engine.tiers.ssd.flush(30)
        features = engine.models.loaded(MODEL).vision.feature_cache
        mlx = runner.run(engine.scheduler.run(threading.get_ident))

        # RAM lets the features go (the SSD keeps them). A new conversation with the image
        # prefills past it: they are read ahead from the SSD, not asked on the MLX thread.
        runner.run(engine.scheduler.run(features.clear))
        start = sql.mark()
        assert runner.run(text_of(engine, request("B"))) == bypass["B"]
        stats = vision_stats(engine)
        assert (stats["encoder_runs"], stats["feature_hits_ssd"]) == (1, 1), stats
        assert sql.by(mlx, start) == []  # before: the feature entry's index row, on it
        assert sql.besides(mlx, start), "the SSD was asked, off the MLX thread"

        # Every entry-file read hangs now: the read-ahead leaves the SSD behind at its
        # deadline, the encoder runs, and a request decoding meanwhile never waits.
        runner.run(engine.scheduler.run(features.clear))
        readers: list[int] = []
        real_read = ssd_store.read_file

        def hung_read(*args, **kwargs):
            readers.append(threading.get_ident())
            time.sleep(SSD_READ_S)
            return real_read(*args, **kwargs)

        monkeypatch.setattr(ssd_store, "read_file", hung_read)
        engine.tiers.reads.ssd_stall_s = SSD_STALL_S
        text, gaps = runner.run(beside_a_decode(engine, request("C")))
        assert text == bypass["C"]
        assert readers and mlx not in readers, "a hung read ran on the MLX thread"
        assert len(gaps) >= 3 and max(gaps) < 0.5 * SSD_READ_S, (len(gaps), max(gaps, default=0))
        stats = vision_stats(engine)
        assert (stats["encoder_runs"], stats["feature_hits_ssd"]) == (2, 1), stats
        assert engine.tiers.reads.stats().late_ssd >= 1
    finally:
        runner.run(engine.close())
        runner.close()


def test_the_feature_cache_asks_no_tier_for_what_ram_lacks(tmp_path, monkeypatch):
    """`get` is what the MLX thread asks during a prefill: RAM only. Features the SSD holds
    come through a request's read-ahead (the test above, and test_vision_features.py)."""
    sql = IndexCalls(monkeypatch)
    digest = b"d" * 32
    with SSDStore(SSDConfig(tmp_path / "ssd", reconcile="sync")) as ssd:
        cache = FeatureCache()
        cache.bind(CacheManager(1 << 30), ssd, "fp")
        cache.put("alice", digest, mx.ones((4, 8), dtype=mx.float16))
        assert ssd.flush()
        cache.clear()  # RAM lets it go; the SSD keeps it
        assert ssd.contains_many(Scope("fp", "alice"), EntryKind.FEATURES, [digest]) == [True]
        start, me = sql.mark(), threading.get_ident()
        assert cache.get("alice", digest) is None  # before: read from the SSD, right here
        assert sql.by(me, start) == []
        assert cache.missing("alice", [digest]) == [digest]  # what a read-ahead reads

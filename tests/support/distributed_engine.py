"""One rank of the lockstep check (tests/distributed/test_lockstep.py).

Every rank builds the engine on a model split across the ranks. Rank 0 serves requests
through `Engine.start`, some at once, one cut off by its client; the others follow its
steps. Rank 0 then runs the same requests on the whole model alone and writes both
answers to `<out>/answers.json`.
    python -m tests.support.distributed_engine OUT CACHE_DIR MODE MODEL
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from engine_bridge.distributed.world import join
from engine_bridge.engine import Engine, EngineSettings
from engine_bridge.types import GenerationRequest, Message, Sampling, TokenEvent

QUESTIONS = ["Name three rivers.", "What is a prompt cache?", "Count to five.", "Say hi."]


def request(model: str, question: str, n: int = 24, t: float = 0.0) -> GenerationRequest:
    return GenerationRequest(
        model=model,
        messages=[Message("system", "You are terse."), Message("user", question)],
        max_tokens=n,
        sampling=Sampling(temperature=t),
        use_cache=False,
    )


async def answer(engine: Engine, req: GenerationRequest, cut_after: int | None = None) -> str:
    stream = await engine.start(req)
    text, seen = "", 0
    async for event in stream:
        if isinstance(event, TokenEvent):
            text += event.text
            seen += 1
            if cut_after is not None and seen >= cut_after:
                await stream.aclose()  # the client leaves mid-stream
                return text
    return text


async def serve(engine: Engine, model: str) -> list[str]:
    first = await answer(engine, request(model, QUESTIONS[0]))
    # Three at once, batched, one of them cut off after 3 events; then one more.
    together = await asyncio.gather(
        answer(engine, request(model, QUESTIONS[1])),
        answer(engine, request(model, QUESTIONS[2], 40), cut_after=3),
        answer(engine, request(model, QUESTIONS[3])),
    )
    last = await answer(engine, request(model, QUESTIONS[0], 8))
    return [first, *together, last]


async def sampled(engine: Engine, model: str) -> list[str]:
    """Sampled without a seed, alone and two at once: every rank must draw the same."""
    one = await answer(engine, request(model, QUESTIONS[1], 16, t=0.9))
    two = await asyncio.gather(
        *(answer(engine, request(model, q, 16, t=0.9)) for q in QUESTIONS[2:])
    )
    return [one, *two]


def settings(cache_dir: Path, model: str, world=None) -> EngineSettings:
    return EngineSettings(
        cache_dir=cache_dir,
        model_specs=[model],
        cache_enabled=False,
        ssd_enabled=False,
        memory_preflight=False,
        world=world,
    )


async def lead(engine: Engine, model: str) -> tuple[list[str], list[str]]:
    try:
        return await serve(engine, model), await sampled(engine, model)
    finally:
        await engine.close()


async def alone(cache_dir: Path, model: str) -> list[str]:
    engine = Engine(settings(cache_dir, model))
    try:
        return await serve(engine, model)
    finally:
        await engine.close()


def main() -> None:
    out, cache_dir, mode, model = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4]
    world = join(mode)
    engine = Engine(settings(cache_dir, model, world))
    # What this rank generated for every request, in order (followers answer no client).
    results: list[str] = []
    engine.on_result(lambda req, res: results.append(res.text))
    if not world.leader:
        engine.follow()
        theirs = world.share(None)  # rank 0's results
        world.all_ok(theirs == results)
        world.share(None)  # wait for rank 0's answers: mlx.launch ends every rank with one
        return
    split, drawn = asyncio.run(lead(engine, model))
    world.share(results)
    agree = world.all_ok(True)
    whole = asyncio.run(alone(cache_dir, model))
    answers = {"split": split, "whole": whole, "sampled": drawn, "ranks_agree": agree}
    (out / "answers.json").write_text(json.dumps(answers))
    world.share("written")


if __name__ == "__main__":
    sys.exit(main())

"""A started generation as proxy/ sees it: what the cache gave, then text and a result."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

from .prompting.output_format import OutputParser
from .types import (
    CacheSource,
    EngineError,
    GenerationFailed,
    GenerationResult,
    PromptInfo,
    TokenEvent,
)

log = logging.getLogger("engine_bridge.stream")

StreamEvent = TokenEvent | GenerationResult


class GenerationStream:
    """Iterates a generation's `TokenEvent`s, then its one `GenerationResult`.

    It exists once the prompt is looked up in the cache and admitted, so the cache headers
    (`prompt_tokens`, `cached_tokens`, `source`) are known before the first token. An
    internal failure surfaces as `GenerationFailed`; `aclose()` (or leaving the iteration)
    cancels the generation and frees its batch slot within one step.
    """

    def __init__(
        self,
        info: PromptInfo,
        events: AsyncIterator[StreamEvent],
        *,
        context_length: int,
        output: Callable[..., OutputParser],
        use_cache: bool,
    ):
        self.info = info
        self.context_length = context_length
        self._output = output
        self.use_cache = use_cache
        self.result: GenerationResult | None = None
        self._events = events

    @property
    def prompt_tokens(self) -> int:
        return self.info.prompt_tokens

    @property
    def cached_tokens(self) -> int:
        return self.info.cached_tokens

    @property
    def source(self) -> CacheSource:
        return self.info.source

    def parser(self, raw: bool = False) -> OutputParser:
        """A parser of this generation's text in the model's own format (reasoning, answer
        text, tool calls); `raw` passes the text through as it is (plain completions)."""
        return self._output(raw=raw)

    def __aiter__(self) -> GenerationStream:
        return self

    async def __anext__(self) -> StreamEvent:
        try:
            event = await anext(self._events)
        except (StopAsyncIteration, asyncio.CancelledError, GenerationFailed):
            raise
        except EngineError as e:
            if e.status == 503:  # the engine stopped under it (a rank lost): retry later
                raise
            raise GenerationFailed(f"generation failed: {e}") from e
        except Exception as e:
            raise GenerationFailed(f"generation failed: {e}") from e
        if isinstance(event, GenerationResult):
            self.result = event
        return event

    async def aclose(self) -> None:
        aclose = getattr(self._events, "aclose", None)
        if aclose is not None:
            await aclose()

"""Between turns: what a request is rendered with, and what a finished turn leaves behind.

Before rendering, a chat request gets the template kwargs its model's template keeps
history with (`preserve_thinking`, unless the request or its settings say otherwise) and
the reasoning a client dropped from its earlier assistant turns. After a turn, the
reasoning it generated is remembered, and when it ended with an answer the next
question's prefix is offered for warming ahead (`warm_ahead.py`), rendered only once the
machine is idle.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
from typing import TYPE_CHECKING, Any

from .prompting import next_turn, reasoning_layout, template_flags
from .prompting.reasoning_memo import ReasoningMemo, Scope
from .scheduling.output_rules import call_marker_is_token
from .scheduling.runner import lane
from .types import GenerationRequest, GenerationResult
from .warm_ahead import WarmAhead, WarmOffer

if TYPE_CHECKING:
    from .engine_settings import EngineSettings
    from .models.loading import LoadedModel
    from .prompting.render import RenderedPrompt
    from .scheduling.jobs import Job

log = logging.getLogger("engine_bridge.turns")

# Turns that end this way leave an answer a client shows and a question may follow (one cut
# off by max_tokens too); a cancelled one was not read.
_ANSWERED = ("stop", "stop_string", "length")
# Turns whose reasoning layout no way renders back before a model is left as sent.
_LAYOUT_TRIES = 3


def _scope(req: GenerationRequest) -> Scope:
    return (req.tenant, req.model, req.session)


class Turns:
    def __init__(
        self,
        settings: EngineSettings,
        warm_ahead: WarmAhead,
        pool: concurrent.futures.Executor,
    ):
        self.settings = settings
        self.warm_ahead = warm_ahead
        self.reasoning = ReasoningMemo(settings.reasoning_memo_bytes)
        # Every render runs on this one thread (the engine's tokenize pool): a turn's
        # reasoning is remembered before the next request of its session is rendered.
        self._pool = pool
        self.loop: asyncio.AbstractEventLoop | None = None
        # Per model (fingerprint): how its template wants reasoning sent back, once a turn
        # showed it (reasoning_layout.py), and how many turns failed to show it.
        self._edges: dict[str, str] = {}
        self._edge_tries: dict[str, int] = {}

    @staticmethod
    def template_defaults(loaded: LoadedModel) -> dict[str, Any]:
        """The kwargs the engine renders `loaded`'s template with unless told otherwise."""
        source = template_flags.chat_template_source(loaded.tokenizer)
        return template_flags.default_kwargs(source)

    def prepare(self, loaded: LoadedModel, req: GenerationRequest) -> GenerationRequest:
        """`req` made ready to render, in place (callers and tests know a request by its
        identity): default template kwargs under its own, and dropped reasoning put back."""
        defaults = self.template_defaults(loaded)
        if defaults:
            req.template_kwargs = defaults | req.template_kwargs
        # Bypassed requests too: `x-prompt-cache: bypass` must see the prompt a cached
        # request sees, or the two answers could not be compared.
        if req.messages is not None:
            if req.restore_reasoning:
                req.messages = self.reasoning.restore(_scope(req), req.messages)
            edge = self._edges.get(loaded.fingerprint)
            if edge is not None:
                req.messages = reasoning_layout.send_back(edge, req.messages)
        return req

    def ended(
        self, loaded: LoadedModel, job: Job, result: GenerationResult, out: list[int]
    ) -> None:
        """A chat turn finished (on the MLX thread) with tokens `out`: the rest runs on the
        tokenize thread."""
        req = job.request
        if req.messages is None or req.prefill_only or not req.use_cache:
            return
        if not self.settings.cache_enabled or self.loop is None or self.warm_ahead.closed:
            return
        self._pool.submit(self._follow_up, loaded, job, result, list(out))

    def _follow_up(
        self, loaded: LoadedModel, job: Job, result: GenerationResult, out: list[int]
    ) -> None:
        req = job.request
        try:
            choice = req.tool_choice
            reply = next_turn.read_reply(
                loaded.output_format,
                result.text,
                job.prompt.text,
                req.tools if choice.mode != "none" else None,
                result.finish_reason,
                choice.parallel,
            )
            self.reasoning.remember(_scope(req), reply.content, reply.calls, reply.reasoning)
            self._learn_layout(loaded, job, reply.message(), out)
            if reply.calls or result.finish_reason not in _ANSWERED:
                return  # a tool result comes next, which no template rewrites history for
            if not self.warm_ahead.settings.enabled:
                return
            prefix = functools.partial(
                next_turn.next_question_prefix,
                loaded.tokenizer,
                req.messages or [],
                reply.message(),
                req.tools,
                req.template_kwargs,
                self.settings.normalization,
                loaded.prefixes,
            )
        except Exception:  # a follow-up must never fail what it follows
            log.exception("[%s] reading the finished turn failed", req.request_id)
            return
        loop, pool = self.loop, self._pool
        assert loop is not None

        async def render() -> RenderedPrompt | None:
            # On this thread too, once the warm-up is due (warm_ahead.py): renders share it.
            return await loop.run_in_executor(pool, prefix)

        offer = WarmOffer(req.model, req.tenant, req.session, render, lane=lane(req))
        loop.call_soon_threadsafe(self.warm_ahead.offer, offer)

    def _learn_layout(self, loaded: LoadedModel, job: Job, reply, out: list[int]) -> None:
        """Once per model: which layout of a turn's reasoning renders what it generated."""
        key = loaded.fingerprint
        if key in self._edges or not reasoning_layout.has_edges(reply.reasoning):
            return
        if self._edge_tries.get(key, 0) >= _LAYOUT_TRIES or job.prompt.vision is not None:
            return
        req = job.request
        written = [*job.prompt.tokens, *out[:-1]]  # the stop token is the template's to write
        edge = reasoning_layout.learn(
            loaded.tokenizer,
            req.messages or [],
            reply,
            written,
            req.tools,
            req.template_kwargs,
            self.settings.normalization,
        )
        if edge is None:
            self._edge_tries[key] = self._edge_tries.get(key, 0) + 1
            log.info("%s: no layout of a turn's reasoning renders what the model wrote", loaded.id)
            return
        self._edges[key] = edge
        if edge != "as_sent":
            log.info("%s: reasoning goes back to its template %s of newlines", loaded.id,
                     {"strip": "stripped", "lstrip": "left-stripped", "rstrip": "right-stripped"}[edge])  # fmt: skip


def rendered_tools(loaded: LoadedModel, req: GenerationRequest) -> list | None:
    """The tools the template shows. `tool_choice: none` keeps them, so the prompt and
    its cache match the turns that allow calls, and bans the call marker instead; a
    family whose marker is several tokens cannot ban it, so it shows none."""
    if req.tool_choice.mode == "none" and not call_marker_is_token(
        loaded.tokenizer, loaded.output_format
    ):
        return None
    if req.tool_choice.name and req.tools:
        # A named tool: only it is offered (the prompt then differs from the turns
        # that offer all, from the tools on).
        named = [t for t in req.tools if t.get("function", {}).get("name") == req.tool_choice.name]
        return named or req.tools
    return req.tools

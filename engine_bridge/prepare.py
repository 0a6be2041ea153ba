"""A request made ready for its model's runner: rendered, tokenized and checked.

Every client mistake a model can reveal (a token outside its vocabulary, a prompt longer
than its context, an image it cannot see) surfaces here, before anything is queued or
streamed. Rendering and tokenizing run on one tokenizer thread, never on the event loop
or the MLX thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures

from .engine_settings import EngineSettings
from .models.loading import LoadedModel
from .prompting.render import RenderedPrompt, render_chat, render_completion
from .scheduling.forced_output import ForcedOutputs
from .scheduling.jobs import Job
from .scheduling.output_rules import output_rule
from .turns import Turns, rendered_tools
from .types import EngineError, GenerationRequest
from .vision import prompt as vision_prompt


def _vocab_size(config: dict) -> int | None:
    """The embedding's row count, from the model's config (nested for vision models)."""
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return int(size) if isinstance(size, int) else None


class Preparer:
    def __init__(
        self,
        settings: EngineSettings,
        turns: Turns,
        pool: concurrent.futures.ThreadPoolExecutor,
    ):
        self.settings = settings
        self.turns = turns
        self._pool = pool  # the tokenizer's one thread
        self._forced = ForcedOutputs.from_env()  # tests only

    async def job(
        self, loaded: LoadedModel, req: GenerationRequest, rendered: RenderedPrompt | None = None
    ) -> Job:
        """`req` as a job for `loaded`; `rendered`: its prompt, already rendered (warming
        ahead)."""
        if req.messages is not None:
            req = await self.tokenize(self.turns.prepare, loaded, req)
        if rendered is not None:
            prompt = rendered
        elif req.prompt_tokens is not None:
            vocab = _vocab_size(loaded.config)
            bad = [t for t in req.prompt_tokens if not 0 <= t < (vocab or 1 << 62)]
            if bad:
                raise EngineError(
                    f"token id {bad[0]} is outside the model's vocabulary of {vocab} tokens",
                    field="prompt",
                )
            text = await self.tokenize(loaded.tokenizer.decode, req.prompt_tokens)
            prompt = RenderedPrompt(list(req.prompt_tokens), text, [0], [0])
        elif req.messages is not None:
            prompt = await self.render_chat(loaded, req)
        else:
            prompt = await self.tokenize(render_completion, loaded.tokenizer, req.prompt or "")
        n = len(prompt.tokens)
        ctx = loaded.context_length
        if n == 0:
            raise EngineError("the prompt is empty after tokenization", field="prompt")
        if n >= ctx:
            raise EngineError(
                f"the prompt is {n} tokens, longer than the model's context of {ctx} tokens",
                field="messages" if req.messages is not None else "prompt",
            )
        if req.max_tokens > ctx:
            raise EngineError(
                f"max_tokens {req.max_tokens} exceeds the model's context of {ctx} tokens",
                field="max_tokens",
            )
        # Past the context there is nowhere to put a token: stop there with "length".
        max_tokens = min(req.max_tokens, ctx - n)
        fmt = loaded.output_format
        rule = output_rule(
            loaded.tokenizer,
            fmt,
            req.tool_choice,
            has_tools=bool(req.tools),
            opens_in_reasoning=fmt.opens_in_reasoning(prompt.text),
            forced_text=self._forced.pick(prompt.text) if self._forced else None,
        )
        return Job(req, prompt, max_tokens, rule=rule)

    async def count_tokens(self, loaded: LoadedModel, req: GenerationRequest) -> int:
        """The tokens `req`'s chat renders to, as a generation would render it."""
        req = await self.tokenize(self.turns.prepare, loaded, req)
        return len((await self.render_chat(loaded, req)).tokens)

    async def render_chat(self, loaded: LoadedModel, req: GenerationRequest) -> RenderedPrompt:
        images = vision_prompt.images_of(req.messages)
        limits = self.settings.vision_limits
        if images:
            vision_prompt.check_model(loaded, images)
            vision_prompt.check_count(images, limits)
        prompt = await self.tokenize(
            render_chat,
            loaded.tokenizer,
            req.messages or [],
            rendered_tools(loaded, req),
            req.template_kwargs,
            self.settings.normalization,
            loaded.prefixes,
        )
        if images:
            assert loaded.vision is not None
            prompt = await self.tokenize(
                vision_prompt.attach, prompt, images, loaded.vision.spec, limits, req.tenant
            )
        return prompt

    async def tokenize(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

"""A test-only hook: make the model emit given texts, token by token, through the real path.

Tests of output formats must run a model's real markup through the sampler, the
detokenizer, the parser and the SSE writer. A tiny random model writes no markup, so with
`MLX_PROMPT_CACHE_FORCE_OUTPUT=FILE` set, each generation whose prompt matches an entry of
FILE is forced to that entry's text (then end of sequence) by its logits. FILE is JSON:
`{"outputs": [{"match": "<text in the prompt>", "text": "<what the model writes>"}]}`. The
entry whose `match` ends latest in the rendered prompt wins (so a later turn's tool result
beats the first turn's question); an empty `match` is the fallback.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("engine_bridge.scheduling.forced_output")

ENV = "MLX_PROMPT_CACHE_FORCE_OUTPUT"


@dataclass(frozen=True, slots=True)
class ForcedOutputs:
    entries: tuple[tuple[str, str], ...]

    @classmethod
    def from_env(cls) -> ForcedOutputs | None:
        path = os.environ.get(ENV)
        if not path:
            return None
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        entries = tuple((str(e.get("match", "")), str(e["text"])) for e in data["outputs"])
        log.warning(
            "%s is set: %d forced outputs from %s replace what the models write (tests only)",
            ENV,
            len(entries),
            path,
        )
        return cls(entries)

    def pick(self, prompt_text: str) -> str | None:
        best: tuple[int, str] | None = None
        for match, text in self.entries:
            at = prompt_text.rfind(match) + len(match) if match else 0
            if (match and at < len(match)) or (best is not None and at <= best[0]):
                continue
            best = (at, text)
        return best[1] if best else None

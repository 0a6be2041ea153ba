"""What a chat template reads, and the kwargs the engine turns on for it by default.

Qwen3.6's template drops the reasoning of every assistant turn before the last real user
question unless `preserve_thinking` is true. Dropped, each new question re-renders the
whole previous task differently and the prompt leaves the cache at its first assistant
turn; kept, history only grows at its end. Its model card recommends the flag for agents.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import jinja2
from jinja2 import meta

log = logging.getLogger(__name__)

# Flags that keep past reasoning, and the value that does; on unless the user says no.
APPEND_ONLY_FLAGS: dict[str, Any] = {"preserve_thinking": True}


@functools.lru_cache(maxsize=64)
def template_variables(source: str) -> frozenset[str]:
    """The names a template reads from its context (kwargs, messages, tools, …)."""
    try:
        return frozenset(meta.find_undeclared_variables(jinja2.Environment().parse(source)))
    except jinja2.TemplateError as e:
        log.warning("could not parse the chat template to read its flags: %s", e)
        return frozenset()


def chat_template_source(tokenizer: Any) -> str:
    """The template text a tokenizer renders with ("" when it has none, or several)."""
    source = getattr(tokenizer, "chat_template", None)
    return source if isinstance(source, str) else ""


def default_kwargs(source: str) -> dict[str, Any]:
    """The template kwargs the engine sets unless the request or the model's settings do."""
    names = template_variables(source) if source else frozenset()
    return {k: v for k, v in APPEND_ONLY_FLAGS.items() if k in names}

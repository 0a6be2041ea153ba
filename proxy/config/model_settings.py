"""`[model."<pattern>"]`: per-model sampling defaults, max_tokens and chat-template kwargs.

A section applies to a served model when its pattern, compared without regard to case,
equals one of the model's names (exact), or matches one as an fnmatch glob (`*`, `?`,
`[...]`). The names: its id, its LM Studio key `publisher/model-dir`, and the folder name
alone, which LM Studio's REST API gives as `key` beside a separate `publisher`. Every matching section contributes; per key the most specific wins:
an exact pattern beats any glob, a longer glob beats a shorter one, and of two equally
specific sections the one written later in the file wins. `chat_template_kwargs` merge
the same way, kwarg by kwarg. The request's own values always win (proxy/generation.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from proxy.config.schema import key_error
from proxy.config.tomltext import Origins

# Sampling fields a section may set, as engine_bridge.types.Sampling names them.
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
_GLOB_CHARS = frozenset("*?[")


@dataclass(frozen=True, slots=True)
class ModelSettings:
    """One section as written, or a model's resolved settings; None: not set."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    # Used when the request names no limit (never for Anthropic, which requires one).
    max_tokens: int | None = None
    # Merged under the request's own chat_template_kwargs.
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # False: reasoning a client dropped from earlier assistant turns stays dropped. On a
    # template that strips it at the next question anyway (MiniMax M2, GLM-4.7, Gemma 4,
    # gpt-oss), that keeps a question sent at once from prefilling the last task again,
    # at the price of the tool loop's reasoning (docs/templates.md).
    restore_reasoning: bool | None = None

    def values(self) -> dict[str, Any]:
        """The scalar keys that are set (chat_template_kwargs aside)."""
        return {
            f.name: v
            for f in dataclasses.fields(self)
            if f.name != "chat_template_kwargs" and (v := getattr(self, f.name)) is not None
        }

    def effective(self, template_defaults: Mapping[str, Any]) -> dict[str, Any]:
        """What a request gets, as GET /v1/models shows it: the keys that are set, and the
        kwargs the engine gives the template by default under the configured ones."""
        out = self.values()
        kwargs = {**template_defaults, **self.chat_template_kwargs}
        if kwargs:
            out["chat_template_kwargs"] = kwargs
        return out


def specificity(pattern: str, names: Iterable[str]) -> tuple[int, int] | None:
    """How closely `pattern` names a model known by `names` (lower-cased); None: not at all."""
    p = pattern.lower()
    if p in names:
        return (1, len(p))
    if _GLOB_CHARS & set(p) and any(fnmatchcase(n, p) for n in names):
        return (0, len(p))
    return None


def resolve(sections: Mapping[str, ModelSettings], names: Iterable[str]) -> ModelSettings:
    """The settings of a model known by `names` (its id, its LM Studio key)."""
    lowered = {n.lower() for n in names}
    matching = []
    for order, (pattern, section) in enumerate(sections.items()):
        rank = specificity(pattern, lowered)
        if rank is not None:
            matching.append((rank, order, section))
    values: dict[str, Any] = {}
    kwargs: dict[str, Any] = {}
    # Least specific first, so each more specific section overwrites the keys it sets.
    for _, _, section in sorted(matching, key=lambda m: m[:2]):
        values |= section.values()
        kwargs |= section.chat_template_kwargs
    return ModelSettings(**values, chat_template_kwargs=kwargs)


def model_names(model_id: str, key: str) -> tuple[str, ...]:
    """What a section may name a model by: its id, its LM Studio key, the key's folder."""
    return (model_id, key, key.rsplit("/", 1)[-1], model_id.rsplit("/", 1)[-1])


def lmstudio_key(path: Path) -> str:
    """LM Studio's key for a model folder: `publisher/model-dir`, the folder's last two parts."""
    return "/".join(path.parts[-2:])


class ModelSettingsTable:
    """The `[model."<pattern>"]` sections, resolved per served model id."""

    def __init__(
        self,
        sections: Mapping[str, ModelSettings] | None = None,
        keys: Mapping[str, str] | None = None,
    ) -> None:
        self.sections = dict(sections or {})
        # Served id -> LM Studio key, where they differ (a folder outside LM Studio's).
        self._keys = dict(keys or {})

    def resolve(self, model_id: str, key: str | None = None) -> ModelSettings:
        """`key`: the model's LM Studio key when the caller knows it better than the table."""
        if not self.sections:
            return _NONE
        return resolve(
            self.sections, model_names(model_id, key or self._keys.get(model_id, model_id))
        )


_NONE = ModelSettings()


# Each key's range: the test, and what the error says.
_RANGES: dict[str, tuple[Callable[[float], bool], str]] = {
    "temperature": (lambda v: v >= 0, "must be 0 or more"),
    "top_p": (lambda v: 0 < v <= 1, "must be more than 0 and at most 1"),
    "top_k": (lambda v: v >= 0, "must be 0 (off) or more"),
    "min_p": (lambda v: 0 <= v <= 1, "must be from 0 to 1"),
    "repetition_penalty": (lambda v: v > 0, "must be more than 0"),
    "max_tokens": (lambda v: v >= 1, "must be at least 1"),
}


def validate_model_settings(sections: Mapping[str, ModelSettings], origins: Origins) -> None:
    """Raise ConfigError naming the first key out of range and where it was set."""
    for pattern, section in sections.items():
        if not pattern.strip():
            raise key_error(("model", pattern), origins, "the model pattern is empty")
        for name, value in section.values().items():
            if name not in _RANGES:
                continue  # a flag: its type was checked as it was read
            ok, rule = _RANGES[name]
            if not (math.isfinite(value) and ok(value)):
                raise key_error(("model", pattern, name), origins, f"{rule}, got {value!r}")

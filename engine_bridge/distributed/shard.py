"""A model split across the ranks with mlx-lm's own sharding, or refused with its name.

mlx-lm gives a model class `shard(group)` (tensor parallel: attention and DeltaNet split
by heads, MLPs and experts by rows, with an `all_sum` where the halves meet) and its inner
model `pipeline(group)` (each rank keeps a run of layers and passes the hidden state on).
Loading is lazy, so a rank reads from disk only the weights it keeps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import load_model

from .world import Mode, World


class NotShardable(ValueError):
    """The model's class offers no way to split it the way asked."""


def can_split(model: nn.Module, mode: Mode) -> bool:
    if mode == Mode.TENSOR:
        return callable(getattr(model, "shard", None))
    inner = getattr(model, "model", None)
    return callable(getattr(inner, "pipeline", None))


def refusal(model: nn.Module, world: World) -> str | None:
    """Why `model` cannot be split as `world` asks, naming its class and the mode that
    would work; None when it can."""
    if can_split(model, world.mode):
        return None
    name = type(model).__module__.rpartition(".")[2] + "." + type(model).__name__
    how = "shard(group)" if world.mode == Mode.TENSOR else "model.pipeline(group)"
    other = Mode.PIPELINE if world.mode == Mode.TENSOR else Mode.TENSOR
    hint = f'; try mode = "{other}"' if can_split(model, other) else ""
    return (
        f"{name} cannot be split in {world.mode} mode across {world.size} ranks: "
        f"mlx-lm gives it no {how}{hint}"
    )


def split(model: nn.Module, world: World) -> nn.Module:
    """`model` (lazily loaded) cut to this rank's part, its weights then read."""
    if (why := refusal(model, world)) is not None:
        raise NotShardable(why)
    if world.mode == Mode.TENSOR:
        model.shard(world.group)
    else:
        model.model.pipeline(world.group)
    mx.eval(model.parameters())
    return model


def load_split(path: Path, world: World) -> tuple[nn.Module, dict[str, Any]]:
    """Load the model at `path` lazily and keep this rank's part of it."""
    model, config = load_model(path, lazy=True)
    return split(model, world), config

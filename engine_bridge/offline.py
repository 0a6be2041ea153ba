"""What the command line and `doctor` ask of engine_bridge with no engine running: the
models on disk and their size, the machine's BLAS, the chat template's default kwargs,
and the SSD cache read offline (`cache stats|ls|clear`).

One of the public modules `proxy/` may import (docs/architecture.md). Each name loads its
module on first use, so `mlx-prompt-cache cache stats` reads the SSD index without
loading MLX, and `doctor` loads only what its report needs.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass

_WHERE = {
    "offline_clear": ".cache.ssd.offline",
    "offline_ls": ".cache.ssd.offline",
    "offline_stats": ".cache.ssd.offline",
    "DEMO_MODEL_IDS": ".models.demo.specs",
    "is_demo_model": ".models.demo.specs",
    "scan": ".models.discovery",
    "ModelRef": ".models.loading",
    "chat_template_text": ".models.loading",
    "resolve": ".models.loading",
    "gb": ".models.preflight",
    "weights_bytes": ".models.preflight",
    "cpu_blas": ".ops.blas",
    "LaunchError": ".distributed.launch",
    "Ranks": ".distributed.launch",
    "command": ".distributed.launch",
    "first_host_is_here": ".distributed.launch",
    "hosts": ".distributed.launch",
    "default_kwargs": ".prompting.template_flags",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(where, __package__), name)
    globals()[name] = value  # the next lookup is a plain global
    return value

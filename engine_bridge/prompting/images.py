"""A prompt's images as the model sees them: each image's pixels and where its tokens sit,
and what the model needs beside the keyed token list. `vision/prompt.py` builds them;
rendering (`render.py`) carries them on a RenderedPrompt."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class PreparedImage:
    """One image after preprocessing, and where its tokens sit in the prompt."""

    digest: bytes
    pixel_values: np.ndarray
    grid_thw: tuple[int, int, int]
    n_tokens: int
    # Width and height as sent, for the pixel limit on a later request with the same bytes.
    size: tuple[int, int] = (0, 0)
    start: int = 0

    @property
    def end(self) -> int:
        return self.start + self.n_tokens


@dataclass(slots=True)
class VisionPrompt:
    """What the model needs beside the keyed token list: real ids, images, positions."""

    model_tokens: list[int]
    images: list[PreparedImage]
    # Multimodal RoPE positions, (3, n): time, height and width index of every token.
    positions: np.ndarray
    # Decode positions are the cache offset plus this (negative once an image is in).
    rope_delta: int
    # Whose request: features are cached per tenant, as blocks are.
    tenant: str = "default"

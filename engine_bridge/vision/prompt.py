"""Images in a prompt: decode and preprocess them, expand their tokens, key and place them.

A chat template renders each image as one `<|image_pad|>`; the model needs one pad per
merged patch. The cache must see which image those tokens stand for, so in the prompt's
token list (what every tier hashes, compares and stores) the image's tokens are replaced
by ids derived from the image's digest, outside any vocabulary: the block that holds them
hashes differently for a different image, and so does every block after it, which is what
vLLM's ("mm", digest, offset) extra keys give (SGLang's radix cache does the same with
digest-derived pad values). The model is given the real ids, kept in `VisionPrompt`.

Nothing here imports mlx: it runs on the tokenizer threads.
"""

from __future__ import annotations

import io
import threading
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from functools import lru_cache
from hashlib import sha256
from typing import Any

import numpy as np

from ..engine_settings import VisionLimits
from ..prompting.images import PreparedImage, VisionPrompt
from ..prompting.render import RenderedPrompt
from ..types import EngineError, ImageInput, Message

EXTRA_HINT = "pip install 'mlx-prompt-cache[vision]'"
# Keyed ids lie in [2**30, 2**31): above any vocabulary, so they never equal a real id, and
# still fit the signed 32-bit arrays request records keep tokens in. Each carries 30 bits of
# its image's digest; an image has at least four tokens.
KEY_BIT = 1 << 30


class PreparedCache:
    """Preprocessed images by the SHA-256 of the bytes the client sent.

    A conversation sends its screenshot again with every turn, and decoding and resizing a
    1080p PNG costs ~300 ms of CPU here (hashing its bytes well under 1 ms), which every
    later turn would otherwise pay before the cache could even be asked.
    """

    def __init__(self, max_bytes: int = 128 << 20):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[bytes, PreparedImage] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0

    def get(self, key: bytes) -> PreparedImage | None:
        with self._lock:
            found = self._entries.get(key)
            if found is None:
                return None
            self._entries.move_to_end(key)
            self.hits += 1
        # A copy: expand() sets where the image sits in this request's prompt.
        return replace(found, start=0)

    def put(self, key: bytes, image: PreparedImage) -> None:
        with self._lock:
            if key in self._entries:
                return
            self._entries[key] = image
            self._bytes += image.pixel_values.nbytes
            while self._bytes > self.max_bytes and len(self._entries) > 1:
                _, old = self._entries.popitem(last=False)
                self._bytes -= old.pixel_values.nbytes

    def stats(self) -> dict[str, int]:
        """What /v1/cache/stats shows under `vision` (bytes are the pixel tensors held)."""
        with self._lock:
            return {
                "prepared_entries": len(self._entries),
                "prepared_bytes": self._bytes,
                "prepared_hits": self.hits,
            }


@dataclass(frozen=True, slots=True)
class VisionSpec:
    """What prompt preparation needs from a loaded vision model."""

    image_token_id: int
    vision_start_token_id: int
    merge_size: int
    image_processor: Any
    prepared: PreparedCache = field(default_factory=PreparedCache, compare=False, repr=False)
    # The vision tower's dtype: pixels are kept rounded to it, as the tower would round
    # them, so a bf16 model's memo holds half the bytes (a 1080p screenshot: ~25 MB, not 50).
    pixel_dtype: str = "float32"


def images_of(messages: list[Message] | None) -> list[ImageInput]:
    """The request's images in the order the template renders them."""
    return [p for m in messages or () for p in (m.parts or ()) if isinstance(p, ImageInput)]


# Model types whose positions and merge rule `rope_positions` implements.
# Qwen3.5 (hybrid: Gated DeltaNet and attention layers) places still images as Qwen2-VL does.
SUPPORTED_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_5")


def vision_status(config: dict[str, Any]) -> str:
    """Whether a model (by its config.json) can see here: yes, no, or why not."""
    if not isinstance(config.get("vision_config"), dict):
        return "no"
    if config.get("model_type") not in SUPPORTED_TYPES:
        return "unsupported"
    return "yes" if available() else "needs [vision]"


@lru_cache(maxsize=1)
def available() -> bool:
    """Whether the vision extra (mlx-vlm) is installed and imports."""
    try:
        import mlx_vlm  # noqa: F401
    except ImportError:
        return False
    return True


def check_model(loaded: Any, images: list[ImageInput]) -> None:
    """A 400 naming the first image when `loaded` (a LoadedModel) cannot see it."""
    if loaded.vision is not None:
        return
    where = images[0].field
    kind = loaded.config.get("model_type")
    if not loaded.has_vision_tower:
        why = f"model {loaded.id!r} cannot see images: it has no vision tower"
    elif not available():
        why = (
            f"model {loaded.id!r} has a vision tower, but it runs text-only here because "
            f"the vision extra is not installed ({EXTRA_HINT})"
        )
    else:
        why = f"model {loaded.id!r} has a vision tower of type {kind!r}, which is not supported yet"
    raise EngineError(f"{where}: {why}", field=where)


def check_count(images: list[ImageInput], limits: VisionLimits) -> None:
    if len(images) > limits.max_images:
        extra = images[limits.max_images]
        raise EngineError(
            f"{extra.field}: the request has {len(images)} images, more than the "
            f"{limits.max_images} allowed ([vision] max_images)",
            field=extra.field,
        )


def preprocess(image: ImageInput, spec: VisionSpec, limits: VisionLimits) -> PreparedImage:
    """Decode, check and preprocess one image; its digest is of the preprocessed pixels, so
    the same picture re-encoded (another PNG compressor, JPEG metadata) still hits."""
    from PIL import Image, UnidentifiedImageError

    where = image.field
    if len(image.data) > limits.max_image_bytes:
        raise EngineError(
            f"{where}: the image is {len(image.data)} bytes, more than the "
            f"{limits.max_image_bytes} allowed ([vision] max_image_size)",
            field=where,
            status=413,
        )
    key = sha256(image.data).digest()
    known = spec.prepared.get(key)
    if known is not None:
        _check_pixels(known.size, where, limits)
        return known
    try:
        with Image.open(io.BytesIO(image.data)) as img:
            size = img.size
            _check_pixels(size, where, limits)
            rgb = img.convert("RGB")
    except EngineError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise EngineError(f"{where}: not a decodable image ({e})", field=where) from None
    out = spec.image_processor(images=[rgb])
    pixels = np.ascontiguousarray(np.asarray(out["pixel_values"], dtype=np.float32))
    grid = tuple(int(x) for x in np.asarray(out["image_grid_thw"]).reshape(-1)[:3])
    n_tokens = grid[0] * grid[1] * grid[2] // spec.merge_size**2
    h = sha256(b"mlx-prompt-cache/image/v1\0")
    h.update(np.asarray(grid, dtype="<u4").tobytes())
    h.update(pixels.astype("<f4", copy=False).tobytes())
    pixels = narrow(pixels, spec.pixel_dtype)
    prepared = PreparedImage(h.digest(), pixels, grid, n_tokens, size)  # type: ignore[arg-type]
    spec.prepared.put(key, prepared)
    return replace(prepared)


def narrow(pixels: np.ndarray, dtype: str) -> np.ndarray:
    """float32 `pixels` rounded to nearest-even in `dtype`; bfloat16 as its bits (uint16),
    which numpy has no type for."""
    if dtype == "float16":
        return pixels.astype(np.float16)
    if dtype == "bfloat16":
        bits = pixels.view(np.uint32)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return pixels


def _check_pixels(size: tuple[int, int], where: str, limits: VisionLimits) -> None:
    width, height = size
    if width * height > limits.max_image_pixels:
        raise EngineError(
            f"{where}: the image is {width}x{height} pixels, more than the "
            f"{limits.max_image_pixels} allowed ([vision] max_image_pixels)",
            field=where,
            status=413,
        )


def keyed_ids(digest: bytes, n: int) -> list[int]:
    """The ids the cache sees for an image's `n` tokens: each from the digest and its index."""
    out = []
    for j in range(n):
        word = int.from_bytes(sha256(digest + j.to_bytes(4, "little")).digest()[:4], "little")
        out.append(KEY_BIT | (word & (KEY_BIT - 1)))
    return out


def expand(
    tokens: list[int], message_starts: list[int], images: list[PreparedImage], spec: VisionSpec
) -> tuple[list[int], list[int], VisionPrompt]:
    """Replace each rendered image pad with its image's tokens.

    Returns the keyed token list, the message starts shifted past the inserted tokens, and
    the `VisionPrompt` the model runs on.
    """
    pads = [i for i, t in enumerate(tokens) if t == spec.image_token_id]
    if len(pads) != len(images):
        raise EngineError(
            f"the chat template rendered {len(pads)} image placeholders for {len(images)} images",
            field="messages",
        )
    keyed: list[int] = []
    real: list[int] = []
    last = 0
    for pad, image in zip(pads, images, strict=True):
        keyed += tokens[last:pad]
        real += tokens[last:pad]
        image.start = len(keyed)
        keyed += keyed_ids(image.digest, image.n_tokens)
        real += [spec.image_token_id] * image.n_tokens
        last = pad + 1
    keyed += tokens[last:]
    real += tokens[last:]
    # A message start moves by the tokens inserted before it.
    starts = [
        s + sum(img.n_tokens - 1 for pad, img in zip(pads, images, strict=True) if pad < s)
        for s in message_starts
    ]
    assert real[-1] != spec.image_token_id, "the prompt ends inside an image"
    positions, delta = rope_positions(real, images, spec.merge_size)
    return keyed, starts, VisionPrompt(real, images, positions, delta)


def rope_positions(
    tokens: list[int], images: list[PreparedImage], merge_size: int
) -> tuple[np.ndarray, int]:
    """Qwen-VL's multimodal RoPE positions (mlx-vlm's `get_rope_index`, without mlx).

    Text advances all three indices together; an image's tokens get its (t, h, w) grid
    offset from where the text before it stopped, and the text after resumes one past the
    largest. So positions depend only on the tokens and grids, never on where a cached
    prefix ends.
    """
    n = len(tokens)
    pos = np.empty((3, n), dtype=np.int64)
    cursor = 0  # next token index to place
    next_pos = 0  # position the next text token gets
    for image in images:
        text_len = image.start - cursor
        pos[:, cursor : image.start] = np.arange(next_pos, next_pos + text_len)
        next_pos += text_len
        t, h, w = image.grid_thw
        gh, gw = h // merge_size, w // merge_size
        ti = np.repeat(np.arange(t), gh * gw)
        hi = np.tile(np.repeat(np.arange(gh), gw), t)
        wi = np.tile(np.arange(gw), t * gh)
        block = np.stack([ti, hi, wi]) + next_pos
        assert block.shape[1] == image.n_tokens, (block.shape, image.n_tokens)
        pos[:, image.start : image.end] = block
        next_pos = int(block.max()) + 1
        cursor = image.end
    pos[:, cursor:] = np.arange(next_pos, next_pos + n - cursor)
    delta = int(pos.max()) + 1 - n if n else 0
    return pos, delta


def attach(
    prompt: RenderedPrompt,
    images: list[ImageInput],
    spec: VisionSpec,
    limits: VisionLimits,
    tenant: str = "default",
) -> RenderedPrompt:
    """`prompt` with its images preprocessed and their tokens in place."""
    prepared = [preprocess(image, spec, limits) for image in images]
    keyed, starts, vision = expand(prompt.tokens, prompt.message_starts, prepared, spec)
    vision = replace(vision, tenant=tenant)
    opens, question = prompt.reply_opens_at, prompt.question_at
    grown = len(keyed) - len(prompt.tokens)
    if opens is not None:  # the generation prompt comes after every image
        opens += grown
    if question is not None:  # a question's text with no images of its own comes after all
        question += grown
    return replace(
        prompt,
        tokens=keyed,
        message_starts=starts,
        vision=vision,
        reply_opens_at=opens,
        question_at=question,
    )

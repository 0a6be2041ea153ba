"""mlx-lm cache objects ⇄ per-block tensors and checkpoints, and those ⇄ host tensors.

`caches` knows mlx-lm's cache classes (with `batch`, their batch forms, and `rollback`,
going back after a speculative verify pass); `payloads` are what the cache manager stores
(opaque to it beyond `nbytes`); `host` converts them for the SSD tier.
"""

# The one door to mlx-lm's cache classes: the rest of the engine imports them from here,
# so a new mlx-lm version is a change in kv/ (tests/ops/test_layout.py checks it).
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache

from engine_bridge.kv.batch import Batch, batch_blocker, live_nbytes
from engine_bridge.kv.caches import (
    CacheKind,
    Kind,
    Layout,
    Slot,
    UnsupportedCacheError,
    extract_blocks,
    extract_checkpoint,
    layout,
    quantize_block,
    restore,
)
from engine_bridge.kv.host import (
    FORMAT,
    HostCodec,
    PayloadFormatError,
    payload_from_host,
    payload_to_host,
    tensor_from_host,
    tensor_to_host,
)
from engine_bridge.kv.payloads import (
    ArraysState,
    BlockPayload,
    CheckpointPayload,
    DenseKV,
    PagedKV,
    Payload,
    QuantKV,
    RotatingState,
    Snapshot,
)
from engine_bridge.kv.rollback import Rewind, can_rewind

__all__ = [
    "FORMAT",
    "ArraysCache",
    "ArraysState",
    "Batch",
    "BlockPayload",
    "CacheKind",
    "CheckpointPayload",
    "DenseKV",
    "HostCodec",
    "KVCache",
    "Kind",
    "Layout",
    "PagedKV",
    "Payload",
    "PayloadFormatError",
    "QuantKV",
    "Rewind",
    "RotatingState",
    "Slot",
    "Snapshot",
    "UnsupportedCacheError",
    "batch_blocker",
    "can_rewind",
    "extract_blocks",
    "extract_checkpoint",
    "layout",
    "live_nbytes",
    "make_prompt_cache",
    "payload_from_host",
    "payload_to_host",
    "quantize_block",
    "restore",
    "tensor_from_host",
    "tensor_to_host",
]

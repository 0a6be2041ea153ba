"""mlx-lm cache objects ⇄ per-block tensors and checkpoints, and those ⇄ host tensors.

`caches` knows mlx-lm's cache classes (with `batch`, their batch forms, and `rollback`,
going back after a speculative verify pass); `payloads` are what the cache manager stores
(opaque to it beyond `nbytes`); `host` converts them for the SSD tier.
"""

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
    "ArraysState",
    "Batch",
    "BlockPayload",
    "CacheKind",
    "CheckpointPayload",
    "DenseKV",
    "HostCodec",
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
    "payload_from_host",
    "payload_to_host",
    "quantize_block",
    "restore",
    "tensor_from_host",
    "tensor_to_host",
]

"""Host-side tensors: plain bytes with a dtype and shape, the currency between RAM and SSD.

The SSD writer thread only ever sees these, never lazy MLX graphs: the caller converts
(and so evaluates) on its own thread before enqueueing.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

# safetensors dtype codes and their element sizes in bytes.
DTYPE_SIZES: dict[str, int] = {
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "U8": 1,
    "I8": 1,
    "U16": 2,
    "I16": 2,
    "I64": 8,
    "U64": 8,
    "F64": 8,
    "BOOL": 1,
}


@dataclass(frozen=True, slots=True)
class HostTensor:
    """A contiguous, row-major tensor in host memory, dtype as a safetensors code."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes | memoryview

    def __post_init__(self) -> None:
        assert self.dtype in DTYPE_SIZES, f"unknown dtype {self.dtype!r}"
        expected = prod(self.shape) * DTYPE_SIZES[self.dtype]
        assert self.nbytes == expected, (
            f"tensor data is {self.nbytes} bytes, shape {self.shape} {self.dtype} needs {expected}"
        )

    @property
    def nbytes(self) -> int:
        return self.data.nbytes if isinstance(self.data, memoryview) else len(self.data)

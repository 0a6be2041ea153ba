"""Which BLAS MLX's CPU backend multiplies with, found without importing mlx.

On Linux the `mlx[cpu]` wheel bundles the netlib reference BLAS (`mlx_cpu.libs/libblas-*`).
Its sgemm is a plain triple loop: a matmul of n rows costs about n times one row, where an
optimized BLAS, like the GPU on a Mac, costs about the same for 1 to 16 rows. Measured on a
2-core x86 machine, a 9-row 1024 x 2816 float32 matmul took 22.7 ms against 2.5 ms for one
row with the bundled BLAS, and 3.1 ms against 2.5 ms with OpenBLAS; a demo model prefilled
2-5x faster. So on that BLAS prefill is slow and a speculative verify pass gains little.

Preloading a system OpenBLAS (`LD_PRELOAD`) replaces its symbols: libmlx looks up
`cblas_sgemm` by name and takes the first library that defines it. On macOS MLX uses
Accelerate and Metal, and nothing here applies.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path

# Where distributions put OpenBLAS's BLAS (its cblas_* and Fortran symbols under their
# standard names): Debian/Ubuntu's alternatives, then Fedora/Arch's library.
OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/x86_64-linux-gnu/openblas-openmp/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-openmp/libblas.so.3",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)
OPENBLAS_INSTALL = "apt-get install libopenblas0-pthread (Debian, Ubuntu) or dnf install openblas"
_OPTIMIZED = ("openblas", "mkl", "blis", "atlas")


@dataclass(frozen=True, slots=True)
class CpuBlas:
    """What MLX's CPU backend would multiply with in this process."""

    name: str  # "reference (bundled with mlx[cpu])", "OpenBLAS (preloaded)", "Accelerate", ...
    reference: bool  # the slow netlib BLAS, with nothing preloaded over it
    bundled: Path | None  # the wheel's own BLAS, where it ships one
    preloaded: str | None  # an optimized BLAS named in LD_PRELOAD
    openblas: Path | None  # a system OpenBLAS that could be preloaded

    def advice(self) -> str | None:
        """One line on what to do, where MLX is on the reference BLAS; None otherwise."""
        if not self.reference:
            return None
        how = (
            f"start with LD_PRELOAD={self.openblas}"
            if self.openblas is not None
            else f"install OpenBLAS ({OPENBLAS_INSTALL}) and preload it with LD_PRELOAD"
        )
        return (
            "MLX's CPU backend here uses the reference BLAS its mlx[cpu] wheel bundles, where a "
            "matmul of n rows costs n times one row: prefill runs 2-5x slower and speculative "
            f"decoding gains little; {how}"
        )


def bundled_blas() -> Path | None:
    """The BLAS the mlx[cpu] wheel ships beside libmlx (Linux), found from mlx's spec."""
    try:
        spec = importlib.util.find_spec("mlx")
    except ValueError:
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    site = Path(next(iter(spec.submodule_search_locations))).parent
    found = sorted((site / "mlx_cpu.libs").glob("libblas*.so*"))
    return found[0] if found else None


def preloaded_blas(env: dict[str, str] | None = None) -> str | None:
    """The optimized BLAS that LD_PRELOAD names, if any."""
    preload = (os.environ if env is None else env).get("LD_PRELOAD", "")
    for lib in preload.replace(":", " ").split():
        if any(k in lib.lower() for k in _OPTIMIZED):
            return lib
    return None


def system_openblas() -> Path | None:
    """The first OpenBLAS present on this machine that could be preloaded."""
    return next((Path(p) for p in OPENBLAS_CANDIDATES if Path(p).is_file()), None)


def cpu_blas(env: dict[str, str] | None = None) -> CpuBlas:
    """What MLX's CPU backend multiplies with, from the files and the environment."""
    preloaded = preloaded_blas(env)
    bundled = bundled_blas() if sys.platform.startswith("linux") else None
    if sys.platform == "darwin":
        name = "Accelerate"
    elif preloaded is not None:
        name = f"{Path(preloaded).name} (preloaded)"
    elif bundled is not None:
        name = "reference (bundled with mlx[cpu])"
    else:
        name = "the system's"
    reference = bundled is not None and preloaded is None
    return CpuBlas(name, reference, bundled, preloaded, system_openblas())


def mapped_blas() -> list[str]:
    """The BLAS libraries mapped into this process now (Linux; after mlx is imported): with
    a preload, both it and the bundled one are mapped, and the preloaded one's symbols win."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    seen: list[str] = []
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)  # address, perms, offset, device, inode[, path]
        path = fields[5] if len(fields) == 6 else ""
        name = Path(path).name.lower()
        if path.startswith("/") and ("blas" in name or "mkl" in name) and path not in seen:
            seen.append(path)
    return seen


def openblas_env(lib: Path, env: dict[str, str] | None = None) -> dict[str, str]:
    """An environment that preloads `lib` for a child process. One OpenBLAS thread: MLX runs
    its own CPU stream, and on a small machine OpenBLAS's spinning threads contend with it."""
    out = dict(os.environ if env is None else env)
    out["LD_PRELOAD"] = " ".join(p for p in (str(lib), out.get("LD_PRELOAD", "")) if p)
    out.setdefault("OPENBLAS_NUM_THREADS", "1")
    return out

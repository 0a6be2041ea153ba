"""What a scenario needs beyond the base install, checked before it starts.

A scenario whose program or package is missing is skipped with the command that installs
it, so a machine without Redis or mlx-vlm still runs, and passes, everything else. The
checks find a package without importing it: an absent one must not be imported at all,
and importing mlx-vlm alone takes seconds.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Prerequisite:
    """A program on PATH or an importable module, and how to install it."""

    missing: str  # what the skip reason says is absent
    install: str
    program: str | None = None
    module: str | None = None
    # Look for `program` beside this Python first: a package's script sits in its venv's
    # bin/, which is not on PATH when the bench runs as .venv/bin/python.
    beside_python: bool = False

    def found(self) -> bool:
        if self.program is not None:
            return self.where() is not None
        assert self.module is not None, self
        return importable(self.module)

    def where(self) -> Path | None:
        """Where `program` is, or None."""
        assert self.program is not None, self
        beside = Path(sys.executable).with_name(self.program)
        if self.beside_python and beside.is_file():
            return beside
        found = shutil.which(self.program)
        return Path(found) if found else None

    @property
    def reason(self) -> str:
        return f"{self.missing}; {self.install}"


def importable(module: str) -> bool:
    """Whether `import module` would find it; `sys.modules[module] = None` reads as absent."""
    try:
        return importlib.util.find_spec(module) is not None
    except ValueError:  # in sys.modules without a __spec__ (a stub): it imports
        return True


REDIS_SERVER = Prerequisite(
    "redis-server not found",
    "install it with `brew install redis` (macOS) or `apt-get install redis-server`",
    program="redis-server",
)
REDIS = Prerequisite(
    "redis (the Python package) missing", "pip install 'mlx-prompt-cache[shared]'", module="redis"
)
MLX_VLM = Prerequisite(
    "mlx-vlm missing", "pip install 'mlx-prompt-cache[vision]'", module="mlx_vlm"
)
MLX_LAUNCH = Prerequisite(
    "mlx.launch (MLX's launcher of distributed programs) not found",
    "it ships with mlx: pip install --force-reinstall mlx",
    program="mlx.launch",
    beside_python=True,
)
MATPLOTLIB = Prerequisite(
    "matplotlib missing", "pip install 'mlx-prompt-cache[bench]'", module="matplotlib"
)

# Scenarios not named here need only the base install. Plots need MATPLOTLIB (plots.py).
NEEDS: dict[str, tuple[Prerequisite, ...]] = {
    "shared": (REDIS_SERVER, REDIS),
    "vision": (MLX_VLM,),
    "distributed": (MLX_LAUNCH,),
}


def skip_reason(scenario: str) -> str | None:
    """Why `scenario` cannot run here, naming what to install; None when it can."""
    missing = [p.reason for p in NEEDS.get(scenario, ()) if not p.found()]
    return ". ".join(missing) or None

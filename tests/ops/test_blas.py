"""Which BLAS MLX's CPU backend uses (engine_bridge/ops/blas.py): the reference BLAS the
mlx[cpu] wheel bundles is found from its files, a preload is read from LD_PRELOAD, and a
real child process with a system OpenBLAS preloaded maps it and multiplies to the same
numbers as the bundled one."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engine_bridge.ops import blas
from tests.conftest import REPO

linux_cpu = pytest.mark.skipif(
    blas.bundled_blas() is None, reason="mlx here is not the mlx[cpu] wheel with its own BLAS"
)


@linux_cpu
def test_the_bundled_reference_blas_is_named_with_what_to_do():
    found = blas.cpu_blas({})
    assert found.reference and found.preloaded is None
    assert found.name == "reference (bundled with mlx[cpu])"
    assert found.bundled is not None and found.bundled.name.startswith("libblas")
    advice = found.advice()
    assert advice is not None and "n times one row" in advice
    if found.openblas is not None:
        assert f"LD_PRELOAD={found.openblas}" in advice
    else:
        assert blas.OPENBLAS_INSTALL in advice


def test_an_optimized_blas_in_ld_preload_is_no_longer_the_reference():
    env = {"LD_PRELOAD": "/opt/x/libjemalloc.so /usr/lib64/libopenblas.so.0"}
    found = blas.cpu_blas(env)
    assert found.preloaded == "/usr/lib64/libopenblas.so.0" and not found.reference
    assert found.advice() is None
    if sys.platform.startswith("linux"):
        assert found.name == "libopenblas.so.0 (preloaded)"
    assert blas.preloaded_blas({"LD_PRELOAD": "/opt/x/libjemalloc.so"}) is None
    out = blas.openblas_env(blas.Path("/l/libblas.so.3"), {"LD_PRELOAD": "/a.so", "PATH": "/b"})
    assert out == {"LD_PRELOAD": "/l/libblas.so.3 /a.so", "PATH": "/b", "OPENBLAS_NUM_THREADS": "1"}


_CHILD = """
import json, sys
import mlx.core as mx
from engine_bridge.ops.blas import cpu_blas, mapped_blas
mx.random.seed(3)
a, b = mx.random.normal((9, 256)), mx.random.normal((256, 320))
y = (a @ b).tolist()
print(json.dumps({"mapped": mapped_blas(), "name": cpu_blas().name, "y": y}))
"""


def _child(env=None) -> dict:
    done = subprocess.run([sys.executable, "-c", _CHILD], cwd=REPO, env=env, text=True,
                          capture_output=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@linux_cpu
def test_a_preloaded_openblas_is_mapped_and_multiplies_alike():
    lib = blas.system_openblas()
    if lib is None:
        pytest.skip(f"no system OpenBLAS; {blas.OPENBLAS_INSTALL}")
    plain, preloaded = _child(), _child(blas.openblas_env(lib))
    assert not any("openblas" in p.lower() for p in plain["mapped"]), plain["mapped"]
    assert any(p.startswith(str(lib.parent)) for p in preloaded["mapped"]), preloaded["mapped"]
    assert plain["name"] == "reference (bundled with mlx[cpu])"
    assert preloaded["name"] == f"{lib.name} (preloaded)"
    worst = max(abs(x - y) for r1, r2 in zip(plain["y"], preloaded["y"], strict=True)
                for x, y in zip(r1, r2, strict=True))  # fmt: skip
    assert worst < 1e-3, worst  # float32 sums of 256 products, in another order

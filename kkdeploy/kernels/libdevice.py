"""CUDA's own libdevice, for the Triton launches whose math must be ATen's: which file, found once.

Why: ATen's GELU calls ``erff``, which nvcc took from the CUDA toolkit's ``nvvm/libdevice/libdevice.10.bc`` when
torch was built. Triton links its own bundled copy by default, and the two differ in ``erff`` on 151 float16 inputs
(docs/fused-linear.md). Triton's per-launch ``extern_libs`` option links CUDA's file for that launch alone, so every
other Triton kernel of the process keeps the library it was proven with. A launch that links it is proven with it
(the file's bytes are part of its proofs' environment key).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Optional

from kkdeploy.errors import KKError

#: overrides the lookup: the path of CUDA's nvvm/libdevice/libdevice.10.bc
LIBDEVICE_ENV = "KKDEPLOY_CUDA_LIBDEVICE"


def cuda_libdevice() -> Optional[str]:
    """The path of CUDA's libdevice.10.bc here ($KKDEPLOY_CUDA_LIBDEVICE, $CUDA_HOME, /usr/local/cuda*), or None."""
    import glob

    env = os.environ.get(LIBDEVICE_ENV)
    if env:
        if not os.path.isfile(env):
            raise KKError(f"{LIBDEVICE_ENV}={env}: no such file (point it at CUDA's nvvm/libdevice/libdevice.10.bc)")
        return env
    roots = [os.environ.get("CUDA_HOME", ""), os.environ.get("CUDA_PATH", ""), "/usr/local/cuda"]
    roots += sorted(glob.glob("/usr/local/cuda-*"), reverse=True)
    for root in filter(None, roots):
        path = os.path.join(root, "nvvm", "libdevice", "libdevice.10.bc")
        if os.path.isfile(path):
            return path
    return None


@functools.lru_cache(maxsize=8)
def _found(override: Optional[str], cuda_home: Optional[str], cuda_path: Optional[str]) -> Optional[str]:
    return cuda_libdevice()


def gelu_libdevice() -> Optional[str]:
    """CUDA's libdevice for the GEMM launches with a GELU part (looked up once per setting of the variables the
    lookup reads: the op asks at every launch), or None where there is none (those launches then link Triton's copy,
    and their proofs say whether that is bit-identical)."""
    return _found(os.environ.get(LIBDEVICE_ENV), os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"))


def libdevice_sources() -> tuple[Path, ...]:
    """The file ``gelu_libdevice`` links, as a source of the proofs' environment key (none where there is none).
    Asked at every uncaptured GEMM call (through the proofs' lookup): the answer is made once per path."""
    return _sources(gelu_libdevice())


@functools.lru_cache(maxsize=8)
def _sources(found: Optional[str]) -> tuple[Path, ...]:
    return (Path(found),) if found else ()

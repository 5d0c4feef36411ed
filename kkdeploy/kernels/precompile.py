"""Compile many Triton launches side by side: the proof step's one-off cost, paid on a thread pool.

Why: a build's proof step runs every launch variant of every kernel op once before it compares and times them,
and on a fresh machine that first run is Triton's compile (on shape 6, H200: 15 s of proofs, mostly compiles of
the attention's and the GEMMs' variants). Triton compiles a launch in stages, several of which run outside Python's
GIL (LLVM's code generation, ptxas in a child process), and Triton's ``AsyncCompileMode`` hands each compile to an
executor. So ``parallel_compiles()`` turns every launch made through ``launch`` inside it into a compile-only
warm-up on a thread pool; on exit every compile has finished and sits in Triton's caches, and the real runs that
follow hit them. No Triton kernel runs inside (a launch that is not Triton's, such as the rows LayerNorm's CUDA
kernel, runs once as usual), and no result computed there is used.

* ``launch(kernel, grid, *args, **kwargs)``: ``kernel[grid](...)``, or only its compile inside ``parallel_compiles``.
* ``parallel_compiles(workers)``: the context; a no-op under the interpreter (``TRITON_INTERPRET=1``, no compiles).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from concurrent.futures import ThreadPoolExecutor

_COMPILE_ONLY = contextvars.ContextVar("kkdeploy_compile_only", default=False)
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
#: threads compiling at once by default: enough to overlap the stages that leave the GIL
DEFAULT_WORKERS = 8


def compile_only() -> bool:
    """Whether launches are compiled only (inside ``parallel_compiles``)."""
    return _COMPILE_ONLY.get()


def launch(kernel, grid, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)``; inside ``parallel_compiles``, its compile only, handed to the pool."""
    if _COMPILE_ONLY.get():
        return kernel.warmup(*args, grid=grid, **kwargs)
    return kernel[grid](*args, **kwargs)


@contextlib.contextmanager
def parallel_compiles(workers: int = DEFAULT_WORKERS):
    """Inside: launches through ``launch`` compile only, ``workers`` at a time; on exit every compile is done (an
    error in one is left for the real run to meet and record)."""
    if INTERPRET or workers < 1:
        yield
        return
    import triton

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kkdeploy-compile") as pool:
        with triton.AsyncCompileMode(pool, ignore_errors=True):
            token = _COMPILE_ONLY.set(True)
            try:
                yield
            finally:
                _COMPILE_ONLY.reset(token)

"""The build's compiles, started ahead in child processes (``engines.compile_warmup``) while the build proves kernels.

Why: on a GPU machine a default build compiles five ``torch.compile`` candidates one after another; on shape 6 that
was most of a 78 s build. Children compile them side by side into Inductor's shared caches while the build runs the
kernel proofs its our-kernel candidates need (those proofs decide the graph of our GEMMs, so that candidate's child
starts once they are on disk); the build's own compile of each candidate is then a cache hit. Off a GPU (or with
``--compile-workers 0``) nothing changes.
"""

from __future__ import annotations

from pathlib import Path

from engines import BuildContext


def torch_compile_candidates(request, ctx: BuildContext) -> list[str]:
    """The ``torch.compile`` candidates this build will compile that a child can compile first, in build order."""
    from engines import get_backend
    from engines.torch_compile import BACKEND, warmable

    from ..errors import KKError
    from .build import backend_choice

    names: list[str] = []
    for user_name in request.backends:
        key, only, exact = backend_choice(user_name)
        if key != BACKEND.name:
            continue
        backend = get_backend(key)
        if backend.unavailable_reason(request.device, request.dtype):
            return []
        saved, ctx.candidate_filter = ctx.candidate_filter, None if only is None else tuple(only)
        try:
            chosen = exact if exact is not None else backend.candidates(ctx)
        except KKError:  # the build itself reports a bad choice
            chosen = []
        finally:
            ctx.candidate_filter = saved
        names += [n for n in chosen if warmable(n) and n not in names]
    return names


def start_compile_warmup(request, ctx: BuildContext, weights: Path, bar):
    """Start the children (``CompileWarmup``) for this build's candidates and prove the kernels the proof-dependent
    ones need meanwhile; None where no child would help (the CPU, fewer than two candidates, no workers)."""
    from engines.compile_warmup import CompileWarmup, default_workers
    from engines.torch_compile import kernel_kinds, needs_proofs_to_compile

    names = torch_compile_candidates(request, ctx)
    workers = request.compile_workers
    if workers is None:
        workers = default_workers(request.device, len(names))
    if workers < 1 or not names:
        return None
    warmup = CompileWarmup(weights, request.config, request.dtype, request.device, tf32=bool(request.tf32),
                           workers=workers)
    later = [n for n in names if needs_proofs_to_compile(n)]
    warmup.start([n for n in names if n not in later])
    if later:
        from kkdeploy.kernels.model_proofs import prove_model_kernels

        kinds = sorted({kind for n in names for kind in kernel_kinds(n)})
        bar.describe(f"prove kernels ({len(names) - len(later)} candidates compiling in child processes)")
        try:
            proofs = prove_model_kernels(ctx.model, request.config, request.dtype, request.device, kinds)
        except BaseException:
            warmup.close()
            raise
        warmup.proof_seconds = proofs.seconds
        warmup.start(later)
    return warmup

"""The build's first compile, started in a child process (``engines.compile_warmup``) while the build proves kernels.

Why: on a GPU machine a default build compiles five ``torch.compile`` candidates, the first one costly and the rest
cheap (they share its Triton kernels), and proves the kernels of its our-kernel candidates. Done one after the other
on shape 6 that was 9.8 s of compiling and 15 s of proofs. Here the proofs of every candidate run first, while a
child compiles the first candidate into Inductor's shared caches; the build's own compiles then hit them. Off a GPU
(or with ``--compile-workers 0``) the build runs as before.
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
    """Start children (``CompileWarmup``, ``workers`` of them: one by default) for this build's first candidates,
    then prove the kernels of its our-kernel candidates meanwhile; None where no child would help (the CPU, fewer
    than two candidates, ``--compile-workers 0``)."""
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
    kinds = sorted({kind for n in names for kind in kernel_kinds(n)})
    if kinds:  # the proofs every our-kernel candidate will look up, made now, beside the child's compile
        from kkdeploy.kernels.model_proofs import prove_model_kernels

        bar.describe(f"prove kernels (compiling {', '.join(warmup.records)} in a child process)")
        try:
            proofs = prove_model_kernels(ctx.model, request.config, request.dtype, request.device, kinds)
        except BaseException:
            warmup.close()
            raise
        warmup.proof_seconds = proofs.seconds
        warmup.start(later)
    return warmup

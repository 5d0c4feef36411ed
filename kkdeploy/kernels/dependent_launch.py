"""Programmatic dependent launch (PDL) for our Triton kernels: the next kernel starts while the one before drains.

Why: the launch-bound shapes (S <= 128, D <= 128) run about 25 kernels of a few microseconds each in a CUDA graph,
and much of each one's time is the gap between kernels: the launch, the first loads, the last stores' flush. On
Hopper (compute capability 9.0) a kernel launched with CUDA's programmatic stream serialization may start before the
kernel ahead of it in the stream has finished. It must then wait, with ``griddepcontrol.wait``, before it reads what
that kernel wrote; the kernel ahead says with ``griddepcontrol.launch_dependents`` when the next may start.
Inductor emits the same pair in its own kernels (``torch._inductor.config.triton.enable_pdl``), and CUDA graphs
keep the relaxed edge when they capture it.

How our kernels take it: ``_fused_linear_kernel`` and ``_faithful_attention_kernel`` have a ``PDL`` constexpr. With
it, a program waits first (before any load, so whatever any earlier kernel wrote is visible) and then lets the next
kernel launch. A program that has waited has seen every earlier kernel complete, so the next kernel, which waits in
turn, sees them complete too, whichever kernels sit between. The arithmetic is untouched: compiled for sm_90a, the
PDL form's PTX is the plain form's plus those two instructions (``ptx_difference``, checked in the tests with the
Triton the H200 runs), so a launch proven bit-identical stays bit-identical.

Use: ``with dependent_launches(True): ...`` around what captures or calls a graph; the launchers add
``launch_options()`` to every launch. Off by default: whether it is faster is the GPU's to say (a ``-pdl``
candidate, timed beside the same candidate without it).
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from typing import Optional

from .precompile import INTERPRET

_ENABLED = contextvars.ContextVar("kkdeploy_dependent_launch", default=False)
#: the compute capability from which CUDA has programmatic dependent launch (Hopper)
MIN_CAPABILITY = (9, 0)
#: the two instructions the PDL form adds (``triton.language.extra.cuda.gdc_wait`` / ``gdc_launch_dependents``)
PDL_INSTRUCTIONS = ("griddepcontrol.wait", "griddepcontrol.launch_dependents")


def enabled() -> bool:
    """Whether launches made now go out as dependent launches (inside ``dependent_launches(True)``)."""
    return _ENABLED.get()


@contextlib.contextmanager
def dependent_launches(on: bool = True):
    """Inside: our Triton kernels launch as programmatic dependent launches (``on``), or as plain launches."""
    token = _ENABLED.set(bool(on) and not INTERPRET)  # the interpreter has no grids to overlap
    try:
        yield
    finally:
        _ENABLED.reset(token)


def launch_options() -> dict:
    """The keyword arguments a launch adds: the kernels' ``PDL`` constexpr and Triton's ``launch_pdl`` option."""
    return {"PDL": True, "launch_pdl": True} if _ENABLED.get() else {}


def refusal(device) -> Optional[str]:
    """Why dependent launches cannot run on ``device`` (a one-line reason), or None."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return f"programmatic dependent launch is a CUDA feature (device {device.type})"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        return (f"programmatic dependent launch needs compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} "
                f"(Hopper) or later; this GPU is {capability[0]}.{capability[1]}")
    return triton_refusal()


def triton_refusal() -> Optional[str]:
    """Why this Triton cannot emit dependent launches, or None."""
    try:
        import triton.language.extra.cuda as cuda_extra
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError as exc:
        return f"Triton is not importable ({exc})"
    if not hasattr(cuda_extra, "gdc_wait") or "launch_pdl" not in CUDAOptions.__dataclass_fields__:
        return "this Triton has no programmatic dependent launch (gdc_wait and launch_pdl came in Triton 3.4)"
    return None


def inductor_options() -> dict:
    """Inductor's own switch for its kernels, where this torch has it (torch.compile options)."""
    import torch._inductor.config as inductor_config

    return {"triton.enable_pdl": True} if hasattr(inductor_config.triton, "enable_pdl") else {}


_COMMENT = re.compile(r"//.*$")
_SKIPPED = (".", "{", "}", "$", "@%")  # directives, braces, labels; predicated lines keep their opcode below
#: opcodes whose order is the arithmetic: floating point, tensor-core MMA, conversions, special functions
_ARITHMETIC = re.compile(r"\.(f16|f16x2|bf16|bf16x2|f32|f64)\b|^(wgmma|mma|ex2|lg2|rsqrt|rcp|sqrt|div|fma)")


def opcodes(ptx: str) -> list[str]:
    """The PTX's instructions as opcodes in order ("fma.rn.f32", "wgmma.mma_async..."), without the PDL ones."""
    found = []
    for line in ptx.splitlines():
        line = _COMMENT.sub("", line).strip()
        if line.startswith("@"):  # a predicate: "@%p1 bra ..." -> "bra ..."
            line = line.split(None, 1)[1] if " " in line or "\t" in line else ""
        if not line or line.startswith(_SKIPPED) or line.endswith(":"):
            continue
        op = line.split()[0].rstrip(";")
        if op not in PDL_INSTRUCTIONS:
            found.append(op)
    return found


def arithmetic_opcodes(ptx: str) -> list[str]:
    """The floating-point, MMA and conversion instructions of ``opcodes(ptx)``, in order: what decides the bits."""
    return [op for op in opcodes(ptx) if _ARITHMETIC.search(op)]


def ptx_difference(plain: str, dependent: str) -> list[str]:
    """How the PDL form's PTX differs from the plain form's, the two PDL instructions aside: empty when both hold
    the same instructions, as many of each, and the same floating-point, MMA and conversion instructions in the
    same order (the arithmetic). Register numbers and the order of integer index arithmetic may move: inserting
    an instruction renumbers every later register, and the scheduler may interleave address computations anew."""
    from collections import Counter

    a, b = Counter(opcodes(plain)), Counter(opcodes(dependent))
    differences = [f"{op}: {a[op]} -> {b[op]}" for op in sorted(set(a) | set(b)) if a[op] != b[op]]
    for i, (x, y) in enumerate(zip(arithmetic_opcodes(plain), arithmetic_opcodes(dependent))):
        if x != y:
            differences.append(f"arithmetic instruction {i}: {x} -> {y}")
            break
    return differences

"""Which kernel a call takes, and why: the one record every kernel op's path rule returns.

``faithful_attention.select_attention_path``, ``layer_norm.layer_norm_path`` and ``fused_linear.linear_path`` each
answer with a ``KernelPath`` (their own subclass, so a manifest reader and a test can tell them apart): ``kernel`` is
``"aten"`` (the reference's own ops run: the same bits, only slower) or the name of our kernel, and ``reason`` is the
sentence a manifest records.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass
from typing import Optional


from kkdeploy.errors import KKError


@dataclass(frozen=True)
class KernelPath:
    kernel: str  # "aten", or our kernel's name ("triton", "rows")
    reason: str
    launch: Optional[str] = None  # our kernel's launch variant, as the proof chose it (None: the default, or ATen)

    @property
    def fused(self) -> bool:
        """Whether our kernel computes the call (else ATen's ops do)."""
        return self.kernel != "aten"


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """Whether Triton can be imported, without importing it (cached: asked on every CUDA call)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


def triton_refusal(device, dtype, kernel: str, otherwise: str, importable) -> Optional[str]:
    """Why the ``kernel`` (Triton code that reproduces a float16 reference op on CUDA) cannot run on ``device`` for
    ``dtype``, in one line that says what runs instead (``otherwise``), or None. Every Triton kernel module's own
    refusal asks this first, then its shape limits; each passes its own ``triton_available`` as ``importable``, the
    name its tests patch."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return f"{device.type} device: {otherwise} (CUDA-only {kernel})"
    if dtype != torch.float16:
        return f"dtype {dtype}: {otherwise} (the {kernel} reproduce the float16 reference only)"
    if not importable():
        return "triton is not importable"
    return None


def path_mode(env: str) -> str:
    """``$env`` (auto, aten or triton: a Triton kernel's path override), checked with a one-line error."""
    mode = os.environ.get(env, "auto").strip().lower() or "auto"
    if mode not in ("auto", "aten", "triton"):
        raise KKError(f"{env} must be auto, aten or triton, got {mode!r}")
    return mode


def path_from_proof(path: type, kernel: str, record, what: str, proves: str) -> KernelPath:
    """The path a proof record gives (``record``: this environment's proof of the op at this shape, or None):
    ``kernel`` with the chosen launch, else ATen with the reason. ``what`` names the op shape in words ("(M, N, K) =
    (...)"); ``proves`` says what a build proves ("its model's GEMMs")."""
    if record is None:
        return path("aten", f"no proof in this environment for {what} (a build proves {proves})")
    if not record.proven:
        return path("aten", f"proof for {what}: {record.reason}")
    return path(kernel, f"{kernel} kernel, launch {record.chosen} (proven bit-identical here for {what})",
                record.chosen)

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

import torch

from kkdeploy.errors import KKError


@dataclass(frozen=True)
class KernelPath:
    kernel: str  # "aten", or our kernel's name ("triton", "rows")
    reason: str

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


def path_mode(env: str) -> str:
    """``$env`` (auto, aten or triton: a Triton kernel's path override), checked with a one-line error."""
    mode = os.environ.get(env, "auto").strip().lower() or "auto"
    if mode not in ("auto", "aten", "triton"):
        raise KKError(f"{env} must be auto, aten or triton, got {mode!r}")
    return mode


def float16_cuda_refusal(path: type, device, mode: str, env: str, dtype: torch.dtype, off_cuda: str,
                         other_dtype: str) -> Optional[KernelPath]:
    """The first refusals of a Triton kernel's path rule (not CUDA, forced to ATen, not float16; callers check Triton),
    as a ``path`` record; None when none applies."""
    device = torch.device(device)
    if device.type != "cuda":
        return path("aten", f"{device.type} device: {off_cuda}")
    if mode == "aten":
        return path("aten", f"{env}=aten")
    if dtype != torch.float16:
        return path("aten", f"dtype {dtype}: {other_dtype}")
    return None

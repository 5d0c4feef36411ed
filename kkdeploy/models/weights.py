"""Seeded weights, weight files (safetensors or a PyTorch state dict) and the weights hash."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import torch
from torch import nn

from ..config import TransformerConfig
from ..errors import KKError, error_summary

DEFAULT_WEIGHT_SEED = 0


def init_weights(model: nn.Module, seed: int = DEFAULT_WEIGHT_SEED) -> nn.Module:
    """Deterministic on every machine: drawn in FP32 on the CPU from a private generator.

    Linear layers follow PyTorch's default bounds (U(+-1/sqrt(fan_in))); LayerNorm affine
    parameters are perturbed away from (1, 0) so an exporter that drops or swaps them is caught.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear):
                bound = 1.0 / math.sqrt(module.in_features)
                for p in (module.weight, module.bias):
                    p.copy_(torch.empty(p.shape).uniform_(-bound, bound, generator=generator))
            elif isinstance(module, nn.LayerNorm):
                module.weight.copy_(1.0 + 0.1 * torch.randn(module.weight.shape, generator=generator))
                module.bias.copy_(0.1 * torch.randn(module.bias.shape, generator=generator))
    return model


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    path = Path(path)
    if not path.is_file():
        raise KKError(f"weights file {path} does not exist; pass a .safetensors file or a torch state dict")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path))
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # corrupt or foreign file
        raise KKError(f"cannot read weights from {path}: {error_summary(exc)}") from None
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise KKError(f"{path} does not hold a state dict of tensors")
    return state


def load_weights(model: nn.Module, path: str | Path) -> nn.Module:
    """Load a weights file strictly; a mismatch names the missing and unexpected keys."""
    state = read_state_dict(path)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise KKError(
            f"weights in {path} do not fit this model: missing keys {missing[:6]}{' ...' if len(missing) > 6 else ''}, "
            f"unexpected keys {unexpected[:6]}{' ...' if len(unexpected) > 6 else ''}"
        )
    for key, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[key].shape):
            raise KKError(
                f"weights in {path}: {key} has shape {list(tensor.shape)}, the model expects "
                f"{list(expected[key].shape)}; check the shape flags"
            )
    model.load_state_dict({k: v.to(expected[k].dtype) for k, v in state.items()}, strict=True)
    return model


def weights_sha256(model_or_state) -> str:
    """Hash of names, dtypes, shapes and bytes, in sorted order: independent of the device."""
    state = model_or_state.state_dict() if isinstance(model_or_state, nn.Module) else model_or_state
    digest = hashlib.sha256()
    for key in sorted(state):
        t = state[key].detach().to("cpu").contiguous()
        digest.update(f"{key}|{t.dtype}|{list(t.shape)}|".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def build_models(config: TransformerConfig, dtype: torch.dtype, device, weights: str | Path | None = None,
                 seed: int = DEFAULT_WEIGHT_SEED, sdpa_layers: int = 1):
    """Reference and optimized models on identical weights, in inference mode."""
    from .optimized import OptimizedTransformer
    from .reference import ReferenceTransformer

    reference = ReferenceTransformer(config)
    if weights is None:
        init_weights(reference, seed)
    else:
        load_weights(reference, weights)
    optimized = OptimizedTransformer(config, sdpa_layers=sdpa_layers)
    optimized.load_state_dict(reference.state_dict(), strict=True)
    reference = reference.to(device=device, dtype=dtype).eval()
    optimized = optimized.to(device=device, dtype=dtype).eval()
    return reference, optimized

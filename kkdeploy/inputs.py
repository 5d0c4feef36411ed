"""The organizer's input generator (design.md §4) and the call-contract checks."""

from __future__ import annotations

import weakref

import torch

from .config import TransformerConfig
from .errors import KKError

DEFAULT_SEED = 1234
DEFAULT_TRIALS = 5
TIMED_SEED_OFFSET = 100000


def generate_case(
    config: TransformerConfig,
    device,
    dtype: torch.dtype,
    seed: int,
    padding_ratio: float = 0.0,
    input_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same generator, same calls, same order as the organizer's: same seed -> same tensors."""
    device = torch.device(device)
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    shape = (config.batch_size, config.seq_len, config.d_model)
    x = torch.randn(shape, generator=generator, device=device, dtype=dtype) * input_scale
    if padding_ratio <= 0:
        mask = torch.ones(config.batch_size, config.seq_len, dtype=torch.bool, device=device)
        return x, mask
    min_valid = max(1, round(config.seq_len * (1 - padding_ratio)))
    lengths = torch.randint(
        min_valid, config.seq_len + 1, (config.batch_size,), generator=generator, device=device
    )
    mask = torch.arange(config.seq_len, device=device)[None, :] < lengths[:, None]
    x = x.masked_fill(~mask[..., None], 0)
    return x, mask


def padded_case(config: TransformerConfig, device, dtype: torch.dtype, seed: int,
                padding_ratio: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``generate_case`` for a check that must take the padded route: a small batch may draw every sequence at full
    length, and then its first sequence loses its last token (its input there zeroed, as the generator zeroes
    padding)."""
    x, mask = generate_case(config, device, dtype, seed, padding_ratio=padding_ratio)
    if padding_ratio > 0 and bool(mask.all()):
        mask[0, -1] = False
        x[0, -1] = 0
    return x, mask


def check_inputs(x, valid_token_mask, d_model: int, dtype: torch.dtype, device: torch.device,
                 shape: tuple[int, int] | None = None) -> None:
    """Reject a call that breaks the model's contract with one line naming the fix."""
    if not isinstance(x, torch.Tensor):
        raise KKError(f"x must be a torch.Tensor of shape [B, S, {d_model}], got {type(x).__name__}")
    if x.dim() != 3 or x.shape[-1] != d_model:
        raise KKError(f"x must have shape [B, S, {d_model}], got {list(x.shape)}")
    if shape is not None and tuple(x.shape[:2]) != tuple(shape):
        raise KKError(
            f"x has batch/sequence {list(x.shape[:2])} but this engine was built for {list(shape)}; "
            f"build artifacts for that shape or use the PyTorch model"
        )
    if x.dtype != dtype:
        raise KKError(f"x has dtype {x.dtype} but the model runs in {dtype}; pass x.to({dtype})")
    if x.device.type != device.type or (
        device.index is not None and x.device.index is not None and x.device.index != device.index
    ):
        raise KKError(f"x is on {x.device} but the model is on {device}; move x with .to('{device}')")
    check_mask(valid_token_mask, tuple(x.shape[:2]), x.device, "x")


def check_mask(valid_token_mask, shape: tuple[int, int], device: torch.device, beside: str) -> None:
    """None, or a bool tensor of ``shape`` [B, S] on ``device`` (where ``beside``, the tensor it masks, lives)."""
    if valid_token_mask is None:
        return
    if not isinstance(valid_token_mask, torch.Tensor):
        raise KKError("valid_token_mask must be a bool torch.Tensor of shape [B, S] or None")
    if tuple(valid_token_mask.shape) != tuple(shape):
        raise KKError(
            f"valid_token_mask must have shape [B, S] = {list(shape)}, got {list(valid_token_mask.shape)}"
        )
    if valid_token_mask.dtype != torch.bool:
        raise KKError(f"valid_token_mask must have dtype torch.bool, got {valid_token_mask.dtype}; pass mask.bool()")
    if valid_token_mask.device != device:
        raise KKError(f"valid_token_mask is on {valid_token_mask.device} but {beside} is on {device}; "
                      f"put both on one device")


class AllValidMaskCache:
    """Answers "is this mask all True?" without a device sync per call.

    ``mask.all()`` synchronizes the device, so the answer is cached per tensor (by identity)
    and version counter; inference tensors have no version counter, so they are never cached.
    """

    def __init__(self):
        self._entry: tuple | None = None  # (weakref to mask, version, all_valid)

    def is_all_valid(self, mask: torch.Tensor | None) -> bool:
        if mask is None:
            return True
        if mask.is_inference():
            return bool(mask.all())
        entry = self._entry
        if entry is not None and entry[0]() is mask and entry[1] == mask._version:
            return entry[2]
        result = bool(mask.all())
        self._entry = (weakref.ref(mask), mask._version, result)
        return result

    @property
    def cached(self) -> bool:
        return self._entry is not None

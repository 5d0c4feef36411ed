"""The trial plan: which inputs every candidate sees, in which order (design.md §4).

Accuracy trial ``t`` uses ``seed + t`` through the organizer's generator. Padded trials reuse the
same seeds with ``padding_ratio``, so a padded failure can be lined up with its all-valid twin.
Trials are generated lazily: a plan for shape 6 never holds more than one input at a time.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from kkdeploy.config import TransformerConfig
from kkdeploy.errors import KKError
from kkdeploy.inputs import DEFAULT_SEED, DEFAULT_TRIALS, generate_case

ALL_VALID, PADDED = "all-valid", "padded"
MODES = (ALL_VALID, PADDED)
DEFAULT_PADDING_RATIO = 0.25
INPUT_NAMES = ("x", "valid_token_mask")


@dataclass
class Trial:
    """One validation input: ``x`` [B,S,D] and its bool ``mask`` [B,S] (True = real token)."""

    mode: str
    index: int
    seed: int
    x: torch.Tensor
    mask: torch.Tensor

    @property
    def padding_ratio_used(self) -> float:
        return float((~self.mask).float().mean()) if self.mask.numel() else 0.0

    def feed_dict(self) -> "OrderedDict[str, torch.Tensor]":
        """Polygraphy's input format: names match the runner's input metadata."""
        return OrderedDict([("x", self.x), ("valid_token_mask", self.mask)])

    def describe(self) -> str:
        return f"{self.mode} trial {self.index} (seed {self.seed})"


def check_plan_args(trials: int, padding_ratio: float, modes: Sequence[str]) -> tuple[str, ...]:
    """Reject a plan that cannot be run, with one line naming the fix."""
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise KKError(f"trials must be a positive integer, got {trials!r}")
    modes = tuple(modes)
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise KKError(f"unknown trial modes {unknown or list(modes)}; use any of {', '.join(MODES)}")
    if len(set(modes)) != len(modes):
        raise KKError(f"trial modes repeat: {list(modes)}")
    if PADDED in modes and not 0 < padding_ratio < 1:
        raise KKError(f"padding_ratio must be in (0, 1) for padded trials, got {padding_ratio}")
    return modes


def trial_plan(
    config: TransformerConfig,
    dtype: torch.dtype,
    device,
    seed: int = DEFAULT_SEED,
    trials: int = DEFAULT_TRIALS,
    padding_ratio: float = DEFAULT_PADDING_RATIO,
    modes: Sequence[str] = MODES,
) -> Iterator[Trial]:
    """Yield the trials mode by mode (all-valid first), one input alive at a time."""
    modes = check_plan_args(trials, padding_ratio, modes)
    device = torch.device(device)

    def generate() -> Iterator[Trial]:
        for mode in modes:
            ratio = padding_ratio if mode == PADDED else 0.0
            for t in range(trials):
                x, mask = generate_case(config, device, dtype, seed + t, padding_ratio=ratio)
                yield Trial(mode=mode, index=t, seed=seed + t, x=x, mask=mask)

    return generate()

"""What the kernels' GPU self-tests (scripts/*_selftest.py) measure, the same way in each: CUDA-event timing (one call,
median of repeats) and the count of elements whose bits differ.

Why here: every self-test reports its kernel's time and bits beside ATen's on the same tensors.
"""

from __future__ import annotations

from typing import Callable

import torch


def event_median_ms(fn: Callable[[], object], repeats: int, device=None, digits: int = 4) -> float:
    """Median milliseconds of ``fn()`` over ``repeats`` calls, each timed alone with CUDA events around it and a
    synchronize after it (no warm-up: the caller's)."""
    times = []
    for _ in range(max(1, repeats)):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
        times.append(start.elapsed_time(end))
    return round(sorted(times)[len(times) // 2], digits)


def cuda_median_ms(fn: Callable[[], object], repeats: int, digits: int = 4) -> float:
    """``event_median_ms`` after one warm-up call."""
    fn()
    return event_median_ms(fn, repeats, digits=digits)


def differing_bits(ours: torch.Tensor, ref: torch.Tensor) -> int:
    """Elements whose bits differ (signed zeros and NaN payloads count): the proofs' own count."""
    from .proof import differing_elements

    return differing_elements(ours, ref)

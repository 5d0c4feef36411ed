"""CUDA-event timing for the kernels' GPU self-tests (scripts/*_selftest.py): one call, median of repeats.

Why here: every self-test reports its kernel's time beside ATen's on the same tensors, the same way.
"""

from __future__ import annotations

from typing import Callable

import torch


def cuda_median_ms(fn: Callable[[], object], repeats: int, digits: int = 4) -> float:
    """Median milliseconds of ``fn()`` over ``repeats`` calls after one warm-up call, each timed alone with
    CUDA events around it and a synchronize after it."""
    fn()
    times = []
    for _ in range(max(1, repeats)):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return round(sorted(times)[len(times) // 2], digits)

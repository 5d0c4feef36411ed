"""The organizer's timing protocol (design.md §4): warmups, repeats, alternating rounds.

Round r runs every function in turn (its warmups, then its timed repeats), so slow drift of the
machine (clocks, thermal state, neighbours) lands on every backend alike instead of on whichever
ran last. On CUDA each call is bracketed by its own pair of CUDA events; on the CPU by
``time.perf_counter``. The function is the full runner call, so producing an output the caller
owns (a clone out of a CUDA-graph buffer, say) is part of what is timed.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Mapping, Sequence

import torch

from ..errors import KKError

DEFAULT_WARMUPS = 20
DEFAULT_REPEATS = 100
DEFAULT_ROUNDS = 3
TIE_TOLERANCE = 0.02


@dataclass
class LatencyStats:
    """Per-call latency over every timed repeat of every round."""

    median_ms: float
    p90_ms: float
    mean_ms: float
    min_ms: float
    samples: int
    peak_memory_bytes: int | None = None  # torch.cuda.max_memory_allocated during the calls (CUDA only)
    peak_extra_bytes: int | None = None  # that peak minus what was allocated before the calls: working memory
    round_medians_ms: list[float] = field(default_factory=list)
    times_ms: list[float] = field(default_factory=list, repr=False)

    @classmethod
    def from_times(cls, times_ms: Sequence[float], round_medians_ms: Sequence[float] = (),
                   peak_memory_bytes: int | None = None, peak_extra_bytes: int | None = None) -> "LatencyStats":
        if not times_ms:
            raise KKError("no latency samples to summarize; repeats must be at least 1")
        times = sorted(float(t) for t in times_ms)
        return cls(median_ms=statistics.median(times), p90_ms=percentile(times, 90),
                   mean_ms=statistics.fmean(times), min_ms=times[0], samples=len(times),
                   peak_memory_bytes=peak_memory_bytes, peak_extra_bytes=peak_extra_bytes,
                   round_medians_ms=[float(m) for m in round_medians_ms],
                   times_ms=list(times_ms))

    def to_dict(self, include_times: bool = False) -> dict:
        data = asdict(self)
        if not include_times:
            data.pop("times_ms")
        return data


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), on already sorted values."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def _check_counts(warmups: int, repeats: int, rounds: int) -> None:
    for name, value, low in (("warmups", warmups, 0), ("repeats", repeats, 1), ("rounds", rounds, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise KKError(f"{name} must be an integer >= {low}, got {value!r}")


def _time_cpu(fn: Callable[[], object], repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000.0)
    return times


def _time_cuda(fn: Callable[[], object], repeats: int, device: torch.device) -> list[float]:
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    torch.cuda.synchronize(device)
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return [start.elapsed_time(end) for start, end in events]


def measure_latency(
    fns: Mapping[str, Callable[[], object]],
    device,
    warmups: int = DEFAULT_WARMUPS,
    repeats: int = DEFAULT_REPEATS,
    rounds: int = DEFAULT_ROUNDS,
) -> dict[str, LatencyStats]:
    """Time every zero-argument ``fn`` (a full runner call) in alternating rounds.

    Returns one ``LatencyStats`` per name over ``repeats * rounds`` samples. ``peak_memory_bytes``
    (CUDA) is the allocator's peak while that function ran, everything resident included (weights,
    inputs, other backends' buffers); ``peak_extra_bytes`` is the part the calls themselves added.
    """
    _check_counts(warmups, repeats, rounds)
    if not fns:
        raise KKError("nothing to time: give at least one function")
    device = torch.device(device)
    cuda = device.type == "cuda"
    times: dict[str, list[float]] = {name: [] for name in fns}
    round_medians: dict[str, list[float]] = {name: [] for name in fns}
    peaks: dict[str, int] = {name: 0 for name in fns}
    extras: dict[str, int] = {name: 0 for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            if cuda:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                resident = torch.cuda.memory_allocated(device)
            for _ in range(warmups):
                fn()
            samples = _time_cuda(fn, repeats, device) if cuda else _time_cpu(fn, repeats)
            if cuda:
                peak = int(torch.cuda.max_memory_allocated(device))
                peaks[name] = max(peaks[name], peak)
                extras[name] = max(extras[name], peak - resident)
            times[name].extend(samples)
            round_medians[name].append(statistics.median(samples))
    return {
        name: LatencyStats.from_times(times[name], round_medians[name], peaks[name] if cuda else None,
                                      extras[name] if cuda else None)
        for name in fns
    }


def choose_fastest(stats: Mapping[str, LatencyStats], simplicity_order: Sequence[str],
                   tie_tolerance: float = TIE_TOLERANCE) -> str:
    """The fastest median; candidates within ``tie_tolerance`` (relative) of it tie, and a tie goes to
    the simplest (earliest in ``simplicity_order``; names not listed rank after it, fastest first)."""
    if not stats:
        raise KKError("no timed candidates to choose from")
    if tie_tolerance < 0:
        raise KKError(f"tie_tolerance must be >= 0, got {tie_tolerance}")
    best = min(s.median_ms for s in stats.values())
    tied = [name for name, s in stats.items() if s.median_ms <= best * (1 + tie_tolerance)]
    order = list(simplicity_order)

    def rank(name: str):
        return (order.index(name) if name in order else len(order), stats[name].median_ms)

    return min(tied, key=rank)

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
DEFAULT_TIME_BUDGET_S = 10.0  # a build's timing step; the full protocol where it fits (H200: all shapes but 6, 13)
SCREEN_REPEATS = 3  # timed calls per candidate in the screen, after 2 warmups
SCREEN_KEEP = 1.25  # a candidate this much slower than the best in the screen cannot win: it is not timed further
MIN_REPEATS = 10  # the protocol's repeats are never cut below this
#: a contender whose fastest round is this much slower than the leader's slowest round has lost: it is not timed in
#: the rounds left (``race_latency``)
DECIDED_MARGIN = 0.10


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


@dataclass
class TimingPlan:
    """What a budgeted timing step did (``race_latency``): recorded in bench.json and the manifest."""

    budget_s: float | None
    warmups: int
    repeats: int
    rounds: int
    full_protocol: bool  # every candidate got the warmups/repeats/rounds asked for
    screened_out: dict[str, float] = field(default_factory=dict)  # name -> its screen median, ms
    estimated_s: float | None = None  # the full protocol's cost, estimated from the screen
    seconds: float = 0.0
    candidates: int = 0  # how many were timed, screen included (0: not recorded, an older manifest)
    decided: dict = field(default_factory=dict)  # name -> the rounds it ran before it had lost (race_latency)

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        """One line for the build's summary, or "" when nothing was cut."""
        if self.full_protocol:
            return ""
        parts = []
        if self.screened_out:
            names = ", ".join(f"{n} {ms:.3g} ms" for n, ms in sorted(self.screened_out.items(), key=lambda i: i[1]))
            parts.append(f"{len(self.screened_out)} screened out at >= {SCREEN_KEEP}x the best in "
                         f"{SCREEN_REPEATS} calls ({names})")
        who = "the rest" if self.screened_out else "every candidate"
        if self.screened_out and len(self.screened_out) == self.candidates - 1:
            who = "the one left (nothing to decide)"
        parts.append(f"{who} timed with {self.warmups} warmups, {self.repeats} repeats, {self.rounds} rounds")
        if self.decided:
            lost = ", ".join(f"{n} after {k} round{'s' if k > 1 else ''}" for n, k in self.decided.items())
            parts.append(f"lost by more than {DECIDED_MARGIN:.0%} in every round and not timed further: {lost}")
        return (f"timing: {self.seconds:.1f} s against a {self.budget_s:g} s budget (the full protocol would take "
                f"about {self.estimated_s:.0f} s; --time-budget 0 runs it): " + "; ".join(parts))


def race_latency(
    fns: Mapping[str, Callable[[], object]],
    device,
    warmups: int = DEFAULT_WARMUPS,
    repeats: int = DEFAULT_REPEATS,
    rounds: int = DEFAULT_ROUNDS,
    budget_s: float | None = DEFAULT_TIME_BUDGET_S,
) -> tuple[dict[str, LatencyStats], TimingPlan]:
    """``measure_latency`` held to ``budget_s`` seconds, for a build that must choose, not a benchmark.

    Why: on shape 6 (B = 10,000) the protocol's 3 x 120 calls of seven candidates, 14-81 ms each, took 113 s of a
    173 s build (H200), most of it on candidates that could not win. So every candidate is first screened (2
    warmups, ``SCREEN_REPEATS`` timed calls). If the full protocol over all of them fits the budget (on the H200,
    every official shape but 6 and 13), it runs as asked, exactly as ``measure_latency``. Otherwise the candidates
    slower than ``SCREEN_KEEP`` x the best screen median keep their screen figures and drop out, and the rest get
    the protocol with warmups and repeats scaled down to fit (repeats not below ``MIN_REPEATS`` unless fewer were
    asked for; rounds kept, so the alternation still spreads drift). A lone contender has nothing left to race: it
    gets 2 warmups and ``MIN_REPEATS`` per round. The race is decided early too: after each round, a contender
    whose fastest round is more than ``DECIDED_MARGIN`` slower than the leader's slowest has lost (no later round
    can make it the choice, which only ties within ``TIE_TOLERANCE``); it keeps its figures so far, and a leader left
    alone gets the lone contender's calls (shape 6: the runner-up, 1.24x slower, took 4 of the 10 s).
    ``budget_s`` None or <= 0: the full protocol, no screen."""
    _check_counts(warmups, repeats, rounds)
    started = time.perf_counter()
    if budget_s is None or budget_s <= 0:
        stats = measure_latency(fns, device, warmups=warmups, repeats=repeats, rounds=rounds)
        return stats, TimingPlan(None, warmups, repeats, rounds, True, seconds=round(time.perf_counter() - started, 2),
                                 candidates=len(fns))
    screen = measure_latency(fns, device, warmups=min(warmups, 2), repeats=SCREEN_REPEATS, rounds=1)

    def cost(names, w: int, r: int) -> float:
        return rounds * (w + r) * sum(screen[n].median_ms for n in names) / 1000.0

    estimated = cost(fns, warmups, repeats)
    if estimated <= budget_s:
        stats = measure_latency(fns, device, warmups=warmups, repeats=repeats, rounds=rounds)
        return stats, TimingPlan(budget_s, warmups, repeats, rounds, True, estimated_s=round(estimated, 2),
                                 seconds=round(time.perf_counter() - started, 2), candidates=len(fns))
    best = min(s.median_ms for s in screen.values())
    contenders = [n for n in fns if screen[n].median_ms <= SCREEN_KEEP * best]
    left = max(budget_s - (time.perf_counter() - started), 0.0)
    w, r = warmups, repeats
    full = cost(contenders, w, r)
    if len(contenders) == 1:
        # Nothing is left to decide: the lone contender, already warm from the screen, gets the protocol's floor (its
        # median for the record). On shape 6 the full 3 x 120 calls of the winner took ~5 s of a ~60 s build.
        w, r = min(warmups, 2), min(repeats, MIN_REPEATS)
    elif full > left:
        scale = left / full
        r = min(repeats, max(MIN_REPEATS, int(repeats * scale)))  # never more than asked for
        w = max(1, min(warmups, int(warmups * scale)))
    stats = dict(screen)
    raced, decided = _race_rounds({n: fns[n] for n in contenders}, device, w, r, rounds)
    stats.update(raced)
    plan = TimingPlan(budget_s, w, r, rounds, False,
                      screened_out={n: round(screen[n].median_ms, 4) for n in fns if n not in contenders},
                      estimated_s=round(estimated, 2), seconds=round(time.perf_counter() - started, 2),
                      candidates=len(fns), decided=decided)
    return {n: stats[n] for n in fns}, plan


def _race_rounds(fns: Mapping[str, Callable[[], object]], device, warmups: int, repeats: int,
                 rounds: int) -> tuple[dict[str, LatencyStats], dict[str, int]]:
    """``measure_latency`` one round at a time: after each round the contenders that have lost
    (``DECIDED_MARGIN``) stop, and a leader left alone finishes its rounds with the lone contender's calls. Returns
    the stats of every contender (over the rounds it ran) and {loser: rounds it ran}."""
    samples: dict[str, list[LatencyStats]] = {name: [] for name in fns}
    running, decided = list(fns), {}
    for index in range(rounds):
        left_alone = len(running) == 1 < len(fns)  # the others lost: the leader's record needs only the floor
        w, r = (min(warmups, 2), min(repeats, MIN_REPEATS)) if left_alone else (warmups, repeats)
        got = measure_latency({n: fns[n] for n in running}, device, warmups=w, repeats=r, rounds=1)
        for name, stat in got.items():
            samples[name].append(stat)
        if len(running) > 1 and index < rounds - 1:
            medians = {n: [s.round_medians_ms[0] for s in samples[n]] for n in running}
            leader = min(running, key=lambda n: statistics.median(t for s in samples[n] for t in s.times_ms))
            slowest = max(medians[leader])
            for name in [n for n in running if n != leader and min(medians[n]) > slowest * (1 + DECIDED_MARGIN)]:
                running.remove(name)
                decided[name] = index + 1
    return {name: _merged(parts) for name, parts in samples.items()}, decided


def _merged(parts: Sequence[LatencyStats]) -> LatencyStats:
    """One contender's rounds as one ``LatencyStats`` (as ``measure_latency`` would have made them in one call)."""
    peaks = [p.peak_memory_bytes for p in parts if p.peak_memory_bytes is not None]
    extras = [p.peak_extra_bytes for p in parts if p.peak_extra_bytes is not None]
    return LatencyStats.from_times([t for p in parts for t in p.times_ms],
                                   [m for p in parts for m in p.round_medians_ms],
                                   max(peaks) if peaks else None, max(extras) if extras else None)


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

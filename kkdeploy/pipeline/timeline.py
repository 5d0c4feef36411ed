"""Where a call's time goes between its kernels: per call the span, the busy time and the gaps.

On the launch-bound shapes a call is a CUDA graph of about 25-30 short kernels, and its time is their sum plus the
gaps between them. Dependent launches shrink the gaps; a fused launch removes a kernel but may stop the next one from
starting early. The median alone cannot tell these apart, and a kernel profile's sums hide the gaps. So the bench
records, for each timed backend in its first process on a GPU, the timeline of ``CALLS`` calls under torch.profiler
(CUPTI reports each kernel of a graph replay), and ``scripts/trace_gaps.py`` reads the same from any Chrome trace.

The device kernels (``"cat": "kernel"``) are taken in start order and split into the profiled calls, which must each
launch the same number (a fixed shape does). Per call: the span (first start to last end), the busy time (the union
of the kernels' intervals) and the idle rest; per position in the call, the median kernel time and the median gap
before the next kernel. A negative gap is a dependent launch that started before its predecessor ended, reported as
overlap. Figures are in µs, medians over the calls, so one slow call does not move them. Profiling adds its own
cost to each kernel's launch, so the span is an upper bound of the timed median; the gaps are what to compare.
"""

from __future__ import annotations

import difflib
import json
import os
import statistics
import tempfile

import torch

#: calls profiled per backend (fewer for slow calls: ``calls_for``)
CALLS = 20
CPU_REASON = "not on the CPU: its ops are not device kernels, so a call has no timeline of launches"


class TimelineError(Exception):
    """One line: why a trace cannot be split into calls."""


def device_kernels(trace: dict) -> list[tuple[str, float, float]]:
    """(name, start µs, duration µs) of every device kernel of a Chrome trace (torch.profiler's), in start order."""
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else []
    kernels = [(str(e.get("name", "")), float(e["ts"]), float(e.get("dur", 0.0)))
               for e in events if isinstance(e, dict) and e.get("cat") == "kernel" and e.get("ph") == "X"
               and "ts" in e]
    return sorted(kernels, key=lambda k: k[1])


def busy_time(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of [start, end) intervals."""
    total, reach = 0.0, None
    for start, end in sorted(intervals):
        if reach is None or start >= reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


def call_timeline(kernels: list[tuple[str, float, float]], calls: int, top: int = 8) -> dict:
    """The per-call and per-position figures (µs) of ``kernels`` split into ``calls`` equal calls."""
    if calls < 1:
        raise TimelineError(f"--calls must be >= 1, got {calls}")
    if not kernels:
        raise TimelineError("the trace holds no device kernels (\"cat\": \"kernel\"): profile on a GPU")
    if len(kernels) % calls:
        raise TimelineError(f"{len(kernels)} device kernels do not split into {calls} equal calls: pass the calls "
                            "the profile ran, or profile a call that launches the same kernels each time")
    per = len(kernels) // calls
    spans, busies, durations, gaps = [], [], [[] for _ in range(per)], [[] for _ in range(per - 1)]
    names = [name for name, _, _ in kernels[:per]]
    for c in range(calls):
        call = kernels[c * per:(c + 1) * per]
        spans.append(max(s + d for _, s, d in call) - call[0][1])
        busies.append(busy_time([(s, s + d) for _, s, d in call]))
        for i, (_, start, dur) in enumerate(call):
            durations[i].append(dur)
            if i + 1 < per:
                gaps[i].append(call[i + 1][1] - (start + dur))
    gap_medians = [statistics.median(g) for g in gaps]
    positions = [{"index": i, "kernel": names[i], "median_us": statistics.median(durations[i]),
                  "median_gap_after_us": gap_medians[i] if i < len(gap_medians) else None} for i in range(per)]
    largest = sorted(range(len(gap_medians)), key=lambda i: gap_medians[i], reverse=True)[:top]
    span, busy = statistics.median(spans), statistics.median(busies)
    return {"calls": calls, "kernels_per_call": per, "median_span_us": span, "median_busy_us": busy,
            "median_idle_us": statistics.median(s - b for s, b in zip(spans, busies)),
            "busy_fraction": busy / span if span > 0 else None,
            "kernel_sum_us": sum(p["median_us"] for p in positions),
            "gap_sum_us": sum(g for g in gap_medians if g > 0), "overlap_us": -sum(g for g in gap_medians if g < 0),
            "largest_gaps": [{"after": i, "before_kernel": names[i], "next_kernel": names[i + 1],
                              "median_gap_us": gap_medians[i]} for i in largest],
            "positions": positions}


def read_trace(path) -> dict:
    """A Chrome trace file's JSON, or a one-line ``TimelineError``."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise TimelineError(f"cannot read the trace {path}: {exc.__class__.__name__}: {str(exc)[:120]}") from None


def trace_timeline(path, calls: int) -> dict:
    """The timeline of a trace file of ``calls`` calls, or ``{"unavailable": why}``."""
    try:
        return call_timeline(device_kernels(read_trace(path)), calls)
    except TimelineError as exc:
        return {"unavailable": str(exc)}


def summary_line(label: str, t: dict) -> str:
    """One line for a report: what a call spans and how much of it is gaps."""
    return (f"{label}: {t['kernels_per_call']} kernels a call, span {t['median_span_us']:.1f} µs, busy "
            f"{t['median_busy_us']:.1f} µs, idle {t['median_idle_us']:.1f} µs (gaps {t['gap_sum_us']:.1f}, overlap "
            f"{t['overlap_us']:.1f})")


#: the header of a table of timelines, after the columns that name the row (``table_cells`` gives the rest)
TABLE_HEADER = "kernels | span µs | busy µs (share) | gaps µs | overlap µs | largest gap"


def table_cells(t: dict) -> str:
    """A timeline as the cells under ``TABLE_HEADER``; where it has no figures, the reason in the first cell."""
    if t.get("median_span_us") is None:
        return f"{t.get('unavailable', '-')} |||||"
    big = (t.get("largest_gaps") or [None])[0]
    where = f"{big['median_gap_us']:.2f} after {big['after']} ({big['before_kernel'][:40]})" if big else "-"
    share = f" ({t['busy_fraction']:.0%})" if t.get("busy_fraction") is not None else ""
    return (f"{t['kernels_per_call']} | {t['median_span_us']:.1f} | {t['median_busy_us']:.1f}{share} | "
            f"{t['gap_sum_us']:.1f} | {t['overlap_us']:.1f} | {where}")


def calls_for(median_ms: float | None, budget_ms: float = 400.0) -> int:
    """How many calls to profile: ``CALLS``, fewer where a call is slow (at least 3), so that a slow eager or shape 6
    does not spend seconds under the profiler."""
    if not median_ms or median_ms <= 0:
        return CALLS
    return max(3, min(CALLS, int(budget_ms / median_ms)))


def profiled_timeline(call, device, calls: int = CALLS) -> dict:
    """The timeline of ``calls`` calls of ``call()`` under torch.profiler, or ``{"unavailable": why}``.

    A failure is a reason in the record, never an error of the bench (as the launch count)."""
    device = torch.device(device)
    if device.type != "cuda":
        return {"unavailable": CPU_REASON}
    path = None
    try:
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize(device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                call()
            torch.cuda.synchronize(device)
        handle, path = tempfile.mkstemp(suffix=".json", prefix="kk-timeline-")
        os.close(handle)
        prof.export_chrome_trace(path)
        return trace_timeline(path, calls)
    except Exception as exc:  # the timeline is a report, not a reason to lose the bench
        return {"unavailable": f"profiling failed: {type(exc).__name__}: {str(exc)[:200]}"}
    finally:
        if path is not None and os.path.exists(path):
            os.unlink(path)


def position_cost(position: dict) -> float:
    """What one kernel adds to its call's span: its median time and the gap before the next (negative where the next
    started early). Over a call whose kernels run one after another these sum to the span."""
    return position["median_us"] + (position.get("median_gap_after_us") or 0.0)


def compare_timelines(base: dict, other: dict, threshold_us: float = 0.3) -> list[dict]:
    """Where a call's time moved between two timelines (say, the tree as committed and an edit of it): the kernels are
    aligned by name (``difflib``), and each run that differs, or that matches but moved by more than ``threshold_us``,
    is a segment with both sides' kernels and what they add to the span (``position_cost``). An edit that fuses two
    launches shows as one replaced run, or, where the fused launch is the same kernel as one it absorbed (our GEMM
    tiles all run ``_fused_linear_kernel``), as a removed launch beside a matched one whose cost moved. Either way the
    costs say whether the fused launch ran longer or the launch after it started later. Largest change first."""
    import difflib

    a, b = base.get("positions") or [], other.get("positions") or []
    names_a, names_b = [p["kernel"] for p in a], [p["kernel"] for p in b]
    matcher = difflib.SequenceMatcher(a=names_a, b=names_b, autojunk=False)
    segments = []
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":  # matched kernels one by one: only those that moved
            pairs = [(a[i], b[j]) for i, j in zip(range(i1, i2), range(j1, j2))]
            for pa, pb in pairs:
                delta = position_cost(pb) - position_cost(pa)
                if abs(delta) > threshold_us:
                    segments.append({"kind": "moved", "base": [pa["index"]], "other": [pb["index"]],
                                     "base_kernels": [pa["kernel"]], "other_kernels": [pb["kernel"]],
                                     "base_us": position_cost(pa), "other_us": position_cost(pb), "delta_us": delta})
            continue
        cost_a = sum(position_cost(p) for p in a[i1:i2])
        cost_b = sum(position_cost(p) for p in b[j1:j2])
        segments.append({"kind": {"replace": "replaced", "delete": "removed", "insert": "added"}[tag],
                         "base": list(range(i1, i2)), "other": list(range(j1, j2)),
                         "base_kernels": names_a[i1:i2], "other_kernels": names_b[j1:j2],
                         "base_us": cost_a, "other_us": cost_b, "delta_us": cost_b - cost_a})
    return sorted(segments, key=lambda s: abs(s["delta_us"]), reverse=True)

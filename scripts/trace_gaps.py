#!/usr/bin/env python3
"""Where a call's time goes between kernels: per call its span, busy time and the gaps, from a Chrome trace.

    python3 scripts/trace_gaps.py profile-out/trace-torch-compile-faithful-gemms-pdl.json --calls 20 [--top 8]

Why: on the launch-bound shapes a call is a CUDA graph of about 25-30 short kernels, and its time is the kernels'
sum plus the gaps between them. Dependent launches (PDL) shrink the gaps; a fused launch removes a kernel but may
stop the next one from starting early. The kernel profile (`scripts/profile_candidate.py`) sums each kernel's time,
which hides the gaps. This reads the trace it writes (``trace-NAME.json``, torch.profiler's Chrome format: device
kernels have ``"cat": "kernel"``), splits the kernels into ``--calls`` calls of equal length in start order, and
reports per call the span (first start to last end), the busy time (the union of the kernels' intervals) and the
idle rest, then per position in the call the median kernel time and the median gap before the next kernel.
Kernels that overlap (a dependent launch started early) give negative gaps: the overlap is reported as such.

Exit status 0, or 2 with one line: a trace that cannot be read, no device kernels in it (a CPU profile), or a
kernel count that ``--calls`` does not divide (the trace then holds more than the profiled calls).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


class TraceError(Exception):
    """One line: why the trace cannot be split into calls."""


def device_kernels(trace: dict) -> list[tuple[str, float, float]]:
    """(name, start µs, duration µs) of every device kernel, in start order."""
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else []
    kernels = [(str(e.get("name", "")), float(e["ts"]), float(e.get("dur", 0.0)))
               for e in events if isinstance(e, dict) and e.get("cat") == "kernel" and e.get("ph") == "X"
               and "ts" in e]
    return sorted(kernels, key=lambda k: k[1])


def busy_time(intervals: list[tuple[float, float]]) -> float:
    """The union's length of [start, end) intervals, in their unit."""
    total, reach = 0.0, None
    for start, end in sorted(intervals):
        if reach is None or start >= reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


def timeline(kernels: list[tuple[str, float, float]], calls: int, top: int = 8) -> dict:
    """The per-call and per-position figures (µs) of ``kernels`` split into ``calls`` equal calls."""
    if calls < 1:
        raise TraceError(f"--calls must be >= 1, got {calls}")
    if not kernels:
        raise TraceError("the trace holds no device kernels (\"cat\": \"kernel\"): profile on a GPU")
    if len(kernels) % calls:
        raise TraceError(f"{len(kernels)} device kernels do not split into {calls} equal calls: pass the --calls "
                         "the profile ran, or profile a graph whose calls launch the same kernels")
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
    return {"calls": calls, "kernels_per_call": per,
            "median_span_us": statistics.median(spans), "median_busy_us": statistics.median(busies),
            "median_idle_us": statistics.median(s - b for s, b in zip(spans, busies)),
            "kernel_sum_us": sum(p["median_us"] for p in positions),
            "gap_sum_us": sum(g for g in gap_medians if g > 0), "overlap_us": -sum(g for g in gap_medians if g < 0),
            "largest_gaps": [{"after": i, "before_kernel": names[i], "next_kernel": names[i + 1],
                              "median_gap_us": gap_medians[i]} for i in largest],
            "positions": positions}


def read_trace(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise TraceError(f"cannot read the trace {path}: {exc.__class__.__name__}: {str(exc)[:120]}") from None


def summary_line(label: str, t: dict) -> str:
    """One line for a table: what a call spans and how much of it is gaps."""
    return (f"{label}: {t['kernels_per_call']} kernels a call, span {t['median_span_us']:.1f} µs, busy "
            f"{t['median_busy_us']:.1f} µs, idle {t['median_idle_us']:.1f} µs (gaps {t['gap_sum_us']:.1f}, overlap "
            f"{t['overlap_us']:.1f})")


def render(label: str, t: dict, top: int) -> str:
    lines = [summary_line(label, t), "  | position | kernel | median µs | gap after µs |", "  |---|---|---|---|"]
    for p in t["positions"]:
        gap = "-" if p["median_gap_after_us"] is None else f"{p['median_gap_after_us']:.2f}"
        lines.append(f"  | {p['index']} | {p['kernel'][:70]} | {p['median_us']:.2f} | {gap} |")
    lines.append("  largest gaps: " + "; ".join(f"after {g['after']} ({g['before_kernel'][:40]}) "
                                                f"{g['median_gap_us']:.2f} µs" for g in t["largest_gaps"][:top]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+", type=Path, help="Chrome traces (profile_candidate's trace-NAME.json)")
    parser.add_argument("--calls", type=int, default=20, help="the calls the profile ran (profile_candidate --calls)")
    parser.add_argument("--top", type=int, default=8, help="largest gaps to name")
    parser.add_argument("--json", type=Path, default=None, help="write every trace's figures here")
    args = parser.parse_args(argv)
    results, lines = {}, []
    for path in args.traces:
        try:
            results[path.name] = timeline(device_kernels(read_trace(path)), args.calls, args.top)
        except TraceError as exc:
            print(f"trace_gaps: {path.name}: {exc}", file=sys.stderr)
            return 2
        lines.append(render(path.stem, results[path.name], args.top))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print("\n\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

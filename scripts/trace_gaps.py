#!/usr/bin/env python3
"""Where a call's time goes between kernels: per call its span, busy time and the gaps, from a Chrome trace.

    python3 scripts/trace_gaps.py profile-out/trace-torch-compile-faithful-gemms-pdl.json --calls 20 [--top 8]

A thin command over ``kkdeploy.pipeline.timeline`` (the bench records the same per backend, on a GPU), for the
traces ``scripts/profile_candidate.py`` writes (``trace-NAME.json``) or any earlier torch.profiler trace: per call
the span, busy time and idle rest, per position in the call the median kernel time and the gap before the next
kernel (negative where a dependent launch started early: overlap).

Exit status 0, or 2 with one line: a trace that cannot be read, no device kernels in it (a CPU profile), or a
kernel count that ``--calls`` does not divide (the trace then holds more than the profiled calls).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kkdeploy.pipeline.timeline import (TimelineError, call_timeline, device_kernels, read_trace,  # noqa: E402
                                        summary_line)


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
            results[path.name] = call_timeline(device_kernels(read_trace(path)), args.calls, args.top)
        except TimelineError as exc:
            print(f"trace_gaps: {path.name}: {exc}", file=sys.stderr)
            return 2
        lines.append(render(path.stem, results[path.name], args.top))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print("\n\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

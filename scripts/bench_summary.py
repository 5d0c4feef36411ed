#!/usr/bin/env python3
"""One table over many `kkdeploy bench` runs: per shape, the best passing backend and the geomean.

    python scripts/bench_summary.py DIR_OR_BENCH_JSON... [--versus NAME] [--pdl] [--md OUT.md] [--png OUT.png]

Reads every ``bench.json`` found under the arguments (a campaign benches each shape in its own
invocation, so that a time limit keeps what finished). For each shape it reports eager's median,
the fastest backend that passed every trial in every process ("fully passing": serves padded calls
too), and the fastest for all-valid calls (which may be all-valid-only); then the geometric means
of those speedups over the shapes present.

Next to the protocol's speedup (over the pooled eager median) it gives the conservative one, over
eager's fastest round median in the same processes (``kkdeploy.pipeline.bench.eager_floor_ms`` says why).

Where the runs recorded a roofline (``kkdeploy.pipeline.roofline``), the fastest fully passing backend's fraction of
the limit and the term that binds it are a column, followed by their geometric mean and the three shapes furthest from
their limit. Older bench.json files without it read as before. Where a GPU recorded each call's timeline
(``kkdeploy.pipeline.timeline``), a line gives the fastest fully passing backend's busy share of its call per shape.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kkdeploy.pipeline.bench import EAGER, eager_floor_ms, geometric_mean, plot_speedups  # noqa: E402
from kkdeploy.pipeline.op_roofline import furthest_in_plan  # noqa: E402
from kkdeploy.pipeline.roofline import format_fraction  # noqa: E402

FURTHEST = 3  # shapes listed as furthest from their limit

PASSED, PASSED_ALL_VALID_ONLY = "passed", "passed-all-valid-only"


def load_shapes(paths: list[str]) -> tuple[list[dict], list[dict]]:
    files: list[Path] = []
    for p in map(Path, paths):
        files += sorted(p.rglob("bench.json")) if p.is_dir() else [p]
    shapes, runs = [], []
    for f in files:
        data = json.loads(f.read_text())
        runs.append({"file": str(f), "protocol": data["protocol"], "environment": data["environment"]})
        shapes += data["shapes"]
    shapes.sort(key=lambda s: (s["shape_id"] is None, s["shape_id"] or 0))
    return shapes, runs


def best(shape: dict, statuses: tuple[str, ...]) -> tuple[str, dict] | None:
    timed = [(n, b) for n, b in shape["backends"].items()
             if n != EAGER and b["status"] in statuses and b.get("speedup")]
    return max(timed, key=lambda nb: nb[1]["speedup"]) if timed else None


def summarize(shapes: list[dict]) -> dict:
    rows, full, valid, floor, fractions, differed = [], [], [], [], [], []
    for s in shapes:
        eager_entry = s["backends"].get(EAGER, {})
        eager, eager_floor = eager_entry.get("median_ms"), eager_floor_ms(eager_entry)
        b_full = best(s, (PASSED,))
        b_valid = best(s, (PASSED, PASSED_ALL_VALID_ONLY))
        failed = {n: b.get("failed_elements") for n, b in s["backends"].items() if b["status"] == "failed"}
        rows.append({"label": s["label"], "processes": s["processes"], "eager_ms": eager,
                     "eager_floor_ms": eager_floor,
                     "best_full": b_full and (b_full[0], b_full[1]["median_ms"], b_full[1]["speedup"]),
                     "best_all_valid": b_valid and (b_valid[0], b_valid[1]["median_ms"], b_valid[1]["speedup"]),
                     "best_full_roofline": b_full and b_full[1].get("roofline"),
                     "best_full_timeline": b_full and b_full[1].get("timeline"),
                     "failed": failed, "errors": s["errors"]})
        if b_full:
            full.append(b_full[1]["speedup"])
            if b_full[1].get("plans_per_process"):  # its processes chose different plans (kkdeploy bench)
                differed.append((s["label"], b_full[0], (b_full[1].get("roofline") or {}).get("launches_per_process")))
            roofline = b_full[1].get("roofline") or {}
            if roofline.get("fraction") is not None:
                fractions.append((roofline["fraction"], s["label"], b_full[0], roofline.get("bound")))
            if eager_floor:
                floor.append(eager_floor / b_full[1]["median_ms"])
        if b_valid:
            valid.append(b_valid[1]["speedup"])
    return {"rows": rows, "geomean_full": geometric_mean(full), "geomean_all_valid": geometric_mean(valid),
            "min_full": min(full) if full else None, "shapes": len(shapes),
            "geomean_full_over_eager_floor": geometric_mean(floor),
            "min_full_over_eager_floor": min(floor, default=None),
            "geomean_fraction_full": geometric_mean([f[0] for f in fractions]), "fraction_shapes": len(fractions),
            "furthest_from_limit": sorted(fractions)[:FURTHEST], "plans_differed": differed,
            "furthest_ops": {label: furthest_op(next(s for s in shapes if s["label"] == label), name)
                             for _, label, name, _ in sorted(fractions)[:FURTHEST]}}


def furthest_op(shape: dict, name: str) -> dict | None:
    """The kernel op shape of backend ``name`` furthest from its own limit among those its graph computes
    (bench.json's ``roofline.ops``, the furthest first; an op whose ``in_plan`` is False is timed by a proof but not
    run), or None where none was timed against limits: why that shape sits where it does."""
    return furthest_in_plan(((shape["backends"].get(name) or {}).get("roofline") or {}).get("ops") or [])


def markdown(summary: dict, runs: list[dict]) -> str:
    env = runs[0]["environment"] if runs else {}
    proto = runs[0]["protocol"] if runs else {}
    lines = [f"device {env.get('gpu', env.get('cpu', '?'))}, versions {env.get('versions')}, dtype {proto.get('dtype')}, "
             f"contract {proto.get('contract')}, processes {sorted({r['protocol']['processes'] for r in runs})}", "",
             "| shape | procs | eager ms (fastest round) | best fully passing (ms, x) | its fraction of limit (bound) "
             "| best for all-valid calls (ms, x) | failed candidates |",
             "|---|---|---|---|---|---|---|"]
    fmt = lambda b: f"{b[0]} {b[1]:.4g} ms, {b[2]:.2f}x" if b else "none"  # noqa: E731
    for r in summary["rows"]:
        failed = "; ".join(f"{n} {v}" for n, v in r["failed"].items()) or "-"
        eager = f"{r['eager_ms']:.4g} ({r['eager_floor_ms']:.4g})" if r["eager_ms"] else "-"
        errors = f" **errors: {r['errors']}**" if r["errors"] else ""
        lines.append(f"| {r['label']} | {r['processes']} | {eager} | {fmt(r['best_full'])} | "
                     f"{format_fraction(r.get('best_full_roofline'))} | {fmt(r['best_all_valid'])} | "
                     f"{failed}{errors} |")
    g_full, g_valid = summary["geomean_full"], summary["geomean_all_valid"]
    lines += ["", f"geomean over {summary['shapes']} shape(s): fully passing "
              f"{g_full:.2f}x, all-valid calls {g_valid:.2f}x; slowest fully passing "
              f"{summary['min_full']:.2f}x" if g_full and g_valid else "no passing backend timed"]
    if summary["geomean_full_over_eager_floor"]:
        lines.append(f"over eager's fastest round median instead (conservative): fully passing geomean "
                     f"{summary['geomean_full_over_eager_floor']:.2f}x, slowest "
                     f"{summary['min_full_over_eager_floor']:.2f}x")
    if summary.get("geomean_fraction_full"):
        furthest = ", ".join(f"{label} {frac:.2g} ({name}, {bound} bound)"
                             for frac, label, name, bound in summary["furthest_from_limit"])
        lines.append(f"fraction of the roofline limit, fastest fully passing: geomean "
                     f"{summary['geomean_fraction_full']:.3g} over {summary['fraction_shapes']} shape(s); furthest from it: {furthest}")
    ops = [(label, op) for label, op in (summary.get("furthest_ops") or {}).items() if op]
    if ops:
        lines.append("their kernel ops furthest from their own limit (bench.md, Kernel ops against the machine): "
                     + ", ".join(f"{label} {op['op']} {op['runs']} {op['fraction']:.2g} ({op['bound']} bound, "
                                 f"{op['ms']:.4g} ms)" for label, op in ops))
    busy = [(r["label"], t) for r in summary["rows"] if (t := r.get("best_full_timeline") or {}).get("busy_fraction")]
    if busy:  # how much of the fastest's call kernels kept the device busy, and what the rest is (a GPU's timeline)
        lines.append("the fastest fully passing's call, kernels busy of its span (bench.md, Timeline): " + ", ".join(
            f"{label} {t['busy_fraction']:.0%} of {t['median_span_us']:.1f} µs ({t['kernels_per_call']} kernels, gaps "
            f"{t['gap_sum_us']:.1f} µs)" for label, t in busy))
    if summary.get("plans_differed"):
        lines.append("plans that differed between processes (the best's median pools them): " + ", ".join(
            f"{label} {name}" + (f" (launches {'/'.join(map(str, counts))})" if counts else "")
            for label, name, counts in summary["plans_differed"]))
    return "\n".join(lines) + "\n"


def versus(shapes: list[dict], other: str) -> str:
    """Per shape, the fastest fully passing backend's speedup over eager against ``other``'s (both in the same
    processes): how much our best adds to, e.g., plain torch-compile."""
    lines, ratios = ["", f"| shape | best fully passing (x eager) | {other} (x eager) | best / {other} |", "|---|---|---|---|"], []
    for s in shapes:
        b = best(s, (PASSED,))
        o = s["backends"].get(other, {})
        if not b or not o.get("speedup") or o.get("status") not in (PASSED, PASSED_ALL_VALID_ONLY):
            lines.append(f"| {s['label']} | {b[0] if b else 'none'} | {o.get('status', 'not run')} | - |")
            continue
        ratios.append(b[1]["speedup"] / o["speedup"])
        lines.append(f"| {s['label']} | {b[0]} {b[1]['speedup']:.2f}x | {o['speedup']:.2f}x | {ratios[-1]:.2f} |")
    if ratios:
        lines.append(f"\nbest over {other}: geomean {geometric_mean(ratios):.2f}, lowest {min(ratios):.2f} "
                     f"({len(ratios)} shape(s))")
    return "\n".join(lines) + "\n"


def dependent_launch_pairs(shapes: list[dict], suffix: str = "-pdl") -> str:
    """Per shape, every candidate timed both plain and as its ``-pdl`` form (programmatic dependent launches) in the
    same processes: both medians, both statuses and the plain / PDL ratio (above 1: PDL is faster)."""
    lines, ratios = ["", "| shape | candidate | plain ms (status) | -pdl ms (status) | plain / pdl |",
                     "|---|---|---|---|---|"], []
    for s in shapes:
        for name, dependent in s["backends"].items():
            if not name.endswith(suffix) or name.removesuffix(suffix) not in s["backends"]:
                continue
            plain = s["backends"][name.removesuffix(suffix)]
            cell = lambda b: f"{b['median_ms']:.4g} ({b['status']})" if b.get("median_ms") else b["status"]  # noqa: E731
            both = plain.get("median_ms") and dependent.get("median_ms") and \
                plain["status"] == dependent["status"] == PASSED
            ratio = plain["median_ms"] / dependent["median_ms"] if both else None
            if ratio:
                ratios.append(ratio)
            lines.append(f"| {s['label']} | {name.removesuffix(suffix)} | {cell(plain)} | {cell(dependent)} | "
                         f"{f'{ratio:.3f}' if ratio else '-'} |")
    if len(lines) == 3:
        return ""
    if ratios:
        lines.append(f"\nplain / pdl, both fully passing: geomean {geometric_mean(ratios):.3f}, lowest "
                     f"{min(ratios):.3f}, highest {max(ratios):.3f} ({len(ratios)} pair(s))")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+")
    parser.add_argument("--versus", help="also compare the fastest fully passing backend with this one, per shape")
    parser.add_argument("--pdl", action="store_true",
                        help="also compare each candidate with its -pdl form (dependent launches), per shape")
    parser.add_argument("--md", help="also write the table here")
    parser.add_argument("--png", help="also draw every shape's speedups per backend into one chart")
    args = parser.parse_args()
    shapes, runs = load_shapes(args.paths)
    if not shapes:
        print("no bench.json found under " + ", ".join(args.paths), file=sys.stderr)
        return 2
    text = markdown(summarize(shapes), runs) + (versus(shapes, args.versus) if args.versus else "") + \
        (dependent_launch_pairs(shapes) if args.pdl else "")
    if args.md:
        Path(args.md).write_text(text)
    if args.png:  # one chart over all runs, titled with the first run's protocol and device
        plot_speedups({"protocol": runs[0]["protocol"], "environment": runs[0]["environment"], "shapes": shapes},
                      Path(args.png))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

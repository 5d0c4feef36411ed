"""`kkdeploy bench`: accuracy first, then the timing protocol, each shape in its own processes."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from ..config import TransformerConfig, dtype_name
from ..console import console, progress_bar, table
from ..errors import KKError
from ..pipeline.bench import DEFAULT_PROCESSES
from .common import (CUSTOM_SHAPE_FLAGS, add_contract_arg, add_protocol_args, add_runtime_args, add_shape_args,
                     add_tf32_arg, require_validator, resolve_config, resolve_runtime)


def register(sub):
    p = sub.add_parser("bench", help="validate, then time the reference and every candidate (organizer's protocol)")
    add_shape_args(p, required=False)
    p.add_argument("--all", action="store_true", help="official shapes 1-13 (14 takes the long-context path)")
    add_runtime_args(p)
    add_contract_arg(p)
    add_protocol_args(p)
    p.add_argument("--processes", type=int, default=DEFAULT_PROCESSES,
                   help=f"fresh processes per shape, run one after another ({DEFAULT_PROCESSES})")
    p.add_argument("--candidates", help="comma-separated candidates to validate and time (default: per device; "
                   "float32 + judge adds the mixed-precision ones); see docs/benchmark.md")
    add_tf32_arg(p)
    p.add_argument("--artifacts", help="also time kkdeploy.load(DIR) (DIR or DIR/shape-NN for --all)")
    p.add_argument("--no-timeline", dest="timeline", action="store_false",
                   help="skip the profiler's timeline of each backend's calls (on a GPU, after the timing, in the "
                   "first process: span, busy time, the gaps between kernels)")
    p.add_argument("--out", help="output folder (default artifacts/bench-<timestamp>)")
    # internal: one shape in one process
    for flag in ("--_job", "--_options", "--_result", "--_log-dir"):
        p.add_argument(flag, help=argparse.SUPPRESS)
    p.add_argument("--_process", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--_worker", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(func=run)


def run(args) -> int:
    from ..pipeline.bench import BENCH_SHAPES, BenchOptions, jobs_for, parse_candidates, run_bench, tf32_enabled

    require_validator()
    if args._worker:
        return run_worker_process(args)
    custom_given = [CUSTOM_SHAPE_FLAGS[f] for f in CUSTOM_SHAPE_FLAGS if getattr(args, f, None) is not None]
    if args.all:
        if args.shape is not None or custom_given:
            raise KKError("--all cannot be combined with --shape or a custom shape")
        jobs = jobs_for(BENCH_SHAPES, None)
    else:
        if args.shape is None and not custom_given:
            raise KKError("give --shape N, --all, or a full custom shape (--batch-size ... --layers)")
        if args.shape is not None:
            jobs = jobs_for([args.shape], None)  # refuses the long-context shape with a pointer
        else:
            jobs = jobs_for(None, resolve_config(args)[1])
    device, dtype = resolve_runtime(args)
    options = BenchOptions(device=str(device), dtype=dtype_name(dtype), contract=args.contract,
                           processes=args.processes, warmups=args.warmups, repeats=args.repeats, rounds=args.rounds,
                           seed=args.seed, trials=args.trials, padding_ratio=args.padding_ratio,
                           weights=args.weights, artifacts=args.artifacts, candidates=parse_candidates(args.candidates),
                           tf32=args.tf32, timeline=args.timeline).check()
    out = Path(args.out or f"artifacts/bench-{time.strftime('%Y%m%d-%H%M%S')}")
    console.print(f"bench {len(jobs)} shape(s), {options.dtype} on {device}, contract {options.contract}, "
                  f"tf32 {'on' if tf32_enabled(options, device, dtype) else 'off'}, "
                  f"{options.processes} process(es) x {options.rounds} rounds x ({options.warmups} warmups + "
                  f"{options.repeats} repeats) -> {out}")
    with progress_bar("bench", len(jobs) * options.processes) as bar:
        data = run_bench(jobs, options, out, command="kkdeploy " + shlex.join(sys.argv[1:]), progress=bar)
    print_summary(data)
    chart = out / "bench.png" if data["chart"] == "bench.png" else data["chart"]
    console.print(f"wrote {out / 'bench.json'}, {out / 'bench.md'}; chart: {chart}")
    return 1 if any(s["errors"] for s in data["shapes"]) else 0


def print_summary(data: dict) -> None:
    from ..pipeline.bench import EAGER, _limits_text, geometric_mean, shape_op_rooflines
    from ..pipeline.op_roofline import furthest_in_plan
    from ..pipeline.roofline import format_fraction
    from ..pipeline.timeline import summary_line

    rows = []
    speedups: dict[str, list[float]] = {}
    for shape in data["shapes"]:
        for name, b in shape["backends"].items():
            failed = "/".join(str(n) for n in b.get("failed_elements", {}).values()) or "-"
            peak = b.get("peak_memory_bytes")
            rows.append([shape["label"], name, b["status"], failed,
                         f"{b['median_ms']:.4g}" if "median_ms" in b else "-",
                         f"{b['p90_ms']:.4g}" if "p90_ms" in b else "-",
                         f"{peak / 2**20:.1f}" if peak else "-",
                         f"{b['tokens_per_s']:,.0f}" if b.get("tokens_per_s") else "-",
                         f"{b['speedup']:.2f}x" if b.get("speedup") else "-",
                         format_fraction(b.get("roofline"))])
            if b.get("speedup") and name != EAGER:
                speedups.setdefault(name, []).append(b["speedup"])
        for err in shape["errors"]:
            console.print(f"[red]{shape['label']}: {err}[/]")
    console.print(table("Benchmark", ["shape", "backend", "status", "failed (valid/padded)", "median ms", "p90 ms",
                                      "peak MiB", "tokens/s", "speedup", "fraction of limit"], rows))
    for shape in data["shapes"]:
        roofline = shape.get("roofline")
        if roofline:
            work = roofline["work"]
            console.print(f"roofline {shape['label']}: {work['flops']['total'] / 1e9:.4g} GFLOP, "
                          f"{work['bytes']['total'] / 1e6:.4g} MB per call; {_limits_text(roofline['limits'])}")
        for name, b in shape["backends"].items():  # where a call's time goes between kernels (GPU only)
            if (b.get("timeline") or {}).get("median_span_us") is not None:
                console.print(summary_line(f"timeline {shape['label']} {name}", b["timeline"]))
        furthest = furthest_in_plan(shape_op_rooflines(shape))
        if furthest:  # why the shape sits where it does (bench.md: Kernel ops against the machine)
            console.print(f"kernel op furthest from its limit, {shape['label']}: {furthest['op']} {furthest['shape']} "
                          f"({furthest['runs']}) {furthest['ms']:.4g} ms, {furthest['fraction']:.2g} of its "
                          f"{furthest['bound']} limit")
    if len(data["shapes"]) > 1:
        for name, values in speedups.items():
            console.print(f"{name}: geometric-mean speedup {geometric_mean(values):.2f}x over "
                          f"{len(values)}/{len(data['shapes'])} shape(s)")


def run_worker_process(args) -> int:
    from ..artifacts import write_json

    from ..pipeline.bench import BenchOptions, ShapeJob, run_worker

    job_data = json.loads(args._job)
    job = ShapeJob(job_data["label"], job_data["shape_id"], TransformerConfig.from_dict(job_data["config"]))
    options = BenchOptions(**json.loads(args._options))
    log_dir = Path(args._log_dir) if args._log_dir else None
    result = run_worker(job, options, args._process, log_dir)
    write_json(args._result, result)
    for name, b in result["backends"].items():
        lat = b.get("latency")
        print(f"{job.label} p{args._process} {name}: {b['status']}"
              + (f", median {lat['median_ms']:.4g} ms" if lat else f" ({b.get('reason', '')})"))
    return 0

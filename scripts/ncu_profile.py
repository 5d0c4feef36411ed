#!/usr/bin/env python3
"""Each kernel of a bench candidate's call under Nsight Compute: its time, its DRAM traffic and how close it runs to
the memory and compute limits.

    python3 scripts/ncu_profile.py --shape 6 --candidate torch-compile-faithful-gemms [--weights W] --out DIR
    python3 scripts/ncu_profile.py --dims B,S,D,H,F,L --weights W --candidate NAME --out DIR

Why: `kkdeploy bench`'s roofline says how far a whole call is from the machine's limit. To attack the largest term,
one needs each kernel's share and why it is slow. The kernel's speed of light says that: DRAM throughput and SM
throughput as percentages of their peaks, achieved occupancy, and registers per thread.

How: this script starts itself under ``ncu``. The inner process builds the candidate as `kkdeploy bench` does
(``kkdeploy.pipeline.bench.make_candidate``: the same proofs and compile, in float16 under the strict contract
unless told otherwise). It warms it up, then runs ``--calls`` calls between ``cudaProfilerStart`` and
``cudaProfilerStop``. ncu profiles only the kernels launched in between (``--profile-from-start off``), each node
of a CUDA graph on its own (``--graph-profiling node``), and writes one CSV row per kernel (``--page raw
--print-units base``). The outer process reads the CSV.
It writes ``ncu.csv`` (ncu's own output, kept so a format surprise can be re-read offline), ``ncu.json`` and
``ncu.md``, and prints the kernels by time per call.

A kernel's ``bound`` is a reading of its speed of light, and a heuristic: ``memory`` when its DRAM throughput
is at least 60% of peak, else ``compute`` when its SM throughput is, else ``latency`` (neither unit is busy:
too few programs, a dependent chain, or the ramp and tail of a short kernel). Profiling replays each kernel, so
the times are ncu's, not the bench's: the shares are what matter. Accuracy is not checked here.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # profile_candidate's helpers, loaded as a test loads us

from kkdeploy.errors import KKError  # noqa: E402
from profile_candidate import kernel_class, parse_dims  # noqa: E402  the same kernel classes and --dims parser

#: what ncu collects per kernel (base units: nsecond, byte, %; counts as numbers)
METRICS = {
    "duration": "gpu__time_duration.sum",
    "dram_read": "dram__bytes_read.sum",
    "dram_write": "dram__bytes_write.sum",
    "dram_pct": "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "memory_pct": "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed",
    "sm_pct": "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "occupancy_pct": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "registers": "launch__registers_per_thread",
    "grid": "launch__grid_size",
    "block": "launch__block_size",
}
BUSY_PCT = 60.0  # a unit at or above this share of its peak is what bounds the kernel (the heuristic above)
#: ncu's section whose raw metrics say why warps did not issue: each reason's stalled warps per issued instruction
#: (``smsp__average_warps_issue_stalled_<reason>_per_issue_active.ratio``). Read by pattern, not by name, so an ncu
#: that adds or renames a reason is read all the same; a kernel without them has no ``stalls``.
STALL_SECTION = "WarpStateStats"
STALL_COLUMN = re.compile(r"^smsp__average_warps?_issue_stalled_(?P<reason>\w+?)_per_issue_active\.ratio$")
TIME_UNITS = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3, "second": 1e6,
              "s": 1e6}  # -> microseconds
BYTE_UNITS = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "KB": 1e3, "MB": 1e6, "GB": 1e9}


def find_ncu() -> str:
    """The ncu executable: $NCU, PATH, the CUDA toolkit's, or an Nsight Compute install under /opt/nvidia."""
    import glob

    override = os.environ.get("NCU")
    candidates = [override] if override else []
    candidates += [shutil.which("ncu"), "/usr/local/cuda/bin/ncu",
                   *sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"), reverse=True),
                   *sorted(glob.glob("/usr/local/cuda-*/bin/ncu"), reverse=True)]
    for path in filter(None, candidates):
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    if override:
        raise KKError(f"NCU={override} is not an executable; point it at Nsight Compute's ncu")
    raise KKError("Nsight Compute's ncu was not found (PATH, /usr/local/cuda/bin, /opt/nvidia/nsight-compute); "
                  "install Nsight Compute or set NCU")


def ncu_command(ncu: str, csv_path: Path, inner: list[str], launch_count: int) -> list[str]:
    """ncu around ``inner`` (the inner process's argv): only the kernels between cudaProfilerStart and Stop, graph
    nodes one by one, in that process alone (Inductor's compile workers and ptxas are left uninstrumented)."""
    return [ncu, "--target-processes", "application-only", "--profile-from-start", "off", "--graph-profiling", "node",
            "--launch-count", str(launch_count),
            "--metrics", ",".join(METRICS.values()), "--section", STALL_SECTION, "--csv", "--page", "raw",
            "--print-units", "base",
            "--log-file", str(csv_path), *inner]


def _number(text: str) -> float | None:
    text = (text or "").strip().replace(",", "")
    if text in ("", "n/a", "N/A"):
        return None
    try:
        return float(text)
    except ValueError:
        return None


def parse_raw_csv(text: str) -> list[dict]:
    """ncu's ``--csv --page raw`` output (lines before the header, such as ``==PROF==`` notes, skipped): a header
    row, a units row, then one row per profiled kernel. Each kernel as ``{"name", "stream", metric keys...}``, times
    in microseconds and bytes in bytes whatever unit ncu printed."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID",')), None)
    if start is None:
        raise KKError("no kernel rows in ncu's output (no CSV header): were any kernels launched between "
                      "cudaProfilerStart and Stop, and may this user read the GPU's performance counters?")
    rows = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    header, units, data = rows[0], rows[1], rows[2:]
    column = {name: i for i, name in enumerate(header)}
    missing = [m for m in METRICS.values() if m not in column]
    if "Kernel Name" not in column or missing:
        raise KKError(f"ncu's CSV lacks {', '.join(missing) or 'Kernel Name'}: this ncu names its metrics otherwise; "
                      f"ncu.csv keeps its output")
    stall_columns = {m["reason"]: i for i, name in enumerate(header) if (m := STALL_COLUMN.match(name))}
    kernels = []
    for row in data:
        if len(row) < len(header):
            continue
        kernel = {"name": row[column["Kernel Name"]], "stream": row[column["Stream"]] if "Stream" in column else ""}
        stalls = {reason: _number(row[i]) for reason, i in stall_columns.items()}
        kernel["stalls"] = {reason: value for reason, value in stalls.items() if value is not None}
        for key, metric in METRICS.items():
            i = column[metric]
            value, unit = _number(row[i]), units[i].strip()
            if value is not None and unit in TIME_UNITS:
                value *= TIME_UNITS[unit]
            elif value is not None and unit in BYTE_UNITS:
                value *= BYTE_UNITS[unit]
            kernel[key] = value
        kernels.append(kernel)
    return kernels


def bound(kernel: dict) -> str:
    dram, sm = kernel.get("dram_pct") or 0.0, kernel.get("sm_pct") or 0.0
    if dram >= BUSY_PCT and dram >= sm:
        return "memory"
    if sm >= BUSY_PCT:
        return "compute"
    return "memory" if dram >= BUSY_PCT else "latency"


def summarize(kernels: list[dict], calls: int) -> dict:
    """Per call: every kernel name's time and share, its traffic and speed of light (the mean over its launches),
    the classes' totals, and the three largest terms."""
    groups: dict[str, list[dict]] = {}
    for k in kernels:
        groups.setdefault(k["name"], []).append(k)
    total_us = sum(k["duration"] or 0.0 for k in kernels) / calls
    rows = []
    for name, launches in groups.items():
        us = sum(k["duration"] or 0.0 for k in launches) / calls
        nbytes = sum((k["dram_read"] or 0.0) + (k["dram_write"] or 0.0) for k in launches) / calls

        def mean(key, launches=launches):
            values = [k[key] for k in launches if k.get(key) is not None]
            return sum(values) / len(values) if values else None

        reasons = {reason for k in launches for reason in k.get("stalls", {})}
        stalls = {reason: statistics.fmean(k["stalls"][reason] for k in launches if reason in k.get("stalls", {}))
                  for reason in reasons}  # over the launches that report the reason
        row = {"name": name, "class": kernel_class(name), "launches_per_call": len(launches) / calls,
               "us_per_call": us, "share": us / total_us if total_us else None, "dram_bytes_per_call": nbytes,
               "dram_gb_s": nbytes / (us * 1e3) if us else None,
               **{key: mean(key) for key in ("dram_pct", "memory_pct", "sm_pct", "occupancy_pct", "registers")},
               "grid": launches[0].get("grid"), "block": launches[0].get("block"),
               "stalls": dict(sorted(stalls.items(), key=lambda kv: -kv[1]))}  # largest first
        row["bound"] = bound(row)
        rows.append(row)
    rows.sort(key=lambda r: r["us_per_call"], reverse=True)
    classes: dict[str, float] = {}
    for r in rows:
        classes[r["class"]] = classes.get(r["class"], 0.0) + r["us_per_call"]
    return {"kernels_per_call": len(kernels) / calls, "us_per_call": total_us, "classes_us_per_call": classes,
            "largest": [{"name": r["name"], "class": r["class"], "share": r["share"], "bound": r["bound"],
                         "stalls": dict(list(r["stalls"].items())[:3])} for r in rows[:3]],
            "kernels": rows}


def markdown(summary: dict, title: str, top: int) -> str:
    lines = [f"# {title}", "",
             f"{summary['kernels_per_call']:g} kernels, {summary['us_per_call']:.1f} µs per call under ncu (each kernel "
             f"replayed: the shares matter, not the sum). By class: " + ", ".join(
                 f"{c} {us:.1f} µs" for c, us in sorted(summary["classes_us_per_call"].items(), key=lambda kv: -kv[1])),
             "", "| µs/call | share | launches | class | bound | DRAM % | SM % | occupancy % | regs | DRAM GB/s | grid x block "
             "| stalls (warps per issue) | kernel |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    for r in summary["kernels"][:top]:
        lines.append(f"| {r['us_per_call']:.2f} | {fmt(r['share'], '.1%')} | {r['launches_per_call']:g} | {r['class']} | "
                     f"{r['bound']} | {fmt(r['dram_pct'], '.0f')} | {fmt(r['sm_pct'], '.0f')} | "
                     f"{fmt(r['occupancy_pct'], '.0f')} | {fmt(r['registers'], '.0f')} | {fmt(r['dram_gb_s'], '.0f')} | "
                     f"{fmt(r['grid'], '.0f')} x {fmt(r['block'], '.0f')} | "
                     f"{', '.join(f'{k} {v:.1f}' for k, v in list(r['stalls'].items())[:3]) or '-'} | {r['name'][:90]} |")
    return "\n".join(lines) + "\n"


def inner(args) -> int:
    """Runs under ncu: the candidate's build and warm-up unprofiled, then ``--calls`` calls profiled."""
    import torch

    from kkdeploy.config import dtype_name, parse_dtype, resolve_device
    from kkdeploy.inputs import DEFAULT_SEED, TIMED_SEED_OFFSET, generate_case
    from kkdeploy.models.weights import build_models
    from kkdeploy.pipeline.bench import BenchOptions, make_candidate, set_process_tf32

    device, dtype = resolve_device(args.device), parse_dtype(args.dtype)
    config = _config(args)
    options = BenchOptions(device=str(device), dtype=dtype_name(dtype), contract=args.contract,
                           candidates=[args.candidate], weights=args.weights).check()
    set_process_tf32(options, device, dtype)
    reference, _ = build_models(config, dtype, device, weights=args.weights, sdpa_layers=0)
    info: dict = {}
    runner = make_candidate(args.candidate, reference, config, dtype, device, options, info, {})[0]
    x, mask = generate_case(config, device, dtype, DEFAULT_SEED + TIMED_SEED_OFFSET)
    with torch.inference_mode():
        for _ in range(args.warmups):
            runner(x, mask)
        cuda = device.type == "cuda"  # the inner process runs on the CPU only in tests (its plumbing, without ncu)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.profiler.start()  # cudaProfilerStart: ncu (--profile-from-start off) profiles from here
        for _ in range(args.calls):
            runner(x, mask)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
    print(json.dumps({"candidate": args.candidate, "config": config.to_dict(), "info": info}, default=str))
    return 0


def _config(args):
    if args.dims is not None:
        return parse_dims(args.dims)
    from kkdeploy.config import official_config

    return official_config(args.shape)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--shape", type=int, help="official shape id")
    where.add_argument("--dims", help="a non-official shape: B,S,D,H,F,L")
    parser.add_argument("--candidate", default="torch-compile-faithful-gemms", help="one `kkdeploy bench` candidate")
    parser.add_argument("--weights", default=None, help="safetensors file or torch state dict (default: seeded)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--contract", default="strict", choices=("strict", "judge"))
    parser.add_argument("--calls", type=int, default=1, help="calls profiled (default 1)")
    parser.add_argument("--warmups", type=int, default=3)
    parser.add_argument("--launch-count", type=int, default=400, help="ncu stops after this many kernels")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out", default="ncu-out")
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        if args.calls < 1 or args.warmups < 0 or args.launch_count < 1:
            raise KKError("--calls and --launch-count must be >= 1 and --warmups >= 0")
        if args.shape is not None:
            from kkdeploy.config import LONG_CONTEXT_SHAPES, official_config

            official_config(args.shape)  # an unknown id is a one-line error
            if args.shape in LONG_CONTEXT_SHAPES:
                raise KKError(f"shape {args.shape} is long-context: profile it on its bounded-memory path instead")
        _config(args)
        from kkdeploy.pipeline.bench import parse_candidates

        if len(parse_candidates(args.candidate)) != 1:
            raise KKError("--candidate takes one bench candidate")
        if args.inner:
            return inner(args)
        import torch

        if not args.device.startswith("cuda") or not torch.cuda.is_available():
            raise KKError(f"Nsight Compute profiles CUDA kernels and this run is on {args.device!r}"
                          f"{'' if torch.cuda.is_available() else ' with no CUDA GPU visible'}: run it on the GPU machine")
        ncu = find_ncu()
    except KKError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    csv_path = out / "ncu.csv"
    forwarded = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--inner"]
    command = ncu_command(ncu, csv_path, [sys.executable, str(Path(__file__).resolve()), "--inner", *forwarded],
                          args.launch_count)
    print("running:", " ".join(command), flush=True)
    done = subprocess.run(command, capture_output=True, text=True)
    (out / "inner.log").write_text(done.stdout + done.stderr)
    text = csv_path.read_text() if csv_path.is_file() else ""
    if "ERR_NVGPUCTRPERM" in text + done.stdout + done.stderr:
        print("error: this user may not read the GPU's performance counters (ERR_NVGPUCTRPERM); run as root or set "
              "NVreg_RestrictProfilingToAdminUsers=0", file=sys.stderr)
        return 2
    try:
        kernels = parse_raw_csv(text)
    except KKError as exc:
        print(f"error: {exc} (exit {done.returncode}; see {out / 'inner.log'})", file=sys.stderr)
        return 2
    summary = summarize(kernels, args.calls)
    where = f"shape {args.shape}" if args.shape is not None else f"dims {args.dims}"
    title = f"ncu: {args.candidate} on {where}, {args.dtype} {args.contract}, weights {args.weights or 'seeded'}"
    report = {"title": title, "command": command, "calls": args.calls, "weights": args.weights or "seeded",
              "ncu_exit": done.returncode, "summary": summary, "raw_kernels": kernels}
    (out / "ncu.json").write_text(json.dumps(report, indent=1))
    md = markdown(summary, title, args.top)
    (out / "ncu.md").write_text(md)
    print(md)
    print("largest terms: " + "; ".join(f"{r['name'][:60]} {r['share']:.0%} ({r['bound']})"
                                        for r in summary["largest"] if r["share"] is not None))
    return 0 if done.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

"""AOTInductor variants against the eager reference: strict failures, speedup, build times.

For each shape: build every variant (``engines.inductor``; the build cache makes a rerun cheap),
load it as ``kkdeploy.load`` would, run ``--trials`` seeds x {all-valid, padded} through the strict
rule against the eager reference, then time eager and every variant with the organizer's protocol
(``kkdeploy.pipeline.timing``: CUDA events on a GPU, warmups, repeats, alternating rounds).

    # on the H200 (one call must fit ~8 minutes; split the shapes, the cache carries over)
    python scripts/inductor_h200.py --shapes 1-4 --time-budget-s 420
    # CPU smoke
    python scripts/inductor_h200.py --device cpu --custom tiny

The bench protocol's "3 processes" is three invocations (each writes its own --out). JSON goes to
--out (default $OUT/inductor_h200.json, else ./inductor_h200.json) after every shape, so a run cut
short keeps what it measured; the table is printed last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from engines.base import BUILT, BuildContext  # noqa: E402
from engines.inductor import BACKEND  # noqa: E402
from kkdeploy.config import TransformerConfig, default_dtype, dtype_name, official_config, parse_dtype, resolve_device  # noqa: E402
from kkdeploy.errors import KKError  # noqa: E402
from kkdeploy.inputs import TIMED_SEED_OFFSET, generate_case  # noqa: E402
from kkdeploy.pipeline.timing import measure_latency  # noqa: E402
from kkdeploy.models.weights import build_models  # noqa: E402
from validation.strict import CONTRACTS, compare_outputs  # noqa: E402

CUSTOM = {"tiny": TransformerConfig(2, 8, 16, 2, 16, 2), "small": TransformerConfig(4, 64, 64, 4, 64, 2)}
DEFAULT_VARIANTS = "inductor,inductor-fused,inductor-sdpa1"
PADDING_RATIO = 0.25


def parse_shapes(text: str) -> list[int]:
    ids: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if "-" in part:
            lo, hi = part.split("-")
            ids.extend(range(int(lo), int(hi) + 1))
        elif part:
            ids.append(int(part))
    return ids


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def validate(runner, reference, config, dtype, device, seed: int, trials: int, all_valid_only: bool,
             references: dict) -> dict:
    """Strict comparison per trial and mask mode; the reference outputs are computed once per shape."""
    atol, rtol = CONTRACTS["strict"]
    per_mode = {}
    for mode, ratio in (("all-valid", 0.0), ("padded", PADDING_RATIO)):
        if mode == "padded" and all_valid_only:
            per_mode[mode] = {"status": "n/a (all-valid only)"}
            continue
        failed = total = bitwise = 0
        max_abs = 0.0
        for t in range(trials):
            x, mask = generate_case(config, device, dtype, seed + t, padding_ratio=ratio)
            key = (mode, t)
            if key not in references:
                with torch.inference_mode():
                    references[key] = reference(x, mask)
            out = runner(x, mask)
            report = compare_outputs(references[key], out, atol, rtol)
            failed += report.failed
            total += report.total
            max_abs = max(max_abs, report.max_abs)
            bitwise += int(torch.equal(references[key], out))
        per_mode[mode] = {"failed": failed, "total": total, "max_abs": max_abs, "bitwise_trials": bitwise,
                          "trials": trials}
    return per_mode


def run_shape(label: str, config: TransformerConfig, args, device, dtype, deadline: float, work: Path) -> dict:
    record = {"shape": label, "config": config.to_dict(), "dtype": dtype_name(dtype), "device": str(device),
              "variants": {}}
    reference, _ = build_models(config, dtype, device)
    references: dict = {}
    runners = {}
    for variant in args.variants:
        entry = record["variants"][variant] = {}
        if time.monotonic() > deadline:
            entry["status"] = "skipped: time budget spent"
            continue
        out_dir = work / f"{label}-{variant}"
        ctx = BuildContext(config, dtype, device, reference, out_dir,
                           options={"cuda_graph": not args.no_cuda_graph,
                                    **({"cache_dir": args.cache_dir} if args.cache_dir else {})})
        result = BACKEND.build(ctx, variant)
        entry.update(status=result.status, reason=result.reason, build_seconds=result.build_seconds,
                     cache=result.options.get("cache"), compile_seconds=result.options.get("compile_seconds"),
                     export_seconds=result.options.get("export_seconds"),
                     all_valid_only=result.options.get("all_valid_only"))
        if result.status != BUILT:
            continue
        try:
            runner = BACKEND.load(out_dir, result.to_dict(), config, dtype, device)
        except KKError as exc:
            entry["load_error"] = str(exc)
            if device.type != "cuda" or args.no_cuda_graph:
                continue
            entry2 = {**result.to_dict(), "options": {**result.options, "cuda_graph": False}}
            runner = BACKEND.load(out_dir, entry2, config, dtype, device)  # plain AOTI call, flagged
        entry["cuda_graph"] = runner.captured is not None
        entry["validation"] = validate(runner, reference, config, dtype, device, args.seed, args.trials,
                                       bool(result.options.get("all_valid_only")), references)
        entry["failed"] = sum(m.get("failed", 0) for m in entry["validation"].values())
        runners[variant] = runner
    references.clear()
    if runners and time.monotonic() < deadline:
        x, mask = generate_case(config, device, dtype, args.seed + TIMED_SEED_OFFSET)

        def eager():
            with torch.inference_mode():
                return reference(x, mask)

        fns = {"eager": eager, **{v: (lambda r=r: r(x, mask)) for v, r in runners.items()}}
        stats = measure_latency(fns, device, warmups=args.warmups, repeats=args.repeats, rounds=args.rounds)
        record["eager_ms"] = stats["eager"].median_ms
        for v in runners:
            record["variants"][v]["median_ms"] = stats[v].median_ms
            record["variants"][v]["speedup"] = stats["eager"].median_ms / stats[v].median_ms
    elif runners:
        record["timing"] = "skipped: time budget spent"
    runners.clear()
    del reference
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return record


def table(records: list[dict], variants: list[str]) -> str:
    lines = [f"{'shape':>6} {'eager ms':>9} " + " ".join(f"{v[:22]:>34}" for v in variants),
             f"{'':>6} {'':>9} " + " ".join(f"{'failed  speedup  build s (cache)':>34}" for _ in variants)]
    for rec in records:
        cells = []
        for v in variants:
            e = rec["variants"].get(v, {})
            if "failed" not in e:
                cells.append(f"{(e.get('status') or '-')[:34]:>34}")
                continue
            speed = f"{e['speedup']:.2f}x" if "speedup" in e else "-"
            avo = "*" if e.get("all_valid_only") else ""
            modes = [m for m in e["validation"].values() if "trials" in m]
            if modes and all(m["bitwise_trials"] == m["trials"] for m in modes):
                avo += "="
            cells.append(f"{str(e['failed']) + avo:>8} {speed:>8} {e['build_seconds']:>8.1f} ({e['cache']})"
                         .rjust(34))
        eager = f"{rec['eager_ms']:.3f}" if "eager_ms" in rec else "-"
        lines.append(f"{rec['shape']:>6} {eager:>9} " + " ".join(cells))
    speedups = {v: [r["variants"][v]["speedup"] for r in records
                    if r["variants"].get(v, {}).get("failed") == 0 and "speedup" in r["variants"][v]]
                for v in variants}
    for v, s in speedups.items():
        if s:
            lines.append(f"{v}: geomean speedup over shapes with 0 failures = "
                         f"{math.exp(sum(map(math.log, s)) / len(s)):.2f}x over {len(s)} shapes, min {min(s):.2f}x")
    lines.append("= bitwise identical to eager in every trial; * all-valid only (padded calls go to the fallback)")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="1-13", help="official ids, e.g. 1-13 or 2,3,12 (default 1-13)")
    p.add_argument("--custom", choices=sorted(CUSTOM), help="a small custom shape instead of --shapes")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", help="default float16 on CUDA, float32 on the CPU")
    p.add_argument("--variants", default=None, help=f"comma list (default {DEFAULT_VARIANTS})")
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--warmups", type=int, default=20)
    p.add_argument("--repeats", type=int, default=100)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--time-budget-s", type=float, default=450.0,
                   help="no new build or timing starts after this many seconds (default 450)")
    p.add_argument("--cache-dir", help="package cache (default $KKDEPLOY_CACHE_DIR or ~/.cache/kkdeploy/inductor)")
    p.add_argument("--no-cuda-graph", action="store_true")
    p.add_argument("--out", help="JSON path (default $OUT/inductor_h200.json or ./inductor_h200.json)")
    args = p.parse_args(argv)
    start = time.monotonic()
    deadline = start + args.time_budget_s
    try:
        device = resolve_device(args.device)
        dtype = parse_dtype(args.dtype) if args.dtype else (torch.float16 if device.type == "cuda" else default_dtype(device))
        args.variants = [v.strip() for v in (args.variants or DEFAULT_VARIANTS).split(",") if v.strip()]
        shapes = [(args.custom, CUSTOM[args.custom])] if args.custom else \
            [(f"{i:02d}", official_config(i)) for i in parse_shapes(args.shapes)]
        reason = BACKEND.unavailable_reason(device, dtype)
        if reason:
            raise KKError(reason)
    except KKError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out_path = Path(args.out) if args.out else Path(os.environ.get("OUT", ".")) / "inductor_h200.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    env = {"torch": torch.__version__, "device": str(device),
           "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "dtype": dtype_name(dtype), "variants": args.variants, "trials": args.trials, "seed": args.seed,
           "warmups": args.warmups, "repeats": args.repeats, "rounds": args.rounds, "argv": sys.argv[1:]}
    records: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="kk-inductor-") as tmp:
        for label, config in shapes:
            if time.monotonic() > deadline:
                records.append({"shape": label, "config": config.to_dict(), "variants": {},
                                "status": "skipped: time budget spent"})
                continue
            t0 = time.monotonic()
            print(f"shape {label}: {config.describe()} {dtype_name(dtype)} on {device}", flush=True)
            rec = run_shape(label, config, args, device, dtype, deadline, Path(tmp))
            rec["shape_seconds"] = round(time.monotonic() - t0, 1)
            records.append(rec)
            for v, e in rec["variants"].items():
                print(f"  {v}: {json.dumps({k: e.get(k) for k in ('status', 'cache', 'build_seconds', 'failed', 'speedup')})}",
                      flush=True)
            out_path.write_text(json.dumps({"env": env, "records": records}, indent=2))
    out_path.write_text(json.dumps({"env": env, "records": records,
                                    "wall_seconds": round(time.monotonic() - start, 1)}, indent=2))
    print(f"wrote {out_path}")
    print(table(records, args.variants))
    return 0


if __name__ == "__main__":
    sys.exit(main())

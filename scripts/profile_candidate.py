#!/usr/bin/env python3
"""Where a bench candidate's time goes: a kernel profile of eager and one candidate on one shape (issue 6).

    python scripts/profile_candidate.py --shape 8 [--device auto] [--dtype float32] [--contract judge]
        [--candidate NAME[,NAME...]] [--calls 20] [--warmups 10] [--trials 5] [--top 12] [--out DIR]
    python scripts/profile_candidate.py --dims B,S,D,H,F,L --weights W.safetensors --dtype float16 \
        --contract strict --candidate torch-compile,torch-compile-faithful-kernels

A non-official shape (``--dims``) and a weights file (``--weights``) profile what a user's build would time; several
candidates are profiled one after another in the same process, beside the same eager run. Each candidate is built
by ``kkdeploy.pipeline.bench.make_candidate``, so it is the very runner `kkdeploy bench` times (same calibration,
same compile, same TF32 setting, same timed input). After ``--warmups`` calls,
``--calls`` calls of eager and of the candidate run under torch.profiler: device kernels on a GPU, CPU ops
otherwise. Per backend it prints the time per call by class (GEMM, attention, Triton fusion, layer norm, copy or cast,
other) and the top kernels, and on a GPU the call's timeline (span, busy time, the gaps between kernels:
``kkdeploy.pipeline.timeline``), and writes ``profile.json`` and one Chrome trace per backend under ``--out``.
Accuracy is not checked here: `kkdeploy bench` does that.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from kkdeploy.pipeline.bench import (EAGER, BenchOptions, environment, jobs_for, make_candidate,  # noqa: E402
                            parse_candidates, set_process_tf32)
from kkdeploy.config import TransformerConfig, dtype_name, parse_dtype, resolve_device  # noqa: E402
from kkdeploy.errors import KKError  # noqa: E402
from kkdeploy.inputs import DEFAULT_SEED, TIMED_SEED_OFFSET, generate_case  # noqa: E402
from kkdeploy.models.weights import build_models  # noqa: E402
from kkdeploy.pipeline.timeline import summary_line, trace_timeline  # noqa: E402

# First match wins: attention kernels often carry "cutlass" or "gemm" in their names too. Our own kernels by their
# names (_faithful_attention_kernel, causal_block_softmax_kernel, _fused_linear_kernel, layer_norm_*_f16_kernel).
KERNEL_CLASSES = (
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn_generated", "block_softmax")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "fused_linear", "aten::mm", "aten::addmm", "aten::bmm",
              "aten::_addmm")),
    ("triton", ("triton_",)),
    ("layer norm", ("layer_norm", "layernorm")),
    ("copy/cast", ("memcpy", "memset", "copy", "aten::to", "aten::_to_copy")),
)
CLASSES = [name for name, _ in KERNEL_CLASSES] + ["other"]


def kernel_class(name: str) -> str:
    low = name.lower()
    for cls, needles in KERNEL_CLASSES:
        if any(n in low for n in needles):
            return cls
    return "other"


def default_candidate(device: torch.device) -> str:
    """The float32 judge candidate campaign 7 found fastest on 11 of 13 shapes."""
    return "torch-compile-fused-half-gemm-mixed" if device.type == "cuda" else "fused-half-gemm-mixed"


def kernel_rows(prof, on_gpu: bool, calls: int) -> list[dict]:
    """Self time per call of every device kernel (GPU) or CPU op (CPU), largest first."""
    from torch.autograd import DeviceType

    rows = []
    for e in prof.key_averages():
        if on_gpu and e.device_type != DeviceType.CUDA:
            continue
        us = e.self_device_time_total if on_gpu else e.self_cpu_time_total
        if us > 0:
            rows.append({"name": e.key, "class": kernel_class(e.key), "launches_per_call": e.count / calls,
                         "ms_per_call": us / 1000.0 / calls})
    return sorted(rows, key=lambda r: r["ms_per_call"], reverse=True)


def class_totals(rows: list[dict]) -> dict[str, float]:
    totals = dict.fromkeys(CLASSES, 0.0)
    for r in rows:
        totals[r["class"]] += r["ms_per_call"]
    return totals


def profile_runner(runner, x, mask, device: torch.device, warmups: int, calls: int, trace: Path) -> dict:
    from torch.profiler import ProfilerActivity, profile

    on_gpu = device.type == "cuda"
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    for _ in range(warmups):
        runner(x, mask)
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(calls):
            runner(x, mask)
        sync()
        wall = time.perf_counter() - start
    prof.export_chrome_trace(str(trace))
    rows = kernel_rows(prof, on_gpu, calls)
    if not rows:
        print(f"note: the profiler recorded no {'device kernels' if on_gpu else 'CPU ops'}; see {trace.name}")
    return {"wall_ms_per_call_profiled": wall * 1000.0 / calls, "kernel_ms_per_call": sum(r["ms_per_call"] for r in rows),
            "classes_ms_per_call": class_totals(rows), "kernels": rows, "trace": trace.name,
            "timing": "device kernels (CUPTI)" if on_gpu else "CPU op self time",
            "timeline": trace_timeline(trace, calls)}


def print_report(name: str, result: dict, top: int) -> None:
    total = result["kernel_ms_per_call"] or float("nan")
    print(f"\n{name}: {result['kernel_ms_per_call']:.4f} ms per call in {result['timing']} "
          f"({result['wall_ms_per_call_profiled']:.4f} ms wall per call under the profiler)")
    print("  " + ", ".join(f"{c} {ms:.4f} ms ({100 * ms / total:.0f}%)"
                           for c, ms in result["classes_ms_per_call"].items() if ms > 0))
    timeline = result.get("timeline") or {}
    if "median_span_us" in timeline:
        print("  " + summary_line("timeline", timeline))
    print("  | ms/call | % | launches/call | class | kernel |")
    print("  |---|---|---|---|---|")
    for r in result["kernels"][:top]:
        print(f"  | {r['ms_per_call']:.4f} | {100 * r['ms_per_call'] / total:.1f} | {r['launches_per_call']:g} | "
              f"{r['class']} | {r['name'][:100]} |")


def parse_dims(text: str) -> TransformerConfig:
    """``B,S,D,H,F,L`` as `kkdeploy build`'s custom-shape flags would give them, with the same checks."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if len(values) != 6:
        raise KKError(f"--dims takes six integers B,S,D,H,F,L (batch, sequence, width, heads, FFN, layers), "
                      f"got {text!r}")
    b, s, d, h, f, layers = values
    return TransformerConfig(batch_size=b, seq_len=s, d_model=d, num_heads=h, ffn_dim=f, num_layers=layers)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--shape", type=int, help="official shape id")
    where.add_argument("--dims", help="a non-official shape: B,S,D,H,F,L (batch, sequence, width, heads, FFN, layers)")
    parser.add_argument("--weights", default=None, help="safetensors file or torch state dict (default: seeded)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--contract", default="judge", choices=("strict", "judge"))
    parser.add_argument("--candidate", default=None, help="`kkdeploy bench` candidates, comma-separated (default: "
                        "the half-GEMM mixed one of this device)")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--warmups", type=int, default=10)
    parser.add_argument("--trials", type=int, default=5, help="calibration trials of a -mixed candidate")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--out", default="profile-out")
    args = parser.parse_args(argv)
    try:
        config = (jobs_for([args.shape], None) if args.dims is None  # bench's checks: unknown id, long context
                  else jobs_for(None, parse_dims(args.dims)))[0].config
        if args.calls < 1 or args.warmups < 0:
            raise KKError("--calls must be >= 1 and --warmups >= 0")
        device, dtype = resolve_device(args.device), parse_dtype(args.dtype)
        names = parse_candidates(args.candidate or default_candidate(device))
        options = BenchOptions(device=str(device), dtype=dtype_name(dtype), contract=args.contract,
                               trials=args.trials, candidates=names, weights=args.weights).check()
        tf32 = set_process_tf32(options, device, dtype)  # as the bench worker
        reference, _ = build_models(config, dtype, device, weights=args.weights, sdpa_layers=0)
    except KKError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # A candidate that cannot run here (its kernels unproven, a CUDA-only graph on the CPU) is recorded and the
    # others are still profiled, as the bench does: one refusal must not cost the whole call on the GPU.
    infos: dict[str, dict] = {name: {} for name in names}
    runners, skipped = {}, {}
    for name in names:
        try:
            runners[name] = make_candidate(name, reference, config, dtype, device, options, infos[name], {})[0]
        except KKError as exc:
            skipped[name] = str(exc)
            print(f"{name}: {exc}")
    if not runners and names:
        print(f"error: none of the candidates can run here ({'; '.join(f'{n}: {r}' for n, r in skipped.items())})",
              file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    x, mask = generate_case(config, device, dtype, DEFAULT_SEED + TIMED_SEED_OFFSET)
    report = {"shape_id": args.shape, "config": config.to_dict(), "dtype": dtype_name(dtype),
              "contract": args.contract, "tf32": tf32, "calls": args.calls, "warmups": args.warmups,
              "weights": args.weights or "seeded", "environment": environment(device), "candidate_info": infos,
              "skipped": skipped, "backends": {}}
    where = f"shape {args.shape}" if args.dims is None else "custom shape"
    print(f"profile {where} ({config.describe()}), {dtype_name(dtype)} on {device}, weights "
          f"{args.weights or 'seeded'}, contract {args.contract}, tf32 {'on' if tf32 else 'off'}: {EAGER} vs "
          f"{', '.join(runners) or 'no candidate'}")
    with torch.inference_mode():
        for label, model in ((EAGER, reference), *runners.items()):
            trace = out / f"trace-{label}.json"
            report["backends"][label] = profile_runner(model, x, mask, device, args.warmups, args.calls, trace)
            print_report(label, report["backends"][label], args.top)
    (out / "profile.json").write_text(json.dumps(report, indent=1))
    print(f"\nwrote {out / 'profile.json'} and the Chrome traces beside it")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`kkdeploy run` on a long-context artifact: serve a full-size input, check a few sequences, report time and memory.

Why its own path: the dense reference that `kkdeploy run` compares against for shapes 1-13 cannot exist at shape 14
(a ~10 TB score tensor), so a few sequences of the served output are compared, element by element, with the
query-tiled reference (full key rows, one sequence at a time), and the call's wall time and peak GPU memory (input
and output included) are what a user of the artifact will see.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from validation import DEFAULT_CONTRACT, compare_outputs, contract as contract_tolerances

from ..artifacts import write_json
from ..config import LONG_CONTEXT_SHAPES, TransformerConfig, dtype_name, format_bytes
from ..console import console, table
from ..errors import KKError
from ..inputs import generate_case
from ..models.tiled_reference import TiledReferenceTransformer
from .long_context import full_shape_estimate, synchronize

#: a CPU run estimated to take longer than this is refused with the estimate (shape 14 would take hours)
CPU_RUN_LIMIT_S = 1800.0


def checked_sequences(batch: int, count: int) -> list[int]:
    """``count`` sequence indices spread over the batch, the first and the last included."""
    if count <= 1 or batch == 1:
        return [0][:max(count, 0)] if batch else []
    count = min(count, batch)
    return sorted({round(i * (batch - 1) / (count - 1)) for i in range(count)})


def run_config(config: TransformerConfig, batch_size: int | None, seq_len: int | None) -> TransformerConfig:
    for flag, value in (("--batch-size", batch_size), ("--seq-len", seq_len)):
        if value is not None and value < 1:
            raise KKError(f"{flag} must be at least 1, got {value}")
    return replace(config, batch_size=batch_size or config.batch_size, seq_len=seq_len or config.seq_len)


def refuse_slow_cpu_run(shape: TransformerConfig, dtype, device) -> None:
    if device.type != "cpu":
        return
    estimate = full_shape_estimate(shape, dtype, device)
    if estimate["estimated_seconds"] * 3 > CPU_RUN_LIMIT_S:  # the served call plus the reference's share
        raise KKError(f"{shape.describe()} on the CPU would take ~{estimate['estimated_seconds'] / 3600:.1f} h "
                      f"(~{estimate['flops'] / 1e12:.0f} TFLOP at {estimate['measured_flops_per_s'] / 1e9:.0f} "
                      f"GFLOP/s); run it on a GPU, or pass --batch-size/--seq-len for a smaller input")


def run_long_context(args, runner) -> int:
    """Serve one generated input of the artifact's shape (or ``--batch-size/--seq-len``) through the loaded long-
    context model; strict-compare ``--check-sequences`` of its sequences with the tiled reference."""
    model = runner.fallback
    device, dtype = model.device, model.dtype
    manifest = getattr(runner, "manifest", None) or {}
    shape = run_config(runner.config, getattr(args, "batch_size", None), getattr(args, "seq_len", None))
    refuse_slow_cpu_run(shape, dtype, device)
    rule = args.contract or (manifest.get("validation") or {}).get("contract", DEFAULT_CONTRACT)
    count = getattr(args, "check_sequences", None)
    count = 2 if count is None else count
    if count < 0:
        raise KKError(f"--check-sequences must be >= 0, got {count}")
    with torch.inference_mode():
        warm_x, warm_mask = generate_case(replace(shape, batch_size=1), device, dtype, args.seed + 7,
                                          padding_ratio=args.padding_ratio)
        runner(warm_x, warm_mask)  # kernel builds, proofs, cuBLAS handles: not the served call's cost
        del warm_x, warm_mask
        x, mask = generate_case(shape, device, dtype, args.seed, padding_ratio=args.padding_ratio)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times = []
        for _ in range(max(1, args.repeats)):
            synchronize(device)
            start = time.perf_counter()
            y = runner(x, mask)
            synchronize(device)
            times.append(time.perf_counter() - start)
            if len(times) < max(1, args.repeats):
                del y
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        checks = compare_sequences(model, shape, x, mask, y, checked_sequences(shape.batch_size, count), rule, device)
    times.sort()
    result = {"artifacts": str(args.artifacts), "backend": runner.backend, "reason": runner.reason,
              "shape": shape.to_dict(), "dtype": dtype_name(dtype), "device": str(device), "seed": args.seed,
              "padding_ratio": args.padding_ratio, "valid_tokens": int(mask.sum()),
              "seconds": [round(t, 3) for t in times], "median_seconds": round(times[len(times) // 2], 3),
              "peak_bytes": peak, "attention_path": model.last_attention_path,
              "softmax_launch": model.last_softmax_launch, "path_features": sorted(model.last_path_features),
              "contract": rule, "checks": checks, "passed": all(c["passed"] for c in checks)}
    print_long_context_run(result)
    if getattr(args, "json", None):
        write_json(args.json, result)
    return 0 if result["passed"] else 1


def compare_sequences(model, shape: TransformerConfig, x, mask, y, indices: list[int], rule: str, device) -> list[dict]:
    """Each index's output against the tiled reference (full key rows) on that sequence alone."""
    if not indices:
        return []
    reference = TiledReferenceTransformer(replace(shape, batch_size=len(indices)), sequence_tile=1)
    reference.load_state_dict(model.state_dict(), strict=True)
    reference = reference.to(device=device, dtype=model.dtype).eval()
    atol, rtol = contract_tolerances(rule)
    checks = []
    for index in indices:
        start = time.perf_counter()
        expected = reference(x[index:index + 1], mask[index:index + 1])
        synchronize(device)
        report = compare_outputs(expected, y[index:index + 1], atol, rtol)
        checks.append({"sequence": index, "valid_tokens": int(mask[index].sum()),
                       "bitwise_equal": bool(torch.equal(expected, y[index:index + 1])),
                       "reference_seconds": round(time.perf_counter() - start, 2), **report.to_dict()})
        del expected
    return checks


def print_long_context_run(result: dict) -> None:
    shape = TransformerConfig.from_dict(result["shape"])
    console.print(f"served by [bold]{result['backend']}[/]: {result['reason']}", soft_wrap=True)
    console.print(f"{shape.describe()} {result['dtype']} on {result['device']}, seed {result['seed']}, padding "
                  f"{result['padding_ratio']} ({result['valid_tokens']} valid tokens); path {result['attention_path']}"
                  f"{', block-softmax launch ' + result['softmax_launch'] if result['softmax_launch'] else ''}")
    rows = [[c["sequence"], c["valid_tokens"], "PASS" if c["passed"] else "FAIL", f"{c['failed']}/{c['total']}",
             f"{c['max_abs']:.3g}", "yes" if c["bitwise_equal"] else "no", f"{c['reference_seconds']:.1f}"]
            for c in result["checks"]]
    if rows:
        console.print(table(f"{result['contract']} against the tiled reference", ["sequence", "valid tokens",
                            "verdict", "failed", "max abs", "bitwise", "reference s"], rows))
    peak = "n/a on the CPU" if result["peak_bytes"] is None else format_bytes(result["peak_bytes"])
    console.print(f"call: median {result['median_seconds']:.3f} s over {len(result['seconds'])} call(s); "
                  f"peak GPU memory {peak} (input and output included)")


def is_long_context(runner) -> bool:
    manifest = getattr(runner, "manifest", None) or {}
    return (manifest.get("choice") or {}).get("backend") == "long_context" or manifest.get("shape_id") in \
        LONG_CONTEXT_SHAPES

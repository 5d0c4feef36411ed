#!/usr/bin/env python
"""Shape 14 on a GPU: the full logical shape through the long-context path, checked element by element.

1. the full shape (default B32/S100000/D1024/H16/F1024/L2, float16, all-valid) through
   ``LongContextTransformer``: wall time and ``torch.cuda.max_memory_allocated``;
2. the query-tiled reference on ``--sequences`` of the B sequences (a sliced batch), compared with
   the matching rows of the full-batch output under the strict rule (every element);
3. the reduced-shape validation (B2/S4096, all-valid and padded) that ``kkdeploy build --shape 14`` runs.
A table is printed last; JSON goes to ``--out`` (default ``$OUT/shape14.json``, else ./shape14.json).

H200:      python scripts/shape14_h200.py
CPU smoke: python scripts/shape14_h200.py --device cpu --dtype float32 --batch-size 4 --seq-len 512 \
               --d-model 64 --heads 4 --ffn-dim 64 --reduced-seq-len 256 --reduced-trials 1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kkdeploy import TransformerConfig, generate_case  # noqa: E402
from kkdeploy.config import dtype_name, official_config, parse_dtype, resolve_device  # noqa: E402
from kkdeploy.console import console, table  # noqa: E402
from kkdeploy.pipeline.long_context import reduced_config, validate_long_context  # noqa: E402
from kkdeploy.models.long_context import DEFAULT_QUERY_TILE, LongContextTransformer  # noqa: E402
from kkdeploy.models.tiled_reference import DEFAULT_REFERENCE_QUERY_TILE, TiledReferenceTransformer  # noqa: E402
from kkdeploy.models.weights import init_weights, weights_sha256  # noqa: E402
from validation import compare_outputs, contract  # noqa: E402


def parse_args(argv=None):
    full = official_config(14)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="float16", choices=["float16", "float32"])
    p.add_argument("--batch-size", type=int, default=full.batch_size)
    p.add_argument("--seq-len", type=int, default=full.seq_len)
    p.add_argument("--d-model", type=int, default=full.d_model)
    p.add_argument("--heads", type=int, default=full.num_heads)
    p.add_argument("--ffn-dim", type=int, default=full.ffn_dim)
    p.add_argument("--layers", type=int, default=full.num_layers)
    p.add_argument("--sequences", type=int, default=2, help="sequences compared with the tiled reference (default 2)")
    p.add_argument("--micro-batch", type=int, help="sequences per micro-batch of the long-context path (default auto)")
    p.add_argument("--sdpa-layers", type=int, help="layers (from the last) using fused SDPA; earlier layers run "
                   "tiled reference-order attention (default: every layer)")
    p.add_argument("--query-tile", type=int, default=DEFAULT_QUERY_TILE)
    p.add_argument("--reference-tile", type=int, default=DEFAULT_REFERENCE_QUERY_TILE)
    p.add_argument("--path-key-extent", default="full", choices=["full", "visible", "aligned"],
                   help="the long-context path's tiled layers: every key, the tile's visible keys, or those rounded "
                        "up to 4096 (ATen's block-softmax stride; kkdeploy.models.long_context.key_end)")
    p.add_argument("--path-softmax", default="aten", choices=["aten", "block-kernel"],
                   help="the long-context path's tiled softmax: ATen's ops, or the fused kernel in ATen's block "
                        "order (kkdeploy.kernels.block_softmax; run scripts/block_softmax_selftest.py first)")
    p.add_argument("--key-extent", default="full", choices=["full", "visible"],
                   help="tiled reference: every key row (bitwise-faithful) or only visible causal keys (half the work)")
    p.add_argument("--reduced-seq-len", type=int, default=4096)
    p.add_argument("--reduced-trials", type=int, default=2, help="reduced-shape trials (each all-valid + padded)")
    p.add_argument("--skip-reduced", action="store_true")
    p.add_argument("--contract", default="strict", choices=["strict", "judge"])
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", help="JSON path (default $OUT/shape14.json, else ./shape14.json)")
    return p.parse_args(argv)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rss_bytes() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def probe_flash(device, dtype, head_dim) -> bool:
    """Whether the flash kernel alone accepts this dtype/head size (else efficient attention runs)."""
    q = torch.zeros(1, 1, 256, head_dim, device=device, dtype=dtype)
    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            F.scaled_dot_product_attention(q, q, q, is_causal=True)
        return True
    except RuntimeError:
        return False


def short(config: TransformerConfig) -> str:
    return f"B{config.batch_size} S{config.seq_len} D{config.d_model}"


def pick_sequences(batch: int, count: int) -> list[int]:
    count = max(1, min(count, batch))
    if count == 1:
        return [0]
    return sorted({round(i * (batch - 1) / (count - 1)) for i in range(count)})


def run_full_shape(args, config, device, dtype) -> dict:
    reference = TiledReferenceTransformer(config, query_tile=args.reference_tile, key_extent=args.key_extent)
    init_weights(reference)
    path = LongContextTransformer(config, micro_batch=args.micro_batch, query_tile=args.query_tile,
                                  sdpa_layers=args.sdpa_layers, key_extent=args.path_key_extent,
                                  softmax=args.path_softmax)
    path.load_state_dict(reference.state_dict(), strict=True)
    reference = reference.to(device=device, dtype=dtype).eval()
    path = path.to(device=device, dtype=dtype).eval()
    atol, rtol = contract(args.contract)
    x, mask = generate_case(config, device, dtype, args.seed)
    result = {"config": config.to_dict(), "weights_sha256": weights_sha256(path),
              "micro_batch": path.sequences_per_micro_batch(config.batch_size, config.seq_len),
              "dense_score_bytes": config.dense_score_bytes(dtype)}
    if args.path_softmax == "block-kernel" and device.type == "cuda":
        from kkdeploy.kernels.block_softmax import load_kernel

        load_kernel(device)  # nvcc builds the kernel on first use: not inside the timed run
    with torch.inference_mode():
        path(x[:1, : min(1024, config.seq_len)], mask[:1, : min(1024, config.seq_len)])  # warm-up
        sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        else:
            before = rss_bytes()
        start = time.perf_counter()
        out = path(x, mask)
        sync(device)
        result["seconds"] = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else peak_rss_bytes()
        result.update({"attention_path": path.last_attention_path, "memory_measure":
                       "torch.cuda.max_memory_allocated" if device.type == "cuda" else "ru_maxrss (process RSS)",
                       "peak_bytes": peak, "resident_before_bytes": before, "peak_increase_bytes": peak - before})
        console.print(f"full shape {config.describe()} {dtype_name(dtype)}: {result['seconds']:.2f} s, "
                      f"peak {peak / 2**30:.2f} GiB ({(peak - before) / 2**30:.2f} GiB above inputs+weights), "
                      f"path {path.last_attention_path}")
        comparisons = []
        for index in pick_sequences(config.batch_size, args.sequences):
            sync(device)
            start = time.perf_counter()
            ref = reference(x[index:index + 1], mask[index:index + 1])
            sync(device)
            seconds = time.perf_counter() - start
            report = compare_outputs(ref, out[index:index + 1], atol, rtol)
            comparisons.append({"sequence": index, "reference_seconds": seconds,
                                "bitwise_equal": bool(torch.equal(ref, out[index:index + 1])), **report.to_dict()})
            console.print(f"sequence {index}: {report.summary()} (reference {seconds:.1f} s)")
            del ref
    result["reference"] = {"class": "TiledReferenceTransformer", "query_tile": args.reference_tile,
                           "key_extent": args.key_extent, "path_key_extent": args.path_key_extent,
                           "path_softmax": args.path_softmax,
                           "batch": "one sequence at a time"}
    result["comparisons"] = comparisons
    result["passed"] = all(c["passed"] for c in comparisons)
    del out, x, mask
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    device = resolve_device(args.device)
    dtype = parse_dtype(args.dtype)
    config = TransformerConfig(args.batch_size, args.seq_len, args.d_model, args.heads, args.ffn_dim, args.layers)
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
           "flash_kernel_accepts_dtype": probe_flash(device, dtype, config.head_dim)}
    console.print(f"shape 14 on {env['device']} (torch {env['torch']}), {dtype_name(dtype)}, contract {args.contract}")
    started = time.perf_counter()
    full = run_full_shape(args, config, device, dtype)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    reduced = None
    if not args.skip_reduced:
        reduced_shape = reduced_config(config, seq_len=args.reduced_seq_len)
        reduced = validate_long_context(
            reduced_shape, dtype, device, seed=args.seed, trials=args.reduced_trials, contract=args.contract,
            micro_batch=args.micro_batch, query_tile=args.query_tile, reference_query_tile=args.reference_tile,
            sdpa_layers=args.sdpa_layers,
            on_trial=lambda e: console.print(f"reduced trial {e['trial']} {e['mask_mode']}: failed "
                                             f"{e['failed']}/{e['total']} max_abs {e['max_abs']:.3g}"))
    total = time.perf_counter() - started
    rows = [["full shape", short(config), f"{full['seconds']:.2f} s",
             f"{full['peak_bytes'] / 2**30:.2f} GiB", "-", "-", "-"]]
    for c in full["comparisons"]:
        rows.append([f"seq {c['sequence']} vs tiled ref", f"B1 S{config.seq_len}", f"{c['reference_seconds']:.1f} s",
                     "-", f"{c['failed']}/{c['total']}", f"{c['max_abs']:.3g}", "yes" if c["bitwise_equal"] else "no"])
    if reduced is not None:
        for r in reduced["reports"]:
            rows.append([f"reduced t{r['trial']} {r['mask_mode']}",
                         short(reduced_config(config, seq_len=args.reduced_seq_len)), f"{r['candidate_seconds']:.2f} s", "-", f"{r['failed']}/{r['total']}",
                         f"{r['max_abs']:.3g}", "yes" if r["bitwise_equal"] else "no"])
    passed = full["passed"] and (reduced is None or reduced["passed"])
    data = {"environment": env, "dtype": dtype_name(dtype), "contract": args.contract, "full_shape": full,
            "reduced": reduced, "passed": passed, "total_seconds": total}
    out_path = Path(args.out) if args.out else Path(os.environ.get("OUT", ".")) / "shape14.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(data, indent=2) + "\n")
    console.print(table(f"shape 14 ({'PASS' if passed else 'FAIL'}, {total:.0f} s total; JSON: {out_path})",
                        ["run", "shape", "time", "peak", "failed", "max abs", "bitwise"], rows))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())

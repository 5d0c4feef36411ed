#!/usr/bin/env python3
"""Issue 19, shape 14: is ATen's block softmax what kkdeploy.kernels.block_softmax says, and is the fused
causal kernel bit-identical to the reference's composition?

A. ``emulate_block_softmax`` against ``torch.softmax`` (float32), bitwise, for row lengths on both sides of
   ATen's kernel switch (Smem below ~12,256 floats, the regular kernel above, with and without a scalar tail),
   on random rows with causal -inf tails; and the cut property: a row cut at a multiple of 4096 keys against
   the full row.
B. ``causal_block_softmax`` (the CUDA kernel) against ``reference_causal_softmax`` (the reference's ATen
   composition) on raw fp16 score tiles of 256 queries x 16 heads, for row lengths 20,000 (a scalar tail of
   3616) and 100,000 (shape 14), at several query offsets, with the stored width cut to the visible keys
   rounded up to 4096 (at least 12,288: shorter rows take ATen's shared-memory kernel) and uncut.
C. Timing of B's tile at row length 100,000 (CUDA events, median of --repeats).

    python3 scripts/block_softmax_selftest.py --out $OUT/block-softmax.json

Prints a table last; exit 0 even when something differs (the table says what).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from kkdeploy.errors import KKError  # noqa: E402
from kkdeploy.kernels.timing import cuda_median_ms  # noqa: E402
from kkdeploy.kernels.block_softmax import (CHUNK, block_softmax_layout, causal_block_softmax,  # noqa: E402
                                            emulate_block_softmax, reference_causal_softmax)

LENGTHS = (1025, 2048, 4096, 4100, 8192, 12252, 12256, 16384, 20000, 50000, 100000)


def random_rows(rows: int, length: int, device, generator) -> torch.Tensor:
    x = torch.randn(rows, length, device=device, generator=generator) * 4
    cut = torch.randint(1, length + 1, (rows,), device=device, generator=generator)
    tail = torch.arange(length, device=device)[None, :] >= cut[:, None]
    return x.half().float().masked_fill(tail, float("-inf"))  # fp16 values, like the attention's scores


def check_emulation(device, generator) -> list[dict]:
    out = []
    for length in LENGTHS:
        x = random_rows(64 if length <= 20000 else 16, length, device, generator)
        try:
            kind, tail = block_softmax_layout(length)
        except KKError as exc:  # rows the description does not cover (e.g. not a multiple of 4)
            out.append({"check": "emulation", "length": length, "not_covered": str(exc)})
            continue
        diff = int((emulate_block_softmax(x) != torch.softmax(x, dim=-1)).sum())
        out.append({"check": "emulation", "length": length, "kernel": kind, "tail": tail, "differing": diff})
    # the cut property on ATen itself: a 100,000-row whose keys past c are -inf, against the row cut at c
    for cut in (4096, 49152, 98304, 50000):
        x = random_rows(16, 100000, device, generator)
        x[:, cut:] = float("-inf")
        full = torch.softmax(x, dim=-1)[:, :cut]
        short = torch.softmax(x[:, :cut].contiguous(), dim=-1)
        out.append({"check": "aten cut", "length": 100000, "cut": cut, "multiple_of_4096": cut % CHUNK == 0,
                    "differing": int((full != short).sum())})
    return out


def check_kernel(device, generator, repeats: int) -> list[dict]:
    out = []
    heads, queries, scale = 16, 256, 0.125
    for row_len, starts in ((20000, (0, 8192, 19744)), (100000, (0, 24832, 49920, 98304, 99744))):
        for q0 in starts:
            last = min(row_len, q0 + queries) - 1
            for width in sorted({min(row_len, max(3 * CHUNK, -(-(last + 1) // CHUNK) * CHUNK)), row_len}):
                raw = (torch.randn(heads * queries, width, device=device, generator=generator) * 24).half()
                ref = reference_causal_softmax(raw, scale, row_len, q0, queries)
                got = causal_block_softmax(raw, scale, row_len, q0, queries)
                row = {"check": "kernel", "row_len": row_len, "first_query": q0, "width": width,
                       "differing": int((got != ref).sum()), "elements": ref.numel()}
                if row_len == 100000 and q0 == 49920:
                    row.update(timing(raw, scale, row_len, q0, queries, repeats))
                out.append(row)
                del raw, ref, got
    return out


def timing(raw, scale, row_len, q0, queries, repeats) -> dict:
    return {"kernel_ms": cuda_median_ms(lambda: causal_block_softmax(raw, scale, row_len, q0, queries), repeats, 3),
            "reference_ms": cuda_median_ms(lambda: reference_causal_softmax(raw, scale, row_len, q0, queries),
                                           repeats, 3)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("block-softmax.json"))
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("block_softmax_selftest: needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(7)
    start = time.perf_counter()
    rows = check_emulation(device, generator)
    try:
        rows += check_kernel(device, generator, args.repeats)
    except Exception as exc:  # a build or launch failure is a result too
        rows.append({"check": "kernel", "error": f"{type(exc).__name__}: {exc}"})
    report = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0),
              "shared_mem_per_block": torch.cuda.get_device_properties(0).shared_memory_per_block,
              "seconds": round(time.perf_counter() - start, 1), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"shared memory per block {report['shared_mem_per_block']}")
    for r in rows:
        print(" ".join(f"{k}={v}" for k, v in r.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""The LayerNorm epilogue's tiles on a GPU: out_proj + residual + norm2 of a D = 128 block as one launch, per tile.

Each of ``fused_linear.LN_TILES`` (and their 128-row and 2-stage forms, for comparison) runs the residual epilogue
``r + where(mask, x W^T + b, 0)`` and the next LayerNorm on random float16 inputs, is compared bit for bit with ATen's
composition (both outputs), and is timed as a CUDA graph of one launch (``proof.median_ms``, as a build's proof times
it), beside ATen's composition and the GEMM with the residual alone::

    python3 scripts/ln_epilogue_tiles.py --rows 512 2048 8192      # shape 3's, 12's and 1's rows

Session 36's figures (an H100) are in docs/fused-linear.md. A build proves only ``LN_BUILD_TILES``.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kkdeploy.kernels.proof import differing_elements, median_ms  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[512, 2048, 8192], help="M: batch x sequence")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--seed", type=int, default=5)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("the LayerNorm epilogue's tiles are Triton kernels for CUDA: run it on a GPU")
    from kkdeploy.kernels._fused_linear_triton import triton_linear, triton_linear_layer_norm
    from kkdeploy.kernels.fused_linear import LN_TILES

    dev = torch.device("cuda")
    n = k = 128
    print(f"{'rows':>6} {'launch':>28} {'differing (sum, norm)':>22} {'ms':>9}")
    for m in args.rows:
        g = torch.Generator(device=dev).manual_seed(args.seed)
        x = torch.randn(m, k, device=dev, generator=g).half()
        w = (torch.randn(n, k, device=dev, generator=g) / 11).half()
        b = (torch.randn(n, device=dev, generator=g) / 10).half()
        r = torch.randn(m, n, device=dev, generator=g).half()
        mask = torch.rand(m, device=dev, generator=g) > 0.25
        lg = (1 + torch.randn(n, device=dev, generator=g) / 10).half()
        lb = (torch.randn(n, device=dev, generator=g) / 10).half()
        zero = torch.zeros((), dtype=torch.float16, device=dev)

        def aten():
            total = r + torch.where(mask[:, None], F.linear(x, w, b), zero)
            return total, F.layer_norm(total, (n, ), lg, lb, 1e-5)

        want = aten()
        print(f"{m:>6} {'ATen (GEMM, where, add, LN)':>28} {'-':>22} {median_ms(aten, args.repeats, dev):9.5f}")
        plain = median_ms(lambda: triton_linear(x, w, b, r, mask, "add_masked", BLOCK_M=64, num_warps=4,
                                                num_stages=4), args.repeats, dev)
        print(f"{m:>6} {'GEMM + residual (m64)':>28} {'-':>22} {plain:9.5f}")
        forms = [(name, dict(tile)) for name, tile in LN_TILES.items()]
        forms += [(f"{name} {label}", {**tile, **extra}) for (name, tile), (label, extra) in itertools.product(
            LN_TILES.items(), (("128 rows", {"BLOCK_M": 128}), ("2 stages", {"num_stages": 2})))]
        for name, tile in forms:
            def run():
                return triton_linear_layer_norm(x, w, b, r, mask, lg, lb, 1e-5, "add_masked", **tile)
            try:
                got = run()
                differing = f"{differing_elements(got[0], want[0])}, {differing_elements(got[1], want[1])}"
                print(f"{m:>6} {name:>28} {differing:>22} {median_ms(run, args.repeats, dev):9.5f}", flush=True)
            except Exception as exc:  # a tile that does not compile is a row, not the end
                print(f"{m:>6} {name:>28} ERROR {type(exc).__name__}: {str(exc)[:80]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Issue 29: where one layer of shape 14's scores-attention goes, kernel by kernel, per launch configuration.

One sequence (H16, Dh64, S100000, fp16, random q, k, v at a trained model's score spread), the whole layer in one
call of ``kkdeploy.kernels._scores_softmax_triton.scores_softmax(..., fuse_pv=True)``. Each of the three kernels
(row max, ATen-ordered warp sums, probabilities + P.V) is swept over launch configurations with the other two held
at the baseline; device time per kernel from torch.profiler (median of --repeats calls). Every configuration's
output is compared bit for bit with the baseline's, and the baseline with the shipped block-kernel composition on
sampled tiles.

    python3 scripts/scores_softmax_tune.py --out $OUT/scores-tune.json

Prints a table last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from kkdeploy.kernels.block_softmax import block_softmax_layout, causal_block_softmax  # noqa: E402
from kkdeploy.kernels.timing import differing_bits  # noqa: E402
from kkdeploy.models.long_context import key_end  # noqa: E402

KERNELS = ("_raw_max_kernel", "_warp_sums_kernel", "_probs_kernel")
BASE = dict(max_launch=dict(block_m=128, block_n=64, num_warps=4), sum_launch=dict(block_m=128, num_warps=8),
            prob_launch=dict(block_m=128, block_n=64, num_warps=8), group=2)
#: overrides of one kernel's launch; "group" and "strided" are the sum pass's own switches
SWEEP = {
    "sum": [dict(block_m=128, num_warps=8, group=2, strided=True), dict(block_m=128, num_warps=8, group=4, strided=True,
                                                                       num_stages=2),
            dict(block_m=64, num_warps=4, group=2, strided=True), dict(block_m=128, num_warps=8, group=1, strided=True),
            dict(block_m=64, num_warps=4, group=4, strided=True, num_stages=2),
            dict(block_m=128, num_warps=4, group=1, strided=True)],
    "prob": [dict(block_m=128, block_n=32, num_warps=4), dict(block_m=256, block_n=64, num_warps=8)],
    "max": [dict(block_m=128, block_n=32, num_warps=4), dict(block_m=256, block_n=64, num_warps=8)],
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="scores-tune.json")
    p.add_argument("--seq-len", type=int, default=100000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--budget", type=float, default=300.0)
    args = p.parse_args(argv)
    from kkdeploy.kernels._scores_softmax_triton import scores_softmax

    start = time.time()
    dev = torch.device("cuda")
    S, H, dh = args.seq_len, 16, 64
    gen = torch.Generator(device=dev).manual_seed(31)
    q = (torch.randn(1, S, H, dh, device=dev, generator=gen) * 1.4).half().transpose(1, 2)
    k = (torch.randn(1, S, H, dh, device=dev, generator=gen) * 1.4).half().transpose(1, 2)
    v = torch.randn(1, S, H, dh, device=dev, generator=gen).half().transpose(1, 2)
    scale = dh ** -0.5
    _, tail = block_softmax_layout(S)

    def call(cfg):
        return scores_softmax(q, k, v, scale, S, tail, 0, True, None, fuse_pv=True, nsplit=1, fast_div=True, **cfg)

    def profile(cfg):
        call(cfg)
        torch.cuda.synchronize()
        per = {name: [] for name in KERNELS}
        wall = []
        for _ in range(args.repeats):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                t = time.perf_counter()
                call(cfg)
                torch.cuda.synchronize()
                wall.append((time.perf_counter() - t) * 1e3)
            for evt in prof.key_averages():
                for name in KERNELS:
                    if evt.key.startswith(name):
                        per[name].append(evt.device_time_total / 1e3)
        return {name: round(statistics.median(vals), 2) if vals else None for name, vals in per.items()} | {
            "wall_ms": round(statistics.median(wall), 2)}

    results = {"base": BASE, "runs": []}
    base_out = call(BASE)
    base_times = profile(BASE)
    results["runs"].append({"kernel": "base", "config": BASE, "ms": base_times, "differing": 0})
    print(f"[{time.time() - start:5.1f}s] base {base_times}", flush=True)
    # the baseline against the shipped composition on sampled tiles
    checks = {}
    for t0 in (12288, 49920, 98304, 99968):
        t1 = min(S, t0 + 128)
        w = key_end(t1, S, True, "aligned", S)
        raw = torch.matmul(q[:, :, t0:t1], k[:, :, :w].transpose(-2, -1))
        pr = causal_block_softmax(raw.reshape(-1, w), scale, S, t0, t1 - t0, launch="raw-max+markstein")
        checks[t0] = differing_bits(base_out[:, :, t0:t1], torch.matmul(pr.view(1, H, t1 - t0, w), v[:, :, :w]))
    results["base_vs_shipped"] = checks
    print(f"base vs shipped composition: {checks}", flush=True)
    for which, configs in SWEEP.items():
        for override in configs:
            if time.time() - start > args.budget:
                break
            cfg = {key: (dict(val) if isinstance(val, dict) else val) for key, val in BASE.items()}
            override = dict(override)
            for switch in ("group", "strided"):
                if which == "sum" and switch in override:
                    cfg[switch] = override.pop(switch)
            cfg[f"{which}_launch"] = override
            try:
                out = call(cfg)
                differing = differing_bits(out, base_out)
                del out
                ms = profile(cfg)
            except Exception as exc:
                differing, ms = None, f"{type(exc).__name__}: {str(exc)[:100]}"
            results["runs"].append({"kernel": which, "config": cfg, "ms": ms, "differing": differing})
            print(f"[{time.time() - start:5.1f}s] {which} {override} group={cfg['group']}: {ms} differing {differing}",
                  flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print("\n| kernel swept | config | max ms | sums ms | probs+P.V ms | wall ms | differing vs base |")
    print("|---|---|---|---|---|---|---|")
    for r in results["runs"]:
        ms = r["ms"] if isinstance(r["ms"], dict) else {}
        conf = r["config"] if r["kernel"] == "base" else r["config"][f"{r['kernel']}_launch"]
        extra = (f" group={r['config']['group']} strided={r['config'].get('strided', False)}"
                 if r["kernel"] in ("sum", "base") else "")
        print(f"| {r['kernel']} | {conf}{extra} | {ms.get('_raw_max_kernel')} | {ms.get('_warp_sums_kernel')} | "
              f"{ms.get('_probs_kernel')} | {ms.get('wall_ms', r['ms'])} | {r['differing']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Shape 14 (issue 19): where one reference-order attention tile spends its time, and which skips of masked
work stay bit-identical to the query-tiled reference.

The bitwise path for shape 14 is the query-tiled reference over full key rows (168 s on the H200); cutting
causal tiles at their last query ("visible" keys, 86 s) failed strict by 16 elements, because it shortens
two reductions at once. This study separates them on real activations (layer 0's q, k, v of the seeded model
on one official sequence) for a few query tiles, and compares each variant bit for bit with the reference
tile (`kkdeploy.models.tiled_reference.tiled_reference_attention`'s arithmetic):

* ``qk-visible``: the scores GEMM only over keys ``< kv`` (``kv`` = the tile's last query + 1, rounded up to
  ``--key-block``), the rest filled with -inf, then the reference's full-row softmax and full-K P.V. Bitwise
  iff a score does not depend on how many keys the GEMM covers.
* ``pv-visible``: the reference's probabilities, but P.V only over keys ``< kv``. The dropped probabilities
  are exactly 0, so this is bitwise iff cuBLAS's K-reduction order for the kept part does not change.
* ``softmax-visible``: the softmax over keys ``< kv`` only. ATen's FP32 softmax for rows longer than 1024
  (`cunn_SoftMaxForward`, or `cunn_SoftMaxForwardSmem` for rows that fit 48 KiB of shared memory) runs one
  1024-thread block per row; thread t folds the 4-wide vectors t, t + 1024, t + 2048, ... and a block
  reduction follows. Read at the source, a row cut at a multiple of 4 x 1024 = 4096 keys gives every thread
  the same vectors minus trailing -inf ones (max unchanged, sum + exp(-inf) = sum + 0), so with
  ``--key-block 4096`` (the default) this should be bitwise; a cut elsewhere moves elements between threads.
* ``qk+pv-visible``: the two GEMM skips together, full-row softmax.
* ``all-visible``: all three: every step only over keys ``< kv``, the skip a faster bitwise path would take.

Each tile also gets CUDA-event timings of the reference's seven steps (QK^T, scale, mask, cast, softmax,
cast, P.V) and of ``all-visible``; the JSON extrapolates the whole shape (tiles x sequences x layers).

    python3 scripts/shape14_tile_study.py --out $OUT/shape14-tiles.json          # the H200
    python3 scripts/shape14_tile_study.py --device cpu --dtype float32 --seq-len 300 --d-model 64 --heads 4 \\
        --ffn-dim 64 --tile 64 --tiles 0,100,236 --key-block 32                    # a CPU smoke run

Prints a table last: tile, variant, differing elements, milliseconds.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from kkdeploy import TransformerConfig, generate_case  # noqa: E402
from kkdeploy.config import official_config, parse_dtype, resolve_device  # noqa: E402
from kkdeploy.models.weights import build_models  # noqa: E402

STEPS = ("qk", "scale", "mask", "to_fp32", "softmax", "to_model_dtype", "pv")


class Timer:
    """CUDA events around each step on a GPU (perf_counter with a sync on the CPU)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[str, object]] = []

    def mark(self, name: str) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append((name, event))
        else:
            self.marks.append((name, time.perf_counter()))

    def elapsed_ms(self) -> dict[str, float]:
        if self.cuda:
            torch.cuda.synchronize()
        out = {}
        for (_, a), (name, b) in zip(self.marks, self.marks[1:]):
            out[name] = a.elapsed_time(b) if self.cuda else (b - a) * 1e3
        return out


def reference_tile(q, k, v, scale: float, t0: int, t1: int, timer: Timer | None = None, kv: int | None = None):
    """The tiled reference's arithmetic for rows t0..t1 over every key (causal, all-valid), step by step;
    ``kv``: every step over the first kv keys only (the ``all-visible`` variant)."""
    kv = k.shape[-2] if kv is None else kv
    k, v = k[:, :, :kv], v[:, :, :kv]
    key_index = torch.arange(kv, device=q.device)
    mark = timer.mark if timer else (lambda name: None)
    mark("start")
    scores = torch.matmul(q[:, :, t0:t1], k.transpose(-2, -1))
    mark("qk")
    scores = scores * scale
    mark("scale")
    scores = scores.masked_fill(key_index[None, :] > key_index[t0:t1, None], float("-inf"))
    mark("mask")
    wide = scores.float()
    mark("to_fp32")
    probs32 = torch.softmax(wide, dim=-1)
    mark("softmax")
    probs = probs32.to(q.dtype)
    mark("to_model_dtype")
    out = torch.matmul(probs, v)
    mark("pv")
    return scores, probs, out


def visible_keys(t1: int, seq: int, key_block: int) -> int:
    """Keys a causal tile ending at row t1 - 1 can see, rounded up to whole key blocks (at most seq)."""
    return min(seq, -(-t1 // key_block) * key_block)


def qk_visible_scores(q, k, scale: float, t0: int, t1: int, kv: int):
    seq = k.shape[-2]
    key_index = torch.arange(seq, device=q.device)
    part = torch.matmul(q[:, :, t0:t1], k[:, :, :kv].transpose(-2, -1)) * scale
    part = part.masked_fill(key_index[None, :kv] > key_index[t0:t1, None], float("-inf"))
    scores = part.new_full((*part.shape[:-1], seq), float("-inf"))
    scores[..., :kv] = part
    return scores


def differing(a: torch.Tensor, b: torch.Tensor) -> int:
    """Elements whose values differ (NaN never occurs here: every row keeps its diagonal key)."""
    return int((a != b).sum())


def study_tile(q, k, v, scale: float, t0: int, tile: int, key_block: int, repeats: int) -> dict:
    seq = k.shape[-2]
    t1 = min(seq, t0 + tile)
    kv = visible_keys(t1, seq, key_block)
    scores, probs, out = reference_tile(q, k, v, scale, t0, t1)
    row = {"t0": t0, "t1": t1, "visible_keys": kv, "variants": {}}

    qk_scores = qk_visible_scores(q, k, scale, t0, t1, kv)
    qk_probs = torch.softmax(qk_scores.float(), dim=-1).to(q.dtype)
    qk_out = torch.matmul(qk_probs, v)
    row["variants"]["qk-visible"] = {"scores": differing(qk_scores, scores), "out": differing(qk_out, out)}
    pv_out = torch.matmul(probs[..., :kv], v[:, :, :kv])
    row["variants"]["pv-visible"] = {"dropped_probs_nonzero": int((probs[..., kv:] != 0).sum()),
                                     "out": differing(pv_out, out)}
    sm_probs = torch.softmax(scores[..., :kv].float(), dim=-1).to(q.dtype)
    row["variants"]["softmax-visible"] = {"probs": differing(sm_probs, probs[..., :kv]),
                                          "out": differing(torch.matmul(sm_probs, v[:, :, :kv]), out)}
    both = torch.matmul(qk_probs[..., :kv], v[:, :, :kv])
    row["variants"]["qk+pv-visible"] = {"out": differing(both, out)}
    _, all_probs, all_out = reference_tile(q, k, v, scale, t0, t1, kv=kv)
    row["variants"]["all-visible"] = {"probs": differing(all_probs, probs[..., :kv]), "out": differing(all_out, out)}
    del qk_scores, qk_probs, sm_probs, all_probs

    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    for label, extent in (("reference", None), ("all-visible", kv)):
        steps: dict[str, list[float]] = {name: [] for name in STEPS}
        for _ in range(repeats):
            timer = Timer(q.device)
            reference_tile(q, k, v, scale, t0, t1, timer, kv=extent)
            for name, ms in timer.elapsed_ms().items():
                steps[name].append(ms)
        row[f"{label}_ms"] = {name: round(median(xs), 3) for name, xs in steps.items()}
        row[f"{label}_total_ms"] = round(sum(row[f"{label}_ms"].values()), 3)
    return row


def layer0_heads(config: TransformerConfig, device, dtype, seed: int):
    """Layer 0's q, k, v ([1, H, S, Dh]) of the seeded model on sequence 0 of the official input."""
    model, _ = build_models(config, dtype, device)
    one = TransformerConfig(1, config.seq_len, config.d_model, config.num_heads, config.ffn_dim,
                            config.num_layers, config.causal)
    x, _ = generate_case(one, device, dtype, seed)
    attn = model.layers[0].attention
    with torch.inference_mode():
        h = model.layers[0].norm1(x)
        return (attn.split_heads(attn.q_proj(h)), attn.split_heads(attn.k_proj(h)),
                attn.split_heads(attn.v_proj(h)), attn.scale)


def main(argv=None) -> int:
    full = official_config(14)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="float16", choices=["float16", "float32"])
    for flag, default in (("--seq-len", full.seq_len), ("--d-model", full.d_model), ("--heads", full.num_heads),
                          ("--ffn-dim", full.ffn_dim)):  # shape 14's, smaller for a CPU smoke run
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--tile", type=int, default=256, help="query rows per tile (the reference's default: 256)")
    p.add_argument("--tiles", default="0,24832,49920,99744", help="first rows of the tiles to study")
    p.add_argument("--key-block", type=int, default=4096,
                   help="visible keys are rounded up to this multiple (4096: ATen's block softmax stride)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", type=Path, default=Path("shape14-tiles.json"))
    args = p.parse_args(argv)
    device = resolve_device(args.device)
    dtype = parse_dtype(args.dtype)
    config = TransformerConfig(full.batch_size, args.seq_len, args.d_model, args.heads, args.ffn_dim,
                               full.num_layers, True)
    starts = [int(t) for t in args.tiles.split(",") if t.strip()]
    bad = [t for t in starts if not 0 <= t < config.seq_len]
    if bad or args.tile < 1 or args.key_block < 1:
        print(f"shape14_tile_study: tiles {bad or starts} must lie in [0, {config.seq_len}) and --tile/--key-block "
              f"must be >= 1", file=sys.stderr)
        return 2
    with torch.inference_mode():
        q, k, v, scale = layer0_heads(config, device, dtype, args.seed)
        rows = [study_tile(q, k, v, scale, t0, args.tile, args.key_block, args.repeats) for t0 in starts]
    tiles_per_sequence = -(-config.seq_len // args.tile)
    mean_ref = sum(r["reference_total_ms"] for r in rows) / len(rows)
    mean_skip = sum(r["all-visible_total_ms"] for r in rows) / len(rows)
    scale_up = tiles_per_sequence * config.batch_size * config.num_layers / 1e3
    report = {"config": config.to_dict(), "dtype": args.dtype, "device": str(device),
              "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else platform.processor(),
              "torch": torch.__version__, "weights": "seeded (init_weights seed 0)", "input_seed": args.seed,
              "tile": args.tile, "key_block": args.key_block, "tiles": rows,
              "estimate_s": {"reference_attention": round(mean_ref * scale_up, 1),
                             "all-visible_attention": round(mean_skip * scale_up, 1),
                             "note": "mean of the studied tiles x tiles per sequence x sequences x layers; "
                                     "attention only (projections, FFN and LayerNorm not included)"}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"{'tile':>12} {'variant':16} {'differing (out)':>16}")
    for r in rows:
        for name, v in r["variants"].items():
            print(f"{r['t0']:>6}-{r['t1']:<6} {name:16} {v['out']:>16}")
        print(f"{'':>12} reference ms {r['reference_ms']} total {r['reference_total_ms']}; "
              f"all-visible total {r['all-visible_total_ms']}")
    print(f"estimate (attention only): reference {report['estimate_s']['reference_attention']} s, "
          f"all-visible {report['estimate_s']['all-visible_attention']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

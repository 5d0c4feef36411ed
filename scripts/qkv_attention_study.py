#!/usr/bin/env python3
"""Study: the attention with its Q, K and V projections in one launch (``_qkv_attention_triton``), against the two
launches a build runs now (the packed Q|K|V GEMM tile, then the cached attention launch ``cached64w4_mdiv``), on the
GPU: bits against ATen's composition, and time.

Bits: for each official shape named, weights of our own (``scripts/make_weights.py``'s ``trained_like``, seed
``--weights-seed`` + shape), the normalized rows of the first and last block on two official-style inputs (all-valid
seed 1234, padded 0.25 seed 1236) and one random input; every launch's context against ATen's (the model's q_proj,
k_proj, v_proj and ``reference_attention``), elements whose bits differ counted.
Time: each launch sequence captured 20 times over in one CUDA graph, plain and as dependent launches; the median of
``--repeats`` replays divided by 20 (the launch gaps of a graph included, as in a build's graph).

    python3 scripts/qkv_attention_study.py --shapes 3 6 12 --weights-seed 700 --out qkv-attention.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from kkdeploy.config import official_config  # noqa: E402
from kkdeploy.inputs import generate_case, padded_case  # noqa: E402
from kkdeploy.models.reference import ReferenceTransformer  # noqa: E402

INNER = 20  # launch sequences per graph


def graph_ms(fn, repeats: int, pdl: bool) -> float:
    """Milliseconds per call of ``fn`` captured INNER times in one CUDA graph (median of ``repeats`` replays): the
    proofs' capture (``proof._captured``), a sequence repeated inside the graph so that dependent launches overlap
    one call's tail with the next call's head, as they do in a build's graph."""
    from kkdeploy.kernels.dependent_launch import dependent_launches
    from kkdeploy.kernels.proof import _captured
    from kkdeploy.kernels.timing import event_median_ms

    device = torch.device("cuda")
    with dependent_launches(pdl):
        fn()
        graph = _captured(lambda: [fn() for _ in range(INNER)], device)
    if graph is None:
        raise RuntimeError("the launch sequence could not be captured in a CUDA graph")
    return round(event_median_ms(graph.replay, repeats, device) / INNER, 5)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", type=int, nargs="+", default=[3, 6, 12])
    ap.add_argument("--weights-seed", type=int, default=700)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the plumbing under TRITON_INTERPRET=1, untimed")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from make_weights import trained_like

    from kkdeploy.kernels._faithful_attention_triton import triton_attention
    from kkdeploy.kernels._fused_linear_triton import triton_linear
    from kkdeploy.kernels._qkv_attention_triton import triton_qkv_attention
    from kkdeploy.kernels.qkv_attention import LAUNCHES, qkv_attention_refusal
    from kkdeploy.kernels.faithful_attention import reference_attention
    from kkdeploy.kernels.fused_linear import TILES
    from kkdeploy.kernels.timing import differing_bits

    device = torch.device(args.device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (Triton's interpreter)"
    report = {"device": name, "torch": torch.__version__, "shapes": []}
    rows = []
    for shape in args.shapes:
        config = official_config(shape)
        d, heads = config.d_model, config.num_heads
        refusal = qkv_attention_refusal(config.seq_len, d, heads)
        if refusal:
            print(f"shape {shape}: {refusal}")
            report["shapes"].append({"shape": shape, "refused": refusal})
            continue
        model = ReferenceTransformer(config)
        model.load_state_dict(trained_like(config, args.weights_seed + shape))
        model = model.to(device=device, dtype=torch.float16).eval()
        cases = []
        with torch.no_grad():
            for label, (x, mask) in (("all-valid", generate_case(config, device, torch.float16, 1234)),
                                     ("padded", padded_case(config, device, torch.float16, 1236, 0.25))):
                for i, block in enumerate(model.layers):
                    if i in (0, len(model.layers) - 1):
                        cases.append((f"{label} layer {i}", block, block.norm1(x), mask))
                    x = block(x, mask)
            g = torch.Generator(device=device).manual_seed(7)
            cases.append(("random", model.layers[0], torch.randn(x.shape, generator=g, device=device,
                                                                  dtype=torch.float16), None))

        def launches(block, h, mask):
            a = block.attention
            ws = [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]
            bs = [a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]
            w_cat, b_cat = torch.cat(ws).contiguous(), torch.cat(bs).contiguous()

            def two(tile):
                def run():
                    q, k, v = triton_linear(h, w_cat, b_cat, **TILES[tile]).split(d, dim=-1)
                    return triton_attention(q, k, v, mask, heads, True, cached=True, block_m=64, num_warps=4,
                                            fast_div=True)
                return run

            def one(**kw):
                return lambda: triton_qkv_attention(h, ws, bs, mask, heads, True, **kw)

            def aten():
                return reference_attention(a.q_proj(h), a.k_proj(h), a.v_proj(h), mask, heads, True)

            return {"two launches (auto)": two("auto"), "two launches (m64n64)": two("m64n64"),
                    "two launches (cols)": two("cols"),
                    "one launch (w4)": one(), "one launch (w4, maxnreg 128)": one(max_registers=128),
                    "one launch (w8)": one(num_warps=8), "one launch, whole (w4)": one(**LAUNCHES["whole"]),
                    "one launch, whole (w8)": one(**LAUNCHES["whole"], num_warps=8),
                    "one launch, pair (w4)": one(**LAUNCHES["pair"])}, aten

        record = {"shape": shape, "cases": [], "ms": {}}
        with torch.no_grad():
            for label, block, h, mask in cases:
                runs, aten = launches(block, h, mask)
                ref = aten()
                diffs = {}
                for name, fn in runs.items():
                    try:
                        diffs[name] = differing_bits(fn(), ref)
                    except Exception as exc:  # a launch that fails to compile or run is a finding, not a crash
                        diffs[name] = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                try:  # the one launch against the two it replaces, directly
                    diffs["one (w4) vs two (auto)"] = differing_bits(runs["one launch (w4)"](),
                                                                     runs["two launches (auto)"]())
                except Exception as exc:
                    diffs["one (w4) vs two (auto)"] = f"error: {type(exc).__name__}"
                record["cases"].append({"case": label, "elements": ref.numel(), "differing": diffs})
                print(f"shape {shape} {label}: {diffs}", flush=True)
            label, block, h, mask = cases[2]  # padded, layer 0: the timed inputs
            runs, aten = launches(block, h, mask)
            if device.type == "cuda":
                record["ms"]["ATen composition"] = {"plain": graph_ms(aten, args.repeats, False)}
            for name, fn in runs.items() if device.type == "cuda" else ():
                try:
                    record["ms"][name] = {"plain": graph_ms(fn, args.repeats, False),
                                          "pdl": graph_ms(fn, args.repeats, True)}
                except Exception as exc:
                    record["ms"][name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
        report["shapes"].append(record)
        for name in ["ATen composition", *runs]:
            ms = record["ms"].get(name, {})
            counts = [c["differing"].get(name, 0) for c in record["cases"]]
            worst = (max(counts, default=0) if all(isinstance(n, int) for n in counts)
                     else "error")  # a launch that failed on any case is no 0
            rows.append((shape, name, ms.get("plain"), ms.get("pdl"), worst if name in runs else "-"))
        args.out.write_text(json.dumps(report, indent=1))
    print("\nshape | launch | ms plain | ms pdl | most differing elements (of any case)")
    for row in rows:
        print(" | ".join(str(v) for v in row))
    return 0


if __name__ == "__main__":
    sys.exit(main())

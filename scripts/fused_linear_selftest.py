#!/usr/bin/env python3
"""Issue 19 on the GPU: is kkdeploy_faithful::linear's Triton GEMM (kkdeploy/kernels/_fused_linear_triton.py)
bit-identical to the reference's ATen ops, epilogue by epilogue?

A. Every block of the seeded FP16 ReferenceTransformer on each official shape 1-13, official input (seed 1234)
   all-valid and padded 0.25, walked op by op with the reference's own modules; at each Linear the kernel gets
   the reference's real input and its output is compared bit for bit with the reference's values:
   q/k/v one by one (``none``), Q/K/V packed in one launch, out_proj + residual + mask (``add_masked``),
   ffn_in + GELU (``gelu``), ffn_out + residual + mask (``masked_sum``). The walk continues on the reference's
   values, so a mismatch never hides a later one.
B. Random inputs (scales 0.1, 1, 10; weights ~N(0, 1/fan_in), a bias), the same five forms, for each distinct
   (M, N, K) of A, and shape 14's Linear size on 65,536 rows.
C. Timing on shapes 6 and 8 (CUDA events, median of --repeats): each fused form against the ATen ops it replaces.

    python3 scripts/fused_linear_selftest.py --out $OUT/fused-linear.json

Prints a table last; exits 0 even when something differs (the table says what).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kkdeploy import OFFICIAL_SHAPES, generate_case  # noqa: E402
from kkdeploy.kernels.fused_linear import LN_WIDTHS  # noqa: E402
from kkdeploy.kernels.layer_norm import emulate_layer_norm_rows, layer_norm_rows_kernel  # noqa: E402
from kkdeploy.kernels.cuda_build import platform_key  # noqa: E402
from kkdeploy.kernels.timing import cuda_median_ms, differing_bits as differing  # noqa: E402
from kkdeploy.models.reference import zero_invalid_rows  # noqa: E402
from kkdeploy.models.weights import build_models  # noqa: E402

# the Triton kernels: imported by main() once a GPU is there (they need Triton, which a CPU machine may lack)
launch_config = triton_linear = triton_linear_layer_norm = None

FORMS = ("q", "k", "v", "qkv_packed", "add_masked", "gelu", "gelu_fpfusion", "masked_sum", "gelu_prologue",
         "gelu_prologue_fpfusion", "ln_emulation", "add_masked_ln", "masked_sum_ln", "gelu_prologue_ln",
         "gelu_prologue_ln_fpfusion")
#: not proven (each has its own column): not part of "differing". gelu_prologue_ln[_fpfusion]: ffn_out's whole
#: launch in fused_model_forward (GELU prologue, residual + mask, the next LayerNorm), as one kernel compiles it
EXPERIMENTAL = ("gelu", "gelu_fpfusion", "gelu_prologue", "gelu_prologue_fpfusion", "ln_emulation", "add_masked_ln",
                "masked_sum_ln", "gelu_prologue_ln", "gelu_prologue_ln_fpfusion")


def first_index(ours: torch.Tensor, ref: torch.Tensor):
    bad = (ours.contiguous().view(torch.int16) != ref.contiguous().view(torch.int16)).nonzero()
    return bad[0].tolist() if len(bad) else None


def block_checks(layer, x, mask, tally: dict, next_norm=None, last: bool = False) -> torch.Tensor:
    """One reference block, op by op; returns the block's output (the reference's values). ``next_norm``: the
    LayerNorm that follows the block (the next block's norm1, or final_norm when ``last``, whose invalid rows the
    model then zeroes), for the LayerNorm epilogue."""
    att = layer.attention
    h = layer.norm1(x)
    if x.shape[-1] <= max(LN_WIDTHS):  # the emulation's scope: rows of 4..128
        tally_add(tally, "ln_emulation", emulate_layer_norm_rows(x, layer.norm1.weight, layer.norm1.bias,
                                                                 layer.norm1.eps), h)
    ref = {}
    for name, proj in (("q", att.q_proj), ("k", att.k_proj), ("v", att.v_proj)):
        ref[name] = F.linear(h, proj.weight, proj.bias)
        tally_add(tally, name, triton_linear(h, proj.weight, proj.bias), ref[name])
    w = torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight])
    b = torch.cat([att.q_proj.bias, att.k_proj.bias, att.v_proj.bias])
    tally_add(tally, "qkv_packed", triton_linear(h, w, b), torch.cat([ref["q"], ref["k"], ref["v"]], dim=-1))
    split = [att.split_heads(ref[n]) for n in ("q", "k", "v")]
    context = att.attend(*split, mask)
    a = zero_invalid_rows(att.out_proj(context), mask)
    x1 = x + a
    tally_add(tally, "add_masked",
              triton_linear(context, att.out_proj.weight, att.out_proj.bias, x, mask, "add_masked"), x1)
    h2 = layer.norm2(x1)
    if x.shape[-1] in LN_WIDTHS:
        total, normed = triton_linear_layer_norm(context, att.out_proj.weight, att.out_proj.bias, x, mask,
                                                 layer.norm2.weight, layer.norm2.bias, layer.norm2.eps, "add_masked")
        tally_add(tally, "add_masked_ln", torch.cat([total, normed], dim=-1), torch.cat([x1, h2], dim=-1))
    g = F.gelu(layer.ffn_in(h2), approximate="none")
    tally_add(tally, "gelu", triton_linear(h2, layer.ffn_in.weight, layer.ffn_in.bias, epilogue="gelu"), g)
    tally_add(tally, "gelu_fpfusion", triton_linear(h2, layer.ffn_in.weight, layer.ffn_in.bias, epilogue="gelu",
                                                    enable_fp_fusion=True), g)
    x2 = zero_invalid_rows(x1 + layer.ffn_out(g), mask)
    tally_add(tally, "masked_sum",
              triton_linear(g, layer.ffn_out.weight, layer.ffn_out.bias, x1, mask, "masked_sum"), x2)
    f = layer.ffn_in(h2)  # ffn_out reading ffn_in's output, GELU on the way in
    for fusion in (False, True):
        tally_add(tally, "gelu_prologue" + ("_fpfusion" if fusion else ""),
                  triton_linear(f, layer.ffn_out.weight, layer.ffn_out.bias, x1, mask, "masked_sum", prologue="gelu",
                                enable_fp_fusion=fusion), x2)
    if x.shape[-1] in LN_WIDTHS and next_norm is not None:
        total, normed = triton_linear_layer_norm(g, layer.ffn_out.weight, layer.ffn_out.bias, x1, mask,
                                                 next_norm.weight, next_norm.bias, next_norm.eps, "masked_sum",
                                                 zero_invalid=last)
        want = zero_invalid_rows(next_norm(x2), mask) if last else next_norm(x2)
        tally_add(tally, "masked_sum_ln", torch.cat([total, normed], dim=-1), torch.cat([x2, want], dim=-1))
        for fusion in (False, True):
            got = triton_linear_layer_norm(f, layer.ffn_out.weight, layer.ffn_out.bias, x1, mask, next_norm.weight,
                                           next_norm.bias, next_norm.eps, "masked_sum", prologue="gelu",
                                           zero_invalid=last, enable_fp_fusion=fusion)
            tally_add(tally, "gelu_prologue_ln" + ("_fpfusion" if fusion else ""), torch.cat(got, dim=-1),
                      torch.cat([x2, want], dim=-1))
    return x2


def summary(tally: dict) -> dict:
    """Differing elements: the proven forms (``differing``); the GELU epilogue and prologue compiled without fp
    contraction (``differing_gelu``, the op's flags) and with it (``differing_fpfusion``); the LayerNorm emulation
    and the LayerNorm epilogues (``differing_ln``)."""
    def total(forms):
        return sum(e["differing"] for f, e in tally.items() if f in forms)

    proven = [f for f in FORMS if f not in EXPERIMENTAL]
    return {"differing": total(proven),
            "differing_gelu": total(["gelu", "gelu_prologue"]),
            "differing_fpfusion": total(["gelu_fpfusion", "gelu_prologue_fpfusion"]),
            "differing_ln": total(["ln_emulation", "add_masked_ln", "masked_sum_ln"])}


def tally_add(tally: dict, form: str, ours: torch.Tensor, ref: torch.Tensor) -> None:
    entry = tally.setdefault(form, {"calls": 0, "elements": 0, "differing": 0, "first": None})
    n = differing(ours, ref)
    entry["calls"] += 1
    entry["elements"] += ref.numel()
    entry["differing"] += n
    if n and entry["first"] is None:
        entry["first"] = {"index": first_index(ours, ref), "call": entry["calls"]}


def model_checks(shapes: list[int], device) -> list[dict]:
    rows = []
    for shape in shapes:
        config = OFFICIAL_SHAPES[shape]
        model = build_models(config, torch.float16, device)[0]
        for ratio in (0.0, 0.25):
            tally: dict = {}
            x, mask = generate_case(config, device, torch.float16, 1234, padding_ratio=ratio)
            with torch.inference_mode():
                layers = list(model.layers)
                for i, layer in enumerate(layers):
                    after = layers[i + 1].norm1 if i + 1 < len(layers) else model.final_norm
                    x = block_checks(layer, x, mask if ratio > 0 else None, tally, after, i + 1 == len(layers))
            torch.cuda.synchronize()
            m = config.batch_size * config.seq_len
            gemm = [m, config.d_model, config.d_model]
            row = {"check": "model", "shape": shape, "padding_ratio": ratio, "gemm": gemm,
                   "forms": tally, **summary(tally)}
            rows.append(row)
            print(f"shape {shape} padding {ratio}: " + ", ".join(f"{f} {e['differing']}/{e['elements']}"
                                                                  for f, e in tally.items()), flush=True)
        del model
        torch.cuda.empty_cache()
    return rows


def random_checks(gemms: list[tuple[int, int, int]], device) -> list[dict]:
    rows = []
    gen = torch.Generator(device=device).manual_seed(7)
    for m, n, k in gemms:
        for scale in (0.1, 1.0, 10.0):
            x = (torch.randn(m, k, generator=gen, device=device) * scale).half()
            r = torch.randn(m, n, generator=gen, device=device).half()
            mask = torch.rand(m, generator=gen, device=device) > 0.2
            ws = [(torch.randn(n, k, generator=gen, device=device) / k ** 0.5).half() for _ in range(3)]
            bs = [(torch.randn(n, generator=gen, device=device) * 0.1).half() for _ in range(3)]
            tally: dict = {}
            with torch.inference_mode():
                y = F.linear(x, ws[0], bs[0])
                tally_add(tally, "q", triton_linear(x, ws[0], bs[0]), y)
                tally_add(tally, "qkv_packed", triton_linear(x, torch.cat(ws), torch.cat(bs)),
                          torch.cat([F.linear(x, w, b) for w, b in zip(ws, bs)], dim=-1))
                tally_add(tally, "gelu", triton_linear(x, ws[0], bs[0], epilogue="gelu"), F.gelu(y))
                fused_gelu = triton_linear(x, ws[0], bs[0], epilogue="gelu", enable_fp_fusion=True)
                tally_add(tally, "gelu_fpfusion", fused_gelu, F.gelu(y))
                tally_add(tally, "add_masked", triton_linear(x, ws[0], bs[0], r, mask, "add_masked"),
                          r + y.masked_fill(~mask[:, None], 0))
                tally_add(tally, "masked_sum", triton_linear(x, ws[0], bs[0], r, mask, "masked_sum"),
                          (r + y).masked_fill(~mask[:, None], 0))
                if n == k:  # ffn_out's shape: GELU on the way in
                    want = (r + F.linear(F.gelu(x), ws[0], bs[0])).masked_fill(~mask[:, None], 0)
                    for fusion in (False, True):
                        tally_add(tally, "gelu_prologue" + ("_fpfusion" if fusion else ""),
                                  triton_linear(x, ws[0], bs[0], r, mask, "masked_sum", prologue="gelu",
                                                enable_fp_fusion=fusion), want)
                if n in LN_WIDTHS:  # trained-like LayerNorm: weight and bias away from identity
                    lw = (1 + 0.5 * torch.randn(n, generator=gen, device=device)).half()
                    lb = (0.2 * torch.randn(n, generator=gen, device=device)).half()
                    for epilogue in ("add_masked", "masked_sum"):
                        total = triton_linear(x, ws[0], bs[0], r, mask, epilogue)
                        got = triton_linear_layer_norm(x, ws[0], bs[0], r, mask, lw, lb, 1e-5, epilogue)
                        tally_add(tally, f"{epilogue}_ln", torch.cat(got, dim=-1),
                                  torch.cat([total, F.layer_norm(total, (n,), lw, lb, 1e-5)], dim=-1))
            torch.cuda.synchronize()
            rows.append({"check": "random", "gemm": [m, n, k], "scale": scale, "forms": tally,
                         **summary(tally)})
            print(f"random {(m, n, k)} scale {scale}: differing {rows[-1]['differing']}", flush=True)
    return rows


def gelu_exhaustive(device) -> list[dict]:
    """Every finite float16 value through the GELU epilogue (an identity GEMM: x @ I + 0 is x exactly) against
    F.gelu: the epilogue is a function of one float16 value, so this covers every input it can ever see."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32, device=device).to(torch.int16).view(torch.float16)
    values = bits[torch.isfinite(bits) & (bits.view(torch.int16) != -32768)]  # -0 leaves a GEMM as +0 (0 + -0)
    pad = (-values.numel()) % 16
    x = torch.cat([values, values.new_zeros(pad)]).view(-1, 16)
    eye, zero = torch.eye(16, device=device, dtype=torch.float16), torch.zeros(16, device=device, dtype=torch.float16)
    rows = []
    with torch.inference_mode():
        assert torch.equal(triton_linear(x, eye, zero).view(torch.int16), x.view(torch.int16))  # the identity holds
        ref = F.gelu(x, approximate="none")
        for fusion in (False, True):
            got = triton_linear(x, eye, zero, epilogue="gelu", enable_fp_fusion=fusion)
            bad = (got.view(torch.int16) != ref.view(torch.int16)).flatten()[: values.numel()]
            examples = [[float(v), float(g), float(r)] for v, g, r in zip(
                x.flatten()[: values.numel()][bad][:5], got.flatten()[: values.numel()][bad][:5],
                ref.flatten()[: values.numel()][bad][:5])]
            rows.append({"check": "gelu_exhaustive", "enable_fp_fusion": fusion, "values": int(values.numel()),
                         "differing": int(bad.sum()), "examples": examples})
            print(f"gelu over every finite fp16 value, enable_fp_fusion={fusion}: {rows[-1]['differing']} differing "
                  f"{examples}", flush=True)
            # the prologue: GELU on the GEMM's input, then x @ I + 0. A GELU of -0 (or a tiny negative value) comes
            # back +0 through the identity GEMM, as through any GEMM's +0 accumulator: zeros compare by value.
            got = triton_linear(x, eye, zero, prologue="gelu", enable_fp_fusion=fusion)
            bad = ((got.view(torch.int16) != ref.view(torch.int16)) & ~((got == 0) & (ref == 0))).flatten()
            rows.append({"check": "gelu_exhaustive", "prologue": True, "enable_fp_fusion": fusion,
                         "values": int(values.numel()), "differing": int(bad[: values.numel()].sum())})
            print(f"gelu prologue over every finite fp16 value, enable_fp_fusion={fusion}: {rows[-1]['differing']} "
                  f"differing", flush=True)
    return rows


def timing(shape: int, device, repeats: int) -> dict:
    config = OFFICIAL_SHAPES[shape]
    m, d = config.batch_size * config.seq_len, config.d_model
    gen = torch.Generator(device=device).manual_seed(3)
    x = torch.randn(m, d, generator=gen, device=device).half()
    r = torch.randn(m, d, generator=gen, device=device).half()
    mask = torch.ones(m, dtype=torch.bool, device=device)
    w = (torch.randn(d, d, generator=gen, device=device) / d ** 0.5).half()
    b = torch.zeros(d, device=device).half()
    w3, b3 = torch.cat([w, w, w]), torch.cat([b, b, b])
    t = {}
    with torch.inference_mode():
        t["aten_linear_ms"] = cuda_median_ms(lambda: F.linear(x, w, b), repeats)
        t["kernel_linear_ms"] = cuda_median_ms(lambda: triton_linear(x, w, b), repeats)
        t["aten_qkv_ms"] = cuda_median_ms(lambda: (F.linear(x, w, b), F.linear(x, w, b), F.linear(x, w, b)), repeats)
        t["kernel_qkv_ms"] = cuda_median_ms(lambda: triton_linear(x, w3, b3), repeats)
        t["aten_gelu_ms"] = cuda_median_ms(lambda: F.gelu(F.linear(x, w, b)), repeats)
        t["kernel_gelu_ms"] = cuda_median_ms(lambda: triton_linear(x, w, b, epilogue="gelu"), repeats)
        t["aten_masked_sum_ms"] = cuda_median_ms(
            lambda: (r + F.linear(x, w, b)).masked_fill(~mask[:, None], 0), repeats)
        t["kernel_masked_sum_ms"] = cuda_median_ms(lambda: triton_linear(x, w, b, r, mask, "masked_sum"), repeats)
        # the whole feed-forward half: ATen (GEMM, GELU, GEMM, residual + mask) against ffn_in, then ffn_out with the
        # GELU as its prologue and the residual + mask as its epilogue
        t["aten_ffn_ms"] = cuda_median_ms(
            lambda: (r + F.linear(F.gelu(F.linear(x, w, b)), w, b)).masked_fill(~mask[:, None], 0), repeats)
        t["kernel_ffn_gelu_prologue_ms"] = cuda_median_ms(
            lambda: triton_linear(triton_linear(x, w, b), w, b, r, mask, "masked_sum", prologue="gelu"), repeats)
        t["kernel_ffn_gelu_prologue_fpfusion_ms"] = cuda_median_ms(
            lambda: triton_linear(triton_linear(x, w, b), w, b, r, mask, "masked_sum", prologue="gelu",
                                  enable_fp_fusion=True), repeats)
        # what the blocks ran before the prologue: our GEMM, ATen's GELU, our GEMM with residual + mask
        t["kernel_ffn_aten_gelu_ms"] = cuda_median_ms(
            lambda: triton_linear(F.gelu(triton_linear(x, w, b)), w, b, r, mask, "masked_sum"), repeats)
        ln_w, ln_b = torch.ones(d, device=device).half(), torch.zeros(d, device=device).half()
        if d in LN_WIDTHS:
            t["separate_masked_sum_then_ln_ms"] = cuda_median_ms(
                lambda: layer_norm_rows_kernel(triton_linear(x, w, b, r, mask, "masked_sum"), ln_w, ln_b, 1e-5),
                repeats)
            for bm, warps, reload in ((64, 8, True), (128, 8, True), (64, 8, False), (128, 8, False)):
                t[f"kernel_masked_sum_ln_bm{bm}_w{warps}{'_reload' if reload else ''}_ms"] = cuda_median_ms(
                    lambda: triton_linear_layer_norm(x, w, b, r, mask, ln_w, ln_b, 1e-5, "masked_sum", BLOCK_M=bm,
                                                     num_warps=warps, LN_RELOAD=reload), repeats)
        for bm, bk, warps in ((64, 64, 4), (128, 128, 8), (256, 64, 8)):
            if bk <= d:
                key = f"kernel_linear_bm{bm}_bk{bk}_w{warps}_ms"
                t[key] = cuda_median_ms(lambda: triton_linear(x, w, b, BLOCK_M=bm, BLOCK_K=bk, num_warps=warps),
                                        repeats)
    return {"check": "timing", "shape": shape, "gemm": [m, d, d], "config": launch_config(d, d),
            **{k: round(v, 4) for k, v in t.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="1,2,3,4,5,6,7,8,9,10,11,12,13")
    ap.add_argument("--timing-shapes", default="6,8")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--gelu-only", action="store_true",
                    help="only the exhaustive GELU check (seconds): e.g. under another TRITON_LIBDEVICE_PATH")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("fused_linear_selftest: needs a CUDA GPU", file=sys.stderr)
        return 2
    global launch_config, triton_linear, triton_linear_layer_norm
    from kkdeploy.kernels._fused_linear_triton import launch_config, triton_linear, triton_linear_layer_norm
    device = torch.device("cuda")
    start = time.time()
    shapes = [int(s) for s in args.shapes.split(",") if s]
    rows = gelu_exhaustive(device)
    if not args.gelu_only:
        rows += model_checks(shapes, device)
        gemms = sorted({tuple(r["gemm"]) for r in rows if "gemm" in r})  # the exhaustive rows have none
        rows += random_checks(gemms + [(65536, 1024, 1024)], device)
        rows += [timing(int(s), device, args.repeats) for s in args.timing_shapes.split(",") if s]
    for r in rows:
        if r["check"] == "timing":
            print("timing " + json.dumps(r), flush=True)
    platform = platform_key(device)
    report = {"platform": [list(platform[0]), *platform[1:]], "gpu": torch.cuda.get_device_name(),
              "triton_libdevice_path": os.environ.get("TRITON_LIBDEVICE_PATH"),
              "weights": "kkdeploy.models.weights.init_weights(seed=0)", "rows": rows,
              "seconds": round(time.time() - start, 1)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    checked = {tuple(r["gemm"]) for r in rows if r["check"] == "model"}
    proven = sorted(checked - {tuple(r["gemm"]) for r in rows if r["check"] in ("model", "random") and r["differing"]})
    proven_fusion = sorted(checked - {tuple(r["gemm"]) for r in rows
                                      if r["check"] in ("model", "random") and r["differing_fpfusion"]})
    ln_failed = {tuple(r["gemm"]) for r in rows if r["check"] in ("model", "random") and r["differing_ln"]}
    with_ln = sorted({g for g in checked if g[1] in LN_WIDTHS} - ln_failed)
    total = sum(r.get("differing", 0) for r in rows if r["check"] != "gelu_exhaustive")
    print(f"\nfused linear vs ATen on {report['platform']}: {total} differing elements in all; "
          f"GEMMs with 0 differing in every model and random check: {proven}; with the GELU compiled with fp "
          f"fusion: {proven_fusion}; with the LayerNorm epilogues and the emulation: {with_ln}")
    print(f"{'check':8} {'gemm':>22} {'pad/scale':>9} " + " ".join(f"{f:>10}" for f in FORMS))
    for r in rows:
        if r["check"] in ("timing", "gelu_exhaustive"):
            continue
        extra = r.get("padding_ratio", r.get("scale"))
        cells = " ".join(f"{r['forms'][f]['differing'] if f in r['forms'] else '-':>10}" for f in FORMS)
        print(f"{r['check']:8} {str(tuple(r['gemm'])):>22} {extra:>9} {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

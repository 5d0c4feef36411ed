"""GPU proof for kkdeploy_faithful::attention: the Triton kernel against the ATen composition, bit for bit.

Run from the repository root on a CUDA machine:

    PYTHONUNBUFFERED=1 python3 scripts/faithful_attention_selftest.py --out OUTDIR

What it does (everything lands in OUTDIR/faithful_attention_selftest.json, a table is printed last):

1. environment: torch / triton / CUDA versions, the GPU, and the installed ATen header
   ``ATen/native/cuda/PersistentSoftmax.cuh`` (hash, the lines the kernel depends on; a copy is saved);
2. ATen's softmax order: ``emulate_persistent_softmax`` (plain fp32 tensor ops in the order the kernel
   reproduces) against ``torch.softmax`` for row lengths 1..1024 (and 2048, for information), bitwise;
3. for every official shape 1-13 (B, S, D, H from design.md §3, causal; ``--max-batch`` caps B), with
   real-model-like inputs (layer 0's q/k/v projections of the seeded ReferenceTransformer on the
   organizer's inputs, seed 1234) and wide random inputs, all-valid and padded (padding_ratio 0.25): the
   kernel (through the custom op, and each launch variant directly) against ``reference_attention``:
   differing elements, first differing index; the debug variant's scores/probabilities against ATen's
   intermediate tensors (stage by stage); non-causal and odd sequence lengths as extra cases (for a
   mismatching one: stage by stage, and whether ATen itself changes with the batch count); last, which
   (B*H, S, Dh) were bit-identical (a study: the op itself runs where the build's proof step,
   ``kkdeploy.kernels.model_proofs``, found a launch bit-identical; ``scripts/prove_kernels.py`` runs that step);
4. timing (triton.testing.do_bench, median, L2 flushed): the op and the ATen composition per shape.

Nothing is loosened: a comparison is ``equal bits`` or it is reported as a mismatch.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from kkdeploy import OFFICIAL_SHAPES, ReferenceTransformer, TransformerConfig, generate_case  # noqa: E402
from kkdeploy.kernels.faithful_attention import (  # noqa: E402
    LAUNCHES,
    emulate_persistent_softmax,
    faithful_attention,
    launch_fits,
    reference_attention,
    select_attention_path,
)

SEED = 1234
PADDING_RATIO = 0.25
VARIANTS = dict(LAUNCHES)  # name -> launch options of triton_attention (the first is the op's default)


def variants_for(seq_len: int, names=None) -> list[str]:
    """The launch variants that apply to rows of ``seq_len`` (one pass holds at most 128 keys)."""
    return [n for n in (names or VARIANTS) if launch_fits(n, seq_len)]


def log(msg: str) -> None:
    print(msg, flush=True)


def diff_report(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """Differing elements by bits (NaN payloads, signed zeros included) and the first one."""
    view = torch.int16 if out.dtype in (torch.float16, torch.bfloat16) else torch.int32
    neq = out.contiguous().view(view) != ref.contiguous().view(view)
    n = int(neq.sum())
    rep = {"elements": out.numel(), "differing": n}
    if n:
        flat = int(neq.flatten().nonzero()[0])
        idx = list(torch.unravel_index(torch.tensor(flat), out.shape))
        idx = [int(i) for i in idx]
        rep["first_index"] = idx
        rep["first_values"] = [float(out[tuple(idx)]), float(ref[tuple(idx)])]
        finite = torch.isfinite(out) & torch.isfinite(ref)
        rep["max_abs"] = float((out.float() - ref.float()).abs()[finite].max()) if finite.any() else None
    return rep


def header_facts() -> dict:
    path = Path(torch.__file__).parent / "include" / "ATen" / "native" / "cuda" / "PersistentSoftmax.cuh"
    if not path.is_file():
        return {"path": str(path), "found": False}
    text = path.read_text()
    lines = text.splitlines()
    wanted = [
        "TORCH_INTERNAL_ASSERT( softmax_elements >= 0",
        "constexpr int WARP_SIZE = (next_power_of_two <",
        "constexpr int WARP_ITERATIONS",
        "elements[i][it] = -std::numeric_limits<acc_t>::infinity();",
        "elements[i][it] = std::exp(elements[i][it] - max_value[i]);",
        "sum[i] += elements[i][it];",
        "warp_reduce<acc_t, WARP_BATCH, WARP_SIZE, Add>(sum);",
        "warp_reduce<acc_t, WARP_BATCH, WARP_SIZE, Max>(max_value);",
        "for (int offset = WARP_SIZE / 2; offset > 0; offset /= 2)",
        "dst[i*element_count+it*WARP_SIZE] = elements[i][it] / sum[i];",
        "LAUNCH_SOFTMAX_WARP_FORWARD(10)",
        "LAUNCH_SOFTMAX_WARP_FORWARD(11)",
    ]
    found = {w: [i + 1 for i, line in enumerate(lines) if w in line] for w in wanted}
    return {"path": str(path), "found": True, "sha256": hashlib.sha256(text.encode()).hexdigest(),
            "lines": len(lines), "matches": found}


def check_softmax_order(device) -> list[dict]:
    """emulate_persistent_softmax == torch.softmax(float32) bitwise, per row length."""
    out = []
    g = torch.Generator(device=device).manual_seed(7)
    for s in [1, 2, 3, 5, 8, 13, 16, 17, 31, 32, 33, 64, 65, 100, 127, 128, 129, 255, 256, 300, 512, 513,
              777, 1000, 1023, 1024]:
        rows = 4096 if s <= 256 else 1024
        x = torch.randn(rows, s, generator=g, device=device) * 6
        # causal-like -inf tails on half of the rows (every row keeps element 0)
        cut = torch.randint(1, s + 1, (rows,), generator=g, device=device)
        tail = (torch.arange(s, device=device)[None, :] >= cut[:, None]) & (torch.arange(rows, device=device)[:, None] % 2 == 0)
        x = x.masked_fill(tail, float("-inf"))
        x16 = x.half().float()  # what the attention feeds it: fp16 values
        rep = diff_report(emulate_persistent_softmax(x16), torch.softmax(x16, dim=-1))
        out.append({"S": s, **rep})
    # information only (the kernel stops at 1024): is S = 2048 also the warp softmax in this torch?
    x = torch.randn(512, 2048, generator=g, device=device) * 6
    out.append({"S": 2048, "info_only": True,
                **diff_report(emulate_persistent_softmax(x), torch.softmax(x, dim=-1))})
    return out


_MODELS: dict = {}


def seeded_model(config, device):
    key = (config.d_model, config.num_heads, config.ffn_dim, config.num_layers, config.causal)
    if key not in _MODELS:
        _MODELS.clear()
        _MODELS[key] = _build_model(config, device)
    return _MODELS[key]


def _build_model(config, device):
    torch.manual_seed(0)
    model = ReferenceTransformer(config)
    try:
        from kkdeploy.models.weights import init_weights

        init_weights(model, seed=0)
        how = "kkdeploy.models.weights.init_weights(seed=0)"
    except Exception:  # noqa: BLE001 - the package is being restructured; torch's default init then
        how = "torch default init, torch.manual_seed(0)"
    return model.to(device=device, dtype=torch.float16).eval(), how


def model_inputs(config, device, padded: bool):
    """Layer 0's q/k/v Linear outputs on the organizer's input (seed 1234), and the mask."""
    model, how = seeded_model(config, device)
    x, mask = generate_case(config, device, torch.float16, SEED, padding_ratio=PADDING_RATIO if padded else 0.0)
    attn = model.layers[0].attention
    with torch.no_grad():
        h = model.layers[0].norm1(x)
        q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
    return (q, k, v), (mask if padded else None), attn, how


def random_inputs(config, device, mask, seed=99, sigma=1.5):
    g = torch.Generator(device=device).manual_seed(seed)
    shape = (config.batch_size, config.seq_len, config.d_model)
    return tuple((torch.randn(shape, generator=g, device=device) * sigma).half() for _ in range(3)), mask


def aten_stages(q, k, v, mask, h, causal):
    """The reference's intermediate tensors: scores (fp16, masked), probs (fp16), context."""
    b, s, d = q.shape
    dh = d // h

    def split(t):
        return t.view(b, s, h, dh).transpose(1, 2)

    qh, kh, vh = split(q), split(k), split(v)
    scores = torch.matmul(qh, kh.transpose(-2, -1)) * dh ** -0.5
    if causal:
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return scores, probs


def stage_report(q, k, v, mask, h, causal, max_rows=16, **variant):
    from kkdeploy.kernels._faithful_attention_triton import triton_attention

    b = min(q.shape[0], max_rows)
    q, k, v = q[:b], k[:b], v[:b]
    mask = None if mask is None else mask[:b]
    out, scores, probs = triton_attention(q, k, v, mask, h, causal, debug=True, **variant)
    ref_scores, ref_probs = aten_stages(q, k, v, mask, h, causal)
    ref = reference_attention(q, k, v, mask, h, causal)
    return {"batch_used": b, "scores": diff_report(scores, ref_scores), "probs": diff_report(probs, ref_probs),
            "context": diff_report(out, ref)}


def batch_probe(q, k, v, mask, h, causal, reps=16):
    """Is ATen itself a function of each batch element alone? The same inputs inside a batch ``reps`` times
    larger: ATen small vs ATen big (stage by stage) and the kernel against both."""
    from kkdeploy.kernels._faithful_attention_triton import triton_attention

    b = q.shape[0]
    big = [t.repeat(reps, 1, 1) for t in (q, k, v)]
    mbig = None if mask is None else mask.repeat(reps, 1)
    s_small, p_small = aten_stages(q, k, v, mask, h, causal)
    s_big, p_big = aten_stages(*big, mbig, h, causal)
    c_small = reference_attention(q, k, v, mask, h, causal)
    c_big = reference_attention(*big, mbig, h, causal)
    kern = triton_attention(q, k, v, mask, h, causal)
    kern_big = triton_attention(*big, mbig, h, causal)
    return {
        "reps": reps,
        "aten_small_vs_big": {"scores": diff_report(s_small, s_big[:b])["differing"],
                              "probs": diff_report(p_small, p_big[:b])["differing"],
                              "context": diff_report(c_small, c_big[:b])["differing"]},
        "kernel_vs_aten_small": diff_report(kern, c_small)["differing"],
        "kernel_vs_aten_big": diff_report(kern_big, c_big)["differing"],
        "kernel_small_vs_kernel_big": diff_report(kern, kern_big[:b])["differing"],
    }


def bench(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))


def run_case(q, k, v, mask, h, causal, variants, attn=None):
    from kkdeploy.kernels._faithful_attention_triton import triton_attention

    ref = reference_attention(q, k, v, mask, h, causal)
    rep = {}
    if attn is not None:  # sanity: the pure function is the module's attend()
        split = attn.split_heads
        with torch.no_grad():
            rep["reference_vs_attend"] = diff_report(ref, attn.attend(split(q), split(k), split(v), mask))["differing"]
    rep["op"] = diff_report(faithful_attention(q, k, v, mask, num_heads=h, causal=causal), ref)
    for name in variants:
        rep[name] = diff_report(triton_attention(q, k, v, mask, h, causal, **VARIANTS[name]), ref)
    return rep


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for the JSON report")
    ap.add_argument("--shapes", default="1-13")
    ap.add_argument("--max-batch", type=int, default=0, help="cap B (0: design.md §3's B)")
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--ablation", action="store_true", help="also run with Triton's default fp-fusion / FTZ flags")
    ap.add_argument("--time-variants", default="8", help="shape ids whose launch variants are timed too")
    ap.add_argument("--variants", default="", help="comma-separated launch variants to check (default: all); bm64, "
                                                    "the op's launch, is always checked")
    ap.add_argument("--dry-run-cpu", action="store_true",
                    help="exercise this script on a CPU under TRITON_INTERPRET=1 (proves nothing about bits)")
    args = ap.parse_args(argv)
    if args.variants:
        chosen = ["bm64"] + [n for n in args.variants.split(",") if n and n != "bm64"]
        unknown = [n for n in chosen if n not in VARIANTS]
        if unknown:
            ap.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
        for name in list(VARIANTS):
            if name not in chosen:
                del VARIANTS[name]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.dry_run_cpu:
        os.environ["TRITON_INTERPRET"] = "1"
        device = torch.device("cpu")
        args.no_bench = True
    elif not torch.cuda.is_available():
        log("no CUDA device: nothing to prove here (the CPU path is the reference itself; see the tests)")
        return 2
    else:
        device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    import triton

    cuda = device.type == "cuda"
    report = {
        "env": {
            "python": platform.python_version(), "torch": torch.__version__, "torch_git": torch.version.git_version,
            "cuda": torch.version.cuda, "triton": triton.__version__,
            "gpu": torch.cuda.get_device_name() if cuda else "cpu (dry run)",
            "capability": list(torch.cuda.get_device_capability()) if cuda else None,
            "fp16_reduced_precision_reduction": torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
        },
        "header": header_facts(),
    }
    hdr = Path(report["header"]["path"])
    if hdr.is_file():
        (out_dir / "PersistentSoftmax.cuh").write_text(hdr.read_text())
    log(json.dumps(report["env"]))
    log(json.dumps(report["header"].get("matches", {}), indent=None)[:3000])

    t0 = time.time()
    report["softmax_order"] = check_softmax_order(device)
    bad = [r for r in report["softmax_order"] if r.get("differing") and not r.get("info_only")]
    log(f"[softmax order] {len(report['softmax_order'])} row lengths, mismatching: "
        f"{[(r['S'], r['differing']) for r in bad]}; S=2048 (info): "
        f"{[r.get('differing', r.get('error')) for r in report['softmax_order'] if r.get('info_only')]} "
        f"({time.time() - t0:.1f}s)")

    lo, _, hi = args.shapes.partition("-")
    shape_ids = list(range(int(lo), int(hi or lo) + 1))
    shapes = {}
    for sid in shape_ids:
        config = OFFICIAL_SHAPES[sid]
        if args.max_batch and config.batch_size > args.max_batch:
            from dataclasses import replace

            config = replace(config, batch_size=args.max_batch)
        h = config.num_heads
        entry = {"config": config.to_dict(), "path": select_attention_path(
            config.seq_len, config.head_dim, torch.float16, device, batch_heads=config.batch_size * h).__dict__}
        if cuda and not entry["path"]["kernel"] == "triton":
            log(f"[shape {sid}] WARNING: the op takes {entry['path']} here, so 'op' compares ATen with itself")
        t_shape = time.time()
        try:
            for padded in (False, True):
                mode = "padded" if padded else "all_valid"
                (q, k, v), mask, attn, how = model_inputs(config, device, padded)
                entry["weights"] = how
                entry[f"model_{mode}"] = run_case(q, k, v, mask, h, True, variants_for(config.seq_len), attn=attn)
                entry[f"model_{mode}"]["stages"] = stage_report(q, k, v, mask, h, True, **VARIANTS["bm64"])
                (rq, rk, rv), _ = random_inputs(config, device, mask)
                # random inputs: every chosen launch with --variants, else the op's and cached64w4
                checked = list(VARIANTS) if args.variants else [n for n in ("bm64", "cached64w4") if n in VARIANTS]
                entry[f"random_{mode}"] = run_case(rq, rk, rv, mask, h, True, variants_for(config.seq_len, checked))
                entry[f"random_{mode}"]["stages"] = stage_report(rq, rk, rv, mask, h, True, **VARIANTS["bm64"])
                if not args.no_bench:
                    tm = {"aten_ms": bench(lambda: reference_attention(q, k, v, mask, h, True)),
                          "op_ms": bench(lambda: faithful_attention(q, k, v, mask, num_heads=h, causal=True))}
                    from kkdeploy.kernels._faithful_attention_triton import triton_attention

                    timed = variants_for(config.seq_len, list(VARIANTS) if (
                        padded and str(sid) in args.time_variants.split(",")) else [n for n in ("bm64", "cached64w4") if n in VARIANTS])
                    for name in timed:
                        opts = VARIANTS[name]
                        tm[f"{name}_ms"] = bench(lambda opts=opts: triton_attention(q, k, v, mask, h, True, **opts))
                    entry[f"time_{mode}"] = tm
                del q, k, v, rq, rk, rv
            if sid in (3, 8, 11, 12, 13):  # non-causal (the op supports it; no official shape uses it)
                (q, k, v), mask, _, _ = model_inputs(config, device, True)
                entry["noncausal_padded"] = run_case(q, k, v, mask, h, False, ["bm64"])
        except Exception as exc:  # noqa: BLE001 - record and go on: one shape must not cost the run
            entry["error"] = f"{type(exc).__name__}: {exc}"
            entry["traceback"] = traceback.format_exc()[-3000:]
        entry["seconds"] = round(time.time() - t_shape, 1)
        shapes[sid] = entry
        log(f"[shape {sid}] {summarize(entry)} ({entry['seconds']}s)")
        report["shapes"] = shapes
        (out_dir / "faithful_attention_selftest.json").write_text(json.dumps(report, indent=1, default=str))
        if cuda:
            torch.cuda.empty_cache()
    report["shapes"] = shapes

    # odd lengths and head sizes: not official, the kernel's edges (S < 16, S % 32 != 0, Dh = 8/16/64)
    extras = []
    extra_shapes = [(2, 1, 64, 2), (3, 5, 64, 2), (2, 16, 16, 2), (2, 17, 64, 4), (2, 45, 128, 4),
                    (3, 100, 96, 3), (2, 1000, 64, 1), (2, 333, 256, 1), (2, 128, 256, 1), (64, 128, 256, 1),
                    (2, 128, 1024, 4), (2, 333, 128, 1), (2, 700, 128, 1)]
    for b, s, d, h in extra_shapes if cuda else extra_shapes[:4]:
        for causal in (True, False):
            for padded in (False, True):
                cfg = TransformerConfig(b, s, d, h, d, 1, causal=causal)
                try:
                    (q, k, v), mask, _, _ = model_inputs(cfg, device, padded)
                    # every chosen launch that fits with --variants, else the op's default and bm64x2
                    names = variants_for(s, list(VARIANTS) if args.variants else ["bm64", "bm64x2"])
                    rep = run_case(q, k, v, mask, h, causal, names)
                    row = {"B": b, "S": s, "D": d, "H": h, "causal": causal, "padded": padded,
                           "op_path": select_attention_path(s, d // h, torch.float16, device, batch_heads=b * h).kernel,
                           **{key: val["differing"] for key, val in rep.items()}}
                    if any(row[key] for key in ("op", *names)):
                        st = stage_report(q, k, v, mask, h, causal, **VARIANTS["bm64"])
                        row["stages"] = {key: st[key]["differing"] for key in ("scores", "probs", "context")}
                        row["stages_first"] = {key: st[key].get("first_index") for key in ("scores", "probs", "context")}
                        row["batch_probe"] = batch_probe(q, k, v, mask, h, causal)
                    extras.append(row)
                except Exception as exc:  # noqa: BLE001
                    extras.append({"B": b, "S": s, "D": d, "H": h, "causal": causal, "padded": padded,
                                   "error": f"{type(exc).__name__}: {exc}"})
    report["extra_cases"] = extras
    log(f"[extra] {len(extras)} cases, not bitwise: "
        f"{[e for e in extras if e.get('error') or any(v for k, v in e.items() if k == 'op' or k in VARIANTS)]}")

    # CUDA-graph capture of the op (what a serving runner would do)
    try:
        if not cuda:
            raise RuntimeError("dry run on the CPU")
        config = OFFICIAL_SHAPES[3]
        (q, k, v), mask, _, _ = model_inputs(config, device, True)
        static = [t.clone() for t in (q, k, v)]
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            faithful_attention(*static, mask, num_heads=config.num_heads, causal=True)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            g_out = faithful_attention(*static, mask, num_heads=config.num_heads, causal=True)
        graph.replay()
        torch.cuda.synchronize()
        report["cuda_graph_shape3"] = diff_report(g_out, reference_attention(q, k, v, mask, config.num_heads, True))
    except Exception as exc:  # noqa: BLE001
        report["cuda_graph_shape3"] = {"error": f"{type(exc).__name__}: {exc}"}
    log(f"[cuda graph] {report['cuda_graph_shape3']}")

    # ablation (information): the compile flags this kernel sets, switched back to Triton's defaults
    try:
        if not cuda or not args.ablation:
            raise RuntimeError("not asked (--ablation)" if cuda else "dry run on the CPU")
        from kkdeploy.kernels import _faithful_attention_triton as kt

        ablation = {}
        for sid in (1, 13):
            config = OFFICIAL_SHAPES[sid]
            (q, k, v), mask, _, _ = model_inputs(config, device, True)
            ref = reference_attention(q, k, v, mask, config.num_heads, True)
            ablation[sid] = {}
            for name, flags in {"fp_fusion_on": dict(enable_fp_fusion=True, enable_reflect_ftz=False),
                                "ftz_on": dict(enable_fp_fusion=False, enable_reflect_ftz=True)}.items():
                saved = kt.COMPILE_FLAGS
                kt.COMPILE_FLAGS = flags
                try:
                    ablation[sid][name] = diff_report(kt.triton_attention(q, k, v, mask, config.num_heads, True), ref)["differing"]
                finally:
                    kt.COMPILE_FLAGS = saved
        report["ablation_flags"] = ablation
    except Exception as exc:  # noqa: BLE001
        report["ablation_flags"] = {"error": f"{type(exc).__name__}: {exc}"}
    log(f"[ablation] {report['ablation_flags']}")

    # which measured (B*H, S, Dh) were bit-identical in every case
    keys: dict = {}
    for sid, e in shapes.items():
        c = e["config"]
        key = (c["batch_size"] * c["num_heads"], c["seq_len"], c["d_model"] // c["num_heads"])
        ok = "error" not in e and all(
            v["differing"] == 0 for k, r in e.items() if isinstance(r, dict) and k.startswith(("model_", "random_", "noncausal"))
            for v in r.values() if isinstance(v, dict) and "differing" in v)
        keys[key] = keys.get(key, True) and ok
    for x in extras:
        key = (x["B"] * x["H"], x["S"], x["D"] // x["H"])
        ok = "error" not in x and not any(x.get(k) for k in ("op", *VARIANTS))
        keys[key] = keys.get(key, True) and ok
    report["bit_identical_keys"] = [{"key": list(k), "bit_identical": v} for k, v in keys.items()]
    log(f"[bitwise] (B*H, S, Dh) bit-identical here: {[k for k, v in keys.items() if v]}; NOT: "
        f"{[k for k, v in keys.items() if not v]}")

    path = out_dir / "faithful_attention_selftest.json"
    path.write_text(json.dumps(report, indent=1, default=str))
    log(f"wrote {path}")
    print_table(report)
    return 0


def summarize(entry: dict) -> str:
    if "error" in entry:
        return "ERROR " + entry["error"]
    parts = []
    for key in ("model_all_valid", "model_padded", "random_all_valid", "random_padded", "noncausal_padded"):
        if key in entry:
            r = entry[key]
            diffs = {name: val["differing"] for name, val in r.items() if isinstance(val, dict) and "differing" in val}
            st = r.get("stages")
            if st:
                diffs["stages(s/p/c)"] = f"{st['scores']['differing']}/{st['probs']['differing']}/{st['context']['differing']}"
            parts.append(f"{key}: {diffs}")
    for key in ("time_all_valid", "time_padded"):
        if key in entry:
            parts.append(f"{key}: " + ", ".join(f"{n}={v:.4f}" for n, v in entry[key].items()))
    return "; ".join(parts)


def print_table(report: dict) -> None:
    """One line per shape: worst differing-element count over the op and every launch variant, per input."""
    log("")
    log("differing elements = max over {op, " + ", ".join(VARIANTS) + "} (model) / {op, bm64, cached64w4} (random); "
        "times: do_bench median ms")
    log(f"{'id':>3} {'B':>6} {'S':>5} {'D':>5} {'H':>3} | {'model':>11} {'model':>11} {'random':>11} {'random':>11} | "
        f"{'all-valid ms':>18} | {'padded ms':>18} | {'best variant':>20}")
    log(f"{'':>3} {'':>6} {'':>5} {'':>5} {'':>3} | {'all-valid':>11} {'padded':>11} {'all-valid':>11} {'padded':>11} | "
        f"{'ATen / op':>18} | {'ATen / op':>18} | {'(padded)':>20}")
    for sid, e in report["shapes"].items():
        c = e["config"]
        head = f"{sid:>3} {c['batch_size']:>6} {c['seq_len']:>5} {c['d_model']:>5} {c['num_heads']:>3}"
        if "error" in e:
            log(f"{head} | ERROR {e['error'][:120]}")
            continue

        def worst(key):
            r = e.get(key, {})
            vals = [v["differing"] for v in r.values() if isinstance(v, dict) and "differing" in v]
            return str(max(vals)) if vals else "-"

        def times(key):
            t = e.get(key)
            return f"{t['aten_ms']:.4f} / {t['op_ms']:.4f}" if t else "-"

        tp = e.get("time_padded", {})
        variants = {n[:-3]: v for n, v in tp.items() if n[:-3] in VARIANTS}
        best = min(variants, key=variants.get) if variants else None
        best_s = f"{best} {variants[best]:.4f}" if best else "-"
        log(f"{head} | {worst('model_all_valid'):>11} {worst('model_padded'):>11} {worst('random_all_valid'):>11} "
            f"{worst('random_padded'):>11} | {times('time_all_valid'):>18} | {times('time_padded'):>18} | {best_s:>20}")
        per_variant = {n: [e.get(k, {}).get(n, {}).get("differing", "-") for k in ("model_all_valid", "model_padded")]
                       for n in VARIANTS}
        padded_ms = {n: round(v, 4) for n, v in variants.items()}
        log(f"{'':>3} differing (model all-valid, padded) {per_variant}; padded ms {padded_ms}")


if __name__ == "__main__":
    sys.exit(main())

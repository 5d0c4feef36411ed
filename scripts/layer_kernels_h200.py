"""Whole blocks in one launch each, on a GPU: op by op against the reference, then timed against eager (issue 31).

For each shape: the seeded weights and trained-like weights of our own (``make_weights.trained_like``), official
inputs all-valid and padded (0.25, the generator's padding). Each call compares every intermediate the layer launches
write with the reference's own ops (``layer_kernels.compare_intermediates``: differing elements per part, and the
first part that differs), and the output with ``reference_forward`` under the strict rule. Then, in the same
process: eager ``reference_forward``, the reference captured in a CUDA graph (``torch-graph``) and the layer
launches captured in a CUDA graph, each the median of ``--rounds`` rounds of ``--repeats`` timed calls. The captured
launches are checked again on a padded input after the timed replays.

``persistent`` in a launch spec runs the whole model as one persistent launch (``_model_triton``); ``--trace`` adds
each persistent launch's timeline (waits and runs per kind of work item, from the GPU's clock)::

    python3 scripts/layer_kernels_h200.py --shapes 3,12 --weights own:4711 --trace \
        --launches cached_mdiv:1:8:split,cached_mdiv:1:8:persistent,cached_mdiv:1:4:persistent,cached_mdiv:1:8:persistent:p2

    python3 scripts/layer_kernels_h200.py --shapes 2,3,4,7,12 --json $OUT/layers.json

``--dims B,S,D,H,F,L`` adds shapes of one's own. ``--device cpu`` (with ``TRITON_INTERPRET=1``) runs the same flow
under Triton's interpreter, checks only: a dry run of the script, whose launches differ from the CPU's float16 ATen
ops (those are not CUDA's), so its differing counts say nothing of a GPU::

    TRITON_INTERPRET=1 python3 scripts/layer_kernels_h200.py --device cpu --shapes "" --dims 2,8,16,2,16,2 \
        --weights seeded --launches cached_mdiv:1:4:persistent
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from make_weights import trained_like  # noqa: E402

from engines.cuda_graph import CapturedCall  # noqa: E402
from kkdeploy.config import TransformerConfig, official_config  # noqa: E402
from kkdeploy.inputs import generate_case, padded_case  # noqa: E402
from kkdeploy.kernels.layer_kernels import (LayerKernels, LayerLaunch, compare_intermediates,  # noqa: E402
                                            default_launch, reference_intermediates)
from kkdeploy.kernels.proof import differing_elements as differing  # noqa: E402
from kkdeploy.kernels.timing import event_median_ms  # noqa: E402
from kkdeploy.models.reference import ReferenceTransformer  # noqa: E402
from kkdeploy.models.weights import init_weights  # noqa: E402
from validation.strict import strict_fail_mask  # noqa: E402


HEADER = (f"{'shape':>5} {'weights':>9} {'launch':>24} {'bits_diff':>9} {'strict':>7} {'first differing':>22} "
          f"{'eager':>8} {'graph':>8} {'layers':>8} {'x eager':>8}")


def model_for(config, weights: str, device):
    model = ReferenceTransformer(config)
    if weights == "seeded":
        init_weights(model, 0)
    else:
        model.load_state_dict(trained_like(config, int(weights.split(":")[1])))
    return model.to(device=device, dtype=torch.float16).eval()


def median_ms(fn, repeats: int, rounds: int) -> float:
    """The median over ``rounds`` of each round's median (``event_median_ms``), 10 warm-up calls before each."""
    per_round = []
    for _ in range(rounds):
        for _ in range(10):
            fn()
        per_round.append(event_median_ms(fn, repeats))
    return statistics.median(per_round)


def check(model, kernels: LayerKernels, config, device, seed: int, padding: float) -> dict:
    if padding:
        x, mask = padded_case(config, device, torch.float16, seed, padding)
    else:
        x, mask = generate_case(config, device, torch.float16, seed)
        mask = None
    with torch.inference_mode():
        out = kernels(x, mask).clone()
        got = kernels.intermediates(config.batch_size, config.seq_len)
        want = reference_intermediates(model, x, mask, kernels.launch.gelu_prologue)
        ref = model.reference_forward(x, mask)
    report = compare_intermediates(got, want)
    from kkdeploy.kernels._fused_linear_triton import triton_linear
    from kkdeploy.kernels.fused_linear import TILES
    standalone = {}
    for tile in ("auto", "m64"):  # the Q|K|V launch on its own, from the reference's norm1 (as a build proves it)
        ours = triton_linear(want["hn0"], kernels.qkv_weights[0], kernels.qkv_biases[0], **TILES[tile])
        standalone[tile] = differing(ours, want["qkv0"])
    report["qkv0_standalone"] = standalone
    return {"seed": seed, "padding": padding, "output_differing": differing(out, ref),
            "strict_failed": int(strict_fail_mask(ref, out, 1e-3, 1e-2).sum()), "first": report["first"],
            "parts": report}


def traced_timeline(model, launch: LayerLaunch, config, device) -> dict:
    """The persistent launch's timeline on one call after 20 warm-up calls (its traced twin: the same items, the
    GPU's clock read at each item's start, ready and end, and inside a row chain after out_proj and after ffn_in;
    ``LayerKernels.trace``)."""
    import dataclasses

    traced = LayerKernels(model, dataclasses.replace(launch, trace=True))
    x, mask = generate_case(config, device, torch.float16, 1234)
    with torch.inference_mode():
        for _ in range(20):
            traced(x, mask)
        torch.cuda.synchronize(device)
    return traced.trace()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="2,3,4,7,12")
    parser.add_argument("--weights", default="seeded,own:4711")
    parser.add_argument("--launches", default="default", help="default, or attention:gelu_prologue:warps[:split]"
                        "[:persistent][:p<programs per SM>][:nochain][:regs][:qkv][:tritonlib],... "
                        "e.g. cached:1:8,cached_mdiv:0:4:split,"
                        "cached_mdiv:1:8:persistent:p2")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-time", action="store_true")
    parser.add_argument("--trace", action="store_true",
                        help="after timing a persistent launch, run its traced twin (the GPU's clock at each work "
                             "item's start, ready and end) and report waits and runs per kind")
    parser.add_argument("--json", default=None)
    parser.add_argument("--dims", nargs="*", default=[], metavar="B,S,D,H,F,L",
                        help="shapes of one's own too: batch, seq, d_model, heads, ffn, layers (causal)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cpu: a dry run under Triton's interpreter (TRITON_INTERPRET=1), checks only")
    args = parser.parse_args(argv)
    try:
        dims = [tuple(int(v) for v in text.split(",")) for text in args.dims]
        shapes = [(int(s), official_config(int(s))) for s in args.shapes.split(",") if s.strip()]
    except ValueError as exc:
        parser.error(f"--shapes takes official ids (1-13), --dims B,S,D,H,F,L: {exc}")
    if any(len(d) != 6 for d in dims):
        parser.error("--dims takes six integers per shape: batch, seq, d_model, heads, ffn, layers")
    shapes += [("x".join(map(str, d)), TransformerConfig(*d, causal=True)) for d in dims]
    device = torch.device(args.device)
    if device.type == "cpu":
        import os

        if os.environ.get("TRITON_INTERPRET") != "1":
            parser.error("--device cpu runs Triton's interpreter: set TRITON_INTERPRET=1")
        from tests.interpreter_support import exact_fma, scalar_index  # the GPU's fma; numpy 2.4's int()

        exact_fma()
        scalar_index()
        args.no_time = True  # CUDA graphs and events: a GPU's
    rows, table = [], []
    print(HEADER, flush=True)
    for shape, config in shapes:
        for weights in args.weights.split(","):
            model = model_for(config, weights, device)
            if args.launches == "default":
                launches = [default_launch(config)]
            else:
                launches = []
                for spec in args.launches.split(","):
                    attention, prologue, warps, *more = spec.split(":")
                    per_sm = next((int(m[1:]) for m in more if m[:1] == "p" and m[1:].isdigit()), 1)
                    launches.append(LayerLaunch(attention=attention, gelu_prologue=prologue == "1",
                                                num_warps=int(warps), split="split" in more,
                                                libdevice="triton" if "tritonlib" in more else "cuda",
                                                persistent="persistent" in more, programs_per_sm=per_sm,
                                                row_chain="nochain" not in more,
                                                chain_in_registers="regs" in more or "qkv" in more,
                                                qkv_in_chain="qkv" in more))
            for launch in launches:
                print(f"... {shape} {weights} {launch.name()}", file=sys.stderr, flush=True)
                t0 = time.perf_counter()
                try:
                    kernels = LayerKernels(model, launch)
                    checks = [check(model, kernels, config, device, seed, padding)
                              for seed, padding in ((1234, 0.0), (1235, 0.0), (1236, 0.25), (1237, 0.25))]
                except Exception as exc:  # a launch that does not compile is a row of the table, not the end
                    rows.append({"shape": shape, "weights": weights, "launch": launch.name(), "error": repr(exc)[:500]})
                    table.append(f"{shape:>5} {weights:>9} {launch.name():>24}  ERROR {repr(exc)[:80]}")
                    print(table[-1], flush=True)  # as it comes: a later fault of the device loses nothing
                    continue
                check_s = time.perf_counter() - t0
                row = {"shape": shape, "weights": weights, "launch": launch.name(), "checks": checks,
                       "check_s": round(check_s, 1)}
                bad = sum(c["output_differing"] for c in checks)
                failed = sum(c["strict_failed"] for c in checks)
                first = next((f"{c['seed']}:{c['first']}" for c in checks if c["first"]), "-")
                timing = ""
                if not args.no_time:
                    x, mask = generate_case(config, device, torch.float16, 1234)
                    with torch.inference_mode():
                        eager = median_ms(lambda: model.reference_forward(x, mask), args.repeats, args.rounds)
                        graph = CapturedCall(model.reference_forward, config.batch_size, config.seq_len,
                                             config.d_model, torch.float16, device)
                        graph_ms = median_ms(lambda: graph(x, mask), args.repeats, args.rounds)
                        graph.close()
                        layers = CapturedCall(kernels.forward, config.batch_size, config.seq_len, config.d_model,
                                              torch.float16, device)
                        same = differing(layers(x, mask), model.reference_forward(x, mask))
                        layer_ms = median_ms(lambda: layers(x, mask), args.repeats, args.rounds)
                        # after thousands of replays (the persistent launch resets its own counters each call)
                        xp, maskp = padded_case(config, device, torch.float16, 1238, 0.25)
                        same_after = differing(layers(xp, maskp), model.reference_forward(xp, maskp))
                        layers.close()
                    row.update(eager_ms=round(eager, 4), torch_graph_ms=round(graph_ms, 4), layers_ms=round(layer_ms, 4),
                               captured_differing=same, captured_differing_after_timing=same_after)
                    bad += same + same_after
                    timing = f"{eager:8.3f} {graph_ms:8.3f} {layer_ms:8.4f} {eager / layer_ms:7.2f}x"
                if args.trace and launch.persistent and device.type == "cuda":
                    row["trace"] = traced_timeline(model, launch, config, device)
                    kinds = row["trace"]["kinds"]
                    timing += "  trace " + " ".join(f"{k} {v['wait_us_median']:.1f}+{v['run_us_median']:.1f}us"
                                                    for k, v in kinds.items())
                    stages = kinds.get("row_chain", {}).get("stages_us_median")
                    if stages:  # the row chain's parts: out_proj + norm2, ffn_in, ffn_out + GELU + the next norm
                        timing += " (" + " ".join(f"{k} {v:.1f}" for k, v in stages.items()) + ")"
                    timing += f" span {row['trace']['span_us']:.1f}us busy {row['trace']['busy']}"
                row["kernels"] = kernels.kernel_stats()
                spills = sum(k["spills"] or 0 for k in row["kernels"].values())
                regs = max((k["registers"] or 0) for k in row["kernels"].values()) if row["kernels"] else 0
                standalone = checks[0]["parts"]["qkv0_standalone"]
                timing += f"  regs {regs} spills {spills} qkv-alone {standalone['auto']}/{standalone['m64']}"
                rows.append(row)
                table.append(f"{shape:>5} {weights:>9} {launch.name():>24} {bad:>9} {failed:>7} {first:>22} {timing}")
                print(table[-1], flush=True)
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if args.json:
        name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (Triton's interpreter)"
        Path(args.json).write_text(json.dumps({"device": name, "torch": torch.__version__, "rows": rows}, indent=1))
    print(HEADER)
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())

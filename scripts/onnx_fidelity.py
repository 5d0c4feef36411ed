#!/usr/bin/env python3
"""ONNX fidelity study (design.md §6, issue 3): exported graph variants under ONNX Runtime against eager PyTorch.

For each official shape (float16, strict contract: 5 all-valid trials + 1 padded), each export variant,
each ORT graph optimization level and with/without CUDA graphs: failed elements and median latency
against the eager reference (CUDA events). Results go to JSON after every configuration (a timeout
keeps what was done; --resume skips it next call) and a short table is printed last.

    python scripts/onnx_fidelity.py --shapes 2,3,12 --variants default,fp32_linear --levels disabled,all
    python scripts/onnx_fidelity.py --mode ops --shapes 3      # Linear/LN/GELU op by op, bitwise
    python scripts/onnx_fidelity.py --device cpu --shapes 3 --trials 1   # CPU smoke test
"""

import onnxruntime  # noqa: I001  -- must come first: preload the CUDA 13 libraries shipped as pip packages

if hasattr(onnxruntime, "preload_dlls"):
    onnxruntime.preload_dlls()

import argparse
import importlib.util
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from exporters import NAMED_VARIANTS, export_onnx, op_histogram  # noqa: E402
from kkdeploy.config import official_config  # noqa: E402
from kkdeploy.inputs import DEFAULT_SEED, TIMED_SEED_OFFSET, generate_case  # noqa: E402
from kkdeploy.models.weights import build_models  # noqa: E402


def load_strict():
    """validation.strict without the package __init__ (which pulls in Polygraphy, absent on the GPU box)."""
    spec = importlib.util.spec_from_file_location("kk_strict", ROOT / "validation" / "strict.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["kk_strict"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


STRICT = load_strict()
ATOL, RTOL = STRICT.CONTRACTS["strict"]

VARIANTS = {k: v for k, v in NAMED_VARIANTS.items() if k != "gelu_op_opset20"}
LEVELS = {
    "disabled": onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": onnxruntime.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": onnxruntime.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL,
}
NP_TYPES = {torch.float16: np.float16, torch.float32: np.float32, torch.bool: np.bool_}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["e2e", "ops"], default="e2e")
    p.add_argument("--shapes", default="2,3,12,7,9", help="official ids, comma separated (default 2,3,12,7,9)")
    p.add_argument("--variants", default="default,fp32_linear,bias_in_k",
                   help=f"comma separated, of {','.join(VARIANTS)} (default default,fp32_linear,bias_in_k)")
    p.add_argument("--levels", default="disabled,basic,all", help="of disabled,basic,extended,all")
    p.add_argument("--cuda-graph", default="off,on", help="off, on or off,on (CUDA only)")
    p.add_argument("--disabled-optimizers", default="", help="ORT optimizer names to switch off in every session")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--dtype", default="float16", choices=["float16", "float32"])
    p.add_argument("--trials", type=int, default=5, help="all-valid accuracy trials (default 5)")
    p.add_argument("--padded-trials", type=int, default=1, help="padded trials, padding_ratio 0.25 (default 1)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--time-budget-s", type=float, default=420.0, help="stop starting new work after this (default 420)")
    p.add_argument("--out", help="output directory (default $OUT, else ./out)")
    p.add_argument("--resume", help="a previous results JSON: configurations in it are skipped and carried over")
    return p.parse_args(argv)


# -- timing ------------------------------------------------------------------------------------
def median_ms(fn, device: torch.device, warmup: int, repeats: int) -> float:
    """Median per-call time: CUDA events on the current stream (ORT syncs its stream at the end of Run)."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize()
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


# -- ORT sessions --------------------------------------------------------------------------------
def make_session(path, level, cuda_graph, device, disabled_optimizers, optimized_path=None):
    so = onnxruntime.SessionOptions()
    so.graph_optimization_level = LEVELS[level]
    so.log_severity_level = 3
    if optimized_path:
        so.optimized_model_filepath = str(optimized_path)
    if device.type == "cuda":
        options = {"device_id": str(device.index or 0)}
        if cuda_graph:
            options["enable_cuda_graph"] = "1"
        providers = [("CUDAExecutionProvider", options)]
    else:
        providers = ["CPUExecutionProvider"]
    kwargs = {"disabled_optimizers": disabled_optimizers} if disabled_optimizers else {}
    session = onnxruntime.InferenceSession(str(path), so, providers=providers, **kwargs)
    if device.type == "cuda" and "CUDAExecutionProvider" not in session.get_providers():
        raise RuntimeError(f"CUDA EP not active (providers {session.get_providers()})")
    return session


class BoundRunner:
    """ORT on fixed torch buffers through IO binding: what CUDA-graph replay requires."""

    def __init__(self, session, x: torch.Tensor, mask: torch.Tensor, device: torch.device):
        self.session, self.device = session, device
        self.x, self.mask = torch.empty_like(x), torch.empty_like(mask)
        self.y = torch.empty_like(x)
        self.binding = session.io_binding()
        dev_type, dev_id = ("cuda", device.index or 0) if device.type == "cuda" else ("cpu", 0)
        for name, t in (("x", self.x), ("valid_token_mask", self.mask)):
            self.binding.bind_input(name, dev_type, dev_id, NP_TYPES[t.dtype], list(t.shape), t.data_ptr())
        self.binding.bind_output("y", dev_type, dev_id, NP_TYPES[self.y.dtype], list(self.y.shape), self.y.data_ptr())

    def replay(self):
        self.session.run_with_iobinding(self.binding)

    def __call__(self, x, mask) -> torch.Tensor:
        self.x.copy_(x)
        self.mask.copy_(mask)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.replay()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return self.y.clone()  # the caller owns its output


# -- e2e study ----------------------------------------------------------------------------------
def trial_cases(config, device, dtype, args):
    cases = [("all-valid", DEFAULT_SEED + t, 0.0) for t in range(args.trials)]
    cases += [("padded", DEFAULT_SEED + t, 0.25) for t in range(args.padded_trials)]
    return [(mode, seed, *generate_case(config, device, dtype, seed, padding_ratio=pad)) for mode, seed, pad in cases]


def reference_side(shape_id, device, dtype, args):
    config = official_config(shape_id)
    model = build_models(config, dtype, device)[0]
    cases = trial_cases(config, device, dtype, args)
    with torch.inference_mode():
        expected = [model(x, m) for _, _, x, m in cases]
        x_t, m_t = generate_case(config, device, dtype, DEFAULT_SEED + TIMED_SEED_OFFSET)
        eager_ms = median_ms(lambda: model(x_t, m_t), device, args.warmup, args.repeats)
    return config, model, cases, expected, (x_t, m_t), eager_ms


def run_candidate(path, level, cuda_graph, device, cases, expected, timed, args, workdir):
    optimized = Path(workdir) / f"opt-{level}.onnx"
    session = make_session(path, level, cuda_graph, device, args.disabled_optimizers_list,
                           optimized_path=optimized if not cuda_graph else None)
    runner = BoundRunner(session, *timed, device)
    per_trial, max_abs, worst = [], 0.0, None
    for (mode, seed, x, m), ref in zip(cases, expected):
        report = STRICT.compare_outputs(ref, runner(x, m), ATOL, RTOL)
        per_trial.append({"mode": mode, "seed": seed, "failed": report.failed})
        if report.max_abs >= max_abs:
            max_abs, worst = report.max_abs, report.worst_index
    runner.x.copy_(timed[0])
    runner.mask.copy_(timed[1])
    ms = median_ms(runner.replay, device, args.warmup, args.repeats)
    executed = op_histogram(onnx.load(str(optimized))) if optimized.exists() else None
    return {"failed": sum(t["failed"] for t in per_trial), "trials": per_trial, "max_abs": max_abs,
            "worst_index": worst, "median_ms": ms, "executed_ops": executed}


def key_of(shape_id, variant, level, cuda_graph):
    return f"shape{shape_id}/{variant}/{level}/{'graph' if cuda_graph else 'nograph'}"


def e2e(args, device, dtype, results, deadline):
    levels = args.levels.split(",")
    graphs = [g == "on" for g in args.cuda_graph.split(",")]
    if device.type != "cuda":
        graphs = [g for g in graphs if not g] or [False]
    for shape_id in [int(s) for s in args.shapes.split(",")]:
        todo = [(v, lv, g) for v in args.variants.split(",") for lv in levels for g in graphs
                if key_of(shape_id, v, lv, g) not in results["runs"]]
        if not todo:
            continue
        if time.monotonic() > deadline:
            results["incomplete"].extend(key_of(shape_id, *t) for t in todo)
            continue
        config, model, cases, expected, timed, eager_ms = reference_side(shape_id, device, dtype, args)
        results["eager_ms"][str(shape_id)] = eager_ms
        with tempfile.TemporaryDirectory() as workdir:
            for variant, level, cuda_graph in todo:
                key = key_of(shape_id, variant, level, cuda_graph)
                if time.monotonic() > deadline:
                    results["incomplete"].append(key)
                    continue
                path = Path(workdir) / f"{variant}.onnx"
                if not path.exists():
                    export_onnx(model, config, dtype, path, VARIANTS[variant])
                started = time.monotonic()
                try:
                    run = run_candidate(path, level, cuda_graph, device, cases, expected, timed, args, workdir)
                    run["speedup"] = eager_ms / run["median_ms"]
                except Exception as exc:  # record the exact reason, keep going
                    run = {"error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"}
                run.update(shape=shape_id, variant=variant, level=level, cuda_graph=cuda_graph,
                           options=VARIANTS[variant].to_dict(), seconds=round(time.monotonic() - started, 2))
                results["runs"][key] = run
                write_results(results, args)
                summary = run.get("error") or f"failed {run['failed']} median {run['median_ms']:.3f} ms"
                print(f"{key}: {summary}", flush=True)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()


# -- op-by-op study -------------------------------------------------------------------------------
def single_op_model(nodes, inputs, output, initializers, opset=17):
    graph = helper.make_graph(nodes, "op", inputs, [output], [numpy_helper.from_array(v, k) for k, v in initializers.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    return model


def run_single(model, feeds, device, level="disabled"):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "op.onnx"
        onnx.save(model, str(path))
        session = make_session(path, level, False, device, [])
        return torch.from_numpy(session.run(None, feeds)[0])


def linear_formulations(n, d_in, d_out):
    """{name: (nodes, initializers builder)} for F.linear on [n, d_in] float16."""
    H, F32 = TensorProto.FLOAT16, TensorProto.FLOAT
    x_info = helper.make_tensor_value_info("x", H, [n, d_in])
    y_info = helper.make_tensor_value_info("y", H, [n, d_out])
    cast = lambda i, o, to: helper.make_node("Cast", [i], [o], to=to)  # noqa: E731
    return {
        "ort Gemm (fp16, bias in Gemm)": ([helper.make_node("Gemm", ["x", "w", "b"], ["y"], transB=1)],
                                          lambda w, b: {"w": w, "b": b}),
        "ort MatMul+Add (fp16)": ([helper.make_node("MatMul", ["x", "wt"], ["t"]), helper.make_node("Add", ["t", "b"], ["y"])],
                                  lambda w, b: {"wt": np.ascontiguousarray(w.T), "b": b}),
        "ort FP32 MatMul+Add, one Cast": ([cast("x", "xf", F32), helper.make_node("MatMul", ["xf", "wt"], ["t"]),
                                           helper.make_node("Add", ["t", "b"], ["u"]), cast("u", "y", H)],
                                          lambda w, b: {"wt": np.ascontiguousarray(w.T.astype(np.float32)),
                                                        "b": b.astype(np.float32)}),
        "ort [x,1]@[W^T;b] (fp16)": ([helper.make_node("Concat", ["x", "one"], ["xk"], axis=1),
                                      helper.make_node("MatMul", ["xk", "wk"], ["y"])],
                                     lambda w, b: {"one": np.ones((n, 1), np.float16),
                                                   "wk": np.ascontiguousarray(np.concatenate([w.T, b[None]], 0))}),
    }, x_info, y_info


def bitwise(ref: torch.Tensor, out: torch.Tensor) -> dict:
    ref, out = ref.float().cpu(), out.float().cpu()
    diff = (ref - out).abs()
    return {"differ_pct": round(float((diff > 0).float().mean()) * 100, 4), "max_abs": float(diff.max())}


def ops_study(args, device, results):
    """Per-op divergence from PyTorch on one shape's Linear sizes (bitwise, float16)."""
    for shape_id in [int(s) for s in args.shapes.split(",")]:
        c = official_config(shape_id)
        n = c.batch_size * c.seq_len
        gen = torch.Generator(device="cpu").manual_seed(0)
        for d_in, d_out, label in ((c.d_model, c.d_model, "q_proj"), (c.d_model, c.ffn_dim, "ffn_in")):
            x = torch.randn(n, d_in, generator=gen).half()
            w = ((torch.rand(d_out, d_in, generator=gen) * 2 - 1) / math.sqrt(d_in)).half()
            b = ((torch.rand(d_out, generator=gen) * 2 - 1) / math.sqrt(d_in)).half()
            xd, wd, bd = x.to(device), w.to(device), b.to(device)
            ref = torch.nn.functional.linear(xd, wd, bd)  # the reference's rounding: addmm, bias in the epilogue
            rows = {"torch matmul+add": bitwise(ref, xd @ wd.t() + bd),
                    "torch FP32 linear, one rounding": bitwise(ref, torch.nn.functional.linear(
                        xd.float(), wd.float(), bd.float()).half())}
            formulations, x_info, y_info = linear_formulations(n, d_in, d_out)
            for name, (nodes, inits) in formulations.items():
                try:
                    out = run_single(single_op_model(nodes, [x_info], y_info, inits(w.numpy(), b.numpy())),
                                     {"x": x.numpy()}, device)
                    rows[name] = bitwise(ref, out)
                except Exception as exc:
                    rows[name] = {"error": str(exc).strip().splitlines()[0][:300]}
            results["ops"][f"shape{shape_id}/{label}[{n}x{d_in}->{d_out}]"] = rows
            write_results(results, args)


# -- output ----------------------------------------------------------------------------------------
def out_dir(args) -> Path:
    return Path(args.out or os.environ.get("OUT") or "out")


def write_results(results, args):
    path = out_dir(args) / ("onnx_fidelity_ops.json" if args.mode == "ops" else "onnx_fidelity.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=1, default=str))
    os.replace(tmp, path)
    return path


def environment(device):
    env = {"torch": torch.__version__, "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__,
           "providers": onnxruntime.get_available_providers(), "device": str(device)}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["capability"] = list(torch.cuda.get_device_capability(device))
    return env


def print_table(results):
    if results.get("ops"):
        for key, rows in results["ops"].items():
            print(f"\n{key} vs F.linear (bitwise)")
            for name, r in rows.items():
                print(f"  {name:36s} " + (r["error"] if "error" in r else f"{r['differ_pct']:8.4f}% differ  max {r['max_abs']:.3g}"))
        return
    header = f"{'shape':>5} {'variant':20} {'level':9} {'graph':5} {'failed':>8} {'max_abs':>9} {'ort ms':>8} {'eager ms':>8} {'x':>6}"
    print("\n" + header + "\n" + "-" * len(header))
    for run in sorted(results["runs"].values(), key=lambda r: (r["shape"], r["variant"], r["level"], r["cuda_graph"])):
        eager = results["eager_ms"].get(str(run["shape"]), float("nan"))
        if "error" in run:
            print(f"{run['shape']:>5} {run['variant']:20} {run['level']:9} {str(run['cuda_graph'])[0]:5} error: {run['error'][:60]}")
            continue
        print(f"{run['shape']:>5} {run['variant']:20} {run['level']:9} {'yes' if run['cuda_graph'] else 'no':5} "
              f"{run['failed']:>8} {run['max_abs']:>9.3g} {run['median_ms']:>8.3f} {eager:>8.3f} {run['speedup']:>6.2f}")
    best = {}
    for run in results["runs"].values():
        if "error" not in run:
            best[run["shape"]] = min(best.get(run["shape"], math.inf), run["failed"])
    print("\nfewest strict failures per shape: " + ", ".join(f"{s}: {f}" for s, f in sorted(best.items())))
    if results["incomplete"]:
        print(f"incomplete ({len(results['incomplete'])}, rerun with --resume): {', '.join(results['incomplete'][:8])} ...")


def main(argv=None):
    args = parse_args(argv)
    args.disabled_optimizers_list = [s for s in args.disabled_optimizers.split(",") if s]
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device visible; use --device cpu for a smoke test")
    dtype = {"float16": torch.float16, "float32": torch.float32}[args.dtype]
    deadline = time.monotonic() + args.time_budget_s
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown or any(lv not in LEVELS for lv in args.levels.split(",")):
        sys.exit(f"unknown variants {unknown} or levels {args.levels}; variants: {', '.join(VARIANTS)}")
    results = {"contract": {"atol": ATOL, "rtol": RTOL}, "dtype": args.dtype, "environment": environment(device),
               "args": {k: v for k, v in vars(args).items() if k != "disabled_optimizers_list"},
               "eager_ms": {}, "runs": {}, "ops": {}, "incomplete": []}
    if args.resume and Path(args.resume).is_file():
        previous = json.loads(Path(args.resume).read_text())
        results["runs"].update(previous.get("runs", {}))
        results["eager_ms"].update(previous.get("eager_ms", {}))
        results["ops"].update(previous.get("ops", {}))
    if args.mode == "ops":
        ops_study(args, device, results)
    else:
        e2e(args, device, dtype, results, deadline)
    path = write_results(results, args)
    print(f"\nresults: {path}")
    print_table(results)


if __name__ == "__main__":
    main()

"""`kkdeploy export`: the faithful ONNX graph and its export.json, staged then renamed into place."""

from __future__ import annotations

import time
from pathlib import Path

from ..artifacts import staged_directory, write_json
from ..config import default_dtype, dtype_name, parse_dtype, resolve_device
from ..console import console, progress_bar, table
from ..errors import KKError
from ..models.weights import build_models
from .common import add_shape_args, resolve_config

GIB = 1 << 30


def register(sub):
    from exporters import LAYER_NORM_MODES, LINEAR_MODES, QKV_MODES
    from exporters.budget import DEFAULT_MEMORY_BUDGET_BYTES
    from exporters.options import DEFAULT_OPSET, FAITHFUL_GELU_MODES

    p = sub.add_parser("export", help="export the faithful ONNX graph (model.onnx + export.json) for one shape")
    add_shape_args(p)
    p.add_argument("--dtype", help="float16 or float32 (default: float16 on CUDA, float32 on CPU)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]: picks the default dtype (default auto)")
    p.add_argument("--weights", help="safetensors file or torch state dict (default: seeded random weights)")
    p.add_argument("--out", help="output directory (default artifacts/export-shape-NN-<dtype>)")
    p.add_argument("--force", action="store_true", help="replace a non-empty output directory")
    p.add_argument("--linear", default="gemm", choices=list(LINEAR_MODES), help="Linear formulation (default gemm)")
    p.add_argument("--layer-norm", default="onnx", choices=list(LAYER_NORM_MODES),
                   help="LayerNorm formulation (default onnx; custom: our kkdeploy::LayerNorm op)")
    p.add_argument("--qkv", default="separate", choices=list(QKV_MODES), help="Q/K/V projections (default separate)")
    p.add_argument("--no-fp32-pointwise", dest="fp32_pointwise", action="store_false", default=True,
                   help="LayerNorm and GELU in the model dtype instead of FP32 cast once")
    p.add_argument("--no-scale-in-fp32", dest="scale_in_fp32", action="store_false", default=True,
                   help="scale the scores by a constant in the model dtype (unlike PyTorch)")
    p.add_argument("--gelu", default="exact", choices=list(FAITHFUL_GELU_MODES),
                   help="exact: Erf chain; exact_op: one Gelu node (opset >= 20)")
    p.add_argument("--opset", type=int, default=DEFAULT_OPSET, help=f"ONNX opset (default {DEFAULT_OPSET})")
    p.add_argument("--memory-budget-gb", type=float, default=DEFAULT_MEMORY_BUDGET_BYTES / GIB,
                   help=f"refuse shapes whose FP32 [B,H,S,S] scores exceed this (default {DEFAULT_MEMORY_BUDGET_BYTES / GIB:g})")
    p.set_defaults(func=run)


def default_out_dir(shape_id: int | None, config, dtype) -> Path:
    if shape_id is not None:
        return Path("artifacts") / f"export-shape-{shape_id:02d}-{dtype_name(dtype)}"
    c = config
    name = (f"export-custom-b{c.batch_size}-s{c.seq_len}-d{c.d_model}-h{c.num_heads}-f{c.ffn_dim}-l{c.num_layers}"
            f"{'' if c.causal else '-noncausal'}-{dtype_name(dtype)}")
    return Path("artifacts") / name


def resolve_dtype(args):
    from exporters.onnx_graph import onnx_elem_type

    device = resolve_device(args.device)
    dtype = parse_dtype(args.dtype) if args.dtype else default_dtype(device)
    onnx_elem_type(dtype)  # float32 / float16 only: one line otherwise
    return dtype


def resolve_options(args):
    from exporters import ExportOptions

    return ExportOptions(linear=args.linear, layer_norm=args.layer_norm, qkv=args.qkv,
                         fp32_pointwise=args.fp32_pointwise,
                         scale_in_fp32=args.scale_in_fp32, gelu=args.gelu, opset=args.opset)


def run(args) -> int:
    from exporters import ensure_dense_attention_fits, export_onnx

    shape_id, config = resolve_config(args)
    dtype = resolve_dtype(args)
    options = resolve_options(args)
    if not args.memory_budget_gb > 0:
        raise KKError(f"--memory-budget-gb must be positive, got {args.memory_budget_gb}")
    budget = int(args.memory_budget_gb * GIB)
    ensure_dense_attention_fits(config, budget, shape_id=shape_id)  # before any allocation or file
    out = Path(args.out) if args.out else default_out_dir(shape_id, config, dtype)
    started = time.perf_counter()
    with staged_directory(out, force=args.force) as staging, progress_bar("export", 3) as bar:
        bar.describe("building the model")
        reference, _ = build_models(config, dtype, "cpu", weights=args.weights)
        bar.advance()
        bar.describe("writing and checking model.onnx")
        info = export_onnx(reference, config, dtype, staging / "model.onnx", options, memory_budget_bytes=budget)
        bar.advance()
        bar.describe("writing export.json")
        info["shape_id"] = shape_id
        info["weights_source"] = str(args.weights) if args.weights else "seeded (seed 0)"
        write_json(staging / "export.json", info)
        bar.advance()
    print_summary(out, info, time.perf_counter() - started)
    return 0


def print_summary(out: Path, info: dict, seconds: float) -> None:
    nodes = sum(info["op_histogram"].values())
    top = ", ".join(f"{op} {n}" for op, n in sorted(info["op_histogram"].items(), key=lambda kv: -kv[1])[:6])
    rows = [["directory", out], ["graph", f"opset {info['opset']}, {nodes} nodes ({top})"],
            ["options", ", ".join(f"{k}={v}" for k, v in info["options"].items())],
            ["model.onnx sha256", info["sha256"]], ["weights sha256", info["weights_sha256"]],
            ["graph check", "passed"], ["time", f"{seconds:.1f} s"]]
    from ..config import TransformerConfig

    config = TransformerConfig.from_dict(info["config"])
    console.print(table(f"exported {config.describe()} {info['dtype']}", ["", ""], rows))

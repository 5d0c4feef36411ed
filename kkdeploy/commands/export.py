"""`kkdeploy export`: the faithful ONNX graph and its export.json, staged then renamed into place."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from ..config import default_dtype, dtype_name, parse_dtype, resolve_device
from ..console import console, progress_bar, table
from ..errors import KKError
from ..weights import build_models
from .common import add_shape_args, resolve_config

GIB = 1 << 30


def register(sub):
    from exporters import GELU_MODES, LINEAR_MODES, QKV_MODES
    from exporters.budget import DEFAULT_MEMORY_BUDGET_BYTES
    from exporters.options import DEFAULT_OPSET

    p = sub.add_parser("export", help="export the faithful ONNX graph (model.onnx + export.json) for one shape")
    add_shape_args(p)
    p.add_argument("--dtype", help="float16 or float32 (default: float16 on CUDA, float32 on CPU)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]: picks the default dtype (default auto)")
    p.add_argument("--weights", help="safetensors file or torch state dict (default: seeded random weights)")
    p.add_argument("--out", help="output directory (default artifacts/export-shape-NN-<dtype>)")
    p.add_argument("--force", action="store_true", help="replace a non-empty output directory")
    p.add_argument("--linear", default="gemm", choices=list(LINEAR_MODES), help="Linear formulation (default gemm)")
    p.add_argument("--qkv", default="separate", choices=list(QKV_MODES), help="Q/K/V projections (default separate)")
    p.add_argument("--no-fp32-pointwise", dest="fp32_pointwise", action="store_false", default=True,
                   help="LayerNorm and GELU in the model dtype instead of FP32 cast once")
    p.add_argument("--no-scale-in-fp32", dest="scale_in_fp32", action="store_false", default=True,
                   help="scale the scores by a constant in the model dtype (unlike PyTorch)")
    p.add_argument("--gelu", default="exact", choices=[m for m in GELU_MODES if m != "tanh"],
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


def check_out_dir(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise KKError(f"--out {out} is a file, not a directory; choose another --out")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise KKError(f"output directory {out} is not empty; pass --force to replace it or choose another --out")


def staging_dir(out: Path) -> Path:
    """A temporary directory next to ``out``, so the final rename stays on one filesystem."""
    parent = out.absolute().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".{out.name}.staging-", dir=parent))
    except OSError as exc:
        raise KKError(f"cannot write to {parent}: {exc.strerror or exc}; choose a writable --out") from None


def publish(staging: Path, out: Path) -> None:
    """Swap the finished staging directory into place; an old directory is removed only afterwards."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
    os.replace(staging, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def resolve_dtype(args):
    from exporters.onnx_graph import onnx_elem_type

    device = resolve_device(args.device)
    dtype = parse_dtype(args.dtype) if args.dtype else default_dtype(device)
    onnx_elem_type(dtype)  # float32 / float16 only: one line otherwise
    return dtype


def resolve_options(args):
    from exporters import ExportOptions

    return ExportOptions(linear=args.linear, qkv=args.qkv, fp32_pointwise=args.fp32_pointwise,
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
    check_out_dir(out, args.force)
    staging = staging_dir(out)
    started = time.perf_counter()
    try:
        with progress_bar("export", 3) as bar:
            bar.describe("building the model")
            reference, _ = build_models(config, dtype, "cpu", weights=args.weights)
            bar.advance()
            bar.describe("writing and checking model.onnx")
            info = export_onnx(reference, config, dtype, staging / "model.onnx", options, memory_budget_bytes=budget)
            bar.advance()
            bar.describe("writing export.json")
            info["shape_id"] = shape_id
            info["weights_source"] = str(args.weights) if args.weights else "seeded (seed 0)"
            (staging / "export.json").write_text(json.dumps(info, indent=2) + "\n")
            bar.advance()
        publish(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
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

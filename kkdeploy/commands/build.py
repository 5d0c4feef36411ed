"""`kkdeploy build`: verified artifacts for one shape (or all official shapes)."""

from __future__ import annotations

import argparse
from pathlib import Path

from engines.fresh_process import DEFAULT_TIMEOUT_S
from engines.ort import OPT_LEVELS
from exporters.options import DEFAULT_OPSET, LAYER_NORM_MODES, LINEAR_MODES, gelu_modes_at

from ..pipeline.build import (BACKEND_CHOICES, BuildRequest, default_out_dir, parse_backends, parse_batch_buckets,
                              print_summary, run_build)
from ..config import LONG_CONTEXT_SHAPES, OFFICIAL_SHAPES
from ..pipeline.long_context import REDUCED_SEQ_LEN
from ..pipeline.long_context_plan import (DEFAULT_FULL_LENGTH_BATCH, DEFAULT_FULL_LENGTH_BUDGET_S,
                                          DEFAULT_FULL_LENGTH_TRIALS)
from ..console import console
from ..errors import KKError
from ..pipeline.timing import DEFAULT_TIME_BUDGET_S
from .common import (add_contract_arg, add_protocol_args, add_runtime_args, add_shape_args, add_tf32_arg,
                     require_validator, resolve_config, resolve_runtime)


def register(sub):
    p = sub.add_parser("build", help="export, build candidates, validate every element, choose and write artifacts")
    add_shape_args(p)
    p.add_argument("--all", action="store_true", help="every official shape (1-13; 14 takes the long-context path)")
    add_runtime_args(p)
    p.add_argument("--backends", help=f"comma list from {','.join(BACKEND_CHOICES)}, or a backend's own name as `kkdeploy env` "
                   "lists it (ort: this device's ORT candidates) (default: all available here)")
    p.add_argument("--out", help="artifact directory (default artifacts/shape-NN-<dtype>-<device>)")
    p.add_argument("--force", action="store_true", help="replace a non-empty output directory")
    add_contract_arg(p)
    p.add_argument("--probe-timeout", type=float, default=None, metavar="S",
                   help="seconds a candidate with a native loader (inductor, trt) may take to load and answer once "
                        f"in a fresh process before it is recorded as load-hung (default {DEFAULT_TIMEOUT_S:g})")
    add_tf32_arg(p)
    p.add_argument("--time-budget", type=float, default=DEFAULT_TIME_BUDGET_S, metavar="S",
                   help="seconds for timing the candidates that passed (default %(default)g): when the full "
                        "--warmups/--repeats/--rounds protocol would take longer (the largest shapes), candidates "
                        ">= 1.25x slower than the best in a 3-call screen drop out and the rest get fewer repeats; "
                        "0 runs the full protocol")
    p.add_argument("--batch-buckets", metavar="N,N,...",
                   help="also build and validate engines at these smaller batch sizes (the artifact's batch is "
                        "always the largest): kkdeploy.load then takes any batch up to it and runs the smallest "
                        "bucket that holds it; each bucket passes the strict gate on its own")
    add_protocol_args(p)
    lc = p.add_argument_group("long context (shape 14, or a custom shape with --long-context)")
    lc.add_argument("--long-context", action="store_true",
                    help="build a custom shape on the bounded-memory long-context path (shape 14 always takes it)")
    lc.add_argument("--seq-len-validate", dest="validate_seq_len", type=int,
                    help=f"sequence length of the reduced validation shape (default {REDUCED_SEQ_LEN})")
    lc.add_argument("--full-length-batch", type=int, default=None,
                    help="sequences of the full-length trials, run where the reduced shape misses a path the "
                         f"full shape runs (default {DEFAULT_FULL_LENGTH_BATCH})")
    lc.add_argument("--full-length-trials", type=int, default=None,
                    help=f"full-length trials per mask mode (default {DEFAULT_FULL_LENGTH_TRIALS})")
    lc.add_argument("--full-length-budget", type=float, default=None, metavar="S",
                    help="full-length trials estimated to take longer than this are not run, and the paths only "
                         f"they would check are not shipped (default {DEFAULT_FULL_LENGTH_BUDGET_S:g})")
    p.add_argument("--ort-level", choices=list(OPT_LEVELS),
                   help="ONNX Runtime graph optimization level (default: extended on CPU, basic on CUDA)")
    p.add_argument("--linear", choices=list(LINEAR_MODES),
                   help="how the exporter writes each Linear (default gemm); custom: our kkdeploy::Linear op, "
                        "compiled on demand and shipped in the artifact")
    p.add_argument("--layer-norm", choices=list(LAYER_NORM_MODES),
                   help="how the exporter writes each LayerNorm (default onnx); custom: our kkdeploy::LayerNorm op")
    p.add_argument("--gelu", choices=gelu_modes_at(DEFAULT_OPSET),
                   help="how the exporter writes each GELU (default exact: the Erf chain in FP32); custom: our "
                        "kkdeploy::Gelu op")
    p.add_argument("--mixed-precision", action=argparse.BooleanOptionalAction, default=None,
                   help="also build '-mixed' ONNX candidates whose float16 blocks are calibrated per shape, and "
                        "'-autocast' ones converted by ModelOpt AutoCast when it is installed "
                        "(default: on for float32 under --contract judge)")
    p.set_defaults(func=run)


def request_options(args) -> dict:
    options: dict = {}
    if args.ort_level:
        options["ort_level_cpu"] = options["ort_level_cuda"] = args.ort_level
    if args.linear:
        options.setdefault("export", {})["linear"] = args.linear
    if args.layer_norm:
        options.setdefault("export", {})["layer_norm"] = args.layer_norm
    if args.gelu:
        options.setdefault("export", {})["gelu"] = args.gelu
    if args.mixed_precision is not None:
        options["mixed_precision"] = args.mixed_precision
    return options


def run(args) -> int:
    require_validator()
    device, dtype = resolve_runtime(args)
    if not 0 < args.padding_ratio < 1:
        raise KKError(f"--padding-ratio must be in (0, 1), got {args.padding_ratio}")
    for flag, value in (("--full-length-batch", args.full_length_batch), ("--full-length-trials",
                                                                         args.full_length_trials)):
        if value is not None and value < 1:
            raise KKError(f"{flag} must be at least 1, got {value}")
    if args.full_length_budget is not None and args.full_length_budget < 0:
        raise KKError(f"--full-length-budget must be >= 0 seconds, got {args.full_length_budget}")
    if args.long_context and args.shape is not None and args.shape not in LONG_CONTEXT_SHAPES:
        raise KKError(f"--long-context applies to custom shapes; shape {args.shape} is dense (drop --long-context)")
    if args.all:
        if args.shape is not None or args.out:
            raise KKError("--all builds every official shape into its default directory; drop --shape/--out")
        targets = [(sid, cfg) for sid, cfg in OFFICIAL_SHAPES.items()]
    else:
        targets = [resolve_config(args)]
    if args.time_budget < 0:
        raise KKError(f"--time-budget must be >= 0 seconds (0 runs the full timing protocol), got {args.time_budget:g}")
    backends = parse_backends(args.backends, device)
    status = 0
    for shape_id, config in targets:
        out = Path(args.out) if args.out else default_out_dir(shape_id, config, dtype, device)
        buckets = parse_batch_buckets(args.batch_buckets, config.batch_size)
        if shape_id in LONG_CONTEXT_SHAPES or args.long_context:
            if buckets:
                raise KKError("--batch-buckets does not apply to the long-context path; drop it")
            from ..pipeline.long_context import build_long_context_artifacts

            status = max(status, build_long_context_artifacts(args, shape_id, config, dtype, device, out))
            continue
        console.print(f"[bold]build[/] shape {shape_id if shape_id is not None else 'custom'}: {config.describe()} "
                      f"{str(dtype).replace('torch.', '')} on {device} -> {out}")
        request = BuildRequest(config=config, dtype=dtype, device=device, out=out, shape_id=shape_id,
                               backends=backends, weights=args.weights, force=args.force, seed=args.seed,
                               trials=args.trials, padding_ratio=args.padding_ratio, contract=args.contract,
                               warmups=args.warmups, repeats=args.repeats, rounds=args.rounds,
                               time_budget_s=args.time_budget, tf32=args.tf32, options=request_options(args),
                               probe_timeout_s=args.probe_timeout,
                               batch_buckets=buckets)
        manifest = run_build(request)
        print_summary(manifest, out)
    return status

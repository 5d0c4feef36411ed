"""`kkdeploy check`: OptimizedTransformer against the reference over the official trials."""

from __future__ import annotations

import torch

from validation import compare_outputs, contract

from ..config import LONG_CONTEXT_SHAPES, dtype_name, official_config
from ..console import console, progress_bar
from ..errors import KKError
from ..inputs import generate_case
from ..models.weights import build_models
from .common import add_contract_arg, add_runtime_args, add_shape_args, resolve_config, resolve_runtime


def register(sub):
    p = sub.add_parser("check", help="run the accuracy trials of the optimized PyTorch model against the reference")
    add_shape_args(p)
    add_runtime_args(p)
    add_contract_arg(p)
    p.add_argument("--sdpa-layers", type=int, default=1, help="layers (from the last) using packed SDPA (default 1)")
    p.add_argument("--padding-ratio", type=float, default=0.0, help="padding ratio of the trials (default 0)")
    p.add_argument("--reduced", action="store_true", help="shape 14: validate on the reduced long-context shape "
                   "(B2/S4096; the custom-shape flags, e.g. --seq-len, override its fields)")
    p.add_argument("--full-shape", action="store_true", help="shape 14 on a GPU: run the full logical shape")
    p.add_argument("--micro-batch", type=int, help="long-context path: sequences per micro-batch (default: automatic)")
    p.add_argument("--query-tile", type=int, help="long-context path: queries per tile of the padded path")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.shape in LONG_CONTEXT_SHAPES:  # its custom-shape flags override the reduced shape
        from ..pipeline.long_context import run_check as long_check

        return long_check(args, args.shape, official_config(args.shape), *resolve_runtime(args))
    shape_id, config = resolve_config(args)
    if args.reduced:
        from ..pipeline.long_context import run_check as long_check  # the bounded-memory path owns shape 14

        return long_check(args, shape_id, config, *resolve_runtime(args))
    device, dtype = resolve_runtime(args)
    atol, rtol = contract(args.contract)
    if not 0 <= args.padding_ratio < 1:
        raise KKError(f"--padding-ratio must be in [0, 1), got {args.padding_ratio}")
    reference, optimized = build_models(config, dtype, device, weights=args.weights, sdpa_layers=args.sdpa_layers)
    console.print(f"check {config.describe()} {dtype_name(dtype)} on {device}, contract {args.contract} "
                  f"(atol {atol}, rtol {rtol}), sdpa_layers {args.sdpa_layers}, padding {args.padding_ratio}")
    failures = 0
    lines = []
    with progress_bar("trials", args.trials) as bar, torch.inference_mode():
        for t in range(args.trials):
            x, mask = generate_case(config, device, dtype, args.seed + t, padding_ratio=args.padding_ratio)
            report = compare_outputs(reference(x, mask), optimized(x, mask), atol, rtol)
            failures += report.failed
            lines.append(f"trial {t} seed {args.seed + t}: {report.summary()}")
            bar.advance()
    for line in lines:
        console.print(line)
    console.print("PASS" if failures == 0 else f"FAIL ({failures} elements failed)")
    return 0 if failures == 0 else 1

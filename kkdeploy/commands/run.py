"""`kkdeploy run --artifacts DIR`: load, run a generated input, compare under the build's contract, time.

The reference is computed as the build computed it: the build's contract and its TF32 setting (a float32
judge build on CUDA validates against a TF32 reference; comparing with a full-FP32 one would judge
the engine against a different model)."""

from __future__ import annotations

import time

import torch

from validation import DEFAULT_CONTRACT, compare_outputs, contract

from ..console import console
from ..errors import KKError
from ..inputs import DEFAULT_SEED, generate_case
from .common import add_contract_arg


def register(sub):
    p = sub.add_parser("run", help="serve artifacts on a generated input; strict comparison and latency")
    p.add_argument("--artifacts", required=True, help="artifact directory written by `kkdeploy build`")
    p.add_argument("--device", default=None, help="default: the device the artifacts were built for")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED)
    p.add_argument("--padding-ratio", type=float, default=0.0)
    add_contract_arg(p, default=None, help="default: the contract the artifacts were validated under (manifest)")
    p.add_argument("--repeats", type=int, default=None, help="timed calls (default 20; 1 for long-context artifacts)")
    lc = p.add_argument_group("long-context artifacts (shape 14)")
    lc.add_argument("--check-sequences", type=int, default=None,
                    help="sequences compared with the tiled reference, spread over the batch (default 2)")
    lc.add_argument("--batch-size", type=int, help="serve this many sequences instead of the artifact's batch")
    lc.add_argument("--seq-len", type=int, help="serve sequences of this length instead of the artifact's")
    lc.add_argument("--json", help="also write the result as JSON here")
    p.set_defaults(func=run)


def run(args) -> int:
    import kkdeploy
    from ..config import tf32_mode
    from ..models.reference import ReferenceTransformer

    if not 0 <= args.padding_ratio < 1:
        raise KKError(f"--padding-ratio must be in [0, 1), got {args.padding_ratio}")
    if args.repeats is not None and args.repeats < 1:
        raise KKError(f"--repeats must be at least 1, got {args.repeats}")
    runner = kkdeploy.load(args.artifacts, device=args.device)
    from ..pipeline.long_context_run import is_long_context, run_long_context

    if is_long_context(runner):
        args.repeats = args.repeats or 1
        return run_long_context(args, runner)
    for flag in ("check_sequences", "batch_size", "seq_len", "json"):
        if getattr(args, flag) is not None:
            raise KKError(f"--{flag.replace('_', '-')} applies to long-context artifacts; {args.artifacts} holds "
                          f"a dense engine of a fixed shape")
    args.repeats = args.repeats or 20
    config, model = runner.config, runner.fallback
    device, dtype = model.device, model.dtype
    reference = ReferenceTransformer(config)
    reference.load_state_dict(model.state_dict(), strict=True)
    reference = reference.to(device=device, dtype=dtype).eval()
    manifest = getattr(runner, "manifest", None) or {}
    rule = args.contract or (manifest.get("validation") or {}).get("contract", DEFAULT_CONTRACT)
    x, mask = generate_case(config, device, dtype, args.seed, padding_ratio=args.padding_ratio)
    with torch.inference_mode():
        with tf32_mode(bool(manifest.get("tf32", False))):
            expected = reference(x, mask)
        y = runner(x, mask)
        report = compare_outputs(expected, y, *contract(rule))
        times = []
        for _ in range(max(1, args.repeats)):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            runner(x, mask)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append((time.perf_counter() - start) * 1e3)
    times.sort()
    console.print(f"served by [bold]{runner.backend}[/]: {runner.reason}", soft_wrap=True)
    console.print(f"{config.describe()} {str(dtype).replace('torch.', '')} on {device}, seed {args.seed}, "
                  f"padding {args.padding_ratio}")
    console.print(f"{rule}{' (tf32 reference)' if manifest.get('tf32') else ''}: {report.summary()}")
    console.print(f"latency: median {times[len(times) // 2]:.3f} ms over {len(times)} calls (wall clock)")
    return 0 if report.passed else 1

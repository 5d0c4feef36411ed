"""`kkdeploy prove`: the build's proof step on its own: which of our kernels are bit-identical here, and faster.

Why a command: a deployment engineer wants to know, before a build, whether a GPU and torch build give our kernels
for a model (and the GPU campaigns run the very step the build runs, so the two cannot disagree). The records land
in the proof cache (``$KKDEPLOY_CACHE_DIR/proofs``), where the next build of this environment finds them.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..console import console, table
from ..kernels.precompile import DEFAULT_WORKERS
from ..errors import KKError
from .common import add_shape_args, resolve_config, resolve_runtime

KINDS_HELP = "comma-separated kernel kinds: attention, layer_norm, linear (default: all)"


def register(sub):
    p = sub.add_parser("prove", help="prove our kernels bit-identical (and time them) for a model here")
    add_shape_args(p)
    p.add_argument("--dtype", choices=["float32", "float16"], help="default: float16 on CUDA, float32 on CPU")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:N] (default auto)")
    p.add_argument("--weights", help="safetensors file or torch state dict (default: seeded random weights)")
    p.add_argument("--seed", type=int, default=None, help="the inputs' seed (default: the build's first trial seed)")
    p.add_argument("--kinds", default="attention,layer_norm,linear", help=KINDS_HELP)
    p.add_argument("--again", action="store_true", help="prove again even where a proof of this environment exists")
    p.add_argument("--compile-threads", type=int, default=None, metavar="N",
                   help="threads compiling the kernels' launches before they are proven (default "
                        f"{DEFAULT_WORKERS}; 0: each compiles when the proof first runs it)")
    p.add_argument("--json", dest="json_path", help="write the records here as JSON")
    p.set_defaults(func=run, trials=1)


def run(args) -> int:
    from ..inputs import DEFAULT_SEED
    from ..kernels.model_proofs import KINDS
    from ..kernels.proof_process import prove_model_kernels_isolated
    from ..models.weights import build_models

    _, config = resolve_config(args)
    device, dtype = resolve_runtime(args)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise KKError(f"--kinds: unknown kind {', '.join(unknown) or '(none)'}; the kinds are {', '.join(KINDS)}")
    threads = DEFAULT_WORKERS if args.compile_threads is None else args.compile_threads
    if threads < 0:
        raise KKError(f"--compile-threads must be >= 0 (0 compiles each launch when it first runs), got {threads}")
    model = build_models(config, dtype, device, weights=args.weights)[0]
    with console.status("proving kernel ops"):
        proofs = prove_model_kernels_isolated(model, config, dtype, device, kinds, reuse=not args.again,
                                              seed=DEFAULT_SEED if args.seed is None else args.seed,
                                              compile_workers=threads)
    rows = [[r.op, r.shape_text, r.chosen or "aten", f"{r.seconds:.2f}", r.reason] for r in proofs.records]
    console.print(table(f"Kernel proofs ({proofs.seconds} s, {proofs.reused} reused)",
                        ["op", "shape", "runs", "s", "why"], rows))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"seconds": proofs.seconds, "reused": proofs.reused,
                                                    "records": proofs.to_list()}, indent=1))
    return 0

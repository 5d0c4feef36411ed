#!/usr/bin/env python3
"""The kernels' GPU self-test: the build's own proof step (``kkdeploy.kernels.model_proofs``) over many shapes.

    python3 scripts/kernel_selftest.py --kinds attention,layer_norm,linear --out OUT.json [--shapes 1 2 3]
        [--dims B,S,D,H,F,L ...] [--all-launches | --launches KIND=NAME,NAME ...] [--weights-seed N]

For each official shape (default 1-13), the model in float16 on the GPU (seeded weights, or trained-like weights of
``scripts/make_weights.py`` with ``--weights-seed``) goes through ``prove_model_kernels`` with ``reuse=False``:
every launch variant of each kernel op of ``--kinds`` is compared bit for bit with the ATen op it replaces, on the
model's own activations (all-valid and padded) and random inputs, and timed as CUDA-graph replays against ATen.
``--all-launches`` proves every launch of each kernel, not only the ones a build tries; ``--launches`` names the ones
to prove (``linear=auto,tma,tma_ws``: a study that fits one device call). Nothing here decides
differently from a build: it is the same code, in a spawned child as a build's proof is
(``kkdeploy.kernels.proof_process``), so a launch that faults the GPU or never returns is refused, with the reason
in the report, and the study goes on. The child's progress is printed as it comes, with the seconds since the shape
began, so a study cut short says where it stood. The records land in the proof cache too.

The three former self-tests (``faithful_attention_selftest.py``, ``layer_norm_selftest.py``,
``fused_linear_selftest.py``) are this script with one kind. Prints a table last: shape, op, op shape, launches
bit-identical of those tried, the one that runs, its ms against ATen's.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: how long one proving child may take: a study of every launch compiles and proves several times what a build does
#: (a build's child has 300 s), and a child ended by its timeout would refuse what it was on and start over
STUDY_TIMEOUT_S = 3600.0
#: a child that says nothing new for this long is hung (a kernel that never returns): the launch it last named is
#: refused and the study goes on. The longest silence of a study is its compiles ahead, one line for them all
#: (campaign 22's study of every tile on three shapes took 330 s in all on the H200)
STUDY_STALL_S = 600.0


#: what ``--all-launches`` tries per kind (a build tries fewer: ``faithful_attention.proof_launches`` and friends),
#: less the tiles known to hang (``fused_linear.HANGS``: name them with ``--launches`` to study them again). The
#: linear kind's launches are the GEMM tiles, the LayerNorm epilogue's, the feed-forward's and the LayerNorm
#: prologue's, and the Q|K|V attention's forms (proven beside the GEMMs: ``model_proofs.kernel_op_shapes``)
def all_launches(hanging: bool = False) -> dict[str, list[str]]:
    from kkdeploy.kernels import faithful_attention, fused_linear, layer_norm, qkv_attention

    return {"attention": list(faithful_attention.LAUNCHES), "layer_norm": list(layer_norm.LAUNCHES),
            "linear": [t for t in dict.fromkeys([*fused_linear.TILES, *fused_linear.LN_TILES,
                                                 *fused_linear.FFN_TILES, *fused_linear.NORM_TILES,
                                                 *qkv_attention.LAUNCHES])
                       if hanging or t not in fused_linear.HANGS]}


def parse_args(argv):
    from kkdeploy.kernels.model_proofs import KINDS

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    p.add_argument("--shapes", type=int, nargs="*", default=list(range(1, 14)), help="official shape ids (1-13)")
    p.add_argument("--dims", nargs="*", default=[], metavar="B,S,D,H,F,L",
                   help="non-official shapes too: batch, seq, d_model, heads, ffn, layers (e.g. 16,200,384,6,768,3)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--all-launches", action="store_true", help="every launch variant, not only a build's")
    which.add_argument("--launches", nargs="*", default=[], metavar="KIND=NAME,NAME",
                       help="only these launch variants of a kind (e.g. linear=auto,tma,tma_ws); other kinds as a "
                            "build proves them")
    p.add_argument("--weights-seed", type=int, default=None, help="trained-like weights (scripts/make_weights.py)")
    p.add_argument("--stall-s", type=float, default=STUDY_STALL_S,
                   help=f"seconds of a child's silence after which its launch is refused as hung ({STUDY_STALL_S:.0f})")
    p.add_argument("--out", required=True, help="JSON report")
    args = p.parse_args(argv)
    if args.stall_s <= 0:
        p.error(f"--stall-s takes a positive number of seconds, got {args.stall_s:g}")
    args.kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    try:
        args.dims = [tuple(int(v) for v in text.split(",")) for text in args.dims]
    except ValueError:
        p.error(f"--dims takes B,S,D,H,F,L (six integers), got {' '.join(args.dims)}")
    if any(len(d) != 6 for d in args.dims):
        p.error("--dims takes six integers per shape: batch, seq, d_model, heads, ffn, layers")
    args.launches = parse_launches(p, args.launches)
    unknown = [k for k in args.kinds if k not in KINDS]
    if unknown or not args.kinds:
        p.error(f"--kinds: unknown {', '.join(unknown) or '(none)'}; the kinds are {', '.join(KINDS)}")
    return args


def parse_launches(p: argparse.ArgumentParser, items: list[str]) -> dict[str, list[str]] | None:
    """``["linear=auto,tma"]`` -> ``{"linear": ["auto", "tma"]}``, every name checked against its kind's launches."""
    if not items:
        return None
    known, chosen = all_launches(hanging=True), {}
    for item in items:
        kind, _, names = item.partition("=")
        names = [n for n in names.split(",") if n]
        if kind not in known or not names:
            p.error(f"--launches takes KIND=NAME,NAME with KIND one of {', '.join(known)}, got {item!r}")
        unknown = [n for n in names if n not in known[kind]]
        if unknown:
            p.error(f"--launches: {kind} has no launch {', '.join(unknown)}; its launches are {', '.join(known[kind])}")
        chosen[kind] = names
    return chosen


def rows(shape_id: int, records: list[dict]) -> list[list]:
    """One table row per op shape of one model."""
    from kkdeploy.kernels.proof import ProofRecord

    out = []
    for r in map(ProofRecord.from_dict, records):
        out.append([shape_id, r.op, r.shape_text, f"{sum(x.status == 'proven' for x in r.launches)}/{len(r.launches)}",
                    r.chosen or "aten", "-" if r.chosen_ms is None else f"{r.chosen_ms}",
                    "-" if r.reference_ms is None else f"{r.reference_ms}", sum(x.differing for x in r.launches)])
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("kernel_selftest: needs a CUDA GPU (it compares our kernels with ATen's ops on the device); "
              "the CPU tests cover the proof's logic", file=sys.stderr)
        return 2
    from kkdeploy import OFFICIAL_SHAPES
    from kkdeploy.config import TransformerConfig
    from kkdeploy.console import console, table
    from kkdeploy.kernels.proof_process import prove_model_kernels_isolated
    from kkdeploy.models.weights import build_models

    report, table_rows = {"kinds": args.kinds, "all_launches": args.all_launches, "launches": args.launches,
                          "shapes": {}}, []
    configs = {sid: OFFICIAL_SHAPES[sid] for sid in args.shapes}
    configs.update({",".join(map(str, d)): TransformerConfig(*d) for d in args.dims})
    for sid, config in configs.items():
        if args.weights_seed is None:
            model = build_models(config, torch.float16, "cuda")[0]
        else:  # written for the loader only: not beside the report (a campaign's $OUT brings back what it holds)
            from scripts.make_weights import trained_like
            from safetensors.torch import save_file

            with tempfile.TemporaryDirectory(prefix="kkdeploy-selftest-") as tmp:
                weights = Path(tmp) / "weights.safetensors"
                save_file(trained_like(config, args.weights_seed), str(weights))
                model = build_models(config, torch.float16, "cuda", weights=weights)[0]
        began = time.perf_counter()
        proofs = prove_model_kernels_isolated(
            model, config, torch.float16, "cuda", args.kinds, reuse=False,
            launches=all_launches() if args.all_launches else args.launches, timeout_s=STUDY_TIMEOUT_S,
            stall_s=args.stall_s,
            progress=lambda message: print(f"[shape {sid}, {time.perf_counter() - began:6.1f} s] {message}",
                                           flush=True))
        report["shapes"][sid] = {"seconds": proofs.seconds, "records": proofs.to_list()}
        table_rows += rows(sid, proofs.to_list())
        Path(args.out).write_text(json.dumps(report, indent=1))  # after every shape: a time limit keeps the rest
        del model
        torch.cuda.empty_cache()
    console.print(table("Kernel self-test (the build's proof step)", ["shape", "op", "op shape", "bit-identical",
                                                                       "runs", "ms", "ATen ms", "differing"],
                        table_rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

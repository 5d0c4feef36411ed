"""Arguments and resolution shared by the subcommands."""

from __future__ import annotations

import argparse

from ..config import TransformerConfig, default_dtype, official_config, parse_dtype, resolve_device
from ..errors import KKError
from ..inputs import DEFAULT_SEED, DEFAULT_TRIALS

CUSTOM_SHAPE_FLAGS = {
    "batch_size": "--batch-size", "seq_len": "--seq-len", "d_model": "--d-model",
    "num_heads": "--heads", "ffn_dim": "--ffn-dim", "num_layers": "--layers",
}


def add_shape_args(parser: argparse.ArgumentParser, required: bool = True) -> None:
    parser.add_argument("--shape", type=int, help="official shape id (see `kkdeploy shapes`)")
    group = parser.add_argument_group("custom shape (instead of --shape)")
    for field, flag in CUSTOM_SHAPE_FLAGS.items():
        group.add_argument(flag, dest=field, type=int)
    group.add_argument("--no-causal", dest="causal", action="store_false", default=True)
    parser.set_defaults(shape_required=required)


def add_runtime_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", choices=["float32", "float16"], help="default: float16 on CUDA, float32 on CPU")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda[:N] (default auto)")
    parser.add_argument("--weights", help="safetensors file or torch state dict (default: seeded random weights)")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help=f"first trial seed (default {DEFAULT_SEED})")
    parser.add_argument("--trials", type=int, default=DEFAULT_TRIALS, help=f"accuracy trials (default {DEFAULT_TRIALS})")


def add_tf32_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tf32", action=argparse.BooleanOptionalAction, default=None,
                        help="TF32 GEMMs for float32 on CUDA (default: on under --contract judge, off under strict)")


def resolve_config(args) -> tuple[int | None, TransformerConfig]:
    custom = {f: getattr(args, f, None) for f in CUSTOM_SHAPE_FLAGS}
    given = {f: v for f, v in custom.items() if v is not None}
    if args.shape is not None:
        if given:
            flags = ", ".join(CUSTOM_SHAPE_FLAGS[f] for f in given)
            raise KKError(f"--shape cannot be combined with {flags}; give an official id or a full custom shape")
        config = official_config(args.shape)
        return args.shape, config
    if not given:
        raise KKError("give --shape N (an official id, see `kkdeploy shapes`) or a full custom shape")
    missing = [CUSTOM_SHAPE_FLAGS[f] for f in CUSTOM_SHAPE_FLAGS if f not in given]
    if missing:
        raise KKError(f"a custom shape needs {', '.join(missing)} as well")
    return None, TransformerConfig(**given, causal=args.causal)


def resolve_runtime(args):
    device = resolve_device(args.device)
    dtype = parse_dtype(args.dtype) if args.dtype else default_dtype(device)
    if args.trials is not None and args.trials < 1:
        raise KKError(f"--trials must be at least 1, got {args.trials}")
    return device, dtype

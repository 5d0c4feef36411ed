"""Arguments and resolution shared by the subcommands."""

from __future__ import annotations

import argparse

from validation.strict import CONTRACTS, DEFAULT_CONTRACT
from validation.trials import DEFAULT_PADDING_RATIO

from ..config import TransformerConfig, default_dtype, official_config, parse_dtype, resolve_device
from ..errors import KKError
from ..inputs import DEFAULT_SEED, DEFAULT_TRIALS
from ..pipeline.timing import DEFAULT_REPEATS, DEFAULT_ROUNDS, DEFAULT_WARMUPS

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


def add_contract_arg(parser: argparse.ArgumentParser, default: str | None = DEFAULT_CONTRACT,
                     help: str | None = None) -> None:
    """``--contract``, its choices the contracts ``validation.strict.CONTRACTS`` defines."""
    parser.add_argument("--contract", default=default, choices=list(CONTRACTS),
                        help=help or f"accuracy rule (default {default})")


def add_protocol_args(parser: argparse.ArgumentParser) -> None:
    """The padded trials' ratio and the timing protocol, with the defaults of the modules that own them."""
    parser.add_argument("--padding-ratio", type=float, default=DEFAULT_PADDING_RATIO,
                        help=f"padding ratio of the padded trials (default {DEFAULT_PADDING_RATIO})")
    parser.add_argument("--warmups", type=int, default=DEFAULT_WARMUPS,
                        help=f"untimed calls per candidate per round (default {DEFAULT_WARMUPS})")
    parser.add_argument("--repeats", type=int, default=DEFAULT_REPEATS,
                        help=f"timed calls per candidate per round (default {DEFAULT_REPEATS})")
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS,
                        help=f"alternating rounds over all candidates (default {DEFAULT_ROUNDS})")


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


def require_validator() -> None:
    """Load Polygraphy's comparator glue now: a build or bench validates every candidate with it, and without it
    the command stops here in one line (the CLI names the package), not after minutes of export and compiles."""
    import validation.polygraphy_glue  # noqa: F401

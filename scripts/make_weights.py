#!/usr/bin/env python3
"""Weights of one's own for `kkdeploy build --weights`: trained-like, never the seeded ones the tests use.

Trained-like means what a trained KernelKraft model looks like to the numerics (design.md §6): Linear weights
~N(0, 1/fan_in) with small biases, LayerNorm affine terms away from identity (weight ~N(1, 0.3), bias ~N(0, 0.2)).
Any `--seed` other than the build's weight seed gives weights the project never saw.

    python3 scripts/make_weights.py --shape 14 --seed 77 --out /tmp/w14.safetensors
    python3 scripts/make_weights.py --batch-size 8 --seq-len 256 --d-model 256 --heads 8 --ffn-dim 512 --layers 2 \
        --seed 5 --out /tmp/w.safetensors
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from kkdeploy.config import TransformerConfig, official_config  # noqa: E402
from kkdeploy.errors import KKError  # noqa: E402
from kkdeploy.models.reference import ReferenceTransformer  # noqa: E402
from kkdeploy.models.weights import weights_sha256  # noqa: E402


def trained_like(config: TransformerConfig, seed: int) -> dict[str, torch.Tensor]:
    """A state dict of ``ReferenceTransformer(config)`` drawn in FP32 on the CPU from ``seed``."""
    model = ReferenceTransformer(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.weight.copy_(torch.randn(module.weight.shape, generator=g) / math.sqrt(module.in_features))
                module.bias.copy_(0.02 * torch.randn(module.bias.shape, generator=g))
            elif isinstance(module, nn.LayerNorm):
                module.weight.copy_(1.0 + 0.3 * torch.randn(module.weight.shape, generator=g))
                module.bias.copy_(0.2 * torch.randn(module.bias.shape, generator=g))
    return {k: v.contiguous() for k, v in model.state_dict().items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", type=int)
    for flag in ("--batch-size", "--seq-len", "--d-model", "--heads", "--ffn-dim", "--layers"):
        p.add_argument(flag, type=int)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    try:
        if args.shape is not None:
            config = official_config(args.shape)
        else:
            fields = (args.batch_size, args.seq_len, args.d_model, args.heads, args.ffn_dim, args.layers)
            if any(f is None for f in fields):
                raise KKError("give --shape N or every one of --batch-size --seq-len --d-model --heads --ffn-dim "
                              "--layers")
            config = TransformerConfig(*fields)
        from safetensors.torch import save_file

        state = trained_like(config, args.seed)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        save_file(state, args.out)
    except KKError as exc:
        print(f"make_weights: {exc}", file=sys.stderr)
        return 2
    print(f"{args.out}: trained-like weights for {config.describe()}, seed {args.seed}, sha256 {weights_sha256(state)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

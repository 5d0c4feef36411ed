#!/usr/bin/env python3
"""How far each float32 model is from a TF32 reference, on the CPU (float32 judge contract, issue 6).

    python scripts/tf32_rounding_study.py [--shapes 3,11,7,9] [--seed 1234] [--padding-ratio 0.25]

For each shape and mask mode it compares, element by element under the judge and strict rules:
exact float32 and a truncating TF32 reference against a round-to-nearest TF32 reference
(``validation.tf32_emulation``), and the fused model in float32 and with half-GEMM blocks
(``kkdeploy.models.fused``) against both the TF32 reference and exact float32. The H200's measured gap
between all-float32 candidates and its TF32 reference (~1e-3) is what round-to-nearest predicts;
truncation would fail the judge rule by itself.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from kkdeploy.config import official_config  # noqa: E402
from kkdeploy.models.fused import FusedTransformer  # noqa: E402
from kkdeploy.inputs import generate_case  # noqa: E402
from kkdeploy.models.weights import build_models  # noqa: E402
from validation.strict import compare_outputs, contract  # noqa: E402
from validation.tf32_emulation import TF32Emulation  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="3,11,7,9", help="official shape ids, comma-separated")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--padding-ratio", type=float, default=0.25)
    args = parser.parse_args()
    judge, strict = contract("judge"), contract("strict")
    print("| shape | mask | compared | max abs | judge failed | strict failed |")
    print("|---|---|---|---|---|---|")
    for shape_id in (int(s) for s in args.shapes.split(",")):
        config = official_config(shape_id)
        reference = build_models(config, torch.float32, "cpu")[0]
        fused, half = FusedTransformer(reference), FusedTransformer(reference, half_gemm=True)
        for ratio in (0.0, args.padding_ratio):
            x, mask = generate_case(config, "cpu", torch.float32, args.seed, padding_ratio=ratio)
            with torch.inference_mode():
                exact = reference(x, mask)
                with TF32Emulation("nearest"):
                    tf32 = reference(x, mask)
                with TF32Emulation("truncate"):
                    truncated = reference(x, mask)
                half_gemm = half(x, mask)
                rows = [("exact float32 vs TF32 (nearest)", tf32, exact),
                        ("TF32 (truncate) vs TF32 (nearest)", tf32, truncated),
                        ("fused float32 vs TF32 (nearest)", tf32, fused(x, mask)),
                        ("fused half-GEMM vs TF32 (nearest)", tf32, half_gemm),
                        ("fused half-GEMM vs exact float32", exact, half_gemm)]
            for name, ref, out in rows:
                j, s = compare_outputs(ref, out, *judge), compare_outputs(ref, out, *strict)
                mode = "all-valid" if ratio == 0 else f"padded {ratio}"
                print(f"| {shape_id} | {mode} | {name} | {j.max_abs:.2e} | {j.failed} | {s.failed} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

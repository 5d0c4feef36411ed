"""`kkdeploy build --shape 14`: artifacts for the long-context path (no dense candidate can exist).

Validation runs on the reduced shape (or ``--seq-len``) against the query-tiled reference, with
``sdpa_layers`` calibrated (the most fused attention that passes); the manifest records the dense
candidates' refusals with their bytes and ships ``LongContextTransformer`` as the served model.
"""

from __future__ import annotations

from pathlib import Path

import torch

from . import artifacts
from .config import TransformerConfig, dtype_name
from .console import console, table
from .longcontext import CANDIDATE, build_long_context, trial_line
from .weights import build_models, weights_sha256


def build_long_context_artifacts(args, shape_id: int | None, config: TransformerConfig, dtype: torch.dtype,
                                 device: torch.device, out: Path) -> int:
    from validation import contract as contract_tolerances

    atol, rtol = contract_tolerances(args.contract)
    seq_len = getattr(args, "validate_seq_len", None)
    console.print(f"[bold]build[/] shape {shape_id}: {config.describe()} {dtype_name(dtype)} on {device} -> {out} "
                  f"(long-context path; validated on a reduced shape)")
    with artifacts.staged_directory(out, force=args.force) as stage:
        reference, _ = build_models(config, dtype, "cpu", weights=args.weights, sdpa_layers=0)
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in reference.state_dict().items()},
                  str(stage / artifacts.WEIGHTS_FILE))
        result = build_long_context(config, dtype, device, stage, weights=args.weights, seed=args.seed,
                                    trials=args.trials, seq_len=seq_len, contract=args.contract,
                                    on_trial=lambda e: console.print(trial_line(e)))
        chosen = next(c for c in result["candidates"] if c["name"] == CANDIDATE)
        manifest = {
            "schema": artifacts.MANIFEST_SCHEMA,
            "created": artifacts.utc_now(),
            "shape_id": shape_id,
            "config": config.to_dict(),
            "dtype": dtype_name(dtype),
            "environment": artifacts.environment(device),
            "weights": {"file": artifacts.WEIGHTS_FILE, "sha256": weights_sha256(reference),
                        "source": args.weights or "seeded"},
            "validation": {"contract": args.contract, "atol": atol, "rtol": rtol, "seed": args.seed,
                           "trials": args.trials, "padding_ratio": result["validation"].get("padding_ratio"),
                           "mask_modes": ["all-valid", "padded"], "report": "long-context-validation.json",
                           "validated_shape": result["validated_shape"]},
            "export": None,
            "candidates": result["candidates"],
            "fallback": {"model": "LongContextTransformer", "sdpa_layers": chosen["sdpa_layers"],
                         "validation": {"status": chosen["status"], "failed_elements": chosen["failed_elements"],
                                        "max_abs": chosen["max_abs"]},
                         "calibration": chosen["calibration"]},
            "choice": {"candidate": CANDIDATE, "backend": "long_context", "all_valid_only": False,
                       "validated": result["choice"]["validated"], "reason": result["choice"]["reason"]},
            "files": artifacts.hash_tree(stage),
        }
        artifacts.write_json(stage / artifacts.MANIFEST, manifest)
    rows = [[c["name"], c["status"], c.get("failed_elements", "-"), c.get("sdpa_layers", "-"),
             c.get("reason", "")[:90]] for c in result["candidates"]]
    console.print(table("Candidates", ["candidate", "status", "failed elements", "sdpa layers", "reason"], rows))
    console.print(f"shipped: [bold]{CANDIDATE}[/] — {result['choice']['reason']}", soft_wrap=True)
    return 0 if result["choice"]["validated"] else 1

"""Shape 14: validate and ship the bounded-memory long-context path (design.md §3).

Dense attention at B32/S100000/H16 needs a ~10 TB score tensor, so no dense engine or dense
reference can exist. The long-context path (``LongContextTransformer``) is validated against the
independent query-tiled reference (``TiledReferenceTransformer``) on a reduced shape
(B2/S4096/D1024/H16/F1024/L2 by default, or another sequence length), under the strict rule, for
all-valid and padded masks. ``run_check`` is ``kkdeploy check --shape 14 --reduced``;
``build_long_context`` is what ``kkdeploy build --shape 14`` records in the manifest.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import torch

from validation import compare_outputs, contract as contract_tolerances

from .. import artifacts
from ..artifacts import write_json
from ..config import LONG_CONTEXT_SHAPES, TransformerConfig, dtype_name, format_bytes, parse_dtype, resolve_device
from ..console import console, table
from ..errors import KKError
from ..inputs import DEFAULT_SEED, DEFAULT_TRIALS, generate_case
from ..models.long_context import (DEFAULT_QUERY_TILE, LongContextTransformer, activation_bytes_per_sequence,
                                backend_names, fused_backends)
from ..models.tiled_reference import DEFAULT_REFERENCE_QUERY_TILE, TiledReferenceTransformer
from ..models.weights import DEFAULT_WEIGHT_SEED, build_models, init_weights, load_weights, weights_sha256

REDUCED_BATCH, REDUCED_SEQ_LEN = 2, 4096
DEFAULT_PADDING_RATIO = 0.5  # padded trials when the caller gives none
DENSE_CANDIDATES = ("trt", "ort-cpu", "ort-cuda", "torch-graph")
CANDIDATE = "torch-long-context"
SHAPE_OVERRIDE_FLAGS = {"batch_size": "--batch-size", "seq_len": "--seq-len", "d_model": "--d-model",
                        "num_heads": "--heads", "ffn_dim": "--ffn-dim", "num_layers": "--layers"}


def reduced_config(config: TransformerConfig, seq_len: int | None = None, **overrides) -> TransformerConfig:
    """The validated stand-in: same width, heads, FFN, layers and causality; B2/S4096 (or ``seq_len``)."""
    fields = {"batch_size": min(REDUCED_BATCH, config.batch_size),
              "seq_len": min(REDUCED_SEQ_LEN, config.seq_len) if seq_len is None else seq_len}
    fields.update({k: v for k, v in overrides.items() if v is not None})
    return replace(config, **fields)


def model_flops(config: TransformerConfig) -> float:
    """Multiply-adds x2 of one forward: projections, FFN and attention (causal counts half the keys)."""
    b, s, d, f, h = config.batch_size, config.seq_len, config.d_model, config.ffn_dim, config.num_heads
    linear = 2 * b * s * (4 * d * d + 2 * d * f)
    attention = 4 * b * h * s * s * config.head_dim * (0.5 if config.causal else 1.0)
    return float(config.num_layers * (linear + attention))


def measured_matmul_flops(device: torch.device, dtype: torch.dtype, seconds: float = 0.2) -> float:
    """This machine's GEMM rate, measured now (used to estimate, never to decide correctness)."""
    n = 512
    a = torch.randn(n, n, device=device, dtype=dtype)
    torch.matmul(a, a)
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        torch.matmul(a, a)
        count += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 2 * n ** 3 * count / (time.perf_counter() - start)


def full_shape_estimate(config: TransformerConfig, dtype: torch.dtype, device: torch.device) -> dict:
    itemsize = torch.empty((), dtype=dtype).element_size()
    io_bytes = 2 * config.batch_size * config.seq_len * config.d_model * itemsize
    rate = measured_matmul_flops(device, dtype)
    flops = model_flops(config)
    return {"dense_score_bytes": config.dense_score_bytes(dtype), "input_output_bytes": io_bytes,
            "activation_bytes_per_sequence": activation_bytes_per_sequence(config, config.seq_len, dtype),
            "flops": flops, "measured_flops_per_s": rate, "estimated_seconds": flops / rate}


def build_validation_models(config: TransformerConfig, dtype: torch.dtype, device: torch.device, *,
                            weights=None, weight_seed: int = DEFAULT_WEIGHT_SEED, micro_batch: int | None = None,
                            query_tile: int = DEFAULT_QUERY_TILE,
                            reference_query_tile: int = DEFAULT_REFERENCE_QUERY_TILE, sdpa_layers: int | None = None):
    """Tiled reference and long-context path on identical weights, in eval mode."""
    reference = TiledReferenceTransformer(config, query_tile=reference_query_tile)
    if weights is None:
        init_weights(reference, weight_seed)
    else:
        load_weights(reference, weights)
    candidate = LongContextTransformer(config, micro_batch=micro_batch, query_tile=query_tile,
                                       sdpa_layers=sdpa_layers)
    candidate.load_state_dict(reference.state_dict(), strict=True)
    return reference.to(device=device, dtype=dtype).eval(), candidate.to(device=device, dtype=dtype).eval()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device):
    synchronize(device)
    start = time.perf_counter()
    out = fn()
    synchronize(device)
    return out, time.perf_counter() - start


def trial_plan(trials: int, padding_ratio: float) -> list[tuple[int, str, float]]:
    """Every trial seed runs all-valid (the SDPA path) and padded (the tiled path)."""
    return [(t, mode, ratio) for t in range(trials) for mode, ratio in (("all-valid", 0.0), ("padded", padding_ratio))]


def validate_long_context(config: TransformerConfig, dtype: torch.dtype, device, *, weights=None,
                          weight_seed: int = DEFAULT_WEIGHT_SEED, seed: int = DEFAULT_SEED,
                          trials: int = DEFAULT_TRIALS, contract: str = "strict",
                          padding_ratio: float = DEFAULT_PADDING_RATIO, micro_batch: int | None = None,
                          query_tile: int = DEFAULT_QUERY_TILE,
                          reference_query_tile: int = DEFAULT_REFERENCE_QUERY_TILE, on_trial=None,
                          sdpa_layers: int | None = None) -> dict:
    """Compare every output element of the long-context path with the tiled reference."""
    device = resolve_device(device)
    dtype = parse_dtype(dtype)
    atol, rtol = contract_tolerances(contract)
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise KKError(f"trials must be at least 1, got {trials!r}")
    if not 0 < padding_ratio < 1:
        raise KKError(f"padding ratio for the padded trials must be in (0, 1), got {padding_ratio}")
    reference, candidate = build_validation_models(
        config, dtype, device, weights=weights, weight_seed=weight_seed, micro_batch=micro_batch,
        query_tile=query_tile, reference_query_tile=reference_query_tile, sdpa_layers=sdpa_layers)
    reports = []
    for t, mode, ratio in trial_plan(trials, padding_ratio):
        x, mask = generate_case(config, device, dtype, seed + t, padding_ratio=ratio)
        with torch.inference_mode():
            out, candidate_s = timed(lambda: candidate(x, mask), device)
            ref, reference_s = timed(lambda: reference(x, mask), device)
            report = compare_outputs(ref, out, atol, rtol)
            bitwise = bool(torch.equal(ref, out))
        settings = candidate.last_tiled_settings
        entry = {"trial": t, "seed": seed + t, "mask_mode": mode, "padding_ratio": ratio,
                 "valid_tokens": int(mask.sum()), "attention_path": candidate.last_attention_path,
                 "tiled_settings": None if settings is None else {"key_extent": settings[0], "softmax": settings[1]},
                 "candidate_seconds": round(candidate_s, 4), "reference_seconds": round(reference_s, 4),
                 "bitwise_equal": bitwise, **report.to_dict()}
        reports.append(entry)
        del x, mask, out, ref
        if on_trial is not None:
            on_trial(entry)
    failed = sum(r["failed"] for r in reports)
    return {
        "validated_shape": config.to_dict(), "dtype": dtype_name(dtype), "device": str(device),
        "contract": contract, "atol": atol, "rtol": rtol, "seed": seed, "trials": trials,
        "mask_modes": ["all-valid", "padded"], "padding_ratio": padding_ratio,
        "micro_batch": candidate.sequences_per_micro_batch(config.batch_size, config.seq_len),
        "query_tile": query_tile, "fused_backends": backend_names(fused_backends(device)),
        "reference": {"class": "TiledReferenceTransformer", "query_tile": reference_query_tile,
                      "key_extent": reference.key_extent},
        "weights_sha256": weights_sha256(reference),
        "passed": failed == 0, "failed_elements": failed, "total_elements": sum(r["total"] for r in reports),
        "max_abs": max(r["max_abs"] for r in reports), "max_rel": max(r["max_rel"] for r in reports),
        "reports": reports,
    }


def trial_line(entry: dict) -> str:
    verdict = "PASS" if entry["passed"] else "FAIL"
    return (f"trial {entry['trial']} seed {entry['seed']} {entry['mask_mode']:<9} ({entry['attention_path']}): "
            f"{verdict} failed {entry['failed']}/{entry['total']} max_abs {entry['max_abs']:.3g} "
            f"max_rel {entry['max_rel']:.3g}{' bitwise' if entry['bitwise_equal'] else ''} "
            f"(path {entry['candidate_seconds']:.2f} s, reference {entry['reference_seconds']:.2f} s)")


def dense_refusals(config: TransformerConfig, dtype: torch.dtype) -> list[dict]:
    score_bytes = config.dense_score_bytes(dtype)
    reason = (f"dense attention needs a [B,H,S,S] score tensor of {score_bytes} bytes ({format_bytes(score_bytes)}) "
              f"in {dtype_name(dtype)} for {config.describe()}; only the bounded-memory path can run this shape")
    return [{"name": name, "status": "skipped", "reason": reason, "estimated_bytes": score_bytes}
            for name in DENSE_CANDIDATES]


def calibration_order(config: TransformerConfig, dtype: torch.dtype, device, contract: str) -> list[int]:
    """The ``sdpa_layers`` values the build validates, in order; the first that passes ships.

    The most fused attention that still passes: every layer, then one fewer, ... down to none (reference-order
    tiled attention everywhere). Except under the strict contract where the tiled layers run the proven fast path
    (aligned key cuts + the block-softmax kernel, ``kkdeploy.kernels.block_softmax.fast_path_reason``): there
    the tiled path goes first. Why: on the H200 it is bitwise at full size (0 of 204.8M elements on two
    sequences, 24.5 s), while SDPA in both layers failed 242 elements at full size, a failure the reduced shape
    cannot show (docs/long-context.md)."""
    from ..kernels.block_softmax import fast_path_reason

    order = list(range(config.num_layers, -1, -1))
    if contract == "strict" and fast_path_reason(device, dtype) is None:
        order = [0] + order[:-1]
    return order


def build_long_context(config: TransformerConfig, dtype, device, out_dir=None, *, weights=None,
                       seed: int = DEFAULT_SEED, trials: int = DEFAULT_TRIALS, seq_len: int | None = None,
                       contract: str = "strict", padding_ratio: float = DEFAULT_PADDING_RATIO,
                       micro_batch: int | None = None, query_tile: int = DEFAULT_QUERY_TILE,
                       weight_seed: int = DEFAULT_WEIGHT_SEED, on_trial=None) -> dict:
    """Refuse the dense candidates, validate the long-context path, and say what ships and why.

    Pure apart from an optional ``out_dir/long-context-validation.json``; the manifest is the
    caller's to write.
    """
    dtype = parse_dtype(dtype)
    device = resolve_device(device)
    if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1):
        raise KKError(f"seq_len must be a positive integer, got {seq_len!r}")
    validated = reduced_config(config, seq_len=seq_len)
    calibration = []
    order = calibration_order(config, dtype, device, contract)
    for sdpa_layers in order:
        validation = validate_long_context(
            validated, dtype, device, weights=weights, weight_seed=weight_seed, seed=seed, trials=trials,
            contract=contract, padding_ratio=padding_ratio, micro_batch=micro_batch, query_tile=query_tile,
            on_trial=on_trial, sdpa_layers=sdpa_layers)
        calibration.append({"sdpa_layers": sdpa_layers, "passed": validation["passed"],
                            "failed_elements": validation["failed_elements"]})
        if validation["passed"]:
            break
    passed = validation["passed"]
    modes = sorted({r["attention_path"] for r in validation["reports"]})
    long_context = {
        "name": CANDIDATE, "status": "passed" if passed else "failed",
        "failed_elements": validation["failed_elements"], "total_elements": validation["total_elements"],
        "failed_trials": sum(not r["passed"] for r in validation["reports"]),
        "trial_count": len(validation["reports"]), "max_abs": validation["max_abs"], "max_rel": validation["max_rel"],
        "attention_paths": modes, "validated_shape": validated.to_dict(),
        "sdpa_layers": sdpa_layers, "calibration": calibration, "calibration_order": order,
    }
    score_bytes = config.dense_score_bytes(dtype)
    summary = (f"{validation['failed_elements']} of {validation['total_elements']} elements failed {contract} "
               f"over {len(validation['reports'])} trials (all-valid and padded) at {validated.describe()} against "
               f"the query-tiled reference")
    if passed:
        reason = (f"dense candidates refused (a {format_bytes(score_bytes)} score tensor); the long-context path "
                  f"passed: {summary}")
    else:
        reason = (f"dense candidates refused (a {format_bytes(score_bytes)} score tensor); the long-context path is "
                  f"the only bounded-memory path but FAILED validation: {summary}")
    result = {
        "config": config.to_dict(), "validated_shape": validated.to_dict(), "dtype": dtype_name(dtype),
        "device": str(device), "contract": contract, "dense_score_bytes": score_bytes,
        "candidates": dense_refusals(config, dtype) + [long_context],
        "choice": {"backend": CANDIDATE, "validated": passed, "reason": reason},
        "validation": validation,
    }
    if out_dir is not None:
        path = Path(out_dir) / "long-context-validation.json"
        write_json(path, validation)
        result["validation_file"] = str(path)
    return result


# -- `kkdeploy check --shape 14 [--reduced]` -------------------------------------------------------
def check_config(args, shape_id: int | None, config: TransformerConfig, device: torch.device,
                 dtype: torch.dtype) -> TransformerConfig:
    """The shape the check validates: reduced (with flag overrides), a custom shape, or the full one."""
    overrides = {f: getattr(args, f, None) for f in SHAPE_OVERRIDE_FLAGS}
    given = {f: v for f, v in overrides.items() if v is not None}
    if getattr(args, "causal", True) is False:
        given["causal"] = False
    if shape_id is None:
        return config  # a custom shape given with --reduced: validate the long-context path on it
    if shape_id not in LONG_CONTEXT_SHAPES:
        raise KKError(f"--reduced applies to the long-context shape(s) {sorted(LONG_CONTEXT_SHAPES)}; "
                      f"drop it for shape {shape_id}")
    if args.reduced:
        try:
            return reduced_config(config, **given)
        except KKError as exc:
            raise KKError(f"reduced shape: {exc}") from None
    if given:
        flags = ", ".join(SHAPE_OVERRIDE_FLAGS.get(f, "--no-causal") for f in given)
        raise KKError(f"shape flags ({flags}) apply only to the reduced validation; "
                      f"run `kkdeploy check --shape {shape_id} --reduced {flags.split(',')[0]} N`")
    estimate = full_shape_estimate(config, dtype, device)
    if device.type != "cuda":
        raise KKError(
            f"shape {shape_id} ({config.describe()}) is not run on the CPU: dense scores would take "
            f"{format_bytes(estimate['dense_score_bytes'])}, the long-context path alone needs "
            f"{format_bytes(estimate['input_output_bytes'])} for input and output and ~{estimate['flops'] / 1e12:.0f} "
            f"TFLOP (~{estimate['estimated_seconds'] / 3600:.0f} h at this CPU's measured "
            f"{estimate['measured_flops_per_s'] / 1e9:.0f} GFLOP/s), twice that with the reference; "
            f"run `kkdeploy check --shape {shape_id} --reduced` (B{REDUCED_BATCH}/S{REDUCED_SEQ_LEN})")
    if not getattr(args, "full_shape", False):
        raise KKError(
            f"shape {shape_id} at full size ({config.describe()}) takes ~{estimate['flops'] / 1e12:.0f} TFLOP and "
            f"{format_bytes(estimate['input_output_bytes'])} of input/output on {device}; pass --full-shape to run "
            f"it, or --reduced for the B{REDUCED_BATCH}/S{REDUCED_SEQ_LEN} validation")
    return config


def run_check(args, shape_id: int | None, config: TransformerConfig, device: torch.device, dtype: torch.dtype) -> int:
    """Validate the long-context path against the tiled reference; 0 only when every element passes."""
    from ..console import progress_bar

    validated = check_config(args, shape_id, config, device, dtype)
    padding = getattr(args, "padding_ratio", 0.0) or DEFAULT_PADDING_RATIO
    micro_batch = getattr(args, "micro_batch", None)
    query_tile = getattr(args, "query_tile", None) or DEFAULT_QUERY_TILE
    atol, rtol = contract_tolerances(args.contract)
    console.print(f"long-context check {validated.describe()} {dtype_name(dtype)} on {device}, contract "
                  f"{args.contract} (atol {atol}, rtol {rtol}); path: sdpa ({backend_names(fused_backends(device))}) "
                  f"all-valid, query-tiled (tile {query_tile}) padded; reference: query-tiled, "
                  f"mask modes all-valid + padded {padding}")
    with progress_bar("long-context trials", 2 * args.trials) as bar:
        def on_trial(entry):
            console.print(trial_line(entry))
            bar.advance()

        result = validate_long_context(
            validated, dtype, device, weights=args.weights, seed=args.seed, trials=args.trials,
            contract=args.contract, padding_ratio=padding, micro_batch=micro_batch, query_tile=query_tile,
            on_trial=on_trial)
    if result["passed"]:
        console.print(f"PASS ({result['total_elements']} elements, max_abs {result['max_abs']:.3g})")
        return 0
    console.print(f"FAIL ({result['failed_elements']} elements failed)")
    return 1

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

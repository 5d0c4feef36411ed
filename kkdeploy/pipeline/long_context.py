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

from validation import DEFAULT_CONTRACT, compare_outputs, contract as contract_tolerances
from validation.trials import DEFAULT_PADDING_RATIO  # the padded trials' ratio when the caller gives none

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
                            reference_query_tile: int = DEFAULT_REFERENCE_QUERY_TILE, sdpa_layers: int | None = None,
                            reference_sequence_tile: int | None = None):
    """Tiled reference and long-context path on identical weights, in eval mode."""
    reference = TiledReferenceTransformer(config, query_tile=reference_query_tile,
                                          sequence_tile=reference_sequence_tile)
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


def trial_plan(trials: int, padding_ratio: float, modes=("all-valid", "padded")) -> list[tuple[int, str, float]]:
    """Every trial seed runs all-valid (the SDPA path) and padded (the tiled path), or the ``modes`` given."""
    return [(t, mode, ratio) for t in range(trials) for mode, ratio in (("all-valid", 0.0), ("padded", padding_ratio))
            if mode in modes]


def validate_long_context(config: TransformerConfig, dtype: torch.dtype, device, *, weights=None,
                          weight_seed: int = DEFAULT_WEIGHT_SEED, seed: int = DEFAULT_SEED,
                          trials: int = DEFAULT_TRIALS, contract: str = DEFAULT_CONTRACT,
                          padding_ratio: float = DEFAULT_PADDING_RATIO, micro_batch: int | None = None,
                          query_tile: int = DEFAULT_QUERY_TILE,
                          reference_query_tile: int = DEFAULT_REFERENCE_QUERY_TILE, on_trial=None,
                          sdpa_layers: int | None = None, reference_sequence_tile: int | str | None = None,
                          stage: str = "reduced", modes=("all-valid", "padded")) -> dict:
    """Compare every output element of the long-context path with the tiled reference, and record which code
    paths the trials ran (``exercised_features``: what the validation plan checks against)."""
    device = resolve_device(device)
    dtype = parse_dtype(dtype)
    atol, rtol = contract_tolerances(contract)
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise KKError(f"trials must be at least 1, got {trials!r}")
    if not 0 < padding_ratio < 1:
        raise KKError(f"padding ratio for the padded trials must be in (0, 1), got {padding_ratio}")
    started = time.perf_counter()
    if reference_sequence_tile == "micro-batch":  # the reference's batched GEMMs laid out as the path's
        probe = LongContextTransformer(config, micro_batch=micro_batch)
        reference_sequence_tile = probe.sequences_per_micro_batch(config.batch_size, config.seq_len)
    reference, candidate = build_validation_models(
        config, dtype, device, weights=weights, weight_seed=weight_seed, micro_batch=micro_batch,
        query_tile=query_tile, reference_query_tile=reference_query_tile, sdpa_layers=sdpa_layers,
        reference_sequence_tile=reference_sequence_tile)
    reports, exercised = [], set()
    for t, mode, ratio in trial_plan(trials, padding_ratio, modes):
        x, mask = generate_case(config, device, dtype, seed + t, padding_ratio=ratio)
        with torch.inference_mode():
            out, candidate_s = timed(lambda: candidate(x, mask), device)
            ref, reference_s = timed(lambda: reference(x, mask), device)
            report = compare_outputs(ref, out, atol, rtol)
            bitwise = bool(torch.equal(ref, out))
        settings = candidate.last_tiled_settings
        exercised |= candidate.last_path_features
        entry = {"stage": stage, "trial": t, "seed": seed + t, "mask_mode": mode, "padding_ratio": ratio,
                 "batch_size": config.batch_size, "seq_len": config.seq_len,
                 "valid_tokens": int(mask.sum()), "attention_path": candidate.last_attention_path,
                 "tiled_settings": None if settings is None else {"key_extent": settings[0], "softmax": settings[1]},
                 "softmax_launch": candidate.last_softmax_launch,
                 "path_features": sorted(candidate.last_path_features),
                 "candidate_seconds": round(candidate_s, 4), "reference_seconds": round(reference_s, 4),
                 "bitwise_equal": bitwise, **report.to_dict()}
        reports.append(entry)
        del x, mask, out, ref
        if on_trial is not None:
            on_trial(entry)
    failed = sum(r["failed"] for r in reports)
    return {
        "stage": stage, "validated_shape": config.to_dict(), "dtype": dtype_name(dtype), "device": str(device),
        "contract": contract, "atol": atol, "rtol": rtol, "seed": seed, "trials": trials,
        "mask_modes": list(modes), "padding_ratio": padding_ratio,
        "micro_batch": candidate.sequences_per_micro_batch(config.batch_size, config.seq_len),
        "query_tile": query_tile, "fused_backends": backend_names(fused_backends(device)),
        "sdpa_layers": candidate.sdpa_layers,
        "reference": {"class": "TiledReferenceTransformer", "query_tile": reference_query_tile,
                      "key_extent": reference.key_extent, "sequence_tile": reference_sequence_tile},
        "weights_sha256": weights_sha256(reference),
        "passed": failed == 0, "failed_elements": failed, "total_elements": sum(r["total"] for r in reports),
        "max_abs": max(r["max_abs"] for r in reports), "max_rel": max(r["max_rel"] for r in reports),
        "exercised_features": sorted(exercised), "seconds": round(time.perf_counter() - started, 2),
        "reports": reports,
    }


def trial_line(entry: dict) -> str:
    verdict = "PASS" if entry["passed"] else "FAIL"
    stage = entry.get("stage", "reduced")
    prefix = "" if stage == "reduced" else f"{stage} B{entry['batch_size']}/S{entry['seq_len']} "
    return (f"{prefix}trial {entry['trial']} seed {entry['seed']} "
            f"{entry['mask_mode']:<9} ({entry['attention_path']}): "
            f"{verdict} failed {entry['failed']}/{entry['total']} max_abs {entry['max_abs']:.3g} "
            f"max_rel {entry['max_rel']:.3g}{' bitwise' if entry['bitwise_equal'] else ''} "
            f"(path {entry['candidate_seconds']:.2f} s, reference {entry['reference_seconds']:.2f} s)")


def dense_refusals(config: TransformerConfig, dtype: torch.dtype) -> list[dict]:
    score_bytes = config.dense_score_bytes(dtype)
    reason = (f"dense attention needs a [B,H,S,S] score tensor of {score_bytes} bytes ({format_bytes(score_bytes)}) "
              f"in {dtype_name(dtype)} for {config.describe()}; only the bounded-memory path can run this shape")
    return [{"name": name, "status": "skipped", "reason": reason, "estimated_bytes": score_bytes}
            for name in DENSE_CANDIDATES]


def calibration_order(config: TransformerConfig, dtype: torch.dtype, device, contract: str,
                      query_tile: int = DEFAULT_QUERY_TILE) -> list[int]:
    """The ``sdpa_layers`` values the build validates, in order; the first that passes ships.

    The most fused attention that still passes: every layer, then one fewer, ... down to none (reference-order
    tiled attention everywhere). Except under the strict contract where the tiled layers run a proven fast path
    (aligned key cuts + the block-softmax kernel, proven by this build: ``kkdeploy.kernels.block_softmax
    .fast_path_reason``): there the tiled path goes first. Why: on the H200 it is bitwise at full size, while
    SDPA in both layers failed 242 elements at full size (docs/long-context.md). The scores-attention kernels, where
    proven (``kkdeploy.kernels.scores_attention``), are such a fast path too."""
    from ..kernels.block_softmax import fast_path_reason
    from ..kernels.scores_attention import proven_launch

    order = list(range(config.num_layers, -1, -1))
    rows = config.num_heads * query_tile
    fast = (fast_path_reason(device, dtype, config.seq_len, rows) is None
            or proven_launch(device, dtype, config.seq_len, config.num_heads, config.head_dim) is not None)
    if contract == "strict" and fast:
        order = [0] + order[:-1]
    return order


def calibrate(config: TransformerConfig, validated: TransformerConfig, dtype, device, order: list[int], *,
              validate, query_tile: int, full_length_batch: int, full_length_trials: int, full_length_budget_s: float,
              on_plan=None) -> tuple[int, dict, list[dict]]:
    """Validate each ``sdpa_layers`` in ``order`` by its plan (reduced trials, then full-length trials where the
    reduced shape misses a path); the first that passes every trial, having run every path the full shape runs,
    ships. ``validate(shape, sdpa_layers, stage, trials)`` runs one stage. Returns (sdpa_layers, the validation of
    the last candidate tried, the calibration entries)."""
    from .long_context_plan import plan_validation

    calibration, validation = [], None
    for sdpa_layers in order:
        plan = plan_validation(config, validated, sdpa_layers, dtype, device, query_tile=query_tile,
                               full_length_batch=full_length_batch, full_length_trials=full_length_trials,
                               budget_s=full_length_budget_s)
        entry = {"sdpa_layers": sdpa_layers, "plan": plan.to_dict(), "stages": []}
        calibration.append(entry)
        if on_plan is not None:
            on_plan(plan)
        if not plan.feasible:
            entry.update(passed=False, status="skipped", reason=plan.reason)
            continue
        stages = [("reduced", validated, None, None)]
        if plan.full_length is not None:
            stages.append(("full-length", plan.full_length, full_length_trials, None))
        exercised: set[str] = set()
        for stage, shape, trials, modes in stages:
            validation = validate(shape, sdpa_layers, stage, trials, modes)
            exercised |= set(validation["exercised_features"])
            entry["stages"].append({"stage": stage, "shape": shape.to_dict(), "passed": validation["passed"],
                                    "failed_elements": validation["failed_elements"],
                                    "seconds": validation["seconds"],
                                    "exercised_features": validation["exercised_features"], "validation": validation})
            if not validation["passed"]:
                break
            if stage == "full-length" and any(f.startswith("padded/") for f in set(plan.full_features) - exercised):
                # the official-style padded inputs end before the last tiles' uncut rows: one padded trial
                # whose sequences end in the last 4096-key block reaches them
                stages.append(("full-length-tail", shape, 1, ("padded",)))
        missing = sorted(set(plan.full_features) - exercised)
        passed = all(s["passed"] for s in entry["stages"]) and not missing
        entry.update(passed=passed, failed_elements=sum(s["failed_elements"] for s in entry["stages"]),
                     exercised_features=sorted(exercised), not_exercised=missing,
                     status="passed" if passed else "failed")
        if missing and all(s["passed"] for s in entry["stages"]):
            entry["reason"] = f"paths the full shape runs were not exercised by any trial: {', '.join(missing)}"
        if passed:
            return sdpa_layers, validation, calibration
    return (calibration[-1]["sdpa_layers"] if calibration else 0), validation, calibration


def tail_padding_ratio(seq_len: int) -> float:
    """A padding ratio whose generated lengths all fall in the last 4096-key block of the row, so that the last
    query tiles of a padded call read uncut rows (``key_end``)."""
    from ..models.long_context import ALIGNED_KEY_BLOCK

    last_cut = (seq_len - 1) // ALIGNED_KEY_BLOCK * ALIGNED_KEY_BLOCK
    return max((seq_len - last_cut) / (2 * seq_len), 1.0 / seq_len)


def build_long_context(config: TransformerConfig, dtype, device, out_dir=None, *, weights=None,
                       seed: int = DEFAULT_SEED, trials: int = DEFAULT_TRIALS, seq_len: int | None = None,
                       contract: str = DEFAULT_CONTRACT, padding_ratio: float = DEFAULT_PADDING_RATIO,
                       micro_batch: int | None = None, query_tile: int = DEFAULT_QUERY_TILE,
                       weight_seed: int = DEFAULT_WEIGHT_SEED, on_trial=None, on_plan=None,
                       full_length_batch: int | None = None, full_length_trials: int | None = None,
                       full_length_budget_s: float | None = None, proof_budget_s: float = 60.0) -> dict:
    """Refuse the dense candidates, prove the kernels, validate the long-context path by its plan, and say what
    ships and why.

    Pure apart from an optional ``out_dir/long-context-validation.json``; the manifest is the
    caller's to write.
    """
    from .long_context_plan import (DEFAULT_FULL_LENGTH_BATCH, DEFAULT_FULL_LENGTH_BUDGET_S,
                                    DEFAULT_FULL_LENGTH_TRIALS, prove_long_context_kernels_isolated)

    dtype = parse_dtype(dtype)
    device = resolve_device(device)
    if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1):
        raise KKError(f"seq_len must be a positive integer, got {seq_len!r}")
    for name, value in (("full_length_batch", full_length_batch), ("full_length_trials", full_length_trials)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise KKError(f"{name} must be a positive integer, got {value!r}")
    started = time.perf_counter()
    validated = reduced_config(config, seq_len=seq_len)
    _, prover = build_validation_models(config, dtype, device, weights=weights, weight_seed=weight_seed,
                                        query_tile=query_tile, sdpa_layers=0)
    proofs = prove_long_context_kernels_isolated(prover, config, dtype, device, seed=seed,
                                                 padding_ratio=padding_ratio, budget_s=proof_budget_s)
    del prover

    def validate(shape, sdpa_layers, stage, stage_trials, modes):
        tail = stage == "full-length-tail"
        return validate_long_context(
            shape, dtype, device, weights=weights, weight_seed=weight_seed, seed=seed + (1000 if tail else 0),
            trials=stage_trials or trials, contract=contract,
            padding_ratio=tail_padding_ratio(shape.seq_len) if tail else padding_ratio, micro_batch=micro_batch,
            query_tile=query_tile, on_trial=on_trial, sdpa_layers=sdpa_layers, stage=stage,
            modes=modes or ("all-valid", "padded"),
            reference_sequence_tile=None if stage == "reduced" else "micro-batch")

    order = calibration_order(config, dtype, device, contract, query_tile)
    sdpa_layers, validation, calibration = calibrate(
        config, validated, dtype, device, order, validate=validate, query_tile=query_tile,
        full_length_batch=full_length_batch or DEFAULT_FULL_LENGTH_BATCH,
        full_length_trials=full_length_trials or DEFAULT_FULL_LENGTH_TRIALS,
        full_length_budget_s=DEFAULT_FULL_LENGTH_BUDGET_S if full_length_budget_s is None else full_length_budget_s,
        on_plan=on_plan)
    shipped = next((c for c in calibration if c["sdpa_layers"] == sdpa_layers), None)
    passed = bool(shipped and shipped["passed"])
    stages = shipped["stages"] if shipped else []
    reports = [r for stage in stages for r in stage["validation"]["reports"]]
    failed = sum(r["failed"] for r in reports)
    total = sum(r["total"] for r in reports)
    summary_validation = {
        "passed": passed, "failed_elements": failed, "total_elements": total,
        "max_abs": max((r["max_abs"] for r in reports), default=0.0),
        "max_rel": max((r["max_rel"] for r in reports), default=0.0),
        "padding_ratio": padding_ratio, "contract": contract, "sdpa_layers": sdpa_layers,
        "weights_sha256": validation["weights_sha256"] if validation else None,
        "stages": [{k: v for k, v in stage.items() if k != "validation"} | {
            "validated_shape": stage["validation"]["validated_shape"],
            "exercised_features": stage["validation"]["exercised_features"]} for stage in stages],
        "exercised_features": shipped.get("exercised_features", []) if shipped else [],
        "kernel_proofs": proofs, "reports": reports,
    }
    modes = sorted({r["attention_path"] for r in reports})
    long_context = {
        "name": CANDIDATE, "status": "passed" if passed else "failed",
        "failed_elements": failed, "total_elements": total,
        "failed_trials": sum(not r["passed"] for r in reports), "trial_count": len(reports),
        "max_abs": summary_validation["max_abs"], "max_rel": summary_validation["max_rel"],
        "attention_paths": modes, "validated_shape": validated.to_dict(),
        "validated_shapes": [stage["validation"]["validated_shape"] for stage in stages],
        "sdpa_layers": sdpa_layers, "softmax_launch": next((r["softmax_launch"] for r in reports
                                                            if r.get("softmax_launch")), None),
        "calibration": [{k: v for k, v in c.items() if k != "stages"} | {
            "stages": [{k: v for k, v in st.items() if k != "validation"} for st in c["stages"]]}
            for c in calibration],
        "calibration_order": order, "kernel_proofs": proofs,
        "validation_seconds": round(time.perf_counter() - started, 2),
    }
    score_bytes = config.dense_score_bytes(dtype)
    shapes = " and ".join(f"B{s['shape']['batch_size']}/S{s['shape']['seq_len']}" for s in stages) or "no shape"
    summary = (f"{failed} of {total} elements failed {contract} over {len(reports)} trials (all-valid and padded) "
               f"at {shapes} against the query-tiled reference")
    if passed:
        reason = (f"dense candidates refused (a {format_bytes(score_bytes)} score tensor); the long-context path "
                  f"(sdpa_layers={sdpa_layers}) passed: {summary}")
    else:
        why = shipped.get("reason") if shipped else None
        reason = (f"dense candidates refused (a {format_bytes(score_bytes)} score tensor); the long-context path is "
                  f"the only bounded-memory path but FAILED validation: {why or summary}")
    result = {
        "config": config.to_dict(), "validated_shape": validated.to_dict(), "dtype": dtype_name(dtype),
        "device": str(device), "contract": contract, "dense_score_bytes": score_bytes,
        "candidates": dense_refusals(config, dtype) + [long_context],
        "choice": {"backend": CANDIDATE, "validated": passed, "reason": reason},
        "validation": summary_validation, "kernel_proofs": proofs,
    }
    if out_dir is not None:
        path = Path(out_dir) / "long-context-validation.json"
        write_json(path, summary_validation | {"calibration": calibration_for_file(calibration)})
        result["validation_file"] = str(path)
    return result


def calibration_for_file(calibration: list[dict]) -> list[dict]:
    """The calibration with each stage's validation, minus the per-trial reports already at the top level."""
    return [{k: v for k, v in c.items() if k != "stages"} | {
        "stages": [{k: v for k, v in st.items() if k != "validation"} | {
            "validation": {k: v for k, v in st["validation"].items() if k != "reports"}} for st in c["stages"]]}
        for c in calibration]


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

def plan_line(plan) -> str:
    stages = "reduced" + (f" + full-length {plan.full_length.describe()}" if plan.full_length is not None else "")
    verdict = "" if plan.feasible else "not validated: "
    return f"sdpa_layers={plan.sdpa_layers}: {verdict}{stages} ({plan.reason})"


def proof_line(proof: dict) -> str:
    launches = ", ".join(f"{r['launch']} {r['status']}" + (f" {r['ms']} ms" if r.get("ms") is not None else "")
                         for r in proof.get("launches", []))
    verdict = f"proven: {proof['chosen']}" if proof.get("chosen") else "not proven"
    seconds = f" in {proof.get('wall_seconds', proof.get('seconds', 0)):.1f} s" if proof.get("launches") else ""
    return f"kernel proof {proof.get('op')} {proof.get('shape', '')}: {verdict}{seconds} ({launches or proof.get('reason')})"


def build_long_context_artifacts(args, shape_id: int | None, config: TransformerConfig, dtype: torch.dtype,
                                 device: torch.device, out: Path) -> int:
    from validation import contract as contract_tolerances

    atol, rtol = contract_tolerances(args.contract)
    seq_len = getattr(args, "validate_seq_len", None)
    padding_ratio = getattr(args, "padding_ratio", None) or DEFAULT_PADDING_RATIO
    console.print(f"[bold]build[/] shape {shape_id if shape_id is not None else 'custom'}: {config.describe()} "
                  f"{dtype_name(dtype)} on {device} -> {out} (long-context path: kernel proof, reduced validation, "
                  f"full-length trials where the reduced shape misses a path)")
    started = time.perf_counter()
    with artifacts.staged_directory(out, force=args.force) as stage:
        reference, _ = build_models(config, dtype, "cpu", weights=args.weights, sdpa_layers=0)
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in reference.state_dict().items()},
                  str(stage / artifacts.WEIGHTS_FILE))
        result = build_long_context(config, dtype, device, stage, weights=args.weights, seed=args.seed,
                                    trials=args.trials, seq_len=seq_len, contract=args.contract,
                                    padding_ratio=padding_ratio,
                                    full_length_batch=getattr(args, "full_length_batch", None),
                                    full_length_trials=getattr(args, "full_length_trials", None),
                                    full_length_budget_s=getattr(args, "full_length_budget", None),
                                    on_trial=lambda e: console.print(trial_line(e)),
                                    on_plan=lambda plan: console.print(plan_line(plan)))
        for proof in result["kernel_proofs"]:
            console.print(proof_line(proof), soft_wrap=True)
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
                           "trials": args.trials, "padding_ratio": padding_ratio,
                           "mask_modes": ["all-valid", "padded"], "report": "long-context-validation.json",
                           "validated_shape": result["validated_shape"],
                           "validated_shapes": chosen["validated_shapes"],
                           "exercised_features": result["validation"]["exercised_features"]},
            "export": None,
            "candidates": result["candidates"],
            "kernel_proofs": result["kernel_proofs"],
            "fallback": {"model": "LongContextTransformer", "sdpa_layers": chosen["sdpa_layers"],
                         "softmax_launch": chosen["softmax_launch"],
                         "validation": {"status": chosen["status"], "failed_elements": chosen["failed_elements"],
                                        "max_abs": chosen["max_abs"]},
                         "calibration": chosen["calibration"]},
            "choice": {"candidate": CANDIDATE, "backend": "long_context", "all_valid_only": False,
                       "validated": result["choice"]["validated"], "reason": result["choice"]["reason"]},
            "build_seconds": round(time.perf_counter() - started, 2),
            "files": artifacts.hash_tree(stage),
        }
        artifacts.write_json(stage / artifacts.MANIFEST, manifest)
    rows = [[c["name"], c["status"], c.get("failed_elements", "-"), c.get("sdpa_layers", "-"),
             c.get("reason", "")[:90]] for c in result["candidates"]]
    rows += [[f"  sdpa_layers={c['sdpa_layers']}", c["status"], c.get("failed_elements", "-"), c["sdpa_layers"],
              (c.get("reason") or c["plan"]["reason"])[:90]] for c in chosen["calibration"]]
    console.print(table("Candidates", ["candidate", "status", "failed elements", "sdpa layers", "reason"], rows))
    console.print(f"shipped: [bold]{CANDIDATE}[/] — {result['choice']['reason']}", soft_wrap=True)
    console.print(f"build took {manifest['build_seconds']:.1f} s (validation {chosen['validation_seconds']:.1f} s)")
    return 0 if result["choice"]["validated"] else 1

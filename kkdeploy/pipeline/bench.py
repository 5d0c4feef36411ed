"""`kkdeploy bench`: the organizer's protocol, shape by shape (design.md §4).

For each shape, in ``processes`` fresh processes one after another: accuracy first (every
candidate through ``validate_candidates`` on all trials; a candidate that fails is not timed),
then the timing protocol (``measure_latency``) on the timed input for the reference ("eager")
and every candidate that passed. The parent pools the samples of all processes per backend and
writes ``bench.json``, ``bench.md`` and ``bench.png``. A backend counts as passed only if it
passed in every process.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from engines.base import close_all
from validation.strict import DEFAULT_CONTRACT
from validation.trials import DEFAULT_PADDING_RATIO

from ..config import LONG_CONTEXT_SHAPES, OFFICIAL_SHAPES, TransformerConfig, dtype_name, official_config
from ..errors import KKError, error_summary
from ..inputs import DEFAULT_SEED, DEFAULT_TRIALS, TIMED_SEED_OFFSET, generate_case
from ..status import PASSED, PASSED_ALL_VALID_ONLY
from .launches import count_launches
from .machine_limits import measure_limits
from .op_roofline import in_plan, op_rooflines
from .roofline import attach_roofline, call_work, format_fraction
from .timeline import TABLE_HEADER, calls_for, profiled_timeline, table_cells
from .timing import DEFAULT_REPEATS, DEFAULT_ROUNDS, DEFAULT_WARMUPS, LatencyStats, measure_latency

BENCH_FORMAT = "kkdeploy-bench/1"
DEFAULT_PROCESSES = 3  # fresh processes per shape: a process-level effect shows up as spread between them
EAGER = "eager"
REFERENCE_STATUS = "reference"
SKIPPED = "skipped"
FAILED = "failed"
BENCH_SHAPES = [i for i in sorted(OFFICIAL_SHAPES) if i not in LONG_CONTEXT_SHAPES]
LONG_CONTEXT_POINTER = (
    "shape {sid} is long-context: a dense reference or engine cannot hold its scores; benchmark and check "
    "it on the bounded-memory path instead (`kkdeploy check --shape {sid}`, kkdeploy/longcontext.py)"
)


@dataclass
class BenchOptions:
    """Everything a worker needs; passed to it as JSON."""

    device: str
    dtype: str
    contract: str = DEFAULT_CONTRACT
    processes: int = DEFAULT_PROCESSES
    warmups: int = DEFAULT_WARMUPS
    repeats: int = DEFAULT_REPEATS
    rounds: int = DEFAULT_ROUNDS
    seed: int = DEFAULT_SEED
    trials: int = DEFAULT_TRIALS
    padding_ratio: float = DEFAULT_PADDING_RATIO
    weights: str | None = None
    artifacts: str | None = None
    candidates: list[str] | None = None  # None: default_candidates(device, dtype, contract)
    tf32: bool | None = None  # None: on for float32 CUDA under the judge contract (tf32_enabled)
    timeline: bool = True  # the first process profiles each timed backend's calls on a GPU (kkdeploy.pipeline.timeline)

    def check(self) -> "BenchOptions":
        for name, low in (("processes", 1), ("repeats", 1), ("rounds", 1), ("trials", 1), ("warmups", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or value < low:
                raise KKError(f"--{name} must be an integer >= {low}, got {value!r}")
        if not 0 < self.padding_ratio < 1:
            raise KKError(f"--padding-ratio must be in (0, 1), got {self.padding_ratio}")
        if self.artifacts is not None and not Path(self.artifacts).is_dir():
            raise KKError(f"--artifacts {self.artifacts} is not a directory; pass the output of `kkdeploy build`")
        return self


@dataclass
class ShapeJob:
    label: str  # "shape-03" or "custom-B8-S256-D256-H8-F512-L2" (names files too: no spaces)
    shape_id: int | None
    config: TransformerConfig


def shape_label(shape_id: int | None) -> str:
    return f"shape-{shape_id:02d}" if shape_id is not None else "custom"


def jobs_for(shape_ids: list[int] | None, config: TransformerConfig | None) -> list[ShapeJob]:
    if shape_ids is None:  # the dimensions in the label: a summary over several custom runs tells them apart
        c = config
        return [ShapeJob(f"custom-B{c.batch_size}-S{c.seq_len}-D{c.d_model}-H{c.num_heads}-F{c.ffn_dim}-"
                         f"L{c.num_layers}{'' if c.causal else '-noncausal'}", None, config)]
    jobs = []
    for sid in shape_ids:
        if sid in LONG_CONTEXT_SHAPES:
            raise KKError(LONG_CONTEXT_POINTER.format(sid=sid))
        jobs.append(ShapeJob(shape_label(sid), sid, official_config(sid)))  # an unknown id: one line
    return jobs


# -- the worker: one shape, one process ---------------------------------------------------------------
def _artifacts_dir(root: Path, job: ShapeJob) -> Path | None:
    """``root`` itself when it is one artifact directory, else ``root/shape-NN``."""
    if (root / "manifest.json").is_file():
        return root
    candidate = root / job.label
    return candidate if (candidate / "manifest.json").is_file() else None


# Candidates a bench can run; the defaults per device (and, for mixed precision, per dtype) follow.
GRAPH_CANDIDATES = ["torch-graph", "torch-graph-sdpa1", "torch-graph-nomask"]
COMPILE_CANDIDATES = ["torch-compile", "torch-compile-sdpa1", "torch-compile-faithful-attention",
                      "torch-compile-faithful-kernels", "torch-compile-faithful-gemms"]
MIXED_CANDIDATES = {"cpu": ["mixed", "mixed-sdpa", "fused-mixed", "fused-half-gemm-mixed"],
                    "cuda": ["torch-graph-mixed", "torch-graph-mixed-sdpa", "torch-compile-mixed",
                             "torch-compile-mixed-sdpa", "torch-compile-fused-mixed",
                             "torch-compile-fused-half-gemm-mixed"]}
# SDPA in every block for every mask (kkdeploy.models.fused): judge-contract candidates; "-mixed" ones calibrate,
# "-half-gemm" ones run their float32 blocks' GEMMs on float16 inputs (kkdeploy.models.fused.half_gemm).
FUSED_CANDIDATES = {"cpu": ["fused", "fused-half-gemm"],
                    "cuda": ["torch-compile-fused", "torch-compile-fused-half-gemm"]}
ALL_MIXED = MIXED_CANDIDATES["cpu"] + MIXED_CANDIDATES["cuda"] + FUSED_CANDIDATES["cpu"] + FUSED_CANDIDATES["cuda"]
# The same graphs with programmatic dependent launches (kkdeploy/kernels/dependent_launch.py; Hopper and later):
# opt-in, to be timed beside the plain form in one process.
PDL_CANDIDATES = [f"{name}-pdl" for name in COMPILE_CANDIDATES]
# The model as our own layer launches in a CUDA graph (engines.layer_graph), proven op by op first: opt-in.
LAYER_CANDIDATES = ["layer-graph", "layer-graph-split"]
COMPILED = COMPILE_CANDIDATES + PDL_CANDIDATES + [n for n in ALL_MIXED if n.startswith("torch-compile-")]  # opt-in on the CPU
BENCH_CANDIDATES = (["optimized-sdpa0", "optimized-sdpa1"] + GRAPH_CANDIDATES + COMPILE_CANDIDATES + PDL_CANDIDATES
                    + ALL_MIXED + LAYER_CANDIDATES)


def default_candidates(device: torch.device, dtype: torch.dtype, contract: str,
                       config: TransformerConfig | None = None) -> list[str]:
    """Every PyTorch route; on the CPU the CUDA-graph ones report why they are skipped, and compiling is
    opt-in there (slow on 2 cores; ``--candidates torch-compile``). A float32 bench under the judge contract
    adds the calibrated mixed-precision candidates and the fused ones (SDPA everywhere, Inductor fusion). Where a
    default build would time the GEMMs graph with dependent launches (``dependent_launch_default``), so does the
    bench."""
    names = ["optimized-sdpa0", "optimized-sdpa1"] + GRAPH_CANDIDATES + COMPILE_CANDIDATES
    if config is not None:
        from engines.torch_compile import GEMMS, dependent_launch_default

        if dependent_launch_default(config, device, dtype):
            names.append(f"{GEMMS}-pdl")
    if dtype == torch.float32 and contract == "judge":
        names += FUSED_CANDIDATES[device.type] + MIXED_CANDIDATES[device.type]
    return names


def parse_candidates(text: str | None) -> list[str] | None:
    if text is None:
        return None
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in BENCH_CANDIDATES]
    if unknown or not names:
        raise KKError(f"unknown bench candidate {unknown[0] if unknown else text!r}; choose from "
                      f"{', '.join(BENCH_CANDIDATES)}")
    return names


def tf32_enabled(options: "BenchOptions", device: torch.device, dtype: torch.dtype) -> bool:
    from ..config import tf32_default

    return tf32_default(device, dtype, options.contract, options.tf32)


def make_candidate(name: str, reference, config: TransformerConfig, dtype: torch.dtype, device: torch.device,
                   options: "BenchOptions", info: dict, calibrations: dict | None = None):
    """(runner, all_valid_only) for one bench candidate; raises with the reason it cannot run here."""
    from ..models.weights import build_models

    if name.startswith("optimized-sdpa"):
        k = min(int(name[len("optimized-sdpa"):]), config.num_layers)
        return build_models(config, dtype, device, weights=options.weights, sdpa_layers=k)[1], False
    if name in ALL_MIXED:
        return _make_mixed(name, reference, device, options, info, {} if calibrations is None else calibrations)
    if name in GRAPH_CANDIDATES:
        if device.type != "cuda":
            raise KKError("skipped: CUDA graphs need a CUDA device")
        from engines.torch_graph import VARIANTS, CudaGraphRunner, model_for_variant

        variant = VARIANTS[name]
        model = reference if variant["model"] == "reference" else model_for_variant(
            variant, config, dtype, device, reference.state_dict())
        return CudaGraphRunner(model, config, dtype, device, all_valid_only=variant["all_valid_only"]), \
            variant["all_valid_only"]
    if name in COMPILE_CANDIDATES or name in PDL_CANDIDATES:
        from engines.base import CandidateSkipped
        from engines.torch_compile import (BACKEND, CompiledRunner, kernel_kinds, kernel_paths_record,
                                           prove_candidate_kernels, dependent_launch_refusal)

        reason = BACKEND.unavailable_reason(device, dtype)
        if reason:
            raise KKError(reason)
        why = dependent_launch_refusal(name, device)
        if why:
            raise KKError(f"skipped: {why}")
        if kernel_kinds(name):  # the build's proof step: our kernels run only where proven here
            try:
                proofs = prove_candidate_kernels(name, reference, config, dtype, device)
            except CandidateSkipped as exc:
                raise KKError(f"skipped: {exc}") from None
            info.update({"proof_seconds": proofs.seconds, "kernel_proofs": proofs.to_list()})
        runner = CompiledRunner(reference, config, dtype, device, name=name)
        info["compile_seconds"] = runner.compile_seconds
        info.update(kernel_paths_record(name, config, dtype, device))
        return runner, runner.all_valid_only
    if name in LAYER_CANDIDATES:
        from engines.layer_graph import BACKEND, make_runner, refusal

        reason = BACKEND.unavailable_reason(device, dtype) or refusal(config, dtype, device)
        if reason:
            raise KKError(f"skipped: {reason}")
        runner, record = make_runner(reference, config, dtype, device, name, options.seed)  # proven here first
        info.update({"launch": record["launch"], "layer_proof": record})
        return runner, False
    raise KKError(f"unknown bench candidate {name!r}")


def _attention_kind(name: str) -> str:
    """How a mixed/fused candidate attends: ``reference`` order, ``sdpa`` in float16 blocks (all-valid only),
    or ``fused`` (SDPA in every block, every mask)."""
    if "fused" in name:
        return "fused"
    return "sdpa" if name.endswith("-sdpa") else "reference"


def set_process_tf32(options: "BenchOptions", device: torch.device, dtype: torch.dtype) -> bool:
    """TF32 for the whole process: the reference, eager timing and every candidate alike. Returns it."""
    tf32 = tf32_enabled(options, device, dtype)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
    return tf32


def _make_mixed(name: str, reference, device: torch.device, options: "BenchOptions", info: dict,
                calibrations: dict):
    """Calibrate the float16 blocks for this shape on the trial plan, then build the chosen runner.

    Candidates with the same attention kind calibrate on the same eager twin, so the first one's record is
    reused by the others in this process (``calibrations``, keyed by attention kind and half GEMMs). ``fused``
    candidates without ``-mixed`` keep every block in the model's dtype and need no calibration.
    """
    import copy

    from engines.torch_compile import CALIBRATED_ON_EAGER_TWIN

    from .calibration import calibrate_fused_layers, calibrate_layers
    from ..models.fused import FusedTransformer
    from ..models.mixed import MixedPrecisionTransformer

    kind = _attention_kind(name)
    half = "-half-gemm" in name
    calibrated = kind != "fused" or name.endswith("-mixed")
    if (calibrated or half) and reference.dtype != torch.float32:
        raise KKError("skipped: mixed precision applies to float32 models (float16 is already all float16)")
    captured = name.startswith("torch-graph-")
    compiled = name.startswith("torch-compile-")
    if captured and device.type != "cuda":
        raise KKError("skipped: CUDA graphs need a CUDA device")
    all_valid_only = kind == "sdpa"
    config = reference.config

    def model_for(layers):
        if kind == "fused":
            return FusedTransformer(reference, layers, half_gemm=half)
        return MixedPrecisionTransformer(reference, layers, kind == "sdpa")

    def make_runner(model):
        # A compiled candidate calibrates on its eager twin (CUDA-graph captured where possible): one compile
        # per tried set would cost minutes. The compiled model is then validated like every candidate.
        if device.type != "cuda":
            return model
        from engines.torch_graph import CudaGraphRunner

        return CudaGraphRunner(model, config, torch.float32, device, all_valid_only=all_valid_only)

    layers: tuple = ()
    if calibrated:
        key = (kind, half)
        if key not in calibrations:
            plan = {"contract": options.contract, "seed": options.seed, "trials": options.trials,
                    "padding_ratio": options.padding_ratio}
            start = time.perf_counter()
            if kind == "fused":  # the very search `kkdeploy build` runs for torch-compile-fused-mixed
                record = calibrate_fused_layers(reference, device, plan, half_gemm=half)
            else:
                record = calibrate_layers(reference, lambda chosen: make_runner(model_for(chosen)),
                                          all_valid_only=all_valid_only, **plan)
            record["seconds"] = round(time.perf_counter() - start, 3)
            calibrations[key] = (name, record)
        first, record = calibrations[key]
        calibration = copy.deepcopy(record)
        if first != name:
            calibration["reused_from"] = first
        if compiled:
            calibration["calibrated_on"] = CALIBRATED_ON_EAGER_TWIN
        info["calibration"] = calibration
        layers = tuple(calibration["fp16_layers"])
    chosen = model_for(layers)
    if half:
        info["half_gemm_kernel"] = chosen.half_gemm_kernel
    if compiled:
        from engines.torch_compile import compile_fused, compile_mixed

        runner = (compile_fused(chosen, device, name=name) if kind == "fused"
                  else compile_mixed(chosen, device, name=name, all_valid_sdpa=all_valid_only))
        info["compile_seconds"] = runner.compile_seconds
        return runner, all_valid_only
    return (make_runner(chosen) if captured else chosen), all_valid_only


def bench_candidates(job: ShapeJob, options: BenchOptions, reference, device: torch.device, dtype: torch.dtype):
    """Candidates to validate and time: ``(runners, all_valid_only, skipped, info)``.

    ``skipped`` maps a name to the reason it did not run here; ``info`` holds per-candidate facts worth
    reporting (compile seconds, the mixed-precision calibration record).
    """
    config = job.config
    runners: dict[str, object] = {}
    all_valid_only: set[str] = set()
    skipped: dict[str, str] = {}
    info: dict[str, dict] = {}
    calibrations: dict = {}
    names = options.candidates or default_candidates(device, dtype, options.contract, config)
    for name in names:
        details: dict = {}
        if name in COMPILED and device.type == "cpu" and options.candidates is None:
            skipped[name] = f"skipped: compiling is opt-in on the CPU (--candidates {name})"
            continue
        try:
            runner, valid_only = make_candidate(name, reference, config, dtype, device, options, details,
                                                calibrations)
        except KKError as exc:
            text = str(exc)
            skipped[name] = text if text.split(":")[0] in ("skipped", "unavailable") else f"unavailable: {text}"
        except Exception as exc:  # a capture or compile failure is a reported outcome, not a crash
            skipped[name] = f"unavailable: {error_summary(exc, 300)}"
        else:
            runners[name] = runner
            if valid_only:
                all_valid_only.add(name)
        if details:
            info[name] = details
    if options.artifacts is not None:
        directory = _artifacts_dir(Path(options.artifacts), job)
        if directory is None:
            skipped["shipped"] = f"skipped: no artifact directory for {job.label} under {options.artifacts}"
        else:
            try:
                from .. import load

                served = load(directory, device=str(device))
            except Exception as exc:
                skipped["shipped"] = f"unavailable: kkdeploy.load({directory}) failed: {type(exc).__name__}: {exc}"
            else:
                served_config = getattr(served, "config", config)
                if served_config != config:
                    skipped["shipped"] = f"skipped: {directory} holds {served_config.describe()}, not {config.describe()}"
                else:
                    runners[f"shipped:{getattr(served, 'backend', 'unknown')}"] = served
    return runners, all_valid_only, skipped, info


def run_worker(job: ShapeJob, options: BenchOptions, process_index: int, log_dir: Path | None = None) -> dict:
    """Accuracy, then timing, for one shape in this process. Returns a JSON-ready dict."""
    from validation import validate_candidates

    from ..config import parse_dtype, resolve_device
    from ..models.weights import build_models

    device = resolve_device(options.device)
    dtype = parse_dtype(options.dtype)
    started = time.perf_counter()
    tf32 = set_process_tf32(options, device, dtype)
    limits = measure_limits(device, dtype)  # before any model: the machine as it is, with TF32 as the process has it
    reference, _ = build_models(job.config, dtype, device, weights=options.weights, sdpa_layers=0)
    runners, all_valid_only, skipped, info = bench_candidates(job, options, reference, device, dtype)
    report = validate_candidates(reference, runners, job.config, dtype, device, seed=options.seed,
                                 trials=options.trials, padding_ratio=options.padding_ratio,
                                 contract=options.contract, all_valid_only=all_valid_only)
    if log_dir is not None:
        report.write_json(log_dir / f"validation-{job.label}-p{process_index}.json")
    close_all(r for n, r in runners.items() if n not in report.passed())  # not timed: released before the timing
    backends: dict[str, dict] = {EAGER: {"status": REFERENCE_STATUS, "reason": "the PyTorch reference (eager)"}}
    for name in runners:
        cand = report.candidates[name]
        backends[name] = {
            "status": cand.status, "reason": cand.reason, "all_valid_only": name in all_valid_only,
            "failed_elements": {m: cand.failed_elements(m) for m in cand.modes if cand.mode_records(m)},
            "max_abs": cand.max_abs,
        }
    for name, reason in skipped.items():
        backends[name] = {"status": SKIPPED, "reason": reason}
    for name, details in info.items():
        backends[name].update(details)
    timed = {EAGER: reference, **{n: r for n, r in runners.items() if n in report.passed()}}
    x, mask = generate_case(job.config, device, dtype, options.seed + TIMED_SEED_OFFSET)
    with torch.inference_mode():
        calls = {}
        for name, runner in timed.items():
            try:
                runner(x, mask)  # a runner that cannot run the timed input is reported, not timed
            except Exception as exc:
                backends[name].update(status=FAILED, reason=f"raised on the timed input: {type(exc).__name__}: {exc}")
                continue
            calls[name] = (lambda r=runner: r(x, mask))
        stats = measure_latency(calls, device, warmups=options.warmups, repeats=options.repeats,
                                rounds=options.rounds) if calls else {}
        for name in stats:  # after the timing, so that counting (CUPTI) cannot disturb it
            backends[name]["launches"] = count_launches(timed[name], calls[name], device,
                                                        profile_uncaptured=process_index == 0)
            if process_index == 0 and options.timeline:  # the gaps between kernels, once (pipeline.timeline)
                backends[name]["timeline"] = profiled_timeline(calls[name], device, calls_for(stats[name].median_ms))
    close_all(r for n, r in runners.items() if n in report.passed())
    for name, s in stats.items():
        backends[name]["latency"] = s.to_dict(include_times=True)
    from ..models.weights import weights_sha256

    return {"label": job.label, "shape_id": job.shape_id, "config": job.config.to_dict(), "process": process_index,
            "pid": os.getpid(), "device": str(device), "dtype": dtype_name(dtype), "tf32": tf32, "limits": limits,
            "weights_sha256": weights_sha256(reference),
            "validation_seconds": round(report.seconds, 3), "seconds": round(time.perf_counter() - started, 3),
            "backends": backends}


# -- the parent: processes, aggregation, reports ------------------------------------------------------
def worker_command(job: ShapeJob, options: BenchOptions, process_index: int, result_path: Path,
                   log_dir: Path) -> list[str]:
    return [sys.executable, "-m", "kkdeploy", "bench", "--_worker",
            "--_job", json.dumps({"label": job.label, "shape_id": job.shape_id, "config": job.config.to_dict()}),
            "--_options", json.dumps(asdict(options)), "--_process", str(process_index),
            "--_result", str(result_path), "--_log-dir", str(log_dir)]


def run_processes(job: ShapeJob, options: BenchOptions, out_dir: Path, progress=None) -> tuple[list[dict], list[str]]:
    """Run the worker ``options.processes`` times, one after another (never two at once)."""
    results, errors = [], []
    log_dir = out_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    for p in range(options.processes):
        if progress is not None:
            progress.describe(f"bench {job.label} process {p + 1}/{options.processes}")
        result_path = log_dir / f"result-{job.label}-p{p}.json"
        log_path = log_dir / f"{job.label}-p{p}.log"
        cmd = worker_command(job, options, p, result_path, log_dir)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                          env.get("PYTHONPATH")]))
        with open(log_path, "w") as log:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        if proc.returncode != 0 or not result_path.is_file():
            tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
            errors.append(f"process {p} exited with {proc.returncode}: {' | '.join(tail)} (log: {log_path})")
        else:
            results.append(json.loads(result_path.read_text()))
        if progress is not None:
            progress.advance()
    return results, errors


def _combine_status(statuses: list[str]) -> str:
    if any(s == FAILED for s in statuses):
        return FAILED
    if all(s == REFERENCE_STATUS for s in statuses):
        return REFERENCE_STATUS
    if all(s == SKIPPED for s in statuses):
        return SKIPPED
    if all(s == PASSED for s in statuses):
        return PASSED
    if all(s in (PASSED, PASSED_ALL_VALID_ONLY) for s in statuses):
        return PASSED_ALL_VALID_ONLY
    return FAILED


def aggregate_shape(job: ShapeJob, results: list[dict], errors: list[str], dtype: str | None = None) -> dict:
    """Pool every process's samples per backend; a backend passes only if it passed in every process.

    Every timed backend also gets its ``roofline`` record (``kkdeploy.pipeline.roofline``): the shape's work in
    ``dtype`` (default: the workers' dtype) against the limits the processes measured."""
    config = job.config
    tokens = config.batch_size * config.seq_len
    names: list[str] = []
    for r in results:
        names += [n for n in r["backends"] if n not in names]
    backends = {}
    for name in names:
        entries = [r["backends"].get(name, {"status": SKIPPED, "reason": "not run in this process"}) for r in results]
        status = _combine_status([e["status"] for e in entries])
        worst = next((e for e in entries if e["status"] == status), entries[0])
        entry = {"status": status, "reason": worst.get("reason", ""),
                 "all_valid_only": any(e.get("all_valid_only") for e in entries)}
        if any("failed_elements" in e for e in entries):
            modes: dict[str, int] = {}
            for e in entries:
                for m, n in e.get("failed_elements", {}).items():
                    modes[m] = modes.get(m, 0) + n
            entry["failed_elements"] = modes
            entry["max_abs"] = max((_as_float(e.get("max_abs")) for e in entries), default=float("nan"))
        if any("calibration" in e for e in entries):
            entry["fp16_layers_per_process"] = [e.get("calibration", {}).get("fp16_layers") for e in entries]
            entry["calibration"] = next(e["calibration"] for e in entries if "calibration" in e)
        if any("compile_seconds" in e for e in entries):
            entry["compile_seconds_per_process"] = [e.get("compile_seconds") for e in entries]
        kernels = sorted({e["half_gemm_kernel"] for e in entries if "half_gemm_kernel" in e})
        if kernels:
            entry["half_gemm_kernel"] = " | ".join(kernels)  # one machine, one answer; both if processes differed
        if any("proof_seconds" in e for e in entries):  # the proof step each process ran (or found cached)
            entry["proof_seconds_per_process"] = [e.get("proof_seconds") for e in entries]
        timelines = [e["timeline"] for e in entries if e.get("timeline")]
        if timelines:  # recorded in the first process only (CUPTI's start-up is not free)
            entry["timeline"] = timelines[0]
        for key in ("attention_path", "layer_norm_path", "linear_path", "kernel_proofs"):  # our kernels, and why
            paths = [e[key] for e in entries if key in e]
            if paths:  # the first process's; where the processes chose otherwise, plans_per_process says so
                entry[key] = paths[0]
        plans = [kernel_plan(e) for e in entries]
        if any(plans) and any(plan != plans[0] for plan in plans[1:]):
            entry["plans_per_process"] = plans  # a process that proved anew chose otherwise: timings can be close
        latencies = [e["latency"] for e in entries if e.get("latency")]
        if latencies and status != FAILED and len(latencies) == len(entries):
            times = [t for lat in latencies for t in lat["times_ms"]]
            peaks = [lat["peak_memory_bytes"] for lat in latencies if lat.get("peak_memory_bytes") is not None]
            extras = [lat["peak_extra_bytes"] for lat in latencies if lat.get("peak_extra_bytes") is not None]
            stats = LatencyStats.from_times(times, [m for lat in latencies for m in lat["round_medians_ms"]],
                                            max(peaks) if peaks else None, max(extras) if extras else None)
            entry.update(stats.to_dict())
            entry["process_medians_ms"] = [lat["median_ms"] for lat in latencies]
            entry["tokens_per_s"] = tokens / (stats.median_ms / 1000.0) if stats.median_ms > 0 else None
        backends[name] = entry
    eager, floor = backends.get(EAGER, {}).get("median_ms"), eager_floor_ms(backends.get(EAGER, {}))
    for entry in backends.values():
        if eager and entry.get("median_ms"):
            entry["speedup"] = eager / entry["median_ms"]
            entry["speedup_over_eager_floor"] = floor / entry["median_ms"]
    shape = {"label": job.label, "shape_id": job.shape_id, "config": config.to_dict(), "tokens": tokens,
             "processes": len(results), "errors": errors, "backends": backends}
    # which weights stand behind the figures: the reference's state as the build's manifest hashes it
    digests = sorted({r["weights_sha256"] for r in results if r.get("weights_sha256")})
    if digests:
        shape["weights_sha256"] = digests[0] if len(digests) == 1 else digests
    dtype = dtype or next((r["dtype"] for r in results if "dtype" in r), None)
    if dtype is not None:
        from ..config import parse_dtype

        launches = {name: [r["backends"].get(name, {}).get("launches") for r in results] for name in names}
        shape["roofline"] = attach_roofline(backends, call_work(config, parse_dtype(dtype)),
                                            [r.get("limits") for r in results], launches)
        for entry in backends.values():  # each proven kernel op against the same limits (op_roofline)
            if entry.get("roofline") and entry.get("kernel_proofs"):
                entry["roofline"]["ops"] = op_rooflines(entry["kernel_proofs"], shape["roofline"]["limits"],
                                                        in_plan(entry, config))
    return shape


def kernel_plan(entry: dict) -> dict:
    """What a process's proofs chose for a backend: each ``*_path`` record without its reasons (which quote the
    proofs' timings, different in every process). Equal plans run the same launches."""
    def decided(value):
        if isinstance(value, dict):
            return {k: decided(v) for k, v in value.items() if k != "reason"}
        return value

    return {key: decided(entry[key]) for key in ("attention_path", "layer_norm_path", "linear_path") if key in entry}


def plan_difference(plans: list[dict]) -> str:
    """Which choices the processes' plans disagree on, as 'linear_path.plan.gelu: False/True'."""
    def flat(value, prefix=""):
        if isinstance(value, dict):
            return {k: v for key, sub in value.items() for k, v in flat(sub, f"{prefix}{key}.").items()}
        return {prefix[:-1]: value}

    flats = [flat(plan) for plan in plans]
    keys = sorted({k for f in flats for k in f})
    differ = [k for k in keys if len({json.dumps(f.get(k), default=str) for f in flats}) > 1]
    shown = ", ".join(f"{k}: {'/'.join(str(f.get(k)) for f in flats)}" for k in differ[:6])
    return shown + (f" and {len(differ) - 6} more" if len(differ) > 6 else "")


def eager_floor_ms(eager: dict) -> float | None:
    """Eager's fastest round median (its median where rounds were not recorded).

    Eager is launch-bound on the small shapes and its median moves with the host: on the H200 the rounds of
    one process sat at ~2.6 or ~4.2 ms for the same call, while CUDA-graph candidates held within 1%. A
    speedup over this floor is the conservative one, which a session with slow eager rounds cannot inflate.
    """
    rounds = eager.get("round_medians_ms") or ([eager["median_ms"]] if eager.get("median_ms") else [])
    return min(rounds, default=None)


def _as_float(value) -> float:
    if isinstance(value, str):
        return float(value)  # "inf"/"nan" from json_safe
    return float("nan") if value is None else float(value)


def environment(device: torch.device) -> dict:
    """The machine and library versions (``artifacts.device_info`` / ``library_versions``) in bench.json's keys."""
    from ..artifacts import device_info, library_versions

    dev = device_info(device)
    versions = {"python": platform.python_version(), **{k: v for k, v in library_versions().items() if v}}
    info = {"platform": platform.platform(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "device": str(device), "versions": versions}
    if dev["type"] == "cuda":
        info.update(gpu=dev["name"], compute_capability=dev["capability"], cuda=torch.version.cuda)
    else:
        info["cpu"] = dev["name"]
    return info


def _fmt(value, spec: str, dash: str = "-") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return dash
    return format(value, spec)


def markdown_table(data: dict) -> str:
    p = data["protocol"]
    env = data["environment"]
    lines = [
        "# kkdeploy bench", "",
        f"- created: {data['created']}",
        f"- command: `{data['command']}`",
        f"- device: {env.get('gpu', env.get('cpu', ''))} ({env['device']}), dtype {p['dtype']}, "
        f"contract {p['contract']} (atol {p['atol']}, rtol {p['rtol']})",
        f"- protocol: {p['trials']} accuracy trials per mask mode (seed {p['seed']}+t; padded ratio "
        f"{p['padding_ratio']}), timed input seed {p['seed'] + TIMED_SEED_OFFSET}, {p['warmups']} warmups, "
        f"{p['repeats']} repeats, {p['rounds']} alternating rounds, {p['processes']} process(es) per shape; "
        f"timing by {p['timer']}",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in env["versions"].items()),
        f"- weights: {p.get('weights') or 'seeded'}; sha256 per shape: " + ", ".join(
            f"{s['label']} {str(s['weights_sha256'])[:16]}" for s in data["shapes"] if s.get("weights_sha256")), "",
        "| shape | backend | status | failed elements | median ms | p90 ms | peak MiB (extra) | tokens/s | speedup "
        "| over eager's fastest round | fraction of limit (bound) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for shape in data["shapes"]:
        for name, b in shape["backends"].items():
            failed = ", ".join(f"{m} {n}" for m, n in b.get("failed_elements", {}).items()) or "-"
            peak, extra = b.get("peak_memory_bytes"), b.get("peak_extra_bytes")
            memory = "-" if not peak else f"{peak / 2**20:.1f} ({(extra or 0) / 2**20:.1f})"
            status = b["status"] if b["status"] != FAILED else "**FAILED**"
            lines.append(
                f"| {shape['label']} | {name} | {status} | {failed} | {_fmt(b.get('median_ms'), '.4g')} | "
                f"{_fmt(b.get('p90_ms'), '.4g')} | {memory} | "
                f"{_fmt(b.get('tokens_per_s'), ',.0f')} | {_fmt(b.get('speedup'), '.2f')}x | "
                f"{_fmt(b.get('speedup_over_eager_floor'), '.2f')}x |".replace("-x |", "- |")
                + f" {format_fraction(b.get('roofline'))} |")
        for err in shape["errors"]:
            lines.append(f"| {shape['label']} | (process) | **error** | {err.replace('|', '/')} | | | | | | | |")
    notes = [f"- {shape['label']} {n}: {b['reason']}" for shape in data["shapes"] for n, b in shape["backends"].items()
             if b["status"] in (FAILED, SKIPPED)]
    if notes:
        lines += ["", "Not timed:", ""] + notes
    mixed = [f"- {shape['label']} {n}: float16 blocks {b['fp16_layers_per_process']} per process; tried "
             + ", ".join(f"{t['fp16_layers']} {'pass' if t['passed'] else 'fail'}" for t in b["calibration"]["tried"])
             for shape in data["shapes"] for n, b in shape["backends"].items() if "calibration" in b]
    if mixed:
        lines += ["", "Mixed-precision calibration (float32 model, float16 blocks; later blocks tried first):", ""] + mixed
    half = [f"- {shape['label']} {n}: {b['half_gemm_kernel']}" for shape in data["shapes"]
            for n, b in shape["backends"].items() if "half_gemm_kernel" in b]
    if half:
        lines += ["", "Half-GEMM blocks ran their GEMMs as:", ""] + half
    differed = [f"- {shape['label']} {n}: launches per process "
                + "/".join(str(c) for c in (b.get("roofline") or {}).get("launches_per_process", ["?"]))
                + f"; {plan_difference(b['plans_per_process'])}"
                for shape in data["shapes"] for n, b in shape["backends"].items() if b.get("plans_per_process")]
    if differed:
        lines += ["", "Plans that differed between processes (a process proved anew; the median pools them):", ""]
        lines += differed
    lines += roofline_lines(data["shapes"])
    lines += timeline_lines(data["shapes"])
    lines += op_roofline_lines(data["shapes"])
    return "\n".join(lines) + "\n"


def timeline_lines(shapes: list[dict]) -> list[str]:
    """bench.md's timeline section: per timed backend with a timeline (a GPU's first process), what one call spans,
    how much of it kernels kept the device busy, and the largest gap between two kernels."""
    rows = [(shape, name, b["timeline"]) for shape in shapes for name, b in shape["backends"].items()
            if (b.get("timeline") or {}).get("median_span_us") is not None]
    if not rows:
        return []
    lines = ["", "## Timeline", "",
             "One call under torch.profiler, medians over the calls profiled in the first process (µs; the profiler "
             "adds to each launch, so the span is above the timed median): the kernels, the span from the first "
             "start to the last end, the busy time (kernels running), the gaps between kernels and the overlap of "
             "dependent launches, the largest gap (docs/benchmark.md, The gaps between kernels).", "",
             f"| shape | backend | {TABLE_HEADER} |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {shape['label']} | {name} | {table_cells(t)} |" for shape, name, t in rows]
    return lines


def _limits_text(limits: dict | None) -> str:
    """One line of the limits a shape's fractions are measured against."""
    if not limits:
        return "no limits measured"
    gemm, copy, launch = limits.get("gemm", {}), limits.get("copy", {}), limits.get("launch", {})
    parts = [f"GEMM {gemm['tflop_s']:.4g} TFLOP/s (n={gemm['n']})" if "tflop_s" in gemm
             else f"GEMM: {gemm.get('error')}",
             f"copy {copy['gb_s']:.4g} GB/s" if "gb_s" in copy else f"copy: {copy.get('error')}"]
    if "floor_ms" in launch:
        per = launch.get("per_launch_ms")
        parts.append(f"call floor {launch['floor_ms'] * 1e3:.3g} us"
                     + (f" + {per * 1e3:.3g} us per further launch" if per is not None else " (launches not counted)"))
    else:
        parts.append(f"launch floor: {launch.get('error')}")
    return ", ".join(parts) + f" (best of {limits.get('processes', 1)} process(es))"


def roofline_lines(shapes: list[dict]) -> list[str]:
    """bench.md's roofline section: per shape the work and limits, per timed backend its three terms."""
    with_roofline = [s for s in shapes if s.get("roofline")]
    if not with_roofline:
        return []
    lines = ["", "## Roofline", "",
             "fraction = max(compute, memory, launch) / median; compute = GEMM FLOPs / measured GEMM peak, memory = "
             "minimal bytes (weights + input + output) / measured copy bandwidth, launch = call floor + (launches - 1) "
             "x per-launch cost (docs/benchmark.md, Roofline).", ""]
    for shape in with_roofline:
        work, limits = shape["roofline"]["work"], shape["roofline"]["limits"]
        flops, nbytes = work["flops"], work["bytes"]
        lines += [f"- {shape['label']}: {flops['total'] / 1e9:.4g} GFLOP (projections "
                  f"{flops['projections'] / 1e9:.4g}, FFN {flops['ffn'] / 1e9:.4g}, attention "
                  f"{flops['attention'] / 1e9:.4g}{', causal' if work.get('causal') else ''}), "
                  f"{nbytes['total'] / 1e6:.4g} MB (weights {nbytes['weights'] / 1e6:.4g}, in "
                  f"{nbytes['inputs'] / 1e6:.4g}, out {nbytes['outputs'] / 1e6:.4g}); {_limits_text(limits)}"]
    lines += ["", "| shape | backend | median ms | launches | compute ms | memory ms | launch ms | bound | fraction |"
              " TFLOP/s | GB/s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for shape in with_roofline:
        for name, b in shape["backends"].items():
            r = b.get("roofline")
            if not r:
                continue
            terms = r.get("terms_ms") or {}
            launches = r["launches"] if r.get("launches") is not None else "not counted"
            if r.get("launches_per_process"):  # the processes ran different plans: each one's count
                launches = f"{launches} ({'/'.join(str(n) for n in r['launches_per_process'])})"
            lines.append(f"| {shape['label']} | {name} | {_fmt(r['measured_ms'], '.4g')} | {launches} | "
                         f"{_fmt(terms.get('compute'), '.3g')} | {_fmt(terms.get('memory'), '.3g')} | "
                         f"{_fmt(terms.get('launch'), '.3g')} | {r.get('bound') or '-'} | "
                         f"{_fmt(r.get('fraction'), '.3g')} | "
                         f"{_fmt(r.get('achieved_tflop_s'), '.3g')} | {_fmt(r.get('achieved_gb_s'), '.4g')} |")
    return lines


def shape_op_rooflines(shape: dict) -> list[dict]:
    """The shape's proven op shapes against the machine, each once (the candidates of one process share their
    proofs; the first candidate's record of an op shape stands), with ``in_plan`` True where some candidate's graph
    computes it, False where none does, None where not known: those computed first, each group the furthest from its
    limit first."""
    rows: dict[tuple, dict] = {}
    seen: dict[tuple, set] = {}
    for entry in shape["backends"].values():
        for row in (entry.get("roofline") or {}).get("ops") or []:
            key = (row["op"], row["shape"])
            rows.setdefault(key, dict(row))
            seen.setdefault(key, set()).add(row.get("in_plan"))
    for key, row in rows.items():
        row["in_plan"] = True if True in seen[key] else (False if seen[key] == {False} else None)
    return sorted(rows.values(), key=lambda r: (r["in_plan"] is False, r["fraction"] is None, r["fraction"] or 0.0))


def op_roofline_lines(shapes: list[dict]) -> list[str]:
    """bench.md's per-op section: every proven kernel op shape's time (the proof's) against its own three terms."""
    per_shape = [(s, [r for r in shape_op_rooflines(s) if r.get("fraction") is not None]) for s in shapes]
    if not any(rows for _, rows in per_shape):
        return []  # no kernel op timed (the CPU), or no limits measured
    lines = ["", "## Kernel ops against the machine", "",
             "Each op shape a candidate's proofs timed (one launch, graph replays), against the same limits: "
             "compute = its GEMM FLOPs / GEMM peak, memory = its least bytes / copy bandwidth, launch = one launch "
             "in a graph; fraction = the largest / the time of what runs (ours where chosen, else ATen's). \"in a "
             "graph\": whether a candidate's plan computes it (`linear_path.plan` and the other `*_path` records); "
             "those first, each group the furthest first (docs/benchmark.md).", "",
             "| shape | op | op shape | in a graph | runs | ours ms | ATen ms | compute ms | memory ms | launch ms | "
             "bound | fraction |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for shape, rows in per_shape:
        for r in rows:
            terms = r.get("terms_ms") or {}
            graph = {True: "yes", False: "no"}.get(r.get("in_plan"), "-")
            lines.append(f"| {shape['label']} | {r['op']} | {r['shape']} | {graph} | {r['runs']} | "
                         f"{_fmt(r['ours_ms'], '.4g')} | "
                         f"{_fmt(r['aten_ms'], '.4g')} | {_fmt(terms.get('compute'), '.3g')} | "
                         f"{_fmt(terms.get('memory'), '.3g')} | {_fmt(terms.get('launch'), '.3g')} | "
                         f"{r.get('bound') or '-'} | {_fmt(r.get('fraction'), '.3g')} |")
    return lines


def shape_tick_labels(shapes: list[dict]) -> list[str]:
    """Each shape's label; a shape measured in fewer processes than the others says so, so that a chart
    pooled over several runs cannot pass one process off as three."""
    most = max((s.get("processes", 1) for s in shapes), default=1)
    return [s["label"] + (f" ({s['processes']} proc)" if s.get("processes", most) < most else "") for s in shapes]


def _has_fractions(shapes: list[dict]) -> bool:
    return any((b.get("roofline") or {}).get("fraction") is not None for s in shapes for b in s["backends"].values())


def plot_speedups(data: dict, path: Path) -> None:
    """Speedup over eager per shape per backend; failed backends get a red x at 0, skipped ones nothing. Where the
    backends carry a roofline, a second panel shows each one's fraction of the limit and the term that binds it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = data["shapes"]
    names = []  # backends with something to draw: a speedup, or a failure
    for s in shapes:
        names += [n for n, b in s["backends"].items() if n not in names and n != EAGER
                  and (b.get("speedup") is not None or b["status"] == FAILED)]
    skipped = sorted({n for s in shapes for n, b in s["backends"].items() if b["status"] == SKIPPED})
    fractions = _has_fractions(shapes)
    fig, axes = plt.subplots(2 if fractions else 1, 1, squeeze=False,
                             figsize=(min(20, max(6, 0.25 * len(shapes) * max(1, len(names)) + 2)),
                                      10 if fractions else 5.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    color_of = {name: colors[i % len(colors)] for i, name in enumerate(names)}
    ax = axes[0][0]
    _draw_speedups(ax, shapes, names, color_of)
    p = data["protocol"]
    ax.set_title(f"kkdeploy bench: {p['dtype']} on {data['environment'].get('gpu', p['device'])}, "
                 f"contract {p['contract']}")
    if fractions:
        _draw_fractions(axes[1][0], shapes, color_of)
    if skipped:
        fig.text(0.01, 0.01, "not run here: " + ", ".join(skipped), fontsize="x-small", color="gray")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _shape_axis(ax, shapes: list[dict]) -> None:
    ax.set_xticks(range(len(shapes)))
    crowded = len(shapes) > 6
    ax.set_xticklabels(shape_tick_labels(shapes), rotation=45 if crowded else 0, ha="right" if crowded else "center")


def _draw_speedups(ax, shapes: list[dict], names: list[str], color_of: dict) -> None:
    width = 0.8 / max(1, len(names))
    failed_label_used = False
    for i, name in enumerate(names):
        xs, ys, fails = [], [], []
        for j, s in enumerate(shapes):
            b = s["backends"].get(name)
            x = j - 0.4 + width * (i + 0.5)
            if b is None:
                continue
            if b["status"] == FAILED:
                fails.append(x)
            elif b.get("speedup") is not None:
                xs.append(x)
                ys.append(b["speedup"])
        ax.bar(xs, ys, width, label=name, color=color_of[name])
        for x, y in zip(xs, ys):
            ax.annotate(f"{y:.2f}x", (x, y), ha="center", va="bottom", fontsize="x-small")
        if fails:
            ax.scatter(fails, [0] * len(fails), marker="x", color="red", s=60, zorder=3,
                       label=None if failed_label_used else "failed (not timed)")
            for x in fails:  # in the backend's colour, so the legend says which one failed
                ax.annotate("FAIL", (x, 0), ha="center", va="bottom", fontsize="x-small", rotation=90,
                            color=color_of[name], xytext=(0, 6), textcoords="offset points")
            failed_label_used = True
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    _shape_axis(ax, shapes)
    ax.set_ylabel("speedup over eager (median)")
    if names:
        ax.legend(fontsize="small")


def _draw_fractions(ax, shapes: list[dict], color_of: dict) -> None:
    """Fraction of the roofline limit per shape and backend (eager included, in grey); each bar is labelled with
    its value and the binding term's initial (C compute, M memory, L launch)."""
    names = []
    for s in shapes:
        names += [n for n, b in s["backends"].items()
                  if n not in names and (b.get("roofline") or {}).get("fraction") is not None]
    width = 0.8 / max(1, len(names))
    top = 1.0
    for i, name in enumerate(names):
        xs, ys, tags = [], [], []
        for j, s in enumerate(shapes):
            r = (s["backends"].get(name) or {}).get("roofline") or {}
            if r.get("fraction") is not None:
                xs.append(j - 0.4 + width * (i + 0.5))
                ys.append(r["fraction"])
                value, bound = format_fraction(r).split()[:2]
                tags.append(f"{value}{bound[0].upper()}")
        ax.bar(xs, ys, width, label=name, color=color_of.get(name, "0.6"))
        for x, y, tag in zip(xs, ys, tags):
            ax.annotate(tag, (x, y), ha="center", va="bottom", fontsize="x-small", rotation=90)
        top = max([top] + ys)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_ylim(0, top * 1.15)
    _shape_axis(ax, shapes)
    ax.set_ylabel("fraction of the roofline limit")
    ax.set_title("fraction of the limit measured on the spot (bound: C compute, M memory, L launch)", fontsize="small")
    if names:
        ax.legend(fontsize="small")


def run_bench(jobs: list[ShapeJob], options: BenchOptions, out_dir: Path, command: str | None = None,
              progress=None) -> dict:
    """Every shape in its own processes; writes bench.json, bench.md and bench.png into ``out_dir``."""
    from validation import contract as contract_tolerances
    from ..artifacts import write_json

    options.check()
    atol, rtol = contract_tolerances(options.contract)
    device = torch.device(options.device)
    out_dir.mkdir(parents=True, exist_ok=True)
    shapes = []
    for job in jobs:
        results, errors = run_processes(job, options, out_dir, progress)
        shapes.append(aggregate_shape(job, results, errors, options.dtype))
    data = {
        "format": BENCH_FORMAT, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": command or " ".join(shlex.quote(a) for a in sys.argv),
        "protocol": {**asdict(options), "atol": atol, "rtol": rtol, "timed_seed": options.seed + TIMED_SEED_OFFSET,
                     "timer": "CUDA events" if device.type == "cuda" else "time.perf_counter",
                     "pooling": "samples of every process pooled per backend; passed only if passed in every process"},
        "environment": environment(device),
        "shapes": shapes,
    }
    try:
        plot_speedups(data, out_dir / "bench.png")
        data["chart"] = "bench.png"
    except ImportError as exc:  # the numbers matter more than the picture
        data["chart"] = f"not drawn: matplotlib is not importable here ({exc}); pip install matplotlib"
    write_json(out_dir / "bench.json", data)
    tmp = out_dir / ".bench.md.tmp"
    tmp.write_text(markdown_table(data))
    os.replace(tmp, out_dir / "bench.md")
    return data


def geometric_mean(values: list[float]) -> float | None:
    values = [v for v in values if v and v > 0]
    return math.exp(statistics.fmean(math.log(v) for v in values)) if values else None

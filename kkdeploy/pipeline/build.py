"""`kkdeploy build`: export -> build candidates -> validate every element -> time -> choose -> write.

Everything is written into a staging directory and renamed into place only once the manifest
is complete (``artifacts.staged_directory``), so an interrupted build leaves nothing that
claims a pass. Every candidate's fate, including "unavailable" with the exact reason, is recorded.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engines import BuildContext, CandidateResult, get_backend, registry
from engines.base import close_all
from validation.strict import DEFAULT_CONTRACT
from validation.trials import DEFAULT_PADDING_RATIO

from .. import artifacts
from .calibration import layer_calibrator
from .chooser import FALLBACK, choose
from .timing import DEFAULT_REPEATS, DEFAULT_ROUNDS, DEFAULT_TIME_BUDGET_S, DEFAULT_WARMUPS
from ..config import TransformerConfig, dtype_name, tf32_default, tf32_mode
from ..console import console, progress_bar, table
from ..errors import KKError
from ..inputs import DEFAULT_SEED, DEFAULT_TRIALS, TIMED_SEED_OFFSET, generate_case
from ..models.weights import build_models, weights_sha256
from ..status import BUILD_FAILED, BUILT, FAILED, PASSED, PASSED_ALL_VALID_ONLY, SKIPPED, UNAVAILABLE

FALLBACK_SDPA_LAYERS = (1, 0)  # calibrated: the most fused attention that still passes
# Exporter defaults per device. On the H200 (FP16, ORT 1.31 CUDA EP) a Linear written as an FP32
# MatMul + FP32 bias Add had the fewest strict failures of every variant (shape 2: 4 vs 129 for Gemm;
# docs/results.md); on the CPU every variant passes in FP32, and Gemm is the compact graph.
DEFAULT_EXPORT_OPTIONS = {"cpu": {}, "cuda": {"linear": "fp32"}}


@dataclass
class BuildRequest:
    config: TransformerConfig
    dtype: torch.dtype
    device: torch.device
    out: Path
    shape_id: int | None = None
    backends: list[str] | None = None
    weights: str | None = None
    force: bool = False
    seed: int = DEFAULT_SEED
    trials: int = DEFAULT_TRIALS
    padding_ratio: float = DEFAULT_PADDING_RATIO
    contract: str = DEFAULT_CONTRACT
    warmups: int = DEFAULT_WARMUPS
    repeats: int = DEFAULT_REPEATS
    rounds: int = DEFAULT_ROUNDS
    time_budget_s: float | None = DEFAULT_TIME_BUDGET_S  # timing.race_latency; None or 0: the full protocol
    tf32: bool | None = None  # None: config.tf32_default (on for float32 CUDA under the judge contract)
    options: dict = field(default_factory=dict)  # backend/exporter options, recorded in the manifest
    probe_timeout_s: float | None = None  # fresh-process load check; None: engines.fresh_process.DEFAULT_TIMEOUT_S
    batch_buckets: list[int] | None = None  # smaller batch sizes built and validated beside B


def default_out_dir(shape_id: int | None, config: TransformerConfig, dtype: torch.dtype, device: torch.device) -> Path:
    name = f"shape-{shape_id:02d}" if shape_id is not None else (
        f"custom-b{config.batch_size}-s{config.seq_len}-d{config.d_model}-h{config.num_heads}"
        f"-f{config.ffn_dim}-l{config.num_layers}{'' if config.causal else '-nc'}")
    return Path("artifacts") / f"{name}-{dtype_name(dtype)}-{device.type}"


def __getattr__(name: str):
    """The backend tables, derived from the backends' descriptors (``engines.registry``) when read:
    ``BACKEND_CHOICES`` (--backends name -> (backend key, candidate filter)), ``RECIPE_BACKEND_KEYS`` (recipe
    backend name -> backend key), ``DEFAULT_BACKENDS`` (device type -> what a build without --backends asks for)
    and ``ONNX_BACKENDS`` (backend keys that build from the exported graph)."""
    if name == "BACKEND_CHOICES":
        return registry.backend_choices()
    if name == "RECIPE_BACKEND_KEYS":
        return registry.recipe_backend_keys()
    if name == "DEFAULT_BACKENDS":
        return {device_type: registry.default_choices(device_type) for device_type in ("cpu", "cuda")}
    if name == "ONNX_BACKENDS":
        return registry.onnx_backends()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def backend_choice(name: str) -> tuple[str, list[str] | None, list[str] | None]:
    """A --backends entry -> (backend key, candidate filter, exact candidates). A backend's own ``--backends`` name
    (``engines.registry.BackendChoice``) builds its variants or its defaults; any other candidate name
    (``engines.recipe`` grammar, e.g. ``inductor-sdpa1``) builds exactly that candidate."""
    found = registry.choice(name)
    if found is not None:
        descriptor, option = found
        return descriptor.key, None if option.variants is None else list(option.variants), None
    from engines.recipe import parse

    try:
        recipe = parse(name)
    except KKError:
        raise KKError(f"unknown backend {name!r}; choose from {', '.join(registry.choice_names())} or name one "
                      f"candidate such as inductor-sdpa1 or torch-compile-faithful-attention") from None
    return registry.recipe_backends()[recipe.backend].key, None, [name]


def device_choices(name: str, device: torch.device) -> list[str] | None:
    """A backend's own name (``ort``, as ``kkdeploy env`` lists it) where it is not itself a ``--backends`` name ->
    its choices for this device (``ort-cpu`` on a CPU, ``ort-cuda`` on a GPU); None for any other name."""
    if registry.choice(name) is not None:
        return None
    for desc in registry.DESCRIPTORS.values():
        if name == desc.recipe_name:
            here = [option.name for option in desc.choices if device.type in option.default_on]
            if not here:
                raise KKError(f"backend {name!r} has no choice for a {device.type} device; name one of "
                              f"{', '.join(option.name for option in desc.choices)}")
            return here
    return None


def parse_backends(text: str | None, device: torch.device) -> list[str]:
    """``--backends`` -> the names a build asks for: a backend's own name stands for its choices on this device."""
    if not text:
        return registry.default_choices(device.type)
    names = []
    for name in (n.strip() for n in text.split(",") if n.strip()):
        for chosen in device_choices(name, device) or [name]:
            backend_choice(chosen)
            if chosen not in names:
                names.append(chosen)
    return names


class TrialProgress:
    """Shows validation trials inside the build's single progress bar."""

    def __init__(self, bar, total: int):
        self.bar, self.total, self.done, self.text = bar, total, 0, "validate"

    def describe(self, text: str) -> None:
        self.text = text
        self.bar.describe(f"{text} [{self.done}/{self.total}]")

    def advance(self) -> None:
        self.done += 1
        self.bar.describe(f"{self.text} [{self.done}/{self.total}]")


class EagerTwinCheck:
    """Decides, before anything is compiled, the candidates whose verdict their eager twin already gives.

    A ``-sdpa<k>`` candidate of a backend that holds eager's rounding (a CUDA-graph replay, a faithful compile)
    computes the bits of the eager model with SDPA in its last k blocks, and the build validates that model anyway:
    it is the fallback ``pytorch-sdpa<k>``. When the twin fails the first all-valid trial, the candidate cannot pass,
    so it is skipped rather than compiled. On shape 6 (H100) ``torch-compile-sdpa1`` took 5.3 s to compile, and then
    it and ``torch-graph-sdpa1`` failed with the twin's count of elements. One all-valid trial is decided lazily,
    the first time such a candidate comes up; where the twin passes, the candidate is built and validated as before.
    """

    HOLDS_EAGER_ROUNDING = ("torch-graph", "torch-compile", "inductor")

    def __init__(self, request: BuildRequest, reference, twins: dict):
        self.request, self.reference, self.twins = request, reference, twins
        self.verdicts: dict[int, str | None] = {}

    def refusal(self, name: str) -> str | None:
        """Why ``name`` is not built (its twin failed), or None."""
        from engines.recipe import parse

        try:
            recipe = parse(name)
        except KKError:
            return None
        k = recipe.sdpa_layers
        if (recipe.backend not in self.HOLDS_EAGER_ROUNDING or recipe.attention != "sdpa-last"
                or recipe.precision != "model" or k not in self.twins):
            return None
        if k not in self.verdicts:
            self.verdicts[k] = self._check(k)
        return self.verdicts[k]

    def _check(self, k: int) -> str | None:
        from validation.trials import ALL_VALID
        from validation.validator import validate_candidates

        twin = f"{FALLBACK}-sdpa{k}"
        r = self.request
        with torch.inference_mode():
            report = validate_candidates(self.reference, {twin: self.twins[k]}, r.config, r.dtype, r.device,
                                         seed=r.seed, trials=1, padding_ratio=r.padding_ratio, contract=r.contract,
                                         modes=(ALL_VALID,), stop_after_failure=True)
        verdict = report.candidates[twin]
        if verdict.status != FAILED:
            return None
        failed = verdict.failed_elements(ALL_VALID)
        what = f"{failed} failed elements" if failed else "an error"
        return (f"skipped: its eager twin {twin} failed ({what} on the first all-valid trial); "
                "it computes the twin's bits")


def build_candidates(request: BuildRequest, ctx: BuildContext, bar,
                     twins: EagerTwinCheck | None = None) -> list[CandidateResult]:
    """Build every requested candidate; failures and absences become recorded statuses. ``twins`` skips the
    candidates whose eager twin has already failed (``EagerTwinCheck``)."""
    results: list[CandidateResult] = []
    for user_name in request.backends:
        key, only, exact = backend_choice(user_name)
        bar.describe(f"build {user_name}")
        ctx.progress = lambda text, user_name=user_name: bar.describe(f"build {user_name}: {text}")
        try:
            backend = get_backend(key)
        except ImportError as exc:
            results.append(CandidateResult(user_name, key, UNAVAILABLE, f"unavailable: {exc}"))
            bar.advance()
            continue
        reason = backend.unavailable_reason(request.device, request.dtype)
        if reason is None and registry.descriptor(key).needs_onnx and ctx.onnx_path is None:
            reason = "skipped: the ONNX export did not run"
        if reason is not None:
            results.append(CandidateResult(user_name, key, UNAVAILABLE if reason.startswith("unavailable") else SKIPPED,
                                           reason))
            bar.advance()
            continue
        # None: the backend's defaults, not what an earlier choice of the same backend restricted it to
        ctx.candidate_filter = None if only is None else tuple(only)
        for name in exact if exact is not None else backend.candidates(ctx):
            if any(r.name == name for r in results):  # two choices naming one variant build it once
                continue
            refusal = twins.refusal(name) if twins is not None else None
            if refusal is not None:
                results.append(CandidateResult(name, key, SKIPPED, refusal))
                continue
            try:
                results.append(backend.build(ctx, name))
            except Exception as exc:  # a failed build is a recorded fact, not a crash
                results.append(CandidateResult(name, key, BUILD_FAILED, f"build failed: {type(exc).__name__}: {exc}"))
        bar.advance()
    return results


def probe_fresh_processes(request: BuildRequest, stage: Path, results: list[CandidateResult], bar) -> None:
    """Load and call every candidate whose loader runs native code in a spawned child first.

    A crash, a hang or an error there becomes the candidate's status and it is never loaded here; the
    child's output fingerprint is kept so that ``load_runners`` can check this process computes the same."""
    from engines import backend_module
    from engines.base import fingerprint_padding
    from engines.fresh_process import DEFAULT_TIMEOUT_S, probe

    for result in results:
        if result.status != BUILT or not get_backend(result.backend).loads_native_code(result.to_dict()):
            continue
        bar.describe(f"load {result.name} in a fresh process")
        ratios = fingerprint_padding(result.options.get("all_valid_only"))
        outcome = probe(backend_module(result.backend), stage, result.to_dict(), request.config, request.dtype,
                        request.device, tf32=bool(request.tf32), padding_ratios=ratios,
                        timeout_s=request.probe_timeout_s or DEFAULT_TIMEOUT_S)
        result.fresh_process = {**outcome.to_dict(), "padding_ratios": list(ratios)}
        if not outcome.ok:
            result.status, result.reason = outcome.status, outcome.reason


def load_runners(request: BuildRequest, stage: Path, results: list[CandidateResult], built: dict | None = None) -> dict:
    """Load every built candidate here, or take the runner its builder compiled (``built``, by name: a compiled
    graph is not compiled a second time; every later load checks the artifact reproduces its recorded output); one
    that was probed must compute here what it computed there."""
    from engines.base import output_fingerprint

    built = built if built is not None else {}
    runners = {}
    for result in results:
        if result.status != BUILT:
            if result.name in built:
                built.pop(result.name).close()
            continue
        if result.name in built:
            runner = built.pop(result.name)
        else:
            try:
                runner = get_backend(result.backend).load(stage, result.to_dict(), request.config, request.dtype,
                                                          request.device)
            except Exception as exc:
                result.status, result.reason = BUILD_FAILED, f"load failed: {type(exc).__name__}: {exc}"
                continue
        probed = result.fresh_process
        if probed and output_fingerprint(runner, request.config, request.dtype, request.device,
                                         padding_ratios=probed["padding_ratios"]) != probed["fingerprint"]:
            result.status = FAILED
            result.reason = "its output in a fresh process differs from its output in the build's process"
            runner.close()
            continue
        runners[result.name] = runner
    for runner in built.values():  # handed over under a name no result carries: nothing validates it
        runner.close()
    built.clear()
    return runners


def time_contenders(request: BuildRequest, contenders: dict) -> tuple[dict, dict]:
    """The organizer's timing protocol on the timed input (seed + 100000, all-valid), held to the request's time
    budget (``timing.race_latency``): ``(latency per candidate, the plan that ran)``."""
    from .timing import race_latency

    x, mask = generate_case(request.config, request.device, request.dtype, request.seed + TIMED_SEED_OFFSET)
    with torch.inference_mode():
        calls = {name: (lambda r=runner: r(x, mask)) for name, runner in contenders.items()}
        stats, plan = race_latency(calls, request.device, warmups=request.warmups, repeats=request.repeats,
                                   rounds=request.rounds, budget_s=request.time_budget_s)
    return {name: s.to_dict() for name, s in stats.items()}, plan.to_dict()


BUCKETS_DIR = "buckets"


def parse_batch_buckets(text: str | None, batch: int) -> list[int] | None:
    """``--batch-buckets 1,2,4`` -> the sorted sizes, the artifact's batch B always the largest; None if absent.

    B itself is the artifact's top level (its own build); the smaller sizes are built beside it."""
    if text is None:
        return None
    try:
        sizes = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise KKError(f"--batch-buckets takes batch sizes separated by commas, such as 1,2,4; got {text!r}") from None
    if not sizes or sizes[0] < 1:
        raise KKError(f"--batch-buckets sizes must be positive integers, such as 1,2,4; got {text!r}")
    if sizes[-1] > batch:
        raise KKError(f"--batch-buckets {sizes[-1]} exceeds the artifact's batch {batch}; raise --batch-size or "
                      f"drop the larger sizes")
    return sorted(set(sizes) | {batch})


def bucket_dir(batch: int) -> str:
    return f"{BUCKETS_DIR}/b{batch}"


def run_build(request: BuildRequest) -> dict:
    """The whole pipeline; returns the manifest written to ``request.out``.

    With ``batch_buckets``, each smaller size is a complete build of its own (candidates, fresh-process probes,
    validation at that batch, timing, choice) written to ``buckets/b<N>/`` inside the same staging directory, so
    every bucket passes the strict gate on its own and the whole set is renamed into place at once."""
    if request.batch_buckets:
        request.batch_buckets = parse_batch_buckets(",".join(map(str, request.batch_buckets)),
                                                    request.config.batch_size)
    with artifacts.staged_directory(request.out, force=request.force) as stage:
        buckets = []
        for size in (request.batch_buckets or [])[:-1]:
            from dataclasses import replace

            console.print(f"[bold]bucket[/] batch {size} of {request.config.batch_size}")
            sub = replace(request, config=replace(request.config, batch_size=size), batch_buckets=None,
                          backends=list(request.backends) if request.backends else None,
                          options=dict(request.options))
            manifest = build_into(sub, stage / bucket_dir(size))
            buckets.append((size, bucket_dir(size), manifest))
        manifest = build_into(request, stage, buckets)
    return manifest


def bucket_record(size: int, rel: str, manifest: dict, stage: Path) -> dict:
    """One bucket in the top manifest: where it is, what it shipped, its verdict and its latency."""
    choice = manifest["choice"]
    chosen = next((c for c in manifest["candidates"] if c["name"] == choice["candidate"]), None)
    verdict = (chosen or {}).get("validation") or manifest["fallback"].get("validation") or {}
    latency = (chosen or {}).get("latency") or manifest["fallback"].get("latency") or {}
    record = {"batch": size, "dir": rel, "candidate": choice["candidate"], "backend": choice.get("backend"),
              "all_valid_only": bool(choice.get("all_valid_only")), "status": verdict.get("status"),
              "failed_elements": verdict.get("failed_elements"), "median_ms": latency.get("median_ms"),
              "weights_sha256": manifest["weights"]["sha256"]}
    if rel != ".":
        record["manifest_sha256"] = artifacts.file_sha256(stage / rel / artifacts.MANIFEST)
    return record


def build_into(request: BuildRequest, stage: Path, buckets: list | None = None) -> dict:
    """Build, validate, time and choose into ``stage`` (created here); returns the manifest written there."""
    from validation import contract as contract_tolerances
    from validation.validator import validate_candidates

    stage.mkdir(parents=True, exist_ok=True)
    atol, rtol = contract_tolerances(request.contract)
    request.backends = request.backends or registry.default_choices(request.device.type)
    request.tf32 = tf32_default(request.device, request.dtype, request.contract, request.tf32)
    # Precision repair: a float32 build under the judge contract also builds "-mixed" candidates
    # whose float16 blocks are calibrated on this build's own trial plan. Checked before anything is written.
    if request.options.get("mixed_precision") is None:
        request.options["mixed_precision"] = request.dtype == torch.float32 and request.contract == "judge"
    elif request.options["mixed_precision"] and request.dtype != torch.float32:
        raise KKError("--mixed-precision applies to float32 builds (a float16 build is float16 throughout); "
                      "drop it or use --dtype float32")
    started = time.perf_counter()
    stages = StageTimes()
    # The reference, every candidate and the timing run under one TF32 setting, recorded for kkdeploy.load.
    with tf32_mode(request.tf32):
        steps = 5 + len(request.backends)
        with progress_bar("build", steps) as bar:
            bar.describe("load weights")
            fallbacks = {}
            reference, _ = build_models(request.config, request.dtype, request.device, weights=request.weights,
                                        sdpa_layers=0)
            for k in FALLBACK_SDPA_LAYERS:
                fallbacks[k] = build_models(request.config, request.dtype, request.device, weights=request.weights,
                                            sdpa_layers=k)[1]
            from safetensors.torch import save_file

            save_file({k: v.detach().cpu().contiguous() for k, v in reference.state_dict().items()},
                      str(stage / artifacts.WEIGHTS_FILE))
            stages.mark("weights")
            bar.advance()

            bar.describe("export ONNX")
            ctx = BuildContext(request.config, request.dtype, request.device, reference, stage,
                               options=dict(request.options))
            ctx.validation_plan = {"contract": request.contract, "seed": request.seed, "trials": request.trials,
                                   "padding_ratio": request.padding_ratio}
            ctx.calibrate = layer_calibrator(reference, ctx.validation_plan)
            export_info = export_if_needed(request, reference, stage, ctx)
            stages.mark("export")
            bar.advance()

            ctx.built_runners = {}  # compiled runners the builders hand over: validated as they are, not reloaded
            results = build_candidates(request, ctx, bar, EagerTwinCheck(request, reference, fallbacks))
            stages.mark("candidates")
            probe_fresh_processes(request, stage, results, bar)
            stages.mark("fresh processes")
            runners = load_runners(request, stage, results, ctx.built_runners)
            stages.mark("load")

            bar.describe("validate")
            all_valid_only = {r.name for r in results if r.options.get("all_valid_only") and r.name in runners}
            fallback_names = {f"{FALLBACK}-sdpa{k}": model for k, model in fallbacks.items()}
            with torch.inference_mode():
                report = validate_candidates(
                    reference, {**runners, **fallback_names}, request.config, request.dtype, request.device,
                    seed=request.seed, trials=request.trials, padding_ratio=request.padding_ratio,
                    contract=request.contract, all_valid_only=all_valid_only,
                    progress=TrialProgress(bar, 2 * request.trials), stop_after_failure=True)
            report.write_json(stage / "validation.json")
            for result in results:
                if result.name in runners:
                    result.status = report.status(result.name)
                    if result.status == FAILED:
                        result.reason = report.reason(result.name)
            sdpa_layers = next(k for k in FALLBACK_SDPA_LAYERS
                               if report.status(f"{FALLBACK}-sdpa{k}") == PASSED or k == 0)
            stages.mark("validate")
            bar.advance()

            bar.describe("time")
            passing = {r.name: runners[r.name] for r in results if r.status in (PASSED, PASSED_ALL_VALID_ONLY)}
            latencies, timing = time_contenders(request, {**passing, FALLBACK: fallbacks[sdpa_layers]})
            medians = {n: s["median_ms"] for n, s in latencies.items()}
            choice = choose([r.to_dict() for r in results], medians, medians.get(FALLBACK))
            stages.mark("time")
            bar.advance()

            bar.describe("write")
            close_all(runners.values())  # the engines, in the order they were loaded, before anything is written
            del runners, passing
            artifacts.write_json(stage / "bench.json", {"protocol": {"warmups": request.warmups,
                                                                    "repeats": request.repeats,
                                                                    "rounds": request.rounds,
                                                                    "timed_seed": request.seed + TIMED_SEED_OFFSET,
                                                                    "timing": timing},
                                                       "latency": latencies})
            plot_latency(stage / "latency.png", latencies, choice["candidate"])
            stages.mark("write")
            manifest = make_manifest(request, reference, results, report, latencies, choice, sdpa_layers,
                                     export_info, stage, atol, rtol, time.perf_counter() - started)
            manifest["build_stages"] = stages.seconds
            manifest["timing"] = timing
            if buckets:
                top = [*buckets, (request.config.batch_size, ".", manifest)]
                records = [bucket_record(size, rel, m, stage) for size, rel, m in top]
                if len({r["weights_sha256"] for r in records}) != 1:
                    raise KKError("the batch buckets were built with different weights; rebuild with --weights FILE")
                manifest["batch_buckets"] = {"sizes": [r["batch"] for r in records], "buckets": records}
            artifacts.write_json(stage / artifacts.MANIFEST, manifest)
            bar.advance()
    return manifest


def export_if_needed(request: BuildRequest, reference, stage: Path, ctx: BuildContext) -> dict | None:
    if not any(registry.descriptor(backend_choice(b)[0]).needs_onnx for b in request.backends):
        return None
    from exporters import ExportOptions, export_onnx

    options = ExportOptions.from_dict({**DEFAULT_EXPORT_OPTIONS[request.device.type],
                                       **request.options.get("export", {})})
    info = export_onnx(reference, request.config, request.dtype, stage / "model.onnx", options)
    artifacts.write_json(stage / "export.json", info)
    ctx.onnx_path = stage / "model.onnx"
    ctx.export_options = options
    return info


class StageTimes:
    """Seconds per build stage, in order (``manifest["build_stages"]``): where a slow build spends its time.
    ``mark(name)`` closes the stage that ran since the previous mark."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = round(self.seconds.get(name, 0.0) + now - self._last, 2)
        self._last = now


def stages_line(manifest: dict) -> str | None:
    """``build 62.3 s: weights 1.2, export 3.4, candidates 40.1 (the slowest: name 12.3, ...), ...``, or None for a
    manifest without stage times."""
    stages = manifest.get("build_stages")
    if not stages:
        return None
    parts = []
    for name, seconds in stages.items():
        text = f"{name} {seconds:.1f}"
        if name == "candidates":
            slow = sorted(((c.get("build_seconds") or 0.0, c["name"]) for c in manifest.get("candidates", [])),
                          reverse=True)[:3]
            slow = [f"{n} {t:.1f}" for t, n in slow if t >= 0.05]
            if slow:
                text += f" (the slowest: {', '.join(slow)})"
            proof = proof_phases_text(manifest)
            if proof:
                text += f", of which {proof}"
        parts.append(text)
    return f"build {manifest.get('build_seconds', sum(stages.values())):.1f} s: " + ", ".join(parts)


def proof_phases_text(manifest: dict) -> str | None:
    """``the kernel proof 14.3 (cases 1.2, compile 7.1, prove 6.0)``: the proof step that ran (the candidate that
    proved for its siblings), or None where no proof ran here."""
    for candidate in manifest.get("candidates", []):
        options = candidate.get("options") or {}
        phases, seconds = options.get("proof_phases"), options.get("proof_seconds")
        if phases and seconds:
            return f"the kernel proof {seconds:.1f} (" + ", ".join(f"{k} {v:.1f}" for k, v in phases.items()) + ")"
    return None


def timing_line(manifest: dict) -> str | None:
    """What the time budget cut from the timing protocol (``timing.TimingPlan.describe``), or None."""
    from .timing import TimingPlan

    plan = manifest.get("timing")
    if not plan:
        return None
    return TimingPlan(**plan).describe() or None


def make_manifest(request, reference, results, report, latencies, choice, sdpa_layers, export_info, stage,
                  atol, rtol, seconds) -> dict:
    candidates = []
    for r in results:
        entry = r.to_dict()
        if r.name in report.candidates:
            entry["validation"] = validation_summary(report, r.name)
        if r.name in latencies:
            entry["latency"] = latencies[r.name]
        candidates.append(entry)
    fallback_name = f"{FALLBACK}-sdpa{sdpa_layers}"
    return {
        "schema": artifacts.MANIFEST_SCHEMA,
        "created": artifacts.utc_now(),
        "build_seconds": round(seconds, 2),
        "shape_id": request.shape_id,
        "config": request.config.to_dict(),
        "dtype": dtype_name(request.dtype),
        "tf32": bool(request.tf32),
        "environment": artifacts.environment(request.device),
        "weights": {"file": artifacts.WEIGHTS_FILE, "sha256": weights_sha256(reference),
                    "source": request.weights or "seeded"},
        "validation": {"contract": request.contract, "atol": atol, "rtol": rtol, "seed": request.seed,
                       "trials": request.trials, "padding_ratio": request.padding_ratio,
                       "mask_modes": ["all-valid", "padded"], "report": "validation.json"},
        "export": export_info,
        "candidates": candidates,
        "fallback": {"model": "OptimizedTransformer", "sdpa_layers": sdpa_layers,
                     "validation": validation_summary(report, fallback_name),
                     "latency": latencies.get(FALLBACK)},
        "choice": choice,
        "files": artifacts.hash_tree(stage),
        "options": request.options,
    }


def validation_summary(report, name: str) -> dict:
    """The manifest's per-candidate digest of validation.json."""
    c = report.candidates[name]
    return {"status": c.status, "failed_elements": sum(c.failed_elements(m) for m in c.modes),
            "failed_by_mode": {m: c.failed_elements(m) for m in c.modes if c.mode_records(m)},
            "max_abs": c.max_abs, "max_rel": c.max_rel}


def plot_latency(path: Path, latencies: dict, chosen: str) -> None:
    """Median latency per validated option, the shipped one highlighted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted(latencies, key=lambda n: latencies[n]["median_ms"])
    values = [latencies[n]["median_ms"] for n in names]
    fig, ax = plt.subplots(figsize=(6, 0.5 + 0.45 * len(names)))
    ax.barh(names, values, color=["tab:green" if n == chosen else "tab:gray" for n in names])
    ax.set_xlabel("median latency (ms)")
    ax.set_title("validated options (green: shipped)")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


#: the summary table's reason column: longer reasons are cut there and printed whole below it (``full_reasons``)
REASON_CHARS = 70


def full_reasons(manifest: dict) -> list[str]:
    """"name: reason" for every candidate whose reason the table cut: a failed proof names its part and element
    count only at the end of the sentence."""
    return [f"{c['name']}: {c['reason']}" for c in manifest["candidates"]
            if c["status"] not in (PASSED, "fallback") and len(c.get("reason") or "") > REASON_CHARS]


def summary_table(manifest: dict):
    rows = []
    chosen = manifest["choice"]["candidate"]
    for c in manifest["candidates"] + [{"name": FALLBACK, "status": "fallback", **manifest["fallback"]}]:
        v = c.get("validation") or c  # long-context entries carry their counts at top level
        lat = c.get("latency") or {}
        rows.append([
            c["name"] + precision_label(c.get("options") or {}), recipe_label(c["name"]), c["status"],
            v.get("failed_elements", "-"), _fmt(v.get("max_abs")),
            f"{lat['median_ms']:.3f}" if lat else "-",
            "yes" if c["name"] == chosen else "",
            (c.get("reason") or "")[:REASON_CHARS] if c["status"] not in (PASSED, "fallback") else "",
        ])
    return table("Candidates", ["candidate", "recipe", "status", "failed elements", "max abs", "median ms", "chosen",
                                "reason"], rows)


def recipe_label(name: str) -> str:
    """The recipe's fields (attention, precision, capture) for a candidate name; '-' outside the grammar."""
    from engines.recipe import parse

    try:
        return parse(name).describe()
    except KKError:
        return "-"


def precision_label(options: dict) -> str:
    """How much runs in float16: ' (fp16 blocks [2, 3], 84/128 fp16 nodes)' for our calibrated ONNX
    candidates, ' (116/128 fp16 nodes)' for AutoCast's; blocks alone where no graph was counted."""
    layers, nodes = options.get("fp16_layers"), options.get("fp16_nodes")
    parts = ([f"fp16 blocks {layers}"] if layers is not None else []) + (
        [f"{nodes[0]}/{nodes[1]} fp16 nodes"] if nodes else [])
    return f" ({', '.join(parts)})" if parts else ""


def _fmt(v) -> str:
    return "-" if v is None else (f"{v:.3g}" if isinstance(v, float) else str(v))


def proofs_table(manifest: dict):
    """One row per kernel op shape the build proved (``kernel_proofs`` of its our-kernel candidates, ``custom_op_proofs``
    of its ORT candidates with custom ops), or None."""
    from kkdeploy.kernels.proof import ProofRecord

    seen, rows, timers = set(), [], set()
    for candidate in manifest.get("candidates", []):
        options = candidate.get("options") or {}
        for data in [*(options.get("kernel_proofs") or []), *(options.get("custom_op_proofs") or [])]:
            record = ProofRecord.from_dict(data)
            if (record.op, record.shape_text) in seen:
                continue
            seen.add((record.op, record.shape_text))
            timers.add(record.timer)
            fallback = "none (candidate skipped)" if record.op.startswith("custom-op") else "aten"
            rows.append([record.op, record.shape_text, record.chosen or fallback,
                         "-" if record.chosen_ms is None else f"{record.chosen_ms:.4f}",
                         "-" if record.reference_ms is None else f"{record.reference_ms:.4f}", f"{record.seconds:.2f}"])
    if not rows:
        return None
    return table(f"Kernel proofs (bit-identical launches; timing: {', '.join(sorted(timers))})",
                 ["op", "shape", "runs", "ours ms", "ATen ms", "proof s"], rows)


def print_summary(manifest: dict, out: Path) -> None:
    console.print(summary_table(manifest))
    reasons = full_reasons(manifest)
    if reasons:
        console.print("why, in full:\n" + "\n".join(f"  {line}" for line in reasons), soft_wrap=True, markup=False,
                      highlight=False)
    proofs = proofs_table(manifest)
    if proofs is not None:
        console.print(proofs)
    choice = manifest["choice"]
    console.print(f"shipped: [bold]{choice['candidate']}[/] — {choice['reason']}", soft_wrap=True)
    timing = stages_line(manifest)
    if timing:
        console.print(timing, soft_wrap=True)
    cut = timing_line(manifest)
    if cut:
        console.print(cut, soft_wrap=True)
    buckets = (manifest.get("batch_buckets") or {}).get("buckets")
    if buckets:
        rows = [[b["batch"], b["dir"], b["candidate"], b["status"], b["failed_elements"],
                 "-" if b["median_ms"] is None else f"{b['median_ms']:.3f}",
                 "-" if b["median_ms"] is None else f"{b['median_ms'] / b['batch']:.3f}"] for b in buckets]
        console.print(table("Batch buckets (each validated on its own)", ["batch", "dir", "shipped", "status",
                                                                         "failed elements", "median ms",
                                                                         "ms per sequence"], rows))
    names = sorted({rel.split("/")[0] + ("/" if "/" in rel else "") for rel in manifest.get("files", {})})
    console.print(f"artifacts: {out}  ({', '.join(names)})", soft_wrap=True)

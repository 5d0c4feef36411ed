"""The contract every backend meets: a lazy builder and a runner with the model's call signature.

A backend module exposes one ``Backend`` subclass. ``unavailable_reason`` answers, without
raising, why the backend cannot run here (a missing optional import gives its exact error).
``build`` writes the backend's files into the (staging) artifact directory and returns a
``CandidateResult``; ``load`` turns those files back into a ``Runner``.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from kkdeploy.config import TransformerConfig
from kkdeploy.errors import KKError
from kkdeploy.inputs import DEFAULT_SEED, AllValidMaskCache, check_inputs, padded_case
from kkdeploy.status import (BUILD_FAILED, BUILT, FAILED, PASSED, PASSED_ALL_VALID_ONLY, SKIPPED,  # noqa: F401
                             UNAVAILABLE, UNVALIDATED)  # the builders' vocabulary, importable from here as before


class CandidateSkipped(KKError):
    """Raised by a builder for a candidate that would add nothing here (e.g. its kernels are not proven on this
    machine): recorded as ``skipped`` with the message, not as a failure."""


@dataclass
class BuildContext:
    """Everything a builder may need; ``out_dir`` is the staging directory being written."""

    config: TransformerConfig
    dtype: torch.dtype
    device: torch.device
    model: torch.nn.Module  # the reference model, weights loaded, on ``device`` in ``dtype``
    out_dir: Path
    onnx_path: Path | None = None  # the exported graph inside out_dir, when the exporter ran
    export_options: Any = None  # the ExportOptions behind onnx_path (mixed-precision candidates re-export)
    validation_plan: dict[str, Any] = field(default_factory=dict)  # contract, seed, trials, padding_ratio
    options: dict[str, Any] = field(default_factory=dict)
    # The variants a --backends choice restricts this backend to (``engines.registry.BackendChoice.variants``, such
    # as torch-compile-fused's); None: the backend's defaults for this context.
    candidate_filter: tuple[str, ...] | None = None
    # The precision search over float16 block sets, ``calibrate(runner_for_layers) -> record``. It is validation run
    # once per set, so the pipeline supplies it (``kkdeploy.pipeline.calibration.layer_calibrator``); an engine only
    # says how to build the runner for one set, and engines never import validation.
    calibrate: Callable[[Callable[[tuple[int, ...]], Any]], dict] | None = None
    # The custom-op library's proof records (``engines.custom_op_proof``, ``ProofRecord``s), made once per build by
    # the first ORT candidate that needs them and shared by the others.
    custom_op_proofs: list | None = None
    # Where a builder may leave the runner it compiled, by candidate name, for the pipeline to validate and time
    # instead of loading the artifact again; None: a builder closes what it compiled (``keep_or_close``).
    built_runners: dict[str, Any] | None = None
    # What a builder reports while it works (the proof step's op shapes, as they are proven); the pipeline shows it
    # on the build's progress bar. None: nobody is watching.
    progress: Callable[[str], None] | None = None

    def keep_or_close(self, name: str, runner) -> None:
        """Hand ``runner`` (compiled for candidate ``name``) to the pipeline where it takes it, else close it now."""
        if self.built_runners is None:
            runner.close()
        else:
            self.built_runners[name] = runner

    def calibrate_layers(self, runner_for_layers: Callable[[tuple[int, ...]], Any]) -> dict:
        """The calibration record of ``runner_for_layers`` (``calibrate``'s), or a one-line KKError without one."""
        if self.calibrate is None:
            raise KKError("float16 blocks are calibrated by the build pipeline (kkdeploy build), which this "
                          "context did not come from; pass BuildContext(calibrate=...)")
        return self.calibrate(runner_for_layers)


@dataclass
class CandidateResult:
    name: str  # unique candidate name, e.g. "ort-cpu", "ort-cuda-graph", "trt", "torch-graph"
    backend: str  # module that can load it, e.g. "ort", "trt", "torch_graph", "inductor"
    status: str
    reason: str = ""
    files: list[str] = field(default_factory=list)  # relative to the artifact directory
    options: dict[str, Any] = field(default_factory=dict)  # everything needed to load it again
    build_seconds: float = 0.0
    fresh_process: dict[str, Any] = field(default_factory=dict)  # engines.fresh_process's record, when probed

    def to_dict(self) -> dict:
        """The manifest entry: the result plus the recipe its name stands for (``engines.recipe``)."""
        from .recipe import recipe_record

        return {**asdict(self), "recipe": recipe_record(self.name)}


class Runner:
    """``runner(x, valid_token_mask=None) -> y``: torch in, torch out, on the runner's device.

    The caller owns every output: a later call never overwrites an earlier result.
    Subclasses implement ``infer(x, mask)`` with a bool mask always given.

    A runner holds what it runs: a session, an engine and its execution context, compiled graphs, CUDA-graph
    captures and the model whose memory they read. ``close()`` releases them now, in the order they depend on
    each other, instead of whenever the garbage collector gets to them (GPU memory is what a build or a server
    runs out of); ``with runner:`` closes on exit. Subclasses name what they hold in ``release()``.
    """

    backend = "unknown"
    reason = ""
    closed = False

    def __init__(self, config: TransformerConfig, dtype: torch.dtype, device: torch.device):
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self._all_valid: torch.Tensor | None = None

    def full_mask(self) -> torch.Tensor:
        if self._all_valid is None:
            with torch.inference_mode(False):  # a normal tensor, so AllValidMaskCache can remember it (no sync per call)
                self._all_valid = torch.ones(self.config.batch_size, self.config.seq_len, dtype=torch.bool,
                                             device=self.device)
        return self._all_valid

    def __call__(self, x: torch.Tensor, valid_token_mask: torch.Tensor | None = None) -> torch.Tensor:
        check_inputs(x, valid_token_mask, self.config.d_model, self.dtype, self.device,
                     shape=(self.config.batch_size, self.config.seq_len))
        mask = self.full_mask() if valid_token_mask is None else valid_token_mask
        return self.infer(x, mask)

    def infer(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def close(self) -> None:
        """Release what this runner holds (``release``); a second call does nothing. A closed runner refuses
        every call, ``infer`` included (a router holding it gets the same one-line error)."""
        if self.closed:
            return
        self.closed = True
        self.infer = refusal(self.backend)
        self._all_valid = None
        self.release()

    def release(self) -> None:
        """Drop the references to what this runner holds, dependents first; each runner names its own."""

    def static_call(self):
        """``engines.cuda_graph.StaticCall`` (the captured graph's input buffers and its replay) for a server that
        writes its inputs in place, or None: this runner has no capture that serves every mask."""
        return None

    def __enter__(self) -> "Runner":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def refusal(backend: str):
    """What a closed runner's ``infer`` becomes (it holds no reference to the runner)."""
    def closed(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        raise KKError(f"the {backend} runner is closed; load the artifacts again to serve with it")

    return closed


def close_all(runners: Iterable) -> None:
    """Close each runner in the order given; what has no ``close`` (a plain PyTorch model) is left to the
    garbage collector."""
    for runner in runners:
        close = getattr(runner, "close", None)
        if callable(close):
            close()


class ModuleRunner(Runner):
    """A PyTorch model as a runner, for a router's route that no engine serves (``kkdeploy.load``'s fallback).

    Its call is the model's own, under ``no_grad``: the model checks its inputs and takes what it takes (the
    long-context model serves other batch sizes and lengths than its config's), and a None mask."""

    def __init__(self, model: torch.nn.Module, backend: str = "pytorch"):
        super().__init__(model.config, model.dtype, model.device)
        self.model = model
        self.backend = backend

    def __call__(self, x: torch.Tensor, valid_token_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.infer(x, valid_token_mask)

    def infer(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        with torch.no_grad():
            return self.model(x, mask)

    def release(self) -> None:
        self.model = None


class AllValidRouter(Runner):
    """One model as two fixed-path runners: all-valid calls take ``all_valid``, padded calls ``padded``.

    A captured or compiled graph has one path. A model whose all-valid path is faster (no mask tensor, so
    attention may use fused causal kernels) is built twice and routed here by the mask's content, one
    device sync per new mask tensor (``AllValidMaskCache``; a ``None`` mask costs none). ``all_valid`` is an
    all-valid-only runner: it gets its own full mask, so its check hits its cache and its capture copies
    no mask (as ``kkdeploy.load``'s ServedRunner does for an all-valid-only engine).
    """

    def __init__(self, all_valid: Runner, padded: Runner):
        super().__init__(padded.config, padded.dtype, padded.device)
        self.all_valid, self.padded = all_valid, padded
        self.backend = padded.backend
        self.all_valid_only = False
        self._mask_cache = AllValidMaskCache()

    def infer(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """The one place a call is routed by its mask (None counts as all valid)."""
        if self._mask_cache.is_all_valid(mask):
            return self.all_valid.infer(x, self.all_valid.full_mask())
        return self.padded.infer(x, mask)

    def release(self) -> None:
        close_all((self.all_valid, self.padded))


class Backend:
    """One backend: name, availability, builder, loader."""

    name = "base"

    def unavailable_reason(self, device: torch.device, dtype: torch.dtype) -> str | None:
        return None

    def candidates(self, ctx: BuildContext) -> list[str]:
        """Candidate names this backend would build for this context (variants of one backend)."""
        return [self.name]

    def loads_native_code(self, entry: dict) -> bool:
        """Whether loading ``entry`` runs native code that could kill the loading process (a package or plan
        deserializer, a custom-op library). Such a candidate is loaded in a fresh process first
        (``engines.fresh_process``), at build time and wherever the environment differs at load time."""
        return False

    def build(self, ctx: BuildContext, candidate: str) -> CandidateResult:  # pragma: no cover - abstract
        raise NotImplementedError

    def load(self, artifact_dir: Path, entry: dict, config: TransformerConfig, dtype: torch.dtype,
             device: torch.device) -> Runner:  # pragma: no cover - abstract
        raise NotImplementedError


def timed_build(fn, result: CandidateResult) -> CandidateResult:
    start = time.perf_counter()
    fn()
    result.build_seconds = round(time.perf_counter() - start, 3)
    return result


def requested_variants(ctx: BuildContext, option: str, default: list[str], check) -> list[str]:
    """Variant names from ``ctx.options[option]`` (a comma string or a list), each passed to ``check``
    (which raises a one-line KKError for a bad name); ``default`` when the option is absent."""
    wanted = ctx.options.get(option)
    if wanted is None:
        return list(default)
    names = [n.strip() for n in (wanted.split(",") if isinstance(wanted, str) else wanted)]
    names = [n for n in names if n]
    for name in names:
        check(name)
    return names


def import_error_reason(module: str, exc: BaseException) -> str:
    return f"unavailable: cannot import {module}: {type(exc).__name__}: {exc}"


FINGERPRINT_PADDING = (0.0, 0.25)  # the all-valid case, then a padded one: each route of a routed runner


def fingerprint_padding(all_valid_only: bool) -> tuple[float, ...]:
    """The padding ratios a runner's fingerprint covers: every route it serves, so the padded case only for a
    runner that serves padded calls."""
    return FINGERPRINT_PADDING[:1] if all_valid_only else FINGERPRINT_PADDING


def output_fingerprint(runner, config: TransformerConfig, dtype: torch.dtype, device: torch.device,
                       seed: int = DEFAULT_SEED, padding_ratios=(0.0,)) -> str:
    """sha256 of the runner's output bytes on ``seed``'s case at each padding ratio: equal hashes, equal outputs.

    A padded case takes the padded route even where the generator drew no padding (``padded_case``)."""
    digest = hashlib.sha256()
    for ratio in padding_ratios:
        x, mask = padded_case(config, device, dtype, seed, ratio)
        with torch.inference_mode():
            y = runner(x, mask)
        digest.update(y.detach().cpu().contiguous().view(torch.uint8).numpy())  # the buffer itself, not a copy
    return digest.hexdigest()

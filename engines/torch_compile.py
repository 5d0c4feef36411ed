"""In-process ``torch.compile``: the faithful Inductor graph, compiled where it serves.

The same graph as the AOTInductor package (``engines.inductor.export_variant``: the reference
exported for one fixed shape, LayerNorm / exact GELU / FP32 softmax kept as opaque ATen calls) and
the same Inductor settings (``faithful_inductor_configs``: precision-cast emulation, ATen GEMMs
with the bias inside), but compiled just-in-time by ``torch.compile`` instead of loaded from a
``.pt2`` package. That is the route design.md §6 measured bitwise on all 13 shapes, and it does not
go through the AOTInductor package loader, which has segfaulted on load in fresh processes (docs/results.md).

What the artifact holds: the weights (shared), the compile recipe in the manifest, and the
portable Inductor cache (``torch.compiler.save_cache_artifacts``) in ``<candidate>.inductor-cache``,
loaded before compiling so that serving skips code generation. Because the code is regenerated
where it is served, ``load`` ends with a self-check: the output for the build's fingerprint input
must hash to the value recorded at build time, or the candidate is refused (the caller then serves
the fallback). Variants:

  ``torch-compile``        fully faithful, all-valid and padded calls.
  ``torch-compile-sdpa1``  faithful plus packed QKV + SDPA in the last layer; all-valid calls only.
  ``torch-compile-fused``  judge contract: ``kkdeploy.models.fused`` (SDPA in every block, every mask) under
                           Inductor's own fusion; not bitwise, so validation decides.
  ``torch-compile-fused-mixed``  the same with float16 blocks calibrated on the build's trial plan
                           (float32 builds only).
  ``torch-compile-fused-half-gemm[-mixed]``  the fused model whose float32 blocks run every GEMM and
                           attention on float16 inputs with float32 accumulation: TF32's rounding points on
                           float16 tensor cores (``kkdeploy.models.fused.half_gemm``); float32 builds only.
                           The four fused variants are defaults of float32 judge builds on CUDA.

On CUDA the compiled call is captured in a CUDA graph (``engines.cuda_graph``).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import replace
from pathlib import Path

import torch

from kkdeploy.artifacts import WEIGHTS_FILE, first_difference
from kkdeploy.config import TransformerConfig, dtype_name
from kkdeploy.errors import KKError, error_summary
from kkdeploy.inputs import DEFAULT_SEED, AllValidMaskCache
from kkdeploy.kernels.dependent_launch import dependent_launches, inductor_options, refusal as pdl_refusal

from .base import (AllValidRouter, Backend, BuildContext, CandidateResult, CandidateSkipped,
                   Runner, fingerprint_padding, output_fingerprint, requested_variants)
from .cuda_graph import CapturedCall
from .recipe import Recipe, parse as parse_recipe
from .registry import BackendChoice, BackendDescriptor, register

FAITHFUL = "torch-compile"
KERNEL_ATTENTION = "torch-compile-faithful-attention"  # the faithful graph with kkdeploy.kernels' attention
KERNELS = "torch-compile-faithful-kernels"  # ... and with kkdeploy.kernels' rows LayerNorm too
GEMMS = "torch-compile-faithful-gemms"  # ... and with kkdeploy.kernels' GEMMs with fused epilogues too
OUR_KERNEL_FORMS = ("faithful-attention", "faithful-kernels", "faithful-gemms")
# fused variant -> (half_gemm, calibrated float16 blocks), names derived from their recipes (engines.recipe)
FUSED_VARIANTS = {Recipe("torch-compile", attention="fused", precision=p).name: (p.startswith("half-gemm"),
                                                                                  p.endswith("fp16-blocks"))
                  for p in ("model", "fp16-blocks", "half-gemm", "half-gemm+fp16-blocks")}
FUSED = "torch-compile-fused"
CACHE_SUFFIX = ".inductor-cache"
RECOMPILE_LIMIT = 64  # graphs per compiled code object in one process (see CompiledModuleRunner)


def inductor_variant(name: str) -> str:
    """Our candidate name -> the equivalent ``engines.inductor`` variant (same graph, same checks); the
    faithful-attention candidate exports the faithful variant with its attention cores as one kernel op."""
    recipe = parse_recipe(name)
    if recipe.backend == "torch-compile" and recipe.precision == "model":
        if recipe.attention in ("reference", "sdpa-last"):
            return replace(recipe, backend="inductor", dependent_launch=False).name
        if recipe.attention in OUR_KERNEL_FORMS:
            return "inductor"
    raise KKError(f"unknown torch-compile variant {name!r}; use {FAITHFUL}, {FAITHFUL}-sdpa<k> or {KERNEL_ATTENTION}")


def uses_kernel_attention(name: str) -> bool:
    return "attention" in kernel_kinds(name)


def uses_kernel_layer_norm(name: str) -> bool:
    return "layer_norm" in kernel_kinds(name)


def uses_kernel_linear(name: str) -> bool:
    return "linear" in kernel_kinds(name)


#: the kinds of kernel op each of our-kernel forms runs (``kkdeploy.kernels.model_proofs``), the one it adds to
#: the form below it last
KERNEL_KINDS = {"faithful-attention": ("attention",), "faithful-kernels": ("attention", "layer_norm"),
                "faithful-gemms": ("attention", "layer_norm", "linear")}
#: our-kernel form -> the form with one kernel kind fewer (a candidate's smaller sibling keeps its other fields)
SMALLER_FORM = {"faithful-kernels": "faithful-attention", "faithful-gemms": "faithful-kernels"}


def uses_dependent_launch(name: str) -> bool:
    """Whether candidate ``name`` launches its kernels as programmatic dependent launches ("-pdl")."""
    return parse_recipe(name).dependent_launch


def dependent_launch_refusal(name: str, device: torch.device) -> str | None:
    """Why candidate ``name`` cannot run here because of its "-pdl" (one line naming its plain form), or None."""
    if not uses_dependent_launch(name):
        return None
    why = pdl_refusal(device)
    plain = replace(parse_recipe(name), dependent_launch=False).name
    return f"{why}; {plain} is the same graph with plain launches" if why else None


def kernel_kinds(name: str) -> tuple[str, ...]:
    """The kinds of kernel op candidate ``name`` runs (empty for the pure-ATen variants)."""
    return KERNEL_KINDS.get(parse_recipe(name).attention, ())


def kernel_paths_record(name: str, config: TransformerConfig, dtype: torch.dtype, device: torch.device) -> dict:
    """The manifest's record of which of our kernels this candidate's ops run here, with which launch, and why."""
    kinds = kernel_kinds(name)
    record = {}
    if "attention" in kinds:
        record["attention_path"] = attention_path_record(config, dtype, device)
    if "layer_norm" in kinds:
        from kkdeploy.kernels.layer_norm import layer_norm_path, row_reason

        unfit = row_reason(config.d_model, dtype)
        if unfit:
            record["layer_norm_path"] = {"kernel": "aten", "reason": f"{unfit}; ATen's layer_norm runs"}
        else:
            path = layer_norm_path(device, config.batch_size * config.seq_len, config.d_model)
            record["layer_norm_path"] = {"kernel": path.kernel, "reason": path.reason, "launch": path.launch}
    if "linear" in kinds:
        from kkdeploy.kernels.fused_blocks import (block_plan, ffn_chain_launches, gelu_launches, linear_launches,
                                                   norm_launches)
        from kkdeploy.kernels.fused_linear import linear_path

        launches = {}
        for op, (m, n, k, form) in {**linear_launches(config), **gelu_launches(config),
                                    **ffn_chain_launches(config), **norm_launches(config)}.items():
            path = linear_path(m, n, k, dtype, device, epilogue=form)
            launches[op] = {"kernel": path.kernel, "launch": path.launch, "reason": path.reason}
        plan = block_plan(config, dtype, device)
        fused = [op for op, path in launches.items() if path["kernel"] != "aten"]
        record["linear_path"] = {"kernel": "triton" if fused else "aten",
                                 "reason": f"our GEMM for {', '.join(fused)}" if fused else "no GEMM proven here",
                                 "plan": plan, "launches": launches}
    return record


def attention_path_record(config: TransformerConfig, dtype: torch.dtype, device: torch.device) -> dict:
    """Which attention the kernel op runs for this shape here (the fused kernel with the launch its proof chose, or
    the ATen composition) and why: the manifest says whether the candidate is the kernel at all."""
    from kkdeploy.kernels.faithful_attention import select_attention_path

    path = select_attention_path(config.seq_len, config.d_model // config.num_heads, dtype, device,
                                 batch_heads=config.batch_size * config.num_heads, causal=config.causal)
    record = {"kernel": path.kernel, "reason": path.reason}
    if path.fused:
        record["launch"] = path.launch
    return record


def prove_candidate_kernels(name: str, model, config: TransformerConfig, dtype: torch.dtype, device: torch.device,
                            siblings: tuple[str, ...] = (), progress=None):
    """The proof step for candidate ``name`` (``kkdeploy.kernels.model_proofs``): its kernel ops proven here.

    The first of a build's our-kernel candidates proves the kinds of all of them (``siblings``) in one step: one
    capture of the model's activations and one batch of compiles instead of one per candidate; the others find
    their records made. The returned records are ``name``'s own kinds'.

    Raises ``CandidateSkipped`` when the candidate would add nothing: none of its kernel ops is proven, or (when the
    candidate with one kind fewer is among ``siblings``, this build's other candidates) the kind it adds is not."""
    from kkdeploy.kernels.model_proofs import KINDS
    from kkdeploy.kernels.proof_process import prove_model_kernels_isolated

    kinds = kernel_kinds(name)
    shared = [kind for kind in KINDS if any(kind in kernel_kinds(n) for n in (name, *siblings))]
    proofs = prove_model_kernels_isolated(model, config, dtype, device, shared, progress=progress).only(kinds)
    if not any(proofs.proven(kind) for kind in kinds):
        raise CandidateSkipped(f"none of its kernel ops is proven bit-identical and faster here, so it would run "
                               f"ATen's ops only ({'; '.join(proofs.why_not(kind) for kind in kinds)})")
    recipe = parse_recipe(name)
    # the form with one kind fewer, with the same launches or (a "-pdl" candidate beside plain ones) plain
    smaller = [replace(recipe, attention=SMALLER_FORM[recipe.attention], dependent_launch=pdl).name
               for pdl in dict.fromkeys((recipe.dependent_launch, False))] if recipe.attention in SMALLER_FORM else []
    built = next((form for form in smaller if form in siblings), None)
    if built is not None and not proofs.proven(kinds[-1]):
        raise CandidateSkipped(f"the {kinds[-1]} kernel it adds to {built} is not proven here "
                               f"({proofs.why_not(kinds[-1])})")
    return proofs


def default_variants(device: torch.device, dtype: torch.dtype = torch.float16, contract: str = "strict") -> list[str]:
    """CPU: the faithful graph only (compiles are slow there); CUDA: the last-layer SDPA one and the faithful
    attention kernel too, and for a float32 judge build the fused ones (SDPA everywhere; under strict, fused
    attention fails, design.md §6)."""
    if torch.device(device).type == "cpu":
        return [FAITHFUL]
    fused = list(FUSED_VARIANTS) if dtype == torch.float32 and contract == "judge" else []
    return [FAITHFUL, f"{FAITHFUL}-sdpa1", KERNEL_ATTENTION, KERNELS, GEMMS, *fused]


#: Where a default build also times the GEMMs graph with programmatic dependent launches: one activation tensor
#: (tokens x D in float16) of at most this many bytes. Measured (session 38, an H100, one process per shape, weights
#: of our own, every trial bitwise): the "-pdl" form was 7-10% faster on shapes 2, 3, 4 and 12 (128 to 2,048 tokens
#: of D = 128: at most 512 KiB), and 5-19% slower on shapes 1, 7, 9 and on the custom shapes of D = 64, 256 and 384.
#: Where launches are most of a call, overlapping each kernel's start with its predecessor's tail can pay; where the
#: kernels are long it cannot. The bound only decides what is compiled: the build's timing picks the faster of the
#: two, and validation decides what ships, so a slower "-pdl" form costs build time, never speed.
PDL_DEFAULT_MAX_ACTIVATION_BYTES = 1 << 20


def dependent_launch_default(config: TransformerConfig, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a default build adds ``GEMMS + "-pdl"``: float16 on a GPU that can launch dependently, and small
    activations (``PDL_DEFAULT_MAX_ACTIVATION_BYTES``)."""
    if torch.device(device).type != "cuda" or dtype != torch.float16:
        return False
    activation_bytes = config.batch_size * config.seq_len * config.d_model * 2
    return activation_bytes <= PDL_DEFAULT_MAX_ACTIVATION_BYTES and pdl_refusal(device) is None


def check_variant(name: str, config: TransformerConfig, dtype: torch.dtype) -> None:
    """A one-line KKError for a name this backend cannot build for ``config`` in ``dtype``."""
    if name in FUSED_VARIANTS:
        if needs_float32(name) and dtype != torch.float32:
            raise KKError(f"{name} computes in float16 inside a float32 model; build with --dtype float32")
        return
    from .inductor import parse_variant

    parse_variant(inductor_variant(name), config)


def needs_float32(name: str) -> bool:
    """Fused variants with float16 inside (calibrated blocks or half GEMMs) exist only in a float32 model."""
    return any(FUSED_VARIANTS.get(name, ()))


class CompiledModuleRunner(Runner):
    """``torch.compile`` of a fixed-shape ``module(x, mask)``; CUDA-graph replay on a GPU, a plain call on the CPU.

    ``options`` are Inductor settings for this compile only. ``keep_alive`` holds what the compiled graph
    reads (the model whose parameters it uses).
    """

    def __init__(self, module: torch.nn.Module, config: TransformerConfig, dtype: torch.dtype, device: torch.device,
                 *, name: str, all_valid_only: bool, options: dict | None = None, cuda_graph: bool = True,
                 keep_alive=None, dependent_launch: bool = False):
        super().__init__(config, dtype, device)
        self.backend = self.name = name
        self.all_valid_only = all_valid_only
        self.keep_alive = keep_alive
        self.dependent_launch = dependent_launch  # our kernels' launches as PDL (the graph's capture records them)
        start = time.perf_counter()
        self.compiled = torch.compile(module.requires_grad_(False), options=options or {}, dynamic=False,
                                      fullgraph=True)
        x = torch.zeros(config.batch_size, config.seq_len, config.d_model, dtype=dtype, device=self.device)
        # All BoundForward instances share one code object (as do all MixedForward ones), and Dynamo allows
        # ``recompile_limit`` graphs per code object (8 by default; one per model, shape and method): a process
        # loading more fused artifacts than that would fail hard (fullgraph) and serve the fallback. The limit
        # is raised for this compile and capture only, not per call (the patch costs ~50 us).
        limit = max(RECOMPILE_LIMIT, torch._dynamo.config.recompile_limit)  # never lower the caller's
        capture = self.device.type == "cuda" and cuda_graph
        with torch._dynamo.config.patch(recompile_limit=limit):
            self._forward(x, torch.ones(x.shape[:2], dtype=torch.bool, device=self.device))  # compiles now
            if not capture:  # callers pass inference tensors too, which Dynamo guards apart: compile that now
                with torch.inference_mode():
                    x, mask = x.clone(), torch.ones(x.shape[:2], dtype=torch.bool, device=self.device)
                self._forward(x, mask)
            self.compile_seconds = round(time.perf_counter() - start, 3)
            self.captured = CapturedCall(self._forward, config.batch_size, config.seq_len, config.d_model, dtype,
                                         self.device, all_valid_only=all_valid_only) if capture else None
        self._mask_cache = AllValidMaskCache()

    def _forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # Always the same grad mode: Dynamo guards on it, and a second mode would mean a second compile.
        # A -pdl runner's custom ops read dependent_launches when they launch (at capture, or per uncaptured call).
        launches = dependent_launches(True) if self.dependent_launch else contextlib.nullcontext()
        with launches, torch.inference_mode():
            return self.compiled(x, mask)

    def infer(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.all_valid_only and not self._mask_cache.is_all_valid(mask):
            raise KKError(f"{self.name} is valid for all-valid masks only; send padded calls to the PyTorch model")
        if self.captured is not None:
            return self.captured(x, mask)
        y = self._forward(x.contiguous(), mask.contiguous())  # a fresh output: the caller owns it
        # It is an inference tensor; outside inference mode the caller gets a normal one (as eager would give).
        return y if torch.is_inference_mode_enabled() else y.clone()

    def static_call(self):
        return None if self.captured is None else self.captured.static_call()  # None for an all-valid-only capture

    def release(self) -> None:
        if self.captured is not None:
            self.captured.close()  # the graph replays the compiled kernels on the model's memory: first
        self.captured = self.compiled = self.keep_alive = None


class CompiledRunner(CompiledModuleRunner):
    """The faithful variant: the exported reference with its sensitive ops opaque, faithful Inductor settings."""

    def __init__(self, model: torch.nn.Module, config: TransformerConfig, dtype: torch.dtype,
                 device: torch.device, name: str = FAITHFUL, cuda_graph: bool = True):
        from . import inductor_ops  # noqa: F401  registers the opaque ops the graph calls
        from .inductor import export_variant, faithful_inductor_configs, parse_variant

        variant = inductor_variant(name)
        options = faithful_inductor_configs()
        pdl = uses_dependent_launch(name)
        if pdl:
            why = dependent_launch_refusal(name, torch.device(device))
            if why:
                raise KKError(f"{name}: {why}")
            options.update(inductor_options())
        start = time.perf_counter()
        exported = export_variant(model, config, dtype, torch.device(device), variant,
                                  kernel_attention=uses_kernel_attention(name),
                                  kernel_layer_norm=uses_kernel_layer_norm(name),
                                  kernel_linear=uses_kernel_linear(name))
        export_seconds = time.perf_counter() - start
        super().__init__(exported.module(), config, dtype, device, name=name,
                         all_valid_only=bool(parse_variant(variant, config)[1]), options=options,
                         cuda_graph=cuda_graph, keep_alive=model, dependent_launch=pdl)
        self.inductor_configs = options
        self.compile_seconds = round(self.compile_seconds + export_seconds, 3)


class TorchCompileBackend(Backend):
    name = "torch_compile"

    def unavailable_reason(self, device: torch.device, dtype: torch.dtype) -> str | None:
        from .inductor import BACKEND as AOTI

        return AOTI.unavailable_reason(device, dtype)  # the same compiler, the same requirements

    def candidates(self, ctx: BuildContext) -> list[str]:
        chosen = ctx.candidate_filter  # from a --backends choice such as torch-compile-fused
        if chosen is not None:  # float16 blocks exist only inside a float32 model
            return [n for n in chosen if not needs_float32(n) or ctx.dtype == torch.float32]
        contract = ctx.validation_plan.get("contract", "strict")
        default = default_variants(ctx.device, ctx.dtype, contract)
        if dependent_launch_default(ctx.config, ctx.device, ctx.dtype):
            default.append(f"{GEMMS}-pdl")
        return requested_variants(ctx, "torch_compile_variants", default,
                                  lambda name: check_variant(name, ctx.config, ctx.dtype))

    def build(self, ctx: BuildContext, candidate: str) -> CandidateResult:
        """Compile once here: it proves the graph compiles, fills the cache file and records the fingerprint."""
        from .inductor import guarded_build

        return guarded_build(self, ctx, candidate, lambda: self._compile(ctx, candidate))

    def _compile(self, ctx: BuildContext, candidate: str) -> tuple[dict, list[str]]:
        from kkdeploy.models.weights import weights_sha256

        from .inductor import faithful_inductor_configs

        device = torch.device(ctx.device)
        cuda_graph = ctx.options.get("cuda_graph", True)
        recipe: dict = {"inductor_configs": faithful_inductor_configs()}
        if candidate in FUSED_VARIANTS:
            half, calibrated = FUSED_VARIANTS[candidate]
            layers, calibration = (), None
            if calibrated:
                calibration = ctx.calibrate_layers(fused_eager_twin(ctx.model, device, half))
                calibration["calibrated_on"] = CALIBRATED_ON_EAGER_TWIN
                if not calibration["passed"]:
                    raise KKError("no float16 block set passed calibration (not even none); "
                                  f"{calibration['tried'][-1].get('reason', '')}")
                layers = tuple(calibration["fp16_layers"])
            fused = fused_model(ctx.model, layers, half)
            runner = compile_fused(fused, device, name=candidate, cuda_graph=cuda_graph)
            recipe = {"inductor_configs": {}, "fp16_layers": list(layers), "half_gemm": half,
                      "half_gemm_kernel": fused.half_gemm_kernel, "calibration": calibration}
        else:
            why = dependent_launch_refusal(candidate, device)
            if why:
                raise CandidateSkipped(why)
            if kernel_kinds(candidate):
                siblings = tuple(self.candidates(ctx))
                proofs = prove_candidate_kernels(candidate, ctx.model, ctx.config, ctx.dtype, device, siblings,
                                                 progress=ctx.progress)
                recipe.update({"kernel_proofs": proofs.to_list(), "proof_seconds": proofs.seconds,
                               "proof_phases": proofs.phases, "proofs_reused": proofs.reused})
            runner = CompiledRunner(ctx.model, ctx.config, ctx.dtype, device, name=candidate, cuda_graph=cuda_graph)
            recipe["inductor_configs"] = dict(runner.inductor_configs)
            recipe.update(kernel_paths_record(candidate, ctx.config, ctx.dtype, device))
        ratios = fingerprint_padding(runner.all_valid_only)
        fingerprint = output_fingerprint(runner, ctx.config, ctx.dtype, device, padding_ratios=ratios)
        files = [WEIGHTS_FILE]
        cache_file = None
        saved = torch.compiler.save_cache_artifacts()
        all_valid_only, captured, compile_seconds = runner.all_valid_only, runner.captured, runner.compile_seconds
        ctx.keep_or_close(candidate, runner)
        if saved is not None:
            cache_file = f"{candidate}{CACHE_SUFFIX}"
            Path(ctx.out_dir, cache_file).write_bytes(saved[0])
            files.append(cache_file)
        options = {
            "variant": candidate, "dtype": dtype_name(ctx.dtype), "config": ctx.config.to_dict(),
            "weights_sha256": weights_sha256(ctx.model), "torch": torch.__version__, **recipe,
            "all_valid_only": all_valid_only,  # TF32: the build's one setting, manifest["tf32"]
            "mask_modes": ["all-valid"] if all_valid_only else ["all-valid", "padded"],
            "cuda_graph": captured is not None, "cache_file": cache_file,
            "fingerprint": {"seed": DEFAULT_SEED, "padding_ratios": list(ratios), "sha256": fingerprint},
            "compile_seconds": compile_seconds,
        }
        return options, files

    def load(self, artifact_dir: Path, entry: dict, config: TransformerConfig, dtype: torch.dtype,
             device: torch.device) -> CompiledRunner:
        from safetensors.torch import load_file

        from .torch_graph import model_for_variant

        device = torch.device(device)
        options = entry.get("options") or {}
        name = entry.get("name", FAITHFUL)
        here = {"torch": torch.__version__, "dtype": dtype_name(dtype), "config": config.to_dict()}
        differs = first_difference(options, here, ("torch", "dtype", "config"))
        if differs == "torch":
            raise KKError(f"{name} was compiled with torch {options.get('torch')}, this process has "
                          f"torch {torch.__version__}; rebuild it here")
        if differs:
            raise KKError(f"{name} was built for {options.get('dtype')} {options.get('config')}; rebuild it here")
        if options.get("cache_file"):
            torch.compiler.load_cache_artifacts(Path(artifact_dir, options["cache_file"]).read_bytes())
        state = load_file(str(Path(artifact_dir) / WEIGHTS_FILE))
        model = model_for_variant({"model": "reference"}, config, dtype, device, state)
        cuda_graph = bool(options.get("cuda_graph", True))
        kernel_note = adopt_kernel_proofs(Path(artifact_dir), name, options, model, config, dtype, device)
        try:
            if name in FUSED_VARIANTS:
                runner = compile_fused(fused_model(model, options.get("fp16_layers") or (), options.get("half_gemm")),
                                       device, name=name, cuda_graph=cuda_graph)
            else:
                runner = CompiledRunner(model, config, dtype, device, name=name, cuda_graph=cuda_graph)
        except KKError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise KKError(f"{name} failed to compile here: {error_summary(exc)}") from None
        recorded = options.get("fingerprint") or {}
        expected = recorded.get("sha256")
        got = output_fingerprint(runner, config, dtype, device, recorded.get("seed", DEFAULT_SEED),
                                 recorded.get("padding_ratios", fingerprint_padding(True)))
        if got != expected:
            raise KKError(f"{name} recompiled here does not reproduce the validated output (fingerprint "
                          f"{got[:12]} != {str(expected)[:12]}); rebuild the artifacts on this machine")
        runner.kernel_note = kernel_note
        return runner


def adopt_kernel_proofs(artifact_dir: Path, name: str, options: dict, model, config: TransformerConfig,
                        dtype: torch.dtype, device: torch.device) -> str:
    """Before an our-kernel candidate is compiled where it serves: the manifest's proofs where this is the build's
    environment, else a proof made here (cached beside the artifacts in ``proofs/``, so the next load reuses it).
    An op no longer bit-identical here runs ATen's ops (the same bits, slower); the returned sentence says so
    ("" when every recorded kernel still runs)."""
    import logging

    from kkdeploy.kernels.model_proofs import adopt_recorded
    from kkdeploy.kernels.proof_process import prove_model_kernels_isolated

    kinds = kernel_kinds(name)
    recorded = options.get("kernel_proofs") or []
    if not kinds or not recorded:
        return ""
    _, foreign = adopt_recorded(recorded, device)
    # proven in a fresh process: a kernel that faults here must not take the serving process with it
    proofs = prove_model_kernels_isolated(model, config, dtype, device, kinds, cache_dir=Path(artifact_dir) / "proofs")
    built = {(r["op"], str(r["shape"])) for r in recorded if r.get("chosen")}
    lost = [r for r in proofs.records if (r.op, str(r.shape)) in built and not r.proven]
    if not lost:
        return f"kernel proofs re-made here ({proofs.seconds} s)" if foreign else ""
    note = (f"{name}: {len(lost)} kernel op(s) proven at build time are not bit-identical here and run ATen's ops "
            f"(the same bits, slower): " + "; ".join(f"{r.op} {r.shape}: {r.reason}" for r in lost))
    logging.getLogger("kkdeploy").warning("kkdeploy: %s", note)
    return note


BACKEND = TorchCompileBackend()
DESCRIPTOR = register(BackendDescriptor(
    key=TorchCompileBackend.name, module=__name__, recipe_name="torch-compile", libraries=("torch",),
    choices=(BackendChoice("torch-compile", default_on=("cuda",)),
             BackendChoice("torch-compile-fused", tuple(FUSED_VARIANTS))),
    default_variants=default_variants,
    attentions=frozenset({"reference", "sdpa-last", "fused", *OUR_KERNEL_FORMS}),
    precisions=frozenset({"model", "fp16-blocks", "half-gemm", "half-gemm+fp16-blocks"})))


class MixedForward(torch.nn.Module):
    """``MixedPrecisionTransformer`` as a fixed-signature module for ``torch.compile``: the reference order
    (all masks) or, with ``all_valid_sdpa``, the all-valid fast path. Packed QKV weights are frozen
    (``freeze_packed_qkv``): the model's own cache keys on ``data_ptr()``, which Dynamo cannot trace."""

    def __init__(self, mixed: torch.nn.Module, all_valid_sdpa: bool):
        super().__init__()
        self.mixed = mixed
        self.all_valid_sdpa = all_valid_sdpa
        if all_valid_sdpa:
            mixed.fp16_model.freeze_packed_qkv(mixed.fp16_layers)

    def forward(self, x: torch.Tensor, valid_token_mask: torch.Tensor) -> torch.Tensor:
        if self.all_valid_sdpa:
            return self.mixed.fast_forward(x)
        return self.mixed.reference_forward(x, valid_token_mask)


class BoundForward(torch.nn.Module):
    """``owner.<method>(x, mask)`` as a module's forward: what ``torch.compile`` takes, with ``owner``'s
    parameters registered under it."""

    def __init__(self, owner: torch.nn.Module, method: str):
        super().__init__()
        self.owner = owner
        self.method = method

    def forward(self, x: torch.Tensor, valid_token_mask: torch.Tensor) -> torch.Tensor:
        return getattr(self.owner, self.method)(x, valid_token_mask)


class CompiledRoutes(AllValidRouter):
    """Two compiled graphs of one model behind the router; what the builder records of a compiled runner
    is derived from them."""

    all_valid: CompiledModuleRunner
    padded: CompiledModuleRunner

    @property
    def name(self) -> str:
        return self.padded.name

    @property
    def captured(self):
        return self.padded.captured

    @property
    def compile_seconds(self) -> float:
        return round(self.all_valid.compile_seconds + self.padded.compile_seconds, 3)


def compile_fused(fused: torch.nn.Module, device: torch.device, *, name: str,
                  cuda_graph: bool = True) -> CompiledRoutes:
    """A ``kkdeploy.models.fused.FusedTransformer`` compiled with Inductor's defaults, twice: all-valid calls take the
    causal graph (no mask tensor), padded calls the boolean-mask graph. Serves both.

    Like ``compile_mixed``, not bitwise to anything: a judge-contract candidate that validation gates (per
    mask mode, so each graph is validated on the calls it serves).
    """
    def compiled(method: str, all_valid_only: bool) -> CompiledModuleRunner:
        return CompiledModuleRunner(BoundForward(fused, method), fused.config, fused.dtype, device, name=name,
                                    all_valid_only=all_valid_only, options={}, cuda_graph=cuda_graph,
                                    keep_alive=fused)

    return CompiledRoutes(compiled("all_valid_forward", True), compiled("fused_forward", False))


def compile_mixed(mixed: torch.nn.Module, device: torch.device, *, name: str, all_valid_sdpa: bool,
                  cuda_graph: bool = True) -> CompiledModuleRunner:
    """A mixed-precision model compiled with Inductor's defaults (fusion allowed: judge contract, float32 model).

    It is not the faithful graph, so it is not bitwise to anything; validation decides whether it ships.
    """
    return CompiledModuleRunner(MixedForward(mixed, all_valid_sdpa), mixed.config, torch.float32, device, name=name,
                                all_valid_only=all_valid_sdpa, options={}, cuda_graph=cuda_graph, keep_alive=mixed)


def fused_model(reference: torch.nn.Module, fp16_layers=(), half_gemm: bool = False) -> torch.nn.Module:
    from kkdeploy.models.fused import FusedTransformer

    return FusedTransformer(reference, fp16_layers, half_gemm=bool(half_gemm))


# Where a fused candidate's float16 blocks were searched, for its calibration record.
CALIBRATED_ON_EAGER_TWIN = "the eager twin (CUDA-graph captured on CUDA), not the compiled graph"


def fused_eager_twin(reference: torch.nn.Module, device: torch.device, half_gemm: bool = False):
    """``runner_for_layers`` of a ``torch-compile-fused[-half-gemm]-mixed`` calibration: each tried float16 block
    set runs on its eager twin, routed by mask like the compiled runner (two CUDA-graph captures on a GPU),
    because a compile per tried set would cost minutes. The compiled model is then validated with every other
    candidate, so what ships has passed."""
    def runner_for(layers):
        model = fused_model(reference, layers, half_gemm)
        if torch.device(device).type != "cuda":
            return model
        from .torch_graph import CudaGraphRunner

        def captured(forward, all_valid_only: bool) -> CudaGraphRunner:
            return CudaGraphRunner(model, reference.config, torch.float32, device, all_valid_only=all_valid_only,
                                   forward=forward)

        return AllValidRouter(captured(model.all_valid_forward, True), captured(model.fused_forward, False))

    return runner_for

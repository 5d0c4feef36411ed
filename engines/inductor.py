"""AOTInductor packages: a compiled engine that is bitwise faithful to the reference.

Builder: ``torch.export`` of the reference model for one fixed shape (x [B,S,D] and the bool
mask, always passed), LayerNorm / exact GELU / FP32 softmax swapped for opaque wrappers around
the very same ATen calls (``engines.inductor_ops``), then ``aoti_compile_and_package`` with
``emulate_precision_casts=True`` into ``<candidate>.pt2``.

Why that is faithful: every value the reference computes comes either from the same ATen kernel
(the opaque ops, and the GEMMs, which Inductor calls as extern ``addmm``/``bmm`` kernels) or from
an Inductor-generated pointwise kernel (residual adds, the scale multiply, masked fills, casts).
Pointwise FP16 arithmetic in PyTorch is "load, compute in FP32, round once per op"; precision-cast
emulation makes Inductor round after every op exactly where eager does instead of carrying FP32
through a fused chain. What Inductor would otherwise reimplement differently (reduction order in
LayerNorm and softmax, its own ``erf``) never reaches it.

Variants (candidate names):
  ``inductor``          fully faithful (LayerNorm, GELU, softmax opaque).
  ``inductor-fused``    LayerNorm opaque; GELU and softmax fused by Inductor: faster, usually
                        a few strict failures (the validator decides).
  ``inductor-sdpa<k>``  faithful, plus packed QKV + SDPA in the last k layers. It is the export of
                        ``OptimizedTransformer.fast_forward``, which is valid for all-valid masks
                        only (a mask-dependent branch cannot be exported), so its result says
                        ``all_valid_only`` and its runner refuses a padded mask.

Runner: ``aoti_load_package`` (no recompilation); on CUDA the call is captured in a CUDA graph
(static inputs filled by copy, output cloned so the caller owns it); on the CPU it runs plainly.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import shutil
import time

from pathlib import Path

import torch

from kkdeploy.artifacts import file_sha256, first_difference
from kkdeploy.config import TransformerConfig, dtype_name
from kkdeploy.errors import KKError, error_summary
from kkdeploy.inputs import AllValidMaskCache

from .base import (BUILD_FAILED, BUILT, SKIPPED, UNAVAILABLE, Backend, BuildContext, CandidateResult, CandidateSkipped,
                   Runner, import_error_reason, requested_variants)
from .cuda_graph import CapturedCall
from .recipe import parse as parse_recipe
from .registry import BackendChoice, BackendDescriptor, register

FAITHFUL, FUSED, SDPA_PREFIX = "inductor", "inductor-fused", "inductor-sdpa"
METADATA_PREFIX = "kkdeploy."


# -- variants --------------------------------------------------------------------------------
def parse_variant(name: str, config: TransformerConfig) -> tuple[tuple[str, ...], int]:
    """Variant name -> (ops kept opaque, packed-SDPA layers); a bad name is a one-line KKError.

    The name's grammar is ``engines.recipe``'s: ``inductor`` keeps LayerNorm, GELU and softmax opaque,
    ``inductor-fused`` lets Inductor fuse GELU and softmax, ``inductor-sdpa<k>`` packs the last k blocks."""
    recipe = parse_recipe(name)
    if recipe.backend != "inductor":
        raise KKError(f"unknown inductor variant {name!r}; use {FAITHFUL}, {FUSED} or {SDPA_PREFIX}<k>")
    if recipe.attention == "fused":
        return ("layer_norm",), 0
    if recipe.attention == "sdpa-last" and not 1 <= recipe.sdpa_layers <= config.num_layers:
        raise KKError(f"{name}: k must be between 1 and num_layers={config.num_layers}")
    return ("layer_norm", "gelu", "softmax"), recipe.sdpa_layers


def default_variants(device: torch.device) -> list[str]:
    """CPU: the faithful package only (compiles are slow there); CUDA: fused and sdpa1 too."""
    return [FAITHFUL] if device.type == "cpu" else [FAITHFUL, FUSED, f"{SDPA_PREFIX}1"]


# -- export -----------------------------------------------------------------------------------
class ReferenceForward(torch.nn.Module):
    """The reference's forward with the mask always given (the exported call signature)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, valid_token_mask: torch.Tensor) -> torch.Tensor:
        return self.model.reference_forward(x, valid_token_mask)


class KernelAttentionForward(ReferenceForward):
    """The reference's forward with each block's attention core (scores, scale, masks, FP32 softmax,
    probabilities, context) as one ``kkdeploy_faithful::attention`` call (``kkdeploy.kernels``).

    Bit for bit the same composition (the op's CPU kernel *is* that composition, its CUDA kernel was
    proven equal to it), but one opaque op for Inductor: the [B,H,S,S] scores never reach memory where the
    fused kernel runs. The projections, out_proj, LayerNorms and GELU stay the faithful graph's.

    ``layer_norm_kernel`` (the LayerNorms are our rows kernel's op), once builds take it (``masked_final_norm``): the
    final LayerNorm and the reference's ``zero_invalid_rows`` after it are one op,
    ``kkdeploy_faithful::layer_norm_rows_zero_invalid``, whose launch writes the invalid rows' zeros itself: one
    launch fewer per call than the LayerNorm and Inductor's masked fill."""

    def __init__(self, model: torch.nn.Module, layer_norm_kernel: bool = False):
        super().__init__(model)
        self.layer_norm_kernel = layer_norm_kernel

    def forward(self, x: torch.Tensor, valid_token_mask: torch.Tensor) -> torch.Tensor:
        attentions = [layer.attention for layer in self.model.layers]
        for attention in attentions:
            attention.attend = functools.partial(_kernel_attend, attention)
        try:
            return self._reference_forward(x, valid_token_mask)
        finally:
            for attention in attentions:
                del attention.attend  # the instance attribute goes; the class's reference attend is back

    def _reference_forward(self, x: torch.Tensor, valid_token_mask: torch.Tensor) -> torch.Tensor:
        """``reference_forward``, its final step as one op where the LayerNorms are our kernel's."""
        if not masked_final_norm(self.layer_norm_kernel):
            return self.model.reference_forward(x, valid_token_mask)
        self.model.final = functools.partial(_kernel_final, self.model.final_norm)
        try:
            return self.model.reference_forward(x, valid_token_mask)
        finally:
            del self.model.final  # the instance attribute goes; the class's reference final is back


class KernelGemmForward(KernelAttentionForward):
    """The reference's forward with every block as ``kkdeploy.kernels.fused_blocks.fused_block_forward``: the
    attention op, Q/K/V in one GEMM, and out_proj, ffn_in and ffn_out with their next elementwise ops (residual,
    mask, GELU where proven) in the GEMM's epilogue. Where our GEMMs do not run (``block_plan``: the CPU, an
    unproven platform or size) it is ``KernelAttentionForward``, so Inductor keeps fusing the elementwise ops; the
    LayerNorms (and a GELU outside the epilogue) stay ATen nodes for ``make_sensitive_ops_opaque``."""

    def __init__(self, model: torch.nn.Module, plan: dict, layer_norm_kernel: bool = False):
        super().__init__(model, layer_norm_kernel)
        self.plan = plan

    def forward(self, x: torch.Tensor, valid_token_mask: torch.Tensor) -> torch.Tensor:
        from kkdeploy.kernels.fused_blocks import fused_block_forward, fused_model_forward

        if not self.plan["gemms"]:
            return super().forward(x, valid_token_mask)
        if self.plan.get("layer_norm"):
            return fused_model_forward(self.model, x, valid_token_mask, self.plan)
        layers = list(self.model.layers)
        for layer in layers:
            layer.forward = functools.partial(fused_block_forward, layer, plan=self.plan)
        try:
            return self._reference_forward(x, valid_token_mask)
        finally:
            for layer in layers:
                del layer.forward  # the instance attribute goes; Block.forward is back


def masked_final_norm(layer_norm_kernel: bool) -> bool:
    """Whether the graph's final LayerNorm and ``zero_invalid_rows`` are one op: where the LayerNorms are our rows
    kernel's, once builds take it (``kkdeploy.kernels.layer_norm.MASKED_FINAL``)."""
    from kkdeploy.kernels import layer_norm

    return layer_norm_kernel and layer_norm.MASKED_FINAL


def _kernel_final(final_norm, x, valid_token_mask):
    """``ReferenceTransformer.final`` as one op: the rows kernel's masked launch where proven, else ATen's ops."""
    import kkdeploy.kernels.layer_norm  # noqa: F401  registers kkdeploy_faithful::layer_norm_rows_zero_invalid

    if valid_token_mask is None:
        return final_norm(x)
    return torch.ops.kkdeploy_faithful.layer_norm_rows_zero_invalid(x, list(final_norm.normalized_shape),
                                                                    final_norm.weight, final_norm.bias,
                                                                    final_norm.eps, valid_token_mask)


def _kernel_attend(attention, q, k, v, valid_token_mask):
    """``Attention.attend`` on split heads [B,H,S,Dh] -> the op on the Linear outputs [B,S,D] (views only)."""
    from kkdeploy.kernels.faithful_attention import faithful_attention

    b, h, s, dh = q.shape

    def merged(t):
        return t.transpose(1, 2).reshape(b, s, h * dh)

    return faithful_attention(merged(q), merged(k), merged(v), valid_token_mask, num_heads=attention.num_heads,
                              causal=attention.causal)


class AllValidSdpaForward(torch.nn.Module):
    """``OptimizedTransformer.fast_forward`` (all-valid semantics); the mask input is unused.

    The packed QKV weights are frozen (``freeze_packed_qkv``): the optimized model's own cache keys on
    ``data_ptr()``, which export's fake tensors cannot answer.
    """

    def __init__(self, reference: torch.nn.Module, sdpa_layers: int):
        super().__init__()
        from kkdeploy.models.optimized import OptimizedTransformer

        optimized = OptimizedTransformer(reference.config, sdpa_layers=sdpa_layers)
        optimized.load_state_dict(reference.state_dict(), strict=True)
        self.optimized = optimized.to(device=reference.device, dtype=reference.dtype).eval()
        self.optimized.freeze_packed_qkv(range(reference.config.num_layers - sdpa_layers,
                                               reference.config.num_layers))

    def forward(self, x: torch.Tensor, valid_token_mask: torch.Tensor) -> torch.Tensor:
        return self.optimized.fast_forward(x)


def export_variant(model: torch.nn.Module, config: TransformerConfig, dtype: torch.dtype,
                   device: torch.device, variant: str, kernel_attention: bool = False,
                   kernel_layer_norm: bool = False, kernel_linear: bool = False):
    """ExportedProgram for one fixed shape, sensitive ops made opaque as the variant says; with
    ``kernel_attention`` each attention core is one ``kkdeploy_faithful::attention`` op (no softmax left), with
    ``kernel_layer_norm`` each LayerNorm is ``kkdeploy_faithful::layer_norm_rows`` (ATen's bits, our launch), with
    ``kernel_linear`` each block is ``fused_block_forward`` (GELU inside ``kkdeploy_faithful::linear``)."""
    from .inductor_ops import make_sensitive_ops_opaque

    opaque, sdpa_layers = parse_variant(variant, config)
    if kernel_attention:
        if sdpa_layers:
            raise KKError(f"{variant}: the faithful attention kernel replaces reference-order attention, not SDPA")
        opaque = tuple(op for op in opaque if op != "softmax")
        if kernel_linear:
            from kkdeploy.kernels.fused_blocks import block_plan

            plan = block_plan(config, dtype, device)
            module = KernelGemmForward(model, plan, kernel_layer_norm)
        else:
            module = KernelAttentionForward(model, kernel_layer_norm)
    else:
        module = AllValidSdpaForward(model, sdpa_layers) if sdpa_layers else ReferenceForward(model)
    x = torch.zeros(config.batch_size, config.seq_len, config.d_model, dtype=dtype, device=device)
    mask = torch.ones(config.batch_size, config.seq_len, dtype=torch.bool, device=device)
    with torch.no_grad():
        exported = torch.export.export(module.eval(), (x, mask), strict=False)
    if opaque:
        counts = make_sensitive_ops_opaque(exported, keep=opaque, layer_norm_kernel=kernel_layer_norm)
        gelu_fused = kernel_attention and kernel_linear and plan["gemms"] and (plan["gelu"] or plan["gelu_prologue"])
        norms_fused = kernel_attention and kernel_linear and plan["gemms"] and plan.get("layer_norm", False)
        final_fused = kernel_attention and masked_final_norm(kernel_layer_norm)  # the masked op (or in norms_fused)
        in_gemms = (config.num_layers * (bool(plan.get("norm_ffn_in")) + bool(plan.get("norm_qkv")))
                    if kernel_attention and kernel_linear and plan["gemms"] else 0)  # LayerNorm prologues
        expected = {"layer_norm": 1 if norms_fused else 2 * config.num_layers + (0 if final_fused else 1) - in_gemms,
                    "gelu": 0 if gelu_fused else config.num_layers,
                    "softmax": 0 if kernel_attention else config.num_layers - sdpa_layers}
        wrong = {op: (counts[op], expected[op]) for op in opaque if counts[op] != expected[op]}
        if wrong:
            detail = ", ".join(f"{op}: {got} found, {want} expected" for op, (got, want) in wrong.items())
            raise KKError(f"{variant}: the exported graph does not hold the reference's sensitive ops ({detail})")
    return exported


# -- runner -------------------------------------------------------------------------------------
class InductorRunner(Runner):
    """A loaded AOTInductor package; CUDA-graph replay on a GPU, a plain call on the CPU."""

    backend = "inductor"

    def __init__(self, package: Path, config: TransformerConfig, dtype: torch.dtype, device: torch.device,
                 name: str = FAITHFUL, all_valid_only: bool = False, cuda_graph: bool = True):
        super().__init__(config, dtype, device)
        from . import inductor_ops  # noqa: F401  registers the opaque ops the package calls

        self.name = name
        self.all_valid_only = all_valid_only
        on_cuda = self.device.type == "cuda"
        index = (self.device.index if self.device.index is not None else torch.cuda.current_device()) if on_cuda else -1
        # Single-threaded mode skips the container's locking, which would get in CUDA-graph capture's way.
        # KKDEPLOY_AOTI_SINGLE_THREADED=0 turns it off (scripts/inductor_probe.py tells which mode loads).
        single = on_cuda and os.environ.get("KKDEPLOY_AOTI_SINGLE_THREADED", "1") != "0"
        kwargs = {"run_single_threaded": single}
        if os.environ.get("KKDEPLOY_AOTI_DEVICE_INDEX", "1") != "0":
            kwargs["device_index"] = index
        self.model = torch._inductor.aoti_load_package(str(package), **kwargs)
        self.metadata = dict(self.model.get_metadata())
        self._mask_cache = AllValidMaskCache()
        self.captured = None
        if on_cuda and cuda_graph and os.environ.get("KKDEPLOY_AOTI_GRAPH", "1") != "0":
            self.captured = CapturedCall(self._run, config.batch_size, config.seq_len, config.d_model, dtype,
                                         self.device, all_valid_only=all_valid_only)

    def _run(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        out = self.model(x, mask)
        return out[0] if isinstance(out, (list, tuple)) else out

    def infer(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.all_valid_only and not self._mask_cache.is_all_valid(mask):
            raise KKError(f"{self.name} is valid for all-valid masks only; send padded calls to the PyTorch model")
        if self.captured is not None:
            return self.captured(x, mask)
        # The package was compiled for contiguous inputs; it allocates a fresh output per call.
        return self._run(x.contiguous(), mask.contiguous())

    def release(self) -> None:
        if self.captured is not None:
            self.captured.close()  # the graph replays the package's kernels: first
        self.captured = self.model = None


# -- backend -------------------------------------------------------------------------------------
def _cpu_half_kernels_missing(dtype: torch.dtype) -> str | None:
    try:
        x = torch.ones(2, 4, 8, dtype=dtype)
        w = torch.ones(8, 8, dtype=dtype)
        h = torch.nn.functional.layer_norm(x, (8,), w[0], w[0])
        h = torch.nn.functional.gelu(torch.nn.functional.linear(h, w, w[0]))
        torch.softmax(torch.matmul(h, h.transpose(-2, -1)).float(), dim=-1).to(dtype)
    except Exception as exc:  # noqa: BLE001 - the message is the reason
        return f"unavailable: {dtype_name(dtype)} CPU kernels missing in torch {torch.__version__}: {type(exc).__name__}: {exc}"
    return None


class InductorBackend(Backend):
    name = "inductor"

    def unavailable_reason(self, device: torch.device, dtype: torch.dtype) -> str | None:
        device = torch.device(device)
        try:
            importlib.import_module("torch._inductor")
            importlib.import_module("torch.export")
        except Exception as exc:  # noqa: BLE001
            return import_error_reason("torch._inductor", exc)
        if device.type not in ("cpu", "cuda"):
            return f"unavailable: AOTInductor packages are built here for cpu or cuda, not {device.type}"
        from .inductor_cache import compiler_version

        if not compiler_version():
            from torch._inductor import cpp_builder

            try:
                cxx = cpp_builder.get_cpp_compiler()
            except Exception:  # noqa: BLE001
                cxx = "g++"
            return (f"unavailable: no working C++ compiler for AOTInductor ({cxx} --version failed); "
                    f"install g++ or set CXX")
        if device.type == "cuda":
            try:
                import triton  # noqa: F401
            except Exception as exc:  # noqa: BLE001
                return import_error_reason("triton", exc)
        elif dtype != torch.float32:
            return _cpu_half_kernels_missing(dtype)
        return None

    def candidates(self, ctx: BuildContext) -> list[str]:
        return requested_variants(ctx, "inductor_variants", default_variants(torch.device(ctx.device)),
                                  lambda name: parse_variant(name, ctx.config))

    def loads_native_code(self, entry: dict) -> bool:
        return True  # aoti_load_package has segfaulted in fresh processes (docs/results.md)

    def build(self, ctx: BuildContext, candidate: str) -> CandidateResult:
        def work():
            options = build_package(ctx, candidate)
            return options, [options["package"]]

        return guarded_build(self, ctx, candidate, work)

    def load(self, artifact_dir: Path, entry: dict, config: TransformerConfig, dtype: torch.dtype,
             device: torch.device) -> Runner:
        from .inductor_cache import environment_keys

        device = torch.device(device)
        options = entry.get("options") or {}
        name = entry.get("name", FAITHFUL)
        recorded = options.get("keys") or {}
        mismatch = keys_mismatch(recorded, environment_keys(device))
        if mismatch:
            raise KKError(f"inductor package {name}: {mismatch}; rebuild it here")
        if options.get("dtype") != dtype_name(dtype):
            raise KKError(f"inductor package {name} was built for {options.get('dtype')}, not {dtype_name(dtype)}")
        if options.get("config") != config.to_dict():
            raise KKError(f"inductor package {name} was built for another shape ({options.get('config')})")
        package = Path(artifact_dir) / options.get("package", f"{name}.pt2")
        if not package.is_file():
            raise KKError(f"inductor package {package} is missing; rebuild the artifacts")
        if options.get("sha256") and file_sha256(package) != options["sha256"]:
            raise KKError(f"inductor package {package.name} does not match its recorded sha256; rebuild the artifacts")
        try:
            runner = InductorRunner(package, config, dtype, device, name=name,
                                    all_valid_only=bool(options.get("all_valid_only")),
                                    cuda_graph=bool(options.get("cuda_graph", True)))
        except KKError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise KKError(f"inductor package {name} failed to load: {error_summary(exc)}") from None
        embedded = {k[len(METADATA_PREFIX):]: v for k, v in runner.metadata.items() if k.startswith(METADATA_PREFIX)}
        if embedded.get("variant") != name or embedded.get("weights_sha256") != options.get("weights_sha256"):
            raise KKError(f"inductor package {package.name} holds {embedded.get('variant')} with other weights "
                          f"than its manifest entry records; rebuild the artifacts")
        return runner


def guarded_build(backend: Backend, ctx: BuildContext, candidate: str, work) -> CandidateResult:
    """Run a compiling builder's ``work() -> (options, files)``: unavailable here, a compiler error or a graph
    that lacks the ops it must keep opaque become the candidate's recorded status, never a crash."""
    result = CandidateResult(name=candidate, backend=backend.name, status=BUILT)
    reason = backend.unavailable_reason(torch.device(ctx.device), ctx.dtype)
    if reason:
        result.status, result.reason = UNAVAILABLE, reason
        return result
    start = time.perf_counter()
    try:
        result.options, result.files = work()
    except CandidateSkipped as exc:
        result.status, result.reason = SKIPPED, f"skipped: {exc}"
    except KKError as exc:
        result.status, result.reason = BUILD_FAILED, f"build-failed: {exc}"
    except Exception as exc:  # noqa: BLE001 - a compiler failure is a candidate outcome, not a crash
        result.status, result.reason = BUILD_FAILED, f"build-failed: {error_summary(exc)}"
    result.build_seconds = round(time.perf_counter() - start, 3)
    return result


def keys_mismatch(recorded: dict, current: dict) -> str | None:
    """The first environment key that makes a package unusable here, in words (None if fine)."""
    keys = ("device_type", "torch") + (("capability",) if current["device_type"] == "cuda" else ())
    key = first_difference(recorded, current, keys)
    if key == "device_type":
        return f"compiled for device {recorded.get('device_type')}, this process runs on {current['device_type']}"
    if key == "torch":
        return f"compiled with torch {recorded.get('torch')}, this process has torch {current['torch']}"
    if key == "capability":
        return (f"compiled for compute capability {recorded.get('capability')} ({recorded.get('device_name')}), "
                f"this GPU is {current['capability']} ({current['device_name']})")
    return None


def faithful_inductor_configs() -> dict:
    """Inductor settings for every variant, applied only for the compile (``config.patch``).

    Precision-cast emulation rounds where eager rounds; GEMMs stay ATen extern calls (no Triton
    or C++ GEMM templates from max-autotune, whatever the environment says); an FP16/BF16
    ``addmm`` keeps its bias inside the GEMM (cuBLASLt's FP32 epilogue) instead of being split
    into ``mm`` + a pointwise add.
    """
    from torch._inductor import config as inductor_config

    wanted = {"emulate_precision_casts": True, "max_autotune": False, "max_autotune_gemm": False,
              "keep_addmm_fused_for_half_dtypes": True}
    return {k: v for k, v in wanted.items() if hasattr(inductor_config, k)}


def build_package(ctx: BuildContext, variant: str) -> dict:
    """Write ``<variant>.pt2`` into ctx.out_dir (from the cache when possible); return its options."""
    from kkdeploy.models.weights import weights_sha256

    from . import inductor_cache as cache
    from .inductor_ops import OPS_VERSION

    device = torch.device(ctx.device)
    opaque, sdpa_layers = parse_variant(variant, ctx.config)
    weights_hash = weights_sha256(ctx.model)
    env = cache.environment_keys(device)
    key = cache.cache_key(ctx.config.to_dict(), dtype_name(ctx.dtype), variant, weights_hash,
                          {**env, "inductor_configs": faithful_inductor_configs()}, OPS_VERSION)
    root = cache.cache_dir(ctx.options)
    package_name = f"{variant}.pt2"
    dest = Path(ctx.out_dir) / package_name
    Path(ctx.out_dir).mkdir(parents=True, exist_ok=True)
    use_cache = ctx.options.get("inductor_cache", True)
    hit = cache.lookup(root, key) if use_cache else None
    if hit is not None:
        shutil.copyfile(hit[0], dest)  # a copy: the artifact directory must stand on its own
        info = hit[1]
    else:
        start = time.perf_counter()
        exported = export_variant(ctx.model, ctx.config, ctx.dtype, device, variant)
        export_seconds = time.perf_counter() - start
        metadata = {f"{METADATA_PREFIX}{k}": str(v) for k, v in {
            "variant": variant, "weights_sha256": weights_hash, "dtype": dtype_name(ctx.dtype),
            "config": json.dumps(ctx.config.to_dict(), sort_keys=True), "ops_version": OPS_VERSION,
            **{f"env.{k}": v for k, v in env.items()}}.items()}
        inductor_configs = {**faithful_inductor_configs(), "aot_inductor.metadata": metadata}
        start = time.perf_counter()
        torch._inductor.aoti_compile_and_package(exported, package_path=str(dest),
                                                 inductor_configs=inductor_configs)
        info = {"export_seconds": round(export_seconds, 3),
                "compile_seconds": round(time.perf_counter() - start, 3), "cache_key": key}
        if use_cache:
            cache.store(root, key, dest, info)
    return {
        "variant": variant,
        "package": package_name,
        "sha256": file_sha256(dest),
        "dtype": dtype_name(ctx.dtype),
        "config": ctx.config.to_dict(),
        "weights_sha256": weights_hash,
        "keys": env,
        "emulate_precision_casts": True,
        "inductor_configs": faithful_inductor_configs(),
        "opaque_ops": list(opaque),
        "sdpa_layers": sdpa_layers,
        "all_valid_only": bool(sdpa_layers),
        "mask_modes": ["all-valid"] if sdpa_layers else ["all-valid", "padded"],
        "cuda_graph": device.type == "cuda" and ctx.options.get("cuda_graph", True),
        "cache": "hit" if hit is not None else ("miss" if use_cache else "off"),
        "cache_key": key,
        "export_seconds": info.get("export_seconds"),
        "compile_seconds": info.get("compile_seconds"),
    }


BACKEND = InductorBackend()
# Opt-in (no default device): it compiles the same graph as torch-compile, and its package loader runs native code
# that has crashed fresh processes (docs/inductor.md); asked for, the fresh-process check guards it.
DESCRIPTOR = register(BackendDescriptor(
    key=InductorBackend.name, module=__name__, recipe_name="inductor", libraries=("torch",),
    choices=(BackendChoice("inductor"),),
    default_variants=lambda device, dtype, contract: default_variants(device),
    attentions=frozenset({"reference", "sdpa-last", "fused"})))

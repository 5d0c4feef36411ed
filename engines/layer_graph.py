"""The model as a few Triton launches of our own, captured in a CUDA graph (``kkdeploy.kernels.layer_kernels``).

The launch-bound shapes spend their time in the two dozen launches of the compiled graph. These candidates run the
same arithmetic in fewer launches, each part the tile a build proves on its own:

* ``layer-graph``: the whole model in **one persistent launch** (``kkdeploy.kernels._model_triton``): work items
  taken from a ticket in dependency order, readiness counters between them;
* ``layer-graph-split``: one launch per block plus one for each block's attention, 2L + 1 launches.

**Proven op by op before it is built.** The candidate runs the build's own inputs (the validation seed and the next,
all-valid and padded 0.25) and compares every buffer it writes with the reference's own ops at the same point
(``compare_intermediates``: norm1, the packed Q|K|V, each head's context, out_proj with its residual and norm2,
ffn_in, ffn_out with its residual and the next LayerNorm, per block). One differing element and the candidate is not
built; the reason names the part ("block 2 x2: 491 elements differ"). The record goes into the manifest
(``layer_proof``). The end-to-end strict validation then decides as for any candidate.

**Proven again wherever it loads.** Whether programs of one launch see each other's stores in order is the GPU's
property, not the arithmetic's, so ``load`` repeats the proof before it serves (the launches compile at load
anyway: a fraction of a second more), and checks the output fingerprint the build recorded. A difference is a
one-line error, and ``kkdeploy.load`` serves the PyTorch fallback with it.

Opt-in (``--backends layer-graph``): neither candidate has yet been measured faster than
``torch-compile-faithful-gemms`` on a GPU (docs/layer-kernels.md). CUDA and float16 only; the buffers hold every
block's intermediates, so a model of more than ``MAX_ROWS`` rows (B x S) is skipped.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch

from kkdeploy.artifacts import WEIGHTS_FILE
from kkdeploy.config import TransformerConfig, dtype_name
from kkdeploy.errors import KKError
from kkdeploy.inputs import DEFAULT_SEED, generate_case, padded_case

from .base import (BUILT, Backend, BuildContext, CandidateResult, CandidateSkipped, fingerprint_padding,
                   output_fingerprint)
from .registry import BackendChoice, BackendDescriptor, register

PERSISTENT, SPLIT = "layer-graph", "layer-graph-split"
VARIANTS = (PERSISTENT, SPLIT)
#: rows (B x S) above which the buffers of every block's intermediates are not worth it (shape 6: 1.28 M rows)
MAX_ROWS = 65536
#: the proof's inputs: (seed offset from the validation seed, padding ratio)
PROOF_CASES = ((0, 0.0), (0, 0.25), (1, 0.0), (1, 0.25))


def launch_for(candidate: str, config: TransformerConfig):
    """The ``LayerLaunch`` a candidate runs: the default attention form for this sequence length, split or one
    persistent launch."""
    from kkdeploy.kernels.layer_kernels import chain_in_registers_refusal, default_launch

    launch = dataclasses.replace(default_launch(config), persistent=candidate == PERSISTENT)
    # the row chain in registers where it applies (D <= 128, the persistent launch's D = 128; F <= 128 or tiles of
    # 128): the same bits, no reloads between its parts. Not the next block's Q|K|V in it: on an H100 at shape 3 it
    # took 0.168 ms where the chain alone took 0.143 (docs/layer-kernels.md)
    regs = dataclasses.replace(launch, chain_in_registers=True)
    return regs if chain_in_registers_refusal(config, regs) is None else launch


def refusal(config: TransformerConfig, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why the layer launches cannot serve this model here (one line), or None."""
    from kkdeploy.kernels import layer_kernels
    from kkdeploy.kernels.libdevice import LIBDEVICE_ENV, cuda_libdevice

    rows = config.batch_size * config.seq_len
    if rows > MAX_ROWS:
        return (f"B x S = {rows:,} rows: the layer launches keep every block's intermediates, at most "
                f"{MAX_ROWS:,} rows")
    why = layer_kernels.refusal(config, dtype, device)
    if why is None and not layer_kernels.INTERPRET:
        try:
            if cuda_libdevice() is None:  # the GELU is ATen's only with CUDA's erff
                why = (f"CUDA's libdevice.10.bc not found (the GELU links it): install the CUDA toolkit's nvvm or "
                       f"set {LIBDEVICE_ENV}")
        except KKError as exc:
            why = str(exc)
    return why


def prove_layers(kernels, model, config: TransformerConfig, dtype: torch.dtype, device: torch.device,
                 seed: int) -> dict:
    """Every intermediate of ``kernels`` against the reference's ops on the proof cases; the record says, per
    case, the differing elements of each part and the first part that differs. All-valid cases pass an all-True
    mask: the served graph always has one."""
    from kkdeploy.kernels.layer_kernels import compare_intermediates, reference_intermediates

    start = time.perf_counter()
    cases = []
    for offset, ratio in PROOF_CASES:
        if ratio:
            x, mask = padded_case(config, device, dtype, seed + offset, ratio)
        else:
            x, mask = generate_case(config, device, dtype, seed + offset)
        with torch.inference_mode():
            kernels(x, mask)
            got = kernels.intermediates(config.batch_size, config.seq_len)
            want = reference_intermediates(model, x, mask, kernels.launch.gelu_prologue)
            report = compare_intermediates(got, want)
        differing = report["hn0"] + report["qkv0"] + sum(sum(b.values()) for b in report["blocks"])
        cases.append({"seed": seed + offset, "padding_ratio": ratio, "differing": differing,
                      "first": report["first"], "parts": report})
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    stalls = kernels.stalls() if hasattr(kernels, "stalls") else 0
    return {"launch": kernels.launch.name(), "cases": cases, "differing": sum(c["differing"] for c in cases),
            "stalls": stalls, "seconds": round(time.perf_counter() - start, 3)}


def proof_failure(record: dict) -> str | None:
    """The one-line reason a proof record rejects the candidate, or None."""
    if record.get("stalls"):
        return (f"{record['launch']}: {record['stalls']} waits between its programs gave up (a readiness counter "
                f"never reached its count); its answers are not trusted")
    bad = next((c for c in record["cases"] if c["differing"]), None)
    if bad is None:
        return None
    part = bad["first"] or "output"
    count = bad["parts"]["hn0"] if part == "hn0" else bad["parts"]["qkv0"] if part == "qkv0" else None
    if count is None and part.startswith("block "):
        _, index, name = part.split()
        count = bad["parts"]["blocks"][int(index)][name]
    return (f"{record['launch']} is not bit-identical to the reference's ops: {part} differs in {count} "
            f"element{'' if count == 1 else 's'} (seed {bad['seed']}, padding {bad['padding_ratio']})")


def layer_proof_task(model, config: TransformerConfig, dtype: torch.dtype, device: torch.device, args: dict,
                     report) -> dict:
    """The proof of ``args["candidate"]``'s launches, run in a child (``kkdeploy.kernels.proof_process``)."""
    from kkdeploy.kernels.layer_kernels import LayerKernels

    report(args["candidate"], f"proving {args['candidate']} op by op in a fresh process")
    kernels = LayerKernels(model, launch_for(args["candidate"], config))
    return prove_layers(kernels, model, config, dtype, device, int(args["seed"]))


def prove_in_fresh_process(model, config: TransformerConfig, dtype: torch.dtype, device: torch.device,
                           candidate: str, seed: int) -> dict:
    """The proof record, made in a spawned child first: a launch that faults (session 36: at D = 32) ends that
    child, and the build's process, whose later candidates need a working device, never runs it. Raises a one-line
    KKError for a child that died, hung or failed, and for a record that rejects the candidate."""
    from kkdeploy.kernels.proof_process import OK, run_proof_child

    outcome = run_proof_child(f"{__name__}:layer_proof_task", model, config, dtype, device,
                              {"candidate": candidate, "seed": seed})
    if outcome.status != OK:
        raise KKError(f"{candidate}: its proof {outcome.reason} in a fresh process")
    why = proof_failure(outcome.answer)
    if why:
        raise KKError(why)
    return outcome.answer


def make_runner(model, config: TransformerConfig, dtype: torch.dtype, device: torch.device, candidate: str,
                seed: int, proven: dict | None = None):
    """(runner, proof record): the launches proven on this machine, then captured in a CUDA graph. Raises a
    one-line KKError when the proof finds a differing element. ``proven``: the record a fresh process just made
    of these launches on this machine (``prove_in_fresh_process``), taken instead of proving them again here."""
    from kkdeploy.kernels.layer_kernels import LayerKernels

    from .torch_graph import CudaGraphRunner

    kernels = LayerKernels(model, launch_for(candidate, config))
    record = proven if proven is not None else prove_layers(kernels, model, config, dtype, device, seed)
    why = proof_failure(record)
    if why:
        raise KKError(why)
    runner = CudaGraphRunner(model, config, dtype, device, all_valid_only=False, forward=kernels.forward)
    runner.backend = candidate
    runner.kernels = kernels  # the graph reads its buffers and packed weights
    return runner, record


class LayerGraphBackend(Backend):
    name = "layer_graph"

    def unavailable_reason(self, device: torch.device, dtype: torch.dtype) -> str | None:
        if torch.device(device).type != "cuda":
            return "unavailable: the layer launches are Triton kernels for CUDA devices"
        if dtype != torch.float16:
            return f"unavailable: the layer launches reproduce float16 only, not {dtype_name(dtype)}"
        return None

    def candidates(self, ctx: BuildContext) -> list[str]:
        wanted = ctx.candidate_filter
        return [n for n in VARIANTS if wanted is None or n in wanted]

    def loads_native_code(self, entry: dict) -> bool:
        """Its launches are proven again where it loads, and a launch that faults would end the loading process:
        so it is loaded in a fresh process first (``engines.fresh_process``), as a native loader is."""
        return True

    def build(self, ctx: BuildContext, candidate: str) -> CandidateResult:
        from kkdeploy.kernels.proof_process import isolation_wanted
        from kkdeploy.models.weights import weights_sha256

        start = time.perf_counter()
        why = refusal(ctx.config, ctx.dtype, ctx.device)
        if why:
            raise CandidateSkipped(why)
        seed = int(ctx.validation_plan.get("seed", DEFAULT_SEED))
        proven = prove_in_fresh_process(ctx.model, ctx.config, ctx.dtype, ctx.device, candidate, seed) \
            if isolation_wanted(ctx.device) else None
        runner, record = make_runner(ctx.model, ctx.config, ctx.dtype, ctx.device, candidate, seed, proven)
        ratios = fingerprint_padding(False)
        fingerprint = output_fingerprint(runner, ctx.config, ctx.dtype, ctx.device, padding_ratios=ratios)
        options = {"variant": candidate, "dtype": dtype_name(ctx.dtype), "config": ctx.config.to_dict(),
                   "weights_sha256": weights_sha256(ctx.model), "torch": torch.__version__,
                   "launch": record["launch"], "layer_proof": record, "all_valid_only": False,
                   "mask_modes": ["all-valid", "padded"],
                   "fingerprint": {"seed": DEFAULT_SEED, "padding_ratios": list(ratios), "sha256": fingerprint}}
        ctx.keep_or_close(candidate, runner)
        return CandidateResult(name=candidate, backend=self.name, status=BUILT, files=[WEIGHTS_FILE],
                               options=options, build_seconds=round(time.perf_counter() - start, 3))

    def load(self, artifact_dir: Path, entry: dict, config: TransformerConfig, dtype: torch.dtype,
             device: torch.device):
        from safetensors.torch import load_file

        from .torch_graph import model_for_variant

        device = torch.device(device)
        options = entry.get("options") or {}
        name = entry.get("name", PERSISTENT)
        if options.get("config") != config.to_dict() or options.get("dtype") != dtype_name(dtype):
            raise KKError(f"{name} was built for {options.get('dtype')} {options.get('config')}; rebuild it here")
        why = refusal(config, dtype, device)
        if why:
            raise KKError(f"{name}: {why}")
        state = load_file(str(Path(artifact_dir) / WEIGHTS_FILE))
        model = model_for_variant({"model": "reference"}, config, dtype, device, state)
        cases = (options.get("layer_proof") or {}).get("cases") or [{}]
        seed = int(cases[0].get("seed", DEFAULT_SEED))  # the build's proof inputs, proven again here
        runner, record = make_runner(model, config, dtype, device, name, seed)
        recorded = options.get("fingerprint") or {}
        got = output_fingerprint(runner, config, dtype, device, recorded.get("seed", DEFAULT_SEED),
                                 recorded.get("padding_ratios", fingerprint_padding(False)))
        if got != recorded.get("sha256"):
            runner.close()
            raise KKError(f"{name} here does not reproduce the validated output (fingerprint {got[:12]} != "
                          f"{str(recorded.get('sha256'))[:12]}); rebuild the artifacts on this machine")
        runner.layer_proof = record
        return runner


BACKEND = LayerGraphBackend()
DESCRIPTOR = register(BackendDescriptor(
    key=LayerGraphBackend.name, module=__name__, recipe_name="layer-graph", libraries=("torch",),
    choices=(BackendChoice(PERSISTENT, variants=(PERSISTENT, )), BackendChoice(SPLIT, variants=(SPLIT, ))),
    default_variants=lambda device, dtype, contract: list(VARIANTS)))

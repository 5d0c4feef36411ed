"""The proof step of a build: every kernel op a candidate would run, proven here at the model's own op shapes.

Why: our kernels may stand in for ATen's ops only where they are bit-identical to them (design.md §6), and that is
a property of the device, the torch/CUDA/Triton build and the op shape (cuBLAS picks the reference's GEMM
algorithm per problem size). So before a candidate with our kernels is compiled, the build runs the model once in
eager on its own inputs (all-valid and padded), keeps the real inputs of each kernel op in the first and the last
layer, adds random inputs, and proves every launch variant of each op on them (``kkdeploy.kernels.proof``). The
ops then run the fastest bit-identical launch, or ATen where none is (or where ATen is faster). The end-to-end
strict validation still decides what ships.

``prove_model_kernels(model, config, dtype, device, kinds)`` returns a ``ModelProofs``: the records (one per op
shape; they go into the manifest) and the seconds spent. A record already made in this environment for the same
op shape (this process, or the on-disk cache) is reused, not re-proven.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import torch
import torch.nn.functional as F

from kkdeploy.config import TransformerConfig
from kkdeploy.inputs import DEFAULT_SEED, padded_case

from . import fused_linear, layer_norm, qkv_attention
from . import faithful_attention as attention_kernel
from .precompile import DEFAULT_WORKERS, parallel_compiles
from .proof import RANDOM_INPUTS, ProofCache, ProofRecord, RandomInput, launch_watch, lookup_proof, random_like

#: the kinds of kernel op a candidate can run, in the order they are proven
KINDS = ("attention", "layer_norm", "linear")
#: the padded input's ratio (the build's default padded trial)
PADDING_RATIO = 0.25
#: per op shape, the seconds a proof may spend on cases after the first (the first pays the compiles)
BUDGET_S = 20.0


@dataclass
class ModelProofs:
    """The records of one proof step, and what it spent."""
    records: list[ProofRecord] = field(default_factory=list)
    seconds: float = 0.0
    reused_records: list[ProofRecord] = field(default_factory=list, repr=False)  # found already made here
    #: where ``seconds`` went: the records looked up ("lookups"), the model's inputs captured ("cases"), the launches
    #: compiled ahead ("compile"), the proofs themselves ("prove"); what a build's time is trimmed by
    phases: dict = field(default_factory=dict)

    @property
    def reused(self) -> int:
        return len(self.reused_records)

    def of_kind(self, kind: str) -> list[ProofRecord]:
        return [r for r in self.records if r.op in _ops(kind)]

    def only(self, kinds: Iterable[str]) -> "ModelProofs":
        """The records of ``kinds`` (in the order they were proven), with this step's seconds."""
        wanted = set(kinds)
        records = [r for kind in KINDS if kind in wanted for r in self.of_kind(kind)]
        kept = {id(r) for r in records}
        return ModelProofs(records, self.seconds, [r for r in self.reused_records if id(r) in kept],
                           dict(self.phases))

    def proven(self, kind: str) -> bool:
        """Whether any op of ``kind`` runs our kernel."""
        return any(r.proven for r in self.of_kind(kind))

    def why_not(self, kind: str) -> str:
        records = self.of_kind(kind)
        return "; ".join(f"{r.shape}: {r.reason}" for r in records) or f"no {kind} op in this model"

    def to_list(self) -> list[dict]:
        return [r.to_dict() for r in self.records]


@dataclass
class _Layer:
    """One layer's kernel-op inputs on one input set."""
    x: torch.Tensor  # the block's input (norm1's input, out_proj's residual)
    h: torch.Tensor  # norm1(x): Q/K/V's input
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    context: torch.Tensor  # out_proj's input
    mid: torch.Tensor  # x after the attention's residual: norm2's input, ffn_out's residual
    h2: torch.Tensor  # norm2(mid): ffn_in's input
    f: torch.Tensor  # ffn_in(h2): GELU's input
    g: torch.Tensor  # GELU(ffn_in(h2)): ffn_out's input
    out: torch.Tensor  # the block's output


@torch.no_grad()
def capture_layers(model, x: torch.Tensor, mask: torch.Tensor, keep: Iterable[int]) -> dict[int, _Layer]:
    """Run the reference's blocks op by op (``Block.forward``'s order) and keep the kernel-op inputs of the layers
    in ``keep``; the last block's output is the final LayerNorm's input."""
    from kkdeploy.models.reference import zero_invalid_rows

    keep = set(keep)
    kept = {}
    for i, block in enumerate(model.layers):
        attention = block.attention
        h = block.norm1(x)
        q, k, v = attention.q_proj(h), attention.k_proj(h), attention.v_proj(h)
        context = attention.attend(attention.split_heads(q), attention.split_heads(k), attention.split_heads(v), mask)
        mid = x + zero_invalid_rows(attention.out_proj(context), mask)
        h2 = block.norm2(mid)
        f = block.ffn_in(h2)
        g = F.gelu(f, approximate="none")
        out = zero_invalid_rows(mid + block.ffn_out(g), mask)
        if i in keep:
            kept[i] = _Layer(x, h, q, k, v, context, mid, h2, f, g, out)
        x = out
    return kept


class _Cases:
    """The model's inputs and their captured layers; the cases of each op shape built on demand."""

    def __init__(self, model, config: TransformerConfig, dtype: torch.dtype, device: torch.device, seed: int):
        self.model, self.config, self.device = model, config, device
        last = config.num_layers - 1
        self.layer_ids = sorted({0, last})
        self.inputs = []
        for label, ratio in (("all-valid", 0.0), (f"padded {PADDING_RATIO:g}", PADDING_RATIO)):
            x, mask = padded_case(config, device, dtype, seed, ratio)
            self.inputs.append((label, mask, capture_layers(model, x, mask, self.layer_ids)))
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed + 1)
        _, padded_mask, padded_layers = self.inputs[-1]
        self.random_mask = padded_mask
        self.random_base = padded_layers[self.layer_ids[0]]

    def real(self):
        for label, mask, layers in self.inputs:
            for i in self.layer_ids:
                yield f"{label}, layer {i}", mask, layers[i], self.model.layers[i]

    def random(self, make: Callable[[RandomInput], object]):
        """One case per kind of random input (``proof.RANDOM_INPUTS``), in their order."""
        return [make(spec) for spec in RANDOM_INPUTS]

    def rand(self, t: torch.Tensor, spec: RandomInput) -> torch.Tensor:
        return random_like(t, spec, self.generator)

    # -- per op -------------------------------------------------------------------------------------------
    def attention(self):
        heads, causal = self.config.num_heads, self.config.causal
        cases = [attention_kernel.attention_case(label, layer.q, layer.k, layer.v, mask, heads, causal)
                 for label, mask, layer, _ in self.real()]
        base = self.random_base
        cases += self.random(lambda s: attention_kernel.attention_case(
            f"random {s.label}, padded", self.rand(base.q, s), self.rand(base.k, s), self.rand(base.v, s),
            self.random_mask, heads, causal))
        return cases

    def qkv_attention(self):
        """The Q|K|V attention launch's cases: each layer's normalized rows with its q/k/v weights, and random rows
        with the first layer's."""
        heads, causal = self.config.num_heads, self.config.causal

        def case(label, h, block, mask):
            projections = (block.attention.q_proj, block.attention.k_proj, block.attention.v_proj)
            return qkv_attention.qkv_attention_case(label, h, [p.weight for p in projections],
                                                    [p.bias for p in projections], mask, heads, causal)

        cases = [case(label, layer.h, block, mask) for label, mask, layer, block in self.real()]
        block = self.model.layers[self.layer_ids[0]]
        cases += self.random(lambda s: case(f"random {s.label}, padded", self.rand(self.random_base.h, s), block,
                                            self.random_mask))
        return cases

    def layer_norm(self):
        cases = []
        for label, mask, layer, block in self.real():
            cases.append(layer_norm.layer_norm_case(f"{label}, norm1", layer.x, block.norm1.weight, block.norm1.bias,
                                                    block.norm1.eps))
            cases.append(layer_norm.layer_norm_case(f"{label}, norm2", layer.mid, block.norm2.weight,
                                                    block.norm2.bias, block.norm2.eps))
        final = self.model.final_norm
        for label, mask, layers in self.inputs:  # with zero_invalid_rows after it where the graph runs it so
            out = layers[self.layer_ids[-1]].out
            cases.append(layer_norm.layer_norm_case(f"{label}, final_norm", out, final.weight, final.bias, final.eps,
                                                    valid=mask if layer_norm.MASKED_FINAL else None))
        base = self.random_base
        cases += self.random(lambda s: layer_norm.layer_norm_case(
            f"random {s.label}", self.rand(base.x, s), self.rand(final.weight, RANDOM_INPUTS[0]),
            self.rand(final.bias, RANDOM_INPUTS[0]), final.eps))
        return cases

    def linear(self, name: str):
        cases = []
        for label, mask, layer, block in self.real():
            cases.append(self._linear_case(name, label, mask, layer, block, lambda t: t))
        block = self.model.layers[self.layer_ids[0]]
        cases += self.random(lambda s: self._linear_case(name, f"random {s.label}, padded", self.random_mask,
                                                         self.random_base, block, lambda t: self.rand(t, s)))
        return cases

    def _next_norm(self, block):
        """The LayerNorm after ``block``'s ffn_out: the next block's norm1, or the final norm (whose invalid rows the
        model zeroes)."""
        layers = list(self.model.layers)
        i = layers.index(block)
        return (layers[i + 1].norm1, False) if i + 1 < len(layers) else (self.model.final_norm, True)

    def _linear_case(self, name, label, mask, layer, block, inputs):
        attention = block.attention
        if name == "out_proj_ln":
            norm = block.norm2
            return fused_linear.linear_layer_norm_case(label, inputs(layer.context), attention.out_proj.weight,
                                                       attention.out_proj.bias, inputs(layer.x), mask, norm.weight,
                                                       norm.bias, norm.eps, "add_masked")
        if name == "ffn_chain_qkv":  # the next block's norm1 and Q|K|V (the last layer's: the first block's)
            layers = list(self.model.layers)
            nxt = layers[(layers.index(block) + 1) % len(layers)]
            projections = (nxt.attention.q_proj, nxt.attention.k_proj, nxt.attention.v_proj)
            return fused_linear.ffn_layer_norm_qkv_case(label, inputs(layer.h2), block.ffn_in.weight, block.ffn_in.bias,
                                                        block.ffn_out.weight, block.ffn_out.bias, inputs(layer.mid),
                                                        mask, nxt.norm1.weight, nxt.norm1.bias, nxt.norm1.eps,
                                                        [p.weight for p in projections], [p.bias for p in projections])
        if name == "ffn_chain_ln":
            norm, zero_invalid = self._next_norm(block)
            return fused_linear.ffn_layer_norm_case(label, inputs(layer.h2), block.ffn_in.weight, block.ffn_in.bias,
                                                    block.ffn_out.weight, block.ffn_out.bias, inputs(layer.mid), mask,
                                                    norm.weight, norm.bias, norm.eps, zero_invalid)
        if name == "ffn_out_ln":
            norm, zero_invalid = self._next_norm(block)
            return fused_linear.linear_layer_norm_case(label, inputs(layer.g), block.ffn_out.weight,
                                                       block.ffn_out.bias, inputs(layer.mid), mask, norm.weight,
                                                       norm.bias, norm.eps, "masked_sum", zero_invalid=zero_invalid)
        if name in ("norm2_ffn_in", "norm2_ffn_in_gelu"):  # norm2 inside ffn_in (and its GELU)
            norm = block.norm2
            return fused_linear.norm_linear_case(label, inputs(layer.mid), norm.weight, norm.bias, norm.eps,
                                                 [block.ffn_in.weight], [block.ffn_in.bias],
                                                 "gelu" if name == "norm2_ffn_in_gelu" else "none")
        if name == "norm1_qkv":  # norm1 inside the packed Q|K|V
            norm, projections = block.norm1, (attention.q_proj, attention.k_proj, attention.v_proj)
            return fused_linear.norm_linear_case(label, inputs(layer.x), norm.weight, norm.bias, norm.eps,
                                                 [p.weight for p in projections], [p.bias for p in projections])
        return self._plain_linear_case(name, label, mask, layer, block, inputs)

    @staticmethod
    def _plain_linear_case(name, label, mask, layer, block, inputs):
        attention = block.attention
        if name == "qkv":
            projections = (attention.q_proj, attention.k_proj, attention.v_proj)
            return fused_linear.linear_case(label, inputs(layer.h), [p.weight for p in projections],
                                            [p.bias for p in projections])
        if name == "out_proj":
            return fused_linear.linear_case(label, inputs(layer.context), [attention.out_proj.weight],
                                            [attention.out_proj.bias], inputs(layer.x), mask, "add_masked")
        if name in ("ffn_in", "ffn_in_gelu"):
            return fused_linear.linear_case(label, inputs(layer.h2), [block.ffn_in.weight], [block.ffn_in.bias],
                                            epilogue="gelu" if name == "ffn_in_gelu" else "none")
        return fused_linear.linear_case(label, inputs(layer.g), [block.ffn_out.weight], [block.ffn_out.bias],
                                        inputs(layer.mid), mask, "masked_sum")


def kernel_op_shapes(config: TransformerConfig, kinds: Iterable[str],
                     launches: Optional[dict[str, list[str]]] = None) -> list[tuple[str, str, dict]]:
    """(kind, name, op shape) of every kernel op of ``kinds`` in a model of ``config``. The feed-forward launches
    (``fused_blocks.ffn_chain_launches``) only where a build proves their tiles (``fused_linear.FFN_BUILD_TILES``)
    or a study names one (``launches``), the LayerNorm prologue's launches (``fused_blocks.norm_launches``) likewise
    (``fused_linear.NORM_BUILD_TILES``, ``NORM_TILES``), and the Q|K|V attention launch likewise
    (``qkv_attention.BUILD_LAUNCHES``, or a study naming one of its forms, ``qkv_attention.LAUNCHES``, among the
    linear launches)."""
    from .fused_blocks import ffn_chain_launches, gelu_launches, layer_norm_launches, linear_launches, norm_launches

    b, s, d, h = config.batch_size, config.seq_len, config.d_model, config.num_heads
    shapes = []
    if "attention" in kinds:
        shapes.append(("attention", "attention", attention_kernel.proof_shape(b * h, s, d // h, config.causal)))
    if "layer_norm" in kinds:
        shapes.append(("layer_norm", "layer_norm", layer_norm.proof_shape(b * s, d)))
    if "linear" in kinds:
        named = (launches or {}).get("linear") or ()
        feed_forward = fused_linear.FFN_BUILD_TILES or any(t in fused_linear.FFN_TILES for t in named)
        prologue = fused_linear.NORM_BUILD_TILES or any(t in fused_linear.NORM_TILES for t in named)
        ops = {**linear_launches(config), **gelu_launches(config), **layer_norm_launches(config),
               **(ffn_chain_launches(config) if feed_forward else {}), **(norm_launches(config) if prologue else {})}
        for name, (m, n, k, form) in ops.items():
            shapes.append(("linear", name, fused_linear.proof_shape(m, n, k, form)))
        one_launch = qkv_attention.BUILD_LAUNCHES or any(t in qkv_attention.LAUNCHES for t in named)
        if "attention" in kinds and one_launch and qkv_attention.qkv_attention_refusal(s, d, h) is None:
            # the packed Q|K|V and the attention in one launch: a GEMM candidate's op, where the attention kernel runs
            shapes.append(("linear", "qkv_attention", qkv_attention.proof_shape(b, s, d, h, config.causal)))
    return shapes


def op_key(kind: str, shape: dict) -> str:
    """One op shape of a model as a string (a JSON key): its kind and its shape."""
    return f"{kind} {json.dumps(shape, sort_keys=True)}"


#: between an op key and a launch's name in a launch's key (``launch_key``)
LAUNCH_SEP = " launch "


def launch_key(op: str, launch: str) -> str:
    """One launch at one op shape (``op`` an ``op_key``): what a proving child names before the launch runs, and
    what ``refusals`` may hold to skip that launch alone."""
    return f"{op}{LAUNCH_SEP}{launch}"


def refused_launches(refusals: Optional[dict[str, str]], op: str) -> dict[str, str]:
    """{launch: reason} for the launch keys of ``op`` in ``refusals``."""
    head = f"{op}{LAUNCH_SEP}"
    return {key[len(head):]: why for key, why in (refusals or {}).items() if key.startswith(head)}


#: kind -> the module of its kernel op (``OP``, ``proof_environment``)
_MODULES = {"attention": attention_kernel, "layer_norm": layer_norm, "linear": fused_linear}
#: op shapes (by name) whose op is another module's than their kind's: the Q|K|V attention launch, proven with a GEMM
#: candidate's ops
_NAMED = {"qkv_attention": qkv_attention}


def _module(kind: str, name: Optional[str] = None):
    return _NAMED.get(name) or _MODULES[kind]


def _environment(kind: str, device, name: Optional[str], shape: dict) -> dict:
    """The proof environment of an op shape; a GEMM's depends on its form's tile family
    (``fused_linear.tile_family``), so the shape is always given."""
    module = _module(kind, name)
    if module is fused_linear:
        return module.proof_environment(device, shape["form"])
    return module.proof_environment(device)


def _op(kind: str, name: Optional[str] = None) -> str:
    return _module(kind, name).OP


def _ops(kind: str) -> set[str]:
    """The ops whose records belong to ``kind``."""
    return {_MODULES[kind].OP} | ({module.OP for module in _NAMED.values()} if kind == "linear" else set())


def prove_model_kernels(model, config: TransformerConfig, dtype: torch.dtype, device: torch.device | str,
                        kinds: Iterable[str] = KINDS, *, seed: int = DEFAULT_SEED, budget_s: float = BUDGET_S,
                        reuse: bool = True, cache: Optional[ProofCache] = None,
                        progress: Optional[Callable[[str], None]] = None,
                        launches: Optional[dict[str, list[str]]] = None,
                        compile_workers: int = DEFAULT_WORKERS,
                        refusals: Optional[dict[str, str]] = None,
                        on_op: Optional[Callable[[str], None]] = None,
                        on_launch: Optional[Callable[[str], None]] = None) -> ModelProofs:
    """Prove every kernel op of ``kinds`` at ``model``'s op shapes here (``reuse``: a record already made in this
    environment is taken as it is). Off CUDA or in another dtype the records say why nothing runs. ``launches``
    ({kind: names}) replaces the launch variants a build proves (a study of every variant: scripts/kernel_selftest.py).
    On CUDA every launch is compiled first, ``compile_workers`` at a time (``precompile``; 0: one by one, as each
    proof first runs it). ``refusals`` ({``op_key``: reason}): op shapes not to run at all (their proof took a
    process down: ``proof_process``), or, for a ``launch_key``, that launch alone; ``on_op(op_key)`` is called before
    the launches of each op shape run, and ``on_launch(launch_key)`` before each launch runs (a case, or its timing)."""
    device = torch.device(device)
    kinds = [k for k in KINDS if k in set(kinds)]
    start = time.perf_counter()
    result = ModelProofs()
    cases: Optional[_Cases] = None
    slots: list = []  # per op shape: its reused record, or (kind, name, shape, refusal) to prove
    for kind, name, shape in kernel_op_shapes(config, kinds, launches):
        found = (lookup_proof(_environment(kind, device, name, shape), _op(kind, name), shape, cache=cache)
                 if reuse else None)
        if refusals and op_key(kind, shape) in refusals:
            slots.append((kind, name, shape, refusals[op_key(kind, shape)]))
        elif found is not None:
            slots.append(found)
            result.reused_records.append(found)
        elif kind == "layer_norm" and device.type == "cuda" and compile_workers:
            # Whether the rows kernel can run is known once its CUDA library is built (nvcc: 3.5 s of shape 6's
            # cold build on the H200), so that is found out beside the captures and Triton's compiles (a Future,
            # read when the op is proven)
            builder = ThreadPoolExecutor(1, thread_name_prefix="kkdeploy-nvcc")
            slots.append((kind, name, shape, builder.submit(_refusal, kind, config, dtype, device)))
            builder.shutdown(wait=False)
        else:
            slots.append((kind, name, shape, _refusal(kind, config, dtype, device, name)))
    todo = [slot for slot in slots if isinstance(slot, tuple)]
    mark = start

    def phase(name: str) -> None:
        nonlocal mark
        now = time.perf_counter()
        result.phases[name] = round(result.phases.get(name, 0.0) + now - mark, 3)
        mark = now

    phase("lookups")
    if any(refusal is None or isinstance(refusal, Future) for *_, refusal in todo):
        cases = _Cases(model, config, dtype, device, seed)
        phase("cases")
        if compile_workers and device.type == "cuda":
            if progress:
                progress(f"compiling the launches of {len(todo)} op shapes")
            _compile_ahead(todo, cases, config, device, launches, compile_workers, refusals)
            phase("compile")
    for slot in slots:
        if not isinstance(slot, tuple):
            result.records.append(slot)
            continue
        kind, name, shape, refusal = slot
        if isinstance(refusal, Future):
            refusal = refusal.result()
        if on_op and refusal is None:  # an op shape whose launches are about to run
            on_op(op_key(kind, shape))
        if progress:
            progress(f"proving {name} {shape}")
        key = op_key(kind, shape)
        before = on_launch and (lambda launch, key=key: on_launch(launch_key(key, launch)))
        with launch_watch(before, refused_launches(refusals, key)):
            result.records.append(_prove(kind, name, shape, cases if refusal is None else None, config, device,
                                         budget_s, cache, refusal, (launches or {}).get(kind)))
    del cases
    phase("prove")
    result.seconds = round(time.perf_counter() - start, 3)
    return result


def _compile_ahead(todo, cases: _Cases, config, device, launches, workers: int,
                   refusals: Optional[dict[str, str]] = None) -> None:
    """Every launch of every op shape to prove, run once on its first case inside ``parallel_compiles``: Triton
    compiles them on a thread pool, and the proofs that follow find them compiled. The random inputs the proofs will
    draw are drawn again afterwards (the generator's state is put back), so the proofs see the same cases."""
    state = cases.generator.get_state()
    with parallel_compiles(workers):
        for kind, name, shape, refusal in todo:
            if refusal is not None:  # refused, or the rows LayerNorm (CUDA, built beside: nothing for Triton)
                continue
            try:  # ends in CompiledAhead once its launches are handed to the pool (a refused launch is not)
                with launch_watch(None, refused_launches(refusals, op_key(kind, shape))):
                    _prove(kind, name, shape, cases, config, device, BUDGET_S, None, None, (launches or {}).get(kind))
            except Exception:  # noqa: BLE001 - CompiledAhead, or an error the proof itself meets again and records
                pass
    cases.generator.set_state(state)


def _refusal(kind: str, config: TransformerConfig, dtype: torch.dtype, device: torch.device,
             name: Optional[str] = None) -> Optional[str]:
    """Why no kernel of ``kind`` (op shape ``name``) can run here at all (then no activations are captured for it)."""
    if name == "qkv_attention":
        return qkv_attention.kernel_refusal(config.seq_len, config.d_model, config.num_heads, dtype, device)
    if kind == "attention":
        return attention_kernel.kernel_refusal(config.seq_len, config.head_dim, dtype, device)
    if kind == "layer_norm":
        if dtype != torch.float16:
            return f"dtype {dtype}: the rows kernel is float16 only"
        return layer_norm.kernel_refusal(device) or layer_norm.row_reason(config.d_model, dtype)
    return fused_linear.kernel_refusal(dtype, device)


def _prove(kind, name, shape, cases: Optional[_Cases], config, device, budget_s, cache, refusal,
           launches: Optional[list[str]]) -> ProofRecord:
    if refusal is not None:  # not cached: asking again is cheap, and a refusal may not hold tomorrow (nvcc installed)
        return ProofRecord(op=_op(kind, name), shape=shape, environment=_environment(kind, device, name, shape),
                           reason=refusal)
    if name == "qkv_attention":
        named = [n for n in (launches or ()) if n in qkv_attention.LAUNCHES] or None
        return qkv_attention.prove_qkv_attention(device, cases.qkv_attention(), shape, launches=named,
                                                 budget_s=budget_s, cache=cache)
    if kind == "attention":
        fitting = [n for n in launches or () if attention_kernel.launch_fits(n, shape["seq_len"])] or None
        return attention_kernel.prove_attention(device, cases.attention(), shape["batch_heads"], shape["seq_len"],
                                                shape["head_dim"], shape["causal"], budget_s=budget_s, cache=cache,
                                                launches=fitting)
    if kind == "layer_norm":
        return layer_norm.prove_layer_norm(device, cases.layer_norm(), shape["rows"], shape["width"],
                                           budget_s=budget_s, cache=cache, launches=launches)
    if launches is not None:  # a list for the kind: the LayerNorm epilogue's tiles, or the GEMM's, that apply here
        if fused_linear.NORM_PROLOGUE in shape["form"].split("+"):
            launches = [t for t in launches if fused_linear.norm_tile_fits(t, shape["k"], shape["n"])]
        elif "ffn_chain" in shape["form"]:
            launches = [t for t in launches if fused_linear.ffn_tile_fits(t, shape["n"], shape["k"])]
        elif "layer_norm" in shape["form"]:
            launches = [t for t in launches if fused_linear.ln_tile_fits(t, shape["n"])]
        else:
            launches = [t for t in launches if t in fused_linear.TILES]
        launches = launches or None
    return fused_linear.prove_linear(device, cases.linear(name), shape["m"], shape["n"], shape["k"], shape["form"],
                                     budget_s=budget_s, cache=cache, launches=launches)


def adopt_recorded(records: Iterable[dict], device: torch.device | str) -> tuple[int, int]:
    """Take a manifest's proof records made in this very environment into this process (they hold here as they did
    at build time; the manifest keeps them, so nothing is written to disk on every load); returns (adopted, from
    another environment). The others need a proof here (``prove_model_kernels``)."""
    from .proof import remember_proof

    owner = {_op(k): (k, None) for k in KINDS}  # op -> (kind, op shape name)
    owner.update({module.OP: ("linear", name) for name, module in _NAMED.items()})
    adopted = foreign = 0
    for data in records or []:
        try:
            record = ProofRecord.from_dict(data)
            kind, name = owner.get(record.op, (None, None))
            here = None if kind is None else _environment(kind, device, name, record.shape)
        except (TypeError, KeyError):  # not a record this version writes (a GEMM's shape without its form)
            foreign += 1
            continue
        if kind is None:
            continue
        if record.environment == here:
            remember_proof(record, persist=False)
            adopted += 1
        else:
            foreign += 1
    return adopted, foreign

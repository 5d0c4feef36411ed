"""Whole blocks in one or two launches each: the reference model as a handful of Triton launches.

The launch-bound shapes (S <= 128, D <= 128) spend their time in two dozen small launches of the
``torch-compile-faithful-gemms`` graph. ``LayerKernels`` runs the same arithmetic as one launch per block (plus one
for the first norm1 and Q|K|V; ``_layer_triton``): each part is the very tile function a build proves on its own
(the rows LayerNorm, the packed Q|K|V GEMM, the ATen-order attention, out_proj with its residual and norm2, ffn_in,
ffn_out with GELU on its input, its residual and the next LayerNorm), so the parts round where the reference rounds.
With ``split`` (the default) the attention keeps its own launch, one program per head, before each block's launch:
in one launch the heads run one after another in a program that also holds the GEMMs' registers, and it spilled
and ran slower on the H200 (docs/layer-kernels.md).

The kernels link CUDA's libdevice (``cuda_libdevice``), per launch, through Triton's ``extern_libs``: ATen's GELU
calls that library's ``erff``, which Triton's bundled copy does not match on 151 float16 inputs.

Whether the composition is still bit-identical on a GPU is measured, not assumed: ``compare_intermediates`` runs
the reference op by op beside the kernels and reports, per block and per part, how many elements differ, so the
first differing bit has a name (``scripts/layer_kernels_h200.py``). On the CPU the kernels run under Triton's
interpreter (``tests/test_layer_kernels.py``) against the same tiles launched one by one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

from kkdeploy.errors import KKError
from kkdeploy.models.reference import zero_invalid_rows

from .fused_linear import LN_WIDTHS, multiprocessors, packed
from .libdevice import LIBDEVICE_ENV, cuda_libdevice  # noqa: F401  (the layer launches link it; re-exported)
from .paths import triton_available
from .proof import differing_elements

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
#: the attention forms a layer launch can take (``faithful_attention.LAUNCHES`` at 64 rows: wgmma tiles)
ATTENTION_FORMS = {
    "cached_mdiv": dict(cached=True, fast_div=True),
    "cached": dict(cached=True, fast_div=False),
    "three_pass_mdiv": dict(cached=False, fast_div=True),
    "three_pass": dict(cached=False, fast_div=False),
}
#: the parts of a block, in the order they run, as ``compare_intermediates`` names them
PARTS = ("ctx", "x1", "h2", "ff", "x2", "hn", "qkv_next")
BLOCK_M = 64  # 64 rows keep Hopper's wgmma in every tl.dot (docs/faithful-attention.md)
MAX_SEQ_LEN = 1024


def refusal(config, dtype: torch.dtype, device) -> Optional[str]:
    """None when the layer kernels can run a model of ``config`` here, else why not (one line)."""
    device = torch.device(device)
    if device.type != "cuda" and not INTERPRET:
        return f"{device.type} device: the layer kernels are CUDA-only"
    if dtype != torch.float16:
        return f"dtype {dtype}: the layer kernels reproduce float16 only"
    if config.d_model not in LN_WIDTHS:
        return f"d_model = {config.d_model}: a block's rows must fit one LayerNorm tile ({', '.join(map(str, LN_WIDTHS))})"
    if config.seq_len > MAX_SEQ_LEN:
        return f"seq_len = {config.seq_len} > {MAX_SEQ_LEN}: ATen's persistent softmax rows only"
    if config.ffn_dim % 16 or config.ffn_dim < 16:
        return f"ffn_dim = {config.ffn_dim}: a multiple of 16 is needed (tl.dot's K)"
    if not triton_available():
        return "triton is not importable"
    return None


@dataclass(frozen=True)
class LayerLaunch:
    """A layer launch's tiles: the attention form (``split``: the attention kernel's own launch, one program per
    head, before each block's launch), GELU on ffn_out's input or in ffn_in's epilogue, warps, and the libdevice the
    kernels link ("cuda": CUDA's, whose ``erff`` is ATen's GELU's; "triton": Triton's bundled copy)."""

    attention: str = "cached_mdiv"
    gelu_prologue: bool = True
    num_warps: int = 8
    num_stages: int = 2
    split: bool = True
    libdevice: str = "cuda"
    #: the whole model in one launch (``_model_triton``): work items taken from a ticket by a grid of
    #: ``programs_per_sm`` programs per multiprocessor, readiness counters between them
    persistent: bool = False
    programs_per_sm: int = 1
    #: (persistent) out_proj, ffn_in and ffn_out of a row tile as one work item, where ffn_in is one column tile
    row_chain: bool = True
    #: (D <= 128, F <= 128 or a multiple of 128) the row chain (the persistent launch's, or the block launch's parts
    #: B-E) keeps its rows in registers from out_proj to the next block's Q|K|V
    #: (``_model_triton._row_chain_registers``): no store, barrier and reload between its parts
    chain_in_registers: bool = False
    #: (with ``chain_in_registers``) the entry and each row chain also compute the next block's Q|K|V from the rows
    #: in registers: no Q|K|V work items, one hand-off fewer per block
    qkv_in_chain: bool = False
    #: (persistent) record when each work item was taken, ready and done (the GPU's clock): ``LayerKernels.trace()``
    trace: bool = False

    def name(self) -> str:
        if self.persistent:
            return (f"persistent_{self.attention}_w{self.num_warps}_p{self.programs_per_sm}"
                    f"{'' if self.row_chain else '_nochain'}{'_regs' if self.chain_in_registers else ''}"
                    f"{'_qkv' if self.qkv_in_chain else ''}"
                    f"{'' if self.libdevice == 'cuda' else '_tritonlib'}"
                    f"{'_trace' if self.trace else ''}")
        return (f"{self.attention}{'_split' if self.split else ''}{'' if self.gelu_prologue else '_gelu_epilogue'}"
                f"_w{self.num_warps}{'_regs' if self.chain_in_registers else ''}"
                f"{'' if self.libdevice == 'cuda' else '_tritonlib'}")


#: d_model at which each launch with the chain in registers has run on a GPU (an H100, Triton 3.6.0) without a
#: fault. At d_model 32 (shape 7) Triton compiled the persistent one into an attention that reads shared memory out of
#: bounds (compute-sanitizer: "Invalid __shared__ read of size 256 bytes" at ``_pv_step``'s ``tl.dot``), an illegal
#: address that ends the process's CUDA context. The interpreter cannot see that, so on a GPU a form runs only at the
#: widths where it has run; the interpreter tests keep covering the arithmetic at every width.
GPU_RUN_WIDTHS = {"persistent": (128, ), "split": (32, 128), "fused": ()}


def chain_in_registers_refusal(config, launch: LayerLaunch) -> Optional[str]:
    """None when a launch's row chain (the persistent launch's, or the block launch's parts B-E) can keep its rows
    in registers for ``config``, else why not (one line): a row must be one LayerNorm tile of D / 4 lanes of 4 (D 16,
    32, 64 or 128), and ffn_in's column tiles the split launch's: one power of two up to 128, or tiles of 128."""
    if launch.qkv_in_chain and not launch.chain_in_registers:
        return "the next block's Q|K|V in the chain needs the chain in registers (chain_in_registers=True)"
    if launch.qkv_in_chain and not launch.persistent:
        return "the block launches compute the next block's Q|K|V already (qkv_in_chain is the persistent launch's)"
    if launch.persistent and not launch.row_chain:
        return "it is a form of the persistent launch's row chain (row_chain=True)"
    if not launch.gelu_prologue:
        return "the chain computes GELU on ffn_out's input (gelu_prologue=True)"
    if config.d_model not in LN_WIDTHS:
        return (f"d_model = {config.d_model}: a row must be one LayerNorm tile in registers "
                f"(d_model {', '.join(map(str, LN_WIDTHS))})")
    f = config.ffn_dim
    if not ((16 <= f <= 128 and not f & (f - 1)) or f % 128 == 0):
        return f"ffn_dim = {f}: ffn_in's column tiles must be one power of two of 16 to 128, or tiles of 128"
    form = "persistent" if launch.persistent else "split" if launch.split else "fused"
    if not INTERPRET and config.d_model not in GPU_RUN_WIDTHS[form]:
        widths = ", ".join(map(str, GPU_RUN_WIDTHS[form])) or "none yet"
        return (f"d_model = {config.d_model}: on a GPU the {form} launch keeps its chain in registers only at the "
                f"widths where it has run without a fault (d_model {widths})")
    return None


def _pow2(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


def default_launch(config) -> LayerLaunch:
    """Cached attention where a row fits four 32-key chunks (S <= 128), else three passes."""
    return LayerLaunch(attention="cached_mdiv" if config.seq_len <= 128 else "three_pass_mdiv")


class LayerKernels:
    """A reference model's weights packed for the layer launches, and static buffers for one (B, S).

    ``forward(x, mask)`` returns the final LayerNorm's output (a buffer the next call overwrites: the CUDA-graph
    runner clones it); ``intermediates()`` the buffers of the last call, per block, for op-by-op comparison."""

    def __init__(self, model, launch: Optional[LayerLaunch] = None):
        config = model.config
        reason = refusal(config, model.dtype, model.device)
        if reason:
            raise KKError(f"layer kernels: {reason}")
        self.config, self.launch = config, launch or default_launch(config)
        if self.launch.attention not in ATTENTION_FORMS:
            raise KKError(f"unknown attention form {self.launch.attention!r}; the forms are {', '.join(ATTENTION_FORMS)}")
        if ATTENTION_FORMS[self.launch.attention]["cached"] and config.seq_len > 128:
            raise KKError(f"attention form {self.launch.attention!r} holds rows of at most 128 keys (S = {config.seq_len})")
        if self.launch.persistent and not self.launch.gelu_prologue:
            raise KKError("the persistent launch computes GELU on ffn_out's input only (gelu_prologue=True)")
        if self.launch.trace and (INTERPRET or not self.launch.persistent):
            raise KKError("tracing reads the GPU's clock in the persistent launch: CUDA and persistent=True only")
        if self.launch.chain_in_registers or self.launch.qkv_in_chain:
            why = chain_in_registers_refusal(config, self.launch)
            if why:
                raise KKError(f"layer kernels: the row chain in registers: {why}")
        if self.launch.programs_per_sm < 1:
            raise KKError(f"programs_per_sm = {self.launch.programs_per_sm}: at least 1")
        self.model = model  # the packed Q|K|V tensors are copies; every other parameter is read in place
        with torch.no_grad():
            qkv = [packed([p.weight for p in projections], [p.bias for p in projections])
                   for projections in ((b.attention.q_proj, b.attention.k_proj, b.attention.v_proj)
                                       for b in model.layers)]
        self.qkv_weights, self.qkv_biases = [w for w, _ in qkv], [b for _, b in qkv]
        self.stacked = self._stacked_weights() if self.launch.persistent else None
        from ._fused_linear_triton import COMPILE_FLAGS  # the proven kernels' IEEE arithmetic

        # compile options of every launch, the libdevice looked up once here, not per call
        self.flags = {} if INTERPRET else dict(COMPILE_FLAGS)
        self.libdevice = None
        if not INTERPRET and self.launch.libdevice == "cuda":
            self.libdevice = cuda_libdevice()
            if self.libdevice is None:
                raise KKError(f"layer kernels: CUDA's libdevice not found (set {LIBDEVICE_ENV} to its libdevice.10.bc)")
            self.flags["extern_libs"] = {"libdevice": self.libdevice}
        self._buffers: dict = {}
        self.compiled: dict = {}  # launch name -> Triton's compiled kernel (registers, spills)

    def _stacked_weights(self) -> dict:
        """Every block's parameters stacked [L, ...] (copies), for the persistent launch that indexes them by block;
        the next LayerNorm of block l is block l + 1's norm1, or final_norm for the last."""
        layers = list(self.model.layers)
        nxt = [b.norm1 for b in layers[1:]] + [self.model.final_norm]
        stack = lambda ts: torch.stack([t.detach() for t in ts]).contiguous()  # noqa: E731
        eps = lambda norms: torch.tensor([float(n.eps) for n in norms], dtype=torch.float32,  # noqa: E731
                                         device=self.model.device)
        with torch.no_grad():
            return {
                "wqkv": stack(self.qkv_weights), "bqkv": stack(self.qkv_biases),
                "wo": stack([b.attention.out_proj.weight for b in layers]),
                "bo": stack([b.attention.out_proj.bias for b in layers]),
                "ln2_g": stack([b.norm2.weight for b in layers]), "ln2_b": stack([b.norm2.bias for b in layers]),
                "w1": stack([b.ffn_in.weight for b in layers]), "b1": stack([b.ffn_in.bias for b in layers]),
                "w2": stack([b.ffn_out.weight for b in layers]), "b2": stack([b.ffn_out.bias for b in layers]),
                "lnn_g": stack([n.weight for n in nxt]), "lnn_b": stack([n.bias for n in nxt]),
                "eps2": eps([b.norm2 for b in layers]), "epsn": eps(nxt),
            }

    def buffers(self, batch: int, seq_len: int) -> dict:
        """The launches' buffers for inputs [batch, seq_len, D] (made once per shape; a graph captures them). Each
        kind is one [L, rows, width] tensor, listed per block as views: the persistent launch indexes the block."""
        key = (batch, seq_len)
        if key not in self._buffers:
            c, dev = self.config, self.model.device
            m, d, f, n = batch * seq_len, c.d_model, c.ffn_dim, len(self.model.layers)
            stacks = {name: torch.empty(n, m, width, dtype=torch.float16, device=dev)
                      for name, width in (("qkv", 3 * d), ("ctx", d), ("x1", d), ("h2", d), ("ff", f), ("x2", d),
                                          ("hn", d))}
            self._buffers[key] = {"hn0": torch.empty(m, d, dtype=torch.float16, device=dev), "stacks": stacks,
                                  **{name: list(t.unbind(0)) for name, t in stacks.items()}}
        return self._buffers[key]

    def sync(self, batch: int, seq_len: int) -> torch.Tensor:
        """The persistent launch's ticket and readiness counters, zeroed once: each call's last program zeroes them
        for the next."""
        from . import _model_triton

        key = ("sync", batch, seq_len)
        if key not in self._buffers:
            tiles = batch * -(-seq_len // BLOCK_M)
            self._buffers[key] = torch.zeros(_model_triton.sync_size(len(self.model.layers), tiles),
                                             dtype=torch.int32, device=self.model.device)
        return self._buffers[key]

    def stalls(self) -> int:
        """Waits of the persistent launch that gave up since the buffers were made (``_model_triton.MAX_SPINS``): 0
        unless a wait could not be met. Reading it waits for the device."""
        from . import _model_triton

        return sum(int(t[_model_triton.STALLS.value]) for key, t in self._buffers.items()
                   if isinstance(key, tuple) and key[0] == "sync")

    def trace(self) -> dict:
        """The last traced call's timeline (``trace_summary``); reading it waits for the device."""
        if not self.launch.trace or getattr(self, "trace_buffer", None) is None:
            raise KKError("no traced call: run a persistent launch with LayerLaunch(trace=True) first")
        return trace_summary(self.trace_buffer.cpu(), item_kinds(**self.layout))

    def programs(self, items: int) -> int:
        """The persistent grid: ``programs_per_sm`` per multiprocessor, never more than the items; two under the
        interpreter (one takes every ticket, the other finds none: both paths run)."""
        if INTERPRET:
            return 2
        return max(1, min(items, multiprocessors(self.model.device) * self.launch.programs_per_sm))

    def forward(self, x: torch.Tensor, valid_token_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        import triton

        from . import _layer_triton as kernels
        from ._faithful_attention_triton import kernel_lanes, triton_attention
        from .faithful_attention import fp32_scale

        c, launch = self.config, self.launch
        b, s, d = x.shape
        if d != c.d_model:
            raise KKError(f"layer kernels: inputs of width {d}, the model's is {c.d_model}")
        if s > MAX_SEQ_LEN:
            raise KKError(f"layer kernels: seq_len {s} > {MAX_SEQ_LEN}")
        buf = self.buffers(b, s)
        x2d = x.reshape(b * s, d)
        if x2d.stride(-1) != 1 or x2d.stride(0) != d:
            x2d = x2d.contiguous()
        has_mask = valid_token_mask is not None
        mask = valid_token_mask.contiguous() if has_mask else x2d
        f, heads = c.ffn_dim, c.num_heads
        dh = d // heads
        form = ATTENTION_FORMS[launch.attention]
        lanes = kernel_lanes(s)
        cached = form["cached"]
        ncached = -(-s // lanes) if cached else 0
        tiles = dict(BLOCK_M=BLOCK_M, BN_QKV=min(128, _pow2(3 * d)), BK_D=min(64, max(16, _pow2(d))))
        run = dict(num_warps=launch.num_warps, num_stages=launch.num_stages, **self.flags)
        grid = (triton.cdiv(s, BLOCK_M), b)
        layers = list(self.model.layers)
        first = layers[0].norm1
        if launch.persistent:
            from . import _model_triton

            w, stacks = self.stacked, buf["stacks"]
            nqb = triton.cdiv(s, BLOCK_M)
            nrt = b * nqb
            bn_f = min(128, max(16, _pow2(f)))
            # the chain in registers takes ffn_in's column tiles one after another; through L2, one tile only
            chain = launch.row_chain and (f <= bn_f or launch.chain_in_registers)
            row_items = 1 if chain else 2 + -(-f // bn_f)
            chain_qkv = launch.qkv_in_chain and chain
            qkv_items = 0 if chain_qkv else -(-3 * d // tiles["BN_QKV"])  # per row tile and block
            items = nrt * (1 + len(layers) * (qkv_items + heads + row_items))
            self.layout = dict(row_tiles=nrt, layers=len(layers), qkv_tiles=qkv_items, heads=heads,
                               ffn_tiles=-(-f // bn_f), chain=chain)
            trace = {}
            if launch.trace:
                key = ("trace", b, s)
                if key not in self._buffers:
                    self._buffers[key] = torch.zeros(items, _model_triton.TRACE_COLUMNS.value, dtype=torch.int64,
                                                     device=self.model.device)
                trace = dict(TRACE_BUF=self._buffers[key], TRACE=True)
                self.trace_buffer = self._buffers[key]
            self.compiled["model"] = _model_triton._model_kernel[(self.programs(items), )](
                x2d, mask, buf["hn0"], stacks["qkv"], stacks["ctx"], stacks["x1"], stacks["h2"], stacks["ff"],
                stacks["x2"], stacks["hn"], self.sync(b, s),
                first.weight, first.bias, w["wqkv"], w["bqkv"], w["wo"], w["bo"], w["ln2_g"], w["ln2_b"],
                w["w1"], w["b1"], w["w2"], w["b2"], w["lnn_g"], w["lnn_b"], w["eps2"], w["epsn"],
                s, b * s, nqb, nrt, fp32_scale(d // heads), float(first.eps),
                L=len(layers), D=d, F=f, H=heads, HEAD_DIM=dh, DH_PAD=max(16, _pow2(dh)), LANES=lanes,
                NCACHED=ncached, FAST_DIV=form["fast_div"], CAUSAL=bool(c.causal), HAS_MASK=has_mask,
                ACCURATE=not INTERPRET, BK_F=min(64, max(16, _pow2(f))), BN_F=bn_f, SYNC_BLOCK=1024, ROW_CHAIN=chain,
                CHAIN_REGS=launch.chain_in_registers and chain, CHAIN_QKV=chain_qkv,
                **trace, **tiles, **run)
            return buf["hn"][-1].view(b, s, d)
        self.compiled["entry"] = kernels._entry_kernel[grid](
            x2d, buf["hn0"], buf["qkv"][0], first.weight, first.bias, self.qkv_weights[0], self.qkv_biases[0], s,
            float(first.eps), D=d, ACCURATE=not INTERPRET, CHAIN_REGS=launch.chain_in_registers, **tiles, **run)
        layer_input = x2d
        for i, block in enumerate(layers):
            last = i + 1 == len(layers)
            next_norm = self.model.final_norm if last else layers[i + 1].norm1
            nxt = i if last else i + 1  # the last block writes no Q|K|V: any buffer stands in
            att = block.attention
            if launch.split:  # the attention kernel's own launch (cached64w4's tiles) into the block's CTX buffer
                q, k, v = buf["qkv"][i].view(b, s, 3 * d).split(d, dim=-1)
                triton_attention(q, k, v, valid_token_mask, heads, c.causal, block_m=BLOCK_M, num_warps=4,
                                 cached=cached, fast_div=form["fast_div"], validate=False,
                                 out=buf["ctx"][i].view(b, s, d), libdevice=self.libdevice)
            self.compiled["last" if last else "layer"] = kernels._layer_kernel[grid](
                layer_input, buf["qkv"][i], mask, buf["ctx"][i], buf["x1"][i], buf["h2"][i], buf["ff"][i],
                buf["x2"][i], buf["hn"][i], buf["qkv"][nxt],
                att.out_proj.weight, att.out_proj.bias, block.norm2.weight, block.norm2.bias,
                block.ffn_in.weight, block.ffn_in.bias, block.ffn_out.weight, block.ffn_out.bias,
                next_norm.weight, next_norm.bias, self.qkv_weights[nxt], self.qkv_biases[nxt],
                s, fp32_scale(dh), float(block.norm2.eps), float(next_norm.eps),
                D=d, F=f, H=heads, HEAD_DIM=dh, DH_PAD=max(16, _pow2(dh)), LANES=lanes, SUB=1, ONE_PASS=False,
                NCACHED=ncached, FAST_DIV=form["fast_div"], CAUSAL=bool(c.causal), HAS_MASK=has_mask,
                ACCURATE=not INTERPRET, BK_F=min(64, max(16, _pow2(f))), BN_F=min(128, max(16, _pow2(f))),
                GELU_PROLOGUE=launch.gelu_prologue, LAST=last, FUSE_ATTENTION=not launch.split,
                CHAIN_REGS=launch.chain_in_registers, **tiles, **run)
            layer_input = buf["x2"][i]
        return buf["hn"][-1].view(b, s, d)

    def kernel_stats(self) -> dict:
        """Registers and spills of each launch as compiled here (Triton's CompiledKernel), for reports."""
        return {name: {"registers": getattr(k, "n_regs", None), "spills": getattr(k, "n_spills", None)}
                for name, k in self.compiled.items()}

    __call__ = forward

    def intermediates(self, batch: int, seq_len: int) -> dict:
        """The buffers of the last call: ``hn0`` and ``qkv0`` (the entry launch), then per block each of PARTS."""
        buf = self.buffers(batch, seq_len)
        n = len(self.model.layers)
        blocks = [{"ctx": buf["ctx"][i], "x1": buf["x1"][i], "h2": buf["h2"][i], "ff": buf["ff"][i],
                   "x2": buf["x2"][i], "hn": buf["hn"][i], "qkv_next": buf["qkv"][i + 1] if i + 1 < n else None}
                  for i in range(n)]
        return {"hn0": buf["hn0"], "qkv0": buf["qkv"][0], "blocks": blocks}


def item_kinds(row_tiles: int, layers: int, qkv_tiles: int, heads: int, ffn_tiles: int, chain: bool) -> list:
    """(kind, block) of each work item of the persistent launch, in ticket order (``_model_triton``'s layout): the
    entry's norm1 per row tile, then per block its Q|K|V tiles, attention heads, and out_proj, ffn_in and ffn_out
    (one "row_chain" item per row tile with ``chain``)."""
    kinds = [("entry", -1)] * row_tiles
    for layer in range(layers):
        kinds += [("qkv", layer)] * (row_tiles * qkv_tiles) + [("attention", layer)] * (row_tiles * heads)
        if chain:
            kinds += [("row_chain", layer)] * row_tiles
        else:
            kinds += ([("out_proj", layer)] * row_tiles + [("ffn_in", layer)] * (row_tiles * ffn_tiles)
                      + [("ffn_out", layer)] * row_tiles)
    return kinds


#: the parts of a row-chain item, timed by the traced launch (``_model_triton.TRACE_COLUMNS``)
CHAIN_STAGES = ("out_proj_norm2", "ffn_in", "ffn_out_gelu_norm")


def trace_summary(rows: torch.Tensor, kinds: list) -> dict:
    """Where a traced call's time went. ``rows`` [items, 6] int64: program, taken, ready (its waits met), the row
    chain's out_proj (with its residual and norm2) done, its ffn_in done, done, in the GPU's nanoseconds (the middle
    two for row-chain items only; a trace of 4 columns has none). Per kind: items, median wait and run (µs) and the
    run's sum, and for the row chain the median of each of its parts (``CHAIN_STAGES``); per block: when its first
    item was taken and its last done, from the call's start; the call's span, the programs that took work, and how
    busy they were (run time over span x programs)."""
    import statistics

    rows = [(r[0], r[1], r[2], r[-1], r[3:-1]) for r in rows.to(torch.int64).tolist()]
    if len(rows) != len(kinds):
        raise KKError(f"a trace of {len(rows)} items for a layout of {len(kinds)}")
    start = min(r[1] for r in rows)
    span = max(r[3] for r in rows) - start
    us = lambda ns: round(ns / 1000.0, 3)  # noqa: E731
    per_kind: dict = {}
    blocks: dict = {}
    for (program, taken, ready, done, middle), (kind, block) in zip(rows, kinds):
        entry = per_kind.setdefault(kind, {"wait": [], "run": [], "stages": []})
        entry["wait"].append(ready - taken)
        entry["run"].append(done - ready)
        if kind == "row_chain" and len(middle) == 2:
            marks = (ready, *middle, done)
            entry["stages"].append([b - a for a, b in zip(marks, marks[1:])])
        first, last = blocks.get(block, (taken, done))
        blocks[block] = (min(first, taken), max(last, done))
    programs = len({r[0] for r in rows})
    busy = sum(r[3] - r[2] for r in rows)

    def summary(v: dict) -> dict:
        out = {"items": len(v["run"]), "wait_us_median": us(statistics.median(v["wait"])),
               "run_us_median": us(statistics.median(v["run"])), "run_us_sum": us(sum(v["run"]))}
        if v["stages"]:
            out["stages_us_median"] = {name: us(statistics.median(s[i] for s in v["stages"]))
                                       for i, name in enumerate(CHAIN_STAGES)}
        return out

    return {
        "span_us": us(span), "items": len(rows), "programs": programs,
        "busy": round(busy / (span * programs), 4) if span and programs else None,
        "kinds": {kind: summary(v) for kind, v in per_kind.items()},
        "blocks": {("entry" if block < 0 else f"block {block}"): {"from_us": us(first - start),
                                                                  "to_us": us(last - start)}
                   for block, (first, last) in sorted(blocks.items())},
    }


@torch.no_grad()
def reference_intermediates(model, x: torch.Tensor, valid_token_mask: Optional[torch.Tensor],
                            gelu_prologue: bool = True) -> dict:
    """The reference's tensors at the points the layer launches write them (``model_proofs.capture_layers``: the
    reference's blocks op by op, the ATen ops eager runs), as [rows, width]: what ``compare_intermediates`` holds
    the kernels' buffers to."""
    from .model_proofs import capture_layers

    n = len(model.layers)
    layers = capture_layers(model, x, valid_token_mask, range(n))
    rows = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731
    qkv = lambda layer: rows(torch.cat([layer.q, layer.k, layer.v], dim=-1))  # noqa: E731
    blocks = []
    for i in range(n):
        layer = layers[i]
        if i + 1 < n:
            hn, qkv_next = layers[i + 1].h, qkv(layers[i + 1])
        else:
            hn, qkv_next = zero_invalid_rows(model.final_norm(layer.out), valid_token_mask), None
        blocks.append({"ctx": rows(layer.context), "x1": rows(layer.mid), "h2": rows(layer.h2),
                       "ff": rows(layer.f if gelu_prologue else layer.g), "x2": rows(layer.out), "hn": rows(hn),
                       "qkv_next": qkv_next})
    return {"hn0": rows(layers[0].h), "qkv0": qkv(layers[0]), "blocks": blocks}


def compare_intermediates(got: dict, want: dict) -> dict:
    """Differing elements per part: {"hn0": n, "qkv0": n, "blocks": [{part: n}], "first": "block 2 x1" or None}."""
    report = {"hn0": differing_elements(got["hn0"], want["hn0"]),
              "qkv0": differing_elements(got["qkv0"], want["qkv0"]), "blocks": []}
    first = next((name for name in ("hn0", "qkv0") if report[name]), None)
    for i, (g, w) in enumerate(zip(got["blocks"], want["blocks"])):
        row = {part: differing_elements(g[part], w[part]) for part in PARTS if w[part] is not None}
        report["blocks"].append(row)
        if first is None:
            first = next((f"block {i} {part}" for part in PARTS if row.get(part)), None)
    report["first"] = first
    return report

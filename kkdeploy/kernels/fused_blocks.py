"""The reference's blocks through our kernels' ops: what the ``torch-compile-faithful-gemms`` candidate exports.

``block_plan(config, dtype, device)`` says what can be fused for a model here (each op's path rules:
``fused_linear.linear_path``, ``faithful_attention.select_attention_path``); ``fused_block_forward`` is
``Block.forward`` with those ops and ``fused_model_forward`` the whole ``reference_forward`` with every LayerNorm
after the first inside the GEMM before it. Every op's CPU kernel is the reference's ATen composition, so on the CPU
both are the reference op for op (``tests/test_fused_linear.py`` checks them bit for bit).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .fused_linear import (FFN_FORM, FFN_QKV_FORM, LN_WIDTHS, ffn_layer_norm, ffn_layer_norm_qkv, fused_linear,
                           linear_layer_norm, linear_path, norm_form, norm_linear, reference_linear)


def linear_launches(config) -> dict[str, tuple[int, int, int, str]]:
    """Each Linear launch of a block as (M, N, K, form): Q/K/V packed, out_proj with its residual, ffn_in, ffn_out with
    its residual (the forms the proof step proves; ``block_plan`` asks for the others only if a proof exists)."""
    m, d, f = config.batch_size * config.seq_len, config.d_model, config.ffn_dim
    return {"qkv": (m, 3 * d, d, "none"), "out_proj": (m, d, d, "add_masked"), "ffn_in": (m, f, d, "none"),
            "ffn_out": (m, d, f, "masked_sum")}


def layer_norm_launches(config) -> dict[str, tuple[int, int, int, str]]:
    """The residual launches with the next LayerNorm in their epilogue (rows of at most 128 fit one tile): out_proj
    writing ``norm2(x)``, ffn_out writing the next block's ``norm1(x)`` (the last one ``final_norm``)."""
    m, d, f = config.batch_size * config.seq_len, config.d_model, config.ffn_dim
    if d not in LN_WIDTHS:
        return {}
    return {"out_proj_ln": (m, d, d, "add_masked+layer_norm"), "ffn_out_ln": (m, d, f, "masked_sum+layer_norm")}


def gelu_launches(config) -> dict[str, tuple[int, int, int, str]]:
    """ffn_in with the GELU in its epilogue: one launch instead of the GEMM and ATen's GELU (one kernel fewer per block,
    which the launch-bound shapes feel). Bit-identical only with CUDA's libdevice (``kkdeploy.kernels.libdevice``);
    its proof says whether it is, and whether it is faster than the two launches it replaces."""
    m, d, f = config.batch_size * config.seq_len, config.d_model, config.ffn_dim
    return {"ffn_in_gelu": (m, f, d, "gelu")}


def ffn_chain_launches(config) -> dict[str, tuple[int, int, int, str]]:
    """The block's whole feed-forward in one launch (ffn_in, GELU, ffn_out, residual and mask, the next LayerNorm),
    where its rows fit one LayerNorm tile: one launch per block fewer than ffn_in's and ffn_out's, and ffn_in's output
    never reaches memory. Its op shape is ffn_out's GEMM, (M, D, F)."""
    m, d, f = config.batch_size * config.seq_len, config.d_model, config.ffn_dim
    if d not in LN_WIDTHS:
        return {}
    launches = {"ffn_chain_ln": (m, d, f, FFN_FORM)}
    if config.num_layers > 1:  # every block but the last also computes the next block's Q|K|V
        launches["ffn_chain_qkv"] = (m, d, f, FFN_QKV_FORM)
    return launches


def norm_launches(config) -> dict[str, tuple[int, int, int, str]]:
    """The GEMMs that read their input through the block's LayerNorm before them (``norm_linear``), where a tile
    holds whole rows (D one of LN_WIDTHS): norm2 inside ffn_in, with its GELU or without, and norm1 inside the packed
    Q|K|V. Each saves the LayerNorm's launch; the launch-bound shapes feel each one."""
    m, d, f = config.batch_size * config.seq_len, config.d_model, config.ffn_dim
    if d not in LN_WIDTHS:
        return {}
    return {"norm2_ffn_in": (m, f, d, norm_form("none")), "norm2_ffn_in_gelu": (m, f, d, norm_form("gelu")),
            "norm1_qkv": (m, 3 * d, d, norm_form("none"))}


def norm_prologue_pays(config, dtype: torch.dtype, device, n: int, epilogue: str) -> bool:
    """Whether the launch [M, D] x [D, n] with the LayerNorm prologue and ``epilogue`` is proven here and, by the
    proofs' own timings, faster than the two launches it replaces: the rows LayerNorm (ours where chosen, else ATen's)
    and the plain GEMM with that epilogue (ours where chosen, else cuBLAS's)."""
    from .fused_linear import proven_ms
    from .layer_norm import proven_ms as layer_norm_ms

    m, d = config.batch_size * config.seq_len, config.d_model
    if d not in LN_WIDTHS:
        return False
    fused, plain = proven_ms(m, n, d, norm_form(epilogue), dtype, device), proven_ms(m, n, d, epilogue, dtype, device)
    norm = layer_norm_ms(m, d, dtype, device)
    if fused is None or fused[0] is None or plain is None or norm is None:
        return False  # not proven, or a part never timed here: keep the plan the proofs can vouch for
    return fused[0] < _best(plain) + _best(norm)


def ffn_chain_pays(config, dtype: torch.dtype, device) -> bool:
    """Whether the feed-forward launch is proven here and, by the proofs' own timings, faster than the two launches it
    replaces: ffn_in with its GELU (ours where chosen, else cuBLAS's GEMM and ATen's GELU) and ffn_out with the
    residual and the next LayerNorm (ours where chosen, else ATen's)."""
    from .fused_linear import proven_ms

    m, d, f = config.batch_size * config.seq_len, config.d_model, config.ffn_dim
    chain = proven_ms(m, d, f, FFN_FORM, dtype, device)
    if chain is None or chain[0] is None:
        return False
    parts = [proven_ms(m, f, d, "gelu", dtype, device), proven_ms(m, d, f, "masked_sum+layer_norm", dtype, device)]
    if any(ms is None for ms in parts):
        return False  # a part never timed here: keep the plan the proofs can vouch for
    return chain[0] < sum(_best(ms) for ms in parts)


def ffn_qkv_pays(config, dtype: torch.dtype, device) -> bool:
    """Whether the feed-forward launch with the next block's Q|K|V is proven here and, by the proofs' own timings,
    faster than the feed-forward launch and the packed Q|K|V launch (ours where chosen, else cuBLAS's) together."""
    from .fused_linear import proven_ms

    m, d, f = config.batch_size * config.seq_len, config.d_model, config.ffn_dim
    fused, chain, qkv = (proven_ms(m, d, f, FFN_QKV_FORM, dtype, device), proven_ms(m, d, f, FFN_FORM, dtype, device),
                         proven_ms(m, 3 * d, d, "none", dtype, device))
    if fused is None or fused[0] is None or chain is None or chain[0] is None or qkv is None:
        return False
    return fused[0] < chain[0] + _best(qkv)


def layer_norm_epilogues_pay(config, dtype: torch.dtype, device) -> bool:
    """Whether the LayerNorm epilogues are proven here and faster than what they replace: per block, two residual
    launches plus two LayerNorms (our rows kernel where proven, else ATen's), by the proofs' own timings."""
    from .fused_linear import proven_ms
    from .layer_norm import proven_ms as layer_norm_ms

    fused = [proven_ms(*launch, dtype, device) for launch in layer_norm_launches(config).values()]
    if len(fused) != 2 or any(ms is None or ms[0] is None for ms in fused):
        return False
    m, d = config.batch_size * config.seq_len, config.d_model
    launches = linear_launches(config)
    plain = [proven_ms(*launches[name], dtype, device) for name in ("out_proj", "ffn_out")]
    norm = layer_norm_ms(m, d, dtype, device)
    if any(ms is None for ms in plain) or norm is None:
        return False  # a part never timed here: keep the plan the proofs can vouch for
    return sum(ms[0] for ms in fused) < sum(_best(ms) for ms in plain) + 2 * _best(norm)


def block_plan(config, dtype: torch.dtype, device) -> dict:
    """What ``fused_block_forward`` fuses for a model of ``config`` here, each where a proof made here says so
    (``fused_linear.linear_path``): ``linears`` (which launches run our GEMM), ``gemms`` (our GEMMs at all: else
    the reference block with the attention op, so Inductor keeps fusing the elementwise ops), ``packed_qkv`` (Q/K/V
    in one launch: the attention kernel reads strided rows; ATen's attention keeps the reference's contiguous Q, K,
    V so cuBLAS sees the reference's strides), ``gelu_prologue`` (ffn_out computes GELU on its input: the GELU's
    output never reaches memory), ``gelu`` (else GELU in ffn_in's epilogue), ``layer_norm`` (each residual GEMM
    also writes the next LayerNorm of its rows: ``fused_model_forward``) and ``ffn_chain`` (with ``layer_norm``: the
    whole feed-forward in one launch, where proven and faster than the two it replaces: ``ffn_chain_pays``) and
    ``ffn_qkv`` (with ``ffn_chain`` and ``packed_qkv``: that launch also computes the next block's Q|K|V, where proven
    and faster than the packed Q|K|V launch it replaces: ``ffn_qkv_pays``) and ``qkv_attention`` (Q|K|V projected
    inside the attention's launch, where proven and faster than the two launches: ``qkv_attention_in_plan``).
    Without the LayerNorm epilogues, ``norm_ffn_in`` (norm2 computed by ffn_in on its way in) and ``norm_qkv`` (norm1
    by the packed Q|K|V, where the attention launch does not project them itself), each where proven and faster
    than the LayerNorm's launch and the GEMM's together (``norm_prologue_pays``)."""
    from .faithful_attention import select_attention_path

    launches = linear_launches(config)
    m, d, f = config.batch_size * config.seq_len, config.d_model, config.ffn_dim

    def proven(n: int, k: int, *parts: str) -> bool:
        return linear_path(m, n, k, dtype, device, epilogue="+".join(parts)).fused

    linears = {name: proven(n, k, form) for name, (_, n, k, form) in launches.items()}
    gemms = any(linears.values())
    attention = select_attention_path(config.seq_len, d // config.num_heads, dtype, device,
                                      batch_heads=config.batch_size * config.num_heads, causal=config.causal)
    layer_norm = gemms and layer_norm_epilogues_pay(config, dtype, device)
    gelu_prologue = gemms and proven(d, f, "gelu_prologue", "masked_sum", *(["layer_norm"] if layer_norm else []))
    ffn_chain = layer_norm and proven(d, f, FFN_FORM) and ffn_chain_pays(config, dtype, device)
    packed_qkv = linears["qkv"] and attention.fused
    ffn_qkv = (ffn_chain and packed_qkv and config.num_layers > 1 and proven(d, f, FFN_QKV_FORM)
               and ffn_qkv_pays(config, dtype, device))
    gelu = gemms and not gelu_prologue and proven(f, d, "gelu")
    qkv_attention = qkv_attention_in_plan(config, dtype, device, packed_qkv, ffn_qkv)
    prologues = gemms and not layer_norm  # the LayerNorm epilogues compute norm1 and norm2 already
    return {"gemms": gemms, "linears": linears, "packed_qkv": packed_qkv,
            "gelu_prologue": gelu_prologue, "gelu": gelu,
            "layer_norm": layer_norm, "ffn_chain": ffn_chain, "ffn_qkv": ffn_qkv, "qkv_attention": qkv_attention,
            "norm_ffn_in": prologues and norm_prologue_pays(config, dtype, device, f, "gelu" if gelu else "none"),
            "norm_qkv": prologues and packed_qkv and not qkv_attention and norm_prologue_pays(config, dtype, device,
                                                                                              3 * d, "none")}


def planned_linear_forms(config, plan: Optional[dict]) -> set[tuple[int, int, str]]:
    """The (N, K, form) of every GEMM launch a model of ``config`` computes under ``plan`` (``block_plan``'s), as
    ``fused_block_forward`` and ``fused_model_forward`` launch them, by our kernel or, where its proof chose ATen,
    by the reference's ops: of the op shapes the proofs timed, the ones a report may count as run (a proof is made
    for each form a plan might take, and a plan takes only some)."""
    if not plan or not plan.get("gemms"):
        return set()
    d, f = config.d_model, config.ffn_dim
    ln = "+layer_norm" if plan.get("layer_norm") else ""  # fused_model_forward: residual launches write the norm
    forms = {(d, d, "add_masked" + ln)}
    if not plan.get("packed_qkv"):
        forms.add((d, d, "none"))  # Q, K and V one by one
    elif not plan.get("qkv_attention"):
        forms.add((3 * d, d, norm_form("none") if plan.get("norm_qkv") else "none"))
    if plan.get("ffn_chain"):
        forms.add((d, f, FFN_FORM))
        if plan.get("ffn_qkv") and config.num_layers > 1:
            forms.add((d, f, FFN_QKV_FORM))
        return forms
    if plan.get("gelu_prologue"):
        ffn_in = "none"
        forms.add((d, f, "gelu_prologue+masked_sum" + ln))
    else:
        ffn_in = "gelu" if plan.get("gelu") else "none"
        forms.add((d, f, "masked_sum" + ln))
    forms.add((f, d, norm_form(ffn_in) if plan.get("norm_ffn_in") else ffn_in))  # norm2 on its way in, or not
    return forms


def qkv_attention_in_plan(config, dtype: torch.dtype, device, packed_qkv: bool, ffn_qkv: bool) -> bool:
    """Whether a block's Q|K|V and attention run as one launch (``qkv_attention``): where the packed Q|K|V and the
    attention kernel are both taken (``packed_qkv``), no feed-forward launch computes the next Q|K|V, and a proof
    made here found the launch bit-identical and, by the proofs' own times, faster than the two launches it replaces:
    the packed Q|K|V GEMM (ours where chosen, else cuBLAS's) and the attention's chosen launch."""
    from . import faithful_attention, fused_linear, qkv_attention

    if not packed_qkv or ffn_qkv:
        return False
    b, s, d, h = config.batch_size, config.seq_len, config.d_model, config.num_heads
    one = qkv_attention.proven_ms(b, s, d, h, config.causal, dtype, device)
    gemm = fused_linear.proven_ms(b * s, 3 * d, d, "none", dtype, device)
    attention = faithful_attention.proven_ms(b * h, s, d // h, config.causal, dtype, device)
    if one is None or one[0] is None or gemm is None or attention is None or attention[0] is None:
        return False  # not proven, or a part never timed here: keep the plan the proofs can vouch for
    return one[0] < _best(gemm) + attention[0]


def _best(ms: tuple) -> float:
    """A launch's time by its proof's (ours, ATen's) timings: ours where the proof chose ours, else ATen's."""
    return ms[0] if ms[0] is not None else ms[1]


def _linear(plan: dict, name: str, x, weights, biases, residual=None, mask=None, epilogue: str = "none",
            prologue: str = "none") -> torch.Tensor:
    """One of the block's launches (``linear_launches``' names): our op where the plan has our GEMM for it (or does
    not say), else the reference's own ops in the graph. Why not the op both ways: the op's fallback runs the ATen
    composition eagerly inside one opaque call (the GEMM, then the mask's inversion, ``masked_fill`` and the add as
    three more kernels), where in the graph Inductor fuses the residual and the mask into one elementwise pass with
    eager's rounding, which is also what the proof timed ATen's side as (``fused_linear.compiled_baseline``)."""
    if plan.get("linears", {}).get(name, True):
        return fused_linear(x, weights, biases, residual, mask, epilogue, prologue)
    return reference_linear(x, list(weights), list(biases), residual, mask, epilogue, prologue)


def _projections(attention, h: torch.Tensor, plan: dict):
    """Q, K and V of the normalized rows h: one launch where packed."""
    projections = (attention.q_proj, attention.k_proj, attention.v_proj)
    if plan["packed_qkv"]:
        qkv = fused_linear(h, [p.weight for p in projections], [p.bias for p in projections])
        return qkv.split(h.shape[-1], dim=-1)
    return tuple(_linear(plan, "qkv", h, [p.weight], [p.bias]) for p in projections)


def _attention(attention, h: torch.Tensor, valid_token_mask, plan: dict, qkv=None) -> torch.Tensor:
    """The attention op's context for the normalized rows h (before out_proj), or for the packed Q|K|V ``qkv`` the
    previous block's feed-forward launch computed; with the plan's ``qkv_attention``, Q, K and V projected inside the
    attention's launch (``qkv_attention``)."""
    from .faithful_attention import faithful_attention

    if qkv is None and plan.get("qkv_attention"):
        from .qkv_attention import qkv_attention

        return qkv_attention(h, attention, valid_token_mask)
    q, k, v = _projections(attention, h, plan) if qkv is None else qkv.split(qkv.shape[-1] // 3, dim=-1)
    return faithful_attention(q, k, v, valid_token_mask, num_heads=attention.num_heads, causal=attention.causal)


def _ffn_input(block, h2: Optional[torch.Tensor], plan: dict, x: Optional[torch.Tensor] = None
               ) -> tuple[torch.Tensor, str]:
    """ffn_out's input and prologue: ffn_in's output with ffn_out computing the GELU, or GELU(ffn_in) already. ffn_in
    reads the normalized rows ``h2``, or with the plan's ``norm_ffn_in`` the rows ``x`` through norm2 itself."""
    weights, biases = [block.ffn_in.weight], [block.ffn_in.bias]
    epilogue = "gelu" if plan["gelu"] and not plan.get("gelu_prologue") else "none"
    if plan.get("norm_ffn_in"):
        y = norm_linear(x, block.norm2, weights, biases, epilogue)
    elif epilogue == "gelu":
        y = fused_linear(h2, weights, biases, epilogue="gelu")
    else:
        y = _linear(plan, "ffn_in", h2, weights, biases)
    if plan.get("gelu_prologue"):
        return y, "gelu"
    return (y if epilogue == "gelu" else F.gelu(y, approximate="none")), "none"


def fused_block_forward(block, x: torch.Tensor, valid_token_mask: Optional[torch.Tensor], plan: dict) -> torch.Tensor:
    """``Block.forward`` (models/reference.py) with our GEMMs as ``block_plan`` says: Q/K/V in one launch, the
    attention op, out_proj + residual + mask and ffn_out + residual + mask in the GEMMs' epilogues, the GELU where
    proven (ffn_out's prologue, ffn_in's epilogue) or ATen's, and a launch whose proof chose ATen as the reference's
    own ops (``_linear``). The reference's ops and rounding points throughout."""
    attention = block.attention
    if plan.get("norm_qkv"):  # norm1 inside the packed Q|K|V's launch
        projections = (attention.q_proj, attention.k_proj, attention.v_proj)
        qkv = norm_linear(x, block.norm1, [p.weight for p in projections], [p.bias for p in projections])
        context = _attention(attention, None, valid_token_mask, plan, qkv)
    else:
        context = _attention(attention, block.norm1(x), valid_token_mask, plan)
    x = _linear(plan, "out_proj", context, [attention.out_proj.weight], [attention.out_proj.bias], x,
                valid_token_mask, "add_masked")
    g, prologue = _ffn_input(block, None if plan.get("norm_ffn_in") else block.norm2(x), plan, x)
    if prologue == "gelu":  # the GELU-prologue launch, proven on its own (``gelu_prologue``)
        return fused_linear(g, [block.ffn_out.weight], [block.ffn_out.bias], x, valid_token_mask, "masked_sum",
                            prologue)
    return _linear(plan, "ffn_out", g, [block.ffn_out.weight], [block.ffn_out.bias], x, valid_token_mask,
                   "masked_sum")


def fused_model_forward(model, x: torch.Tensor, valid_token_mask: Optional[torch.Tensor], plan: dict) -> torch.Tensor:
    """``ReferenceTransformer.reference_forward`` with every LayerNorm after the first inside the GEMM before it:
    out_proj's epilogue writes ``x`` and ``norm2(x)``, ffn_out's writes ``x`` and the next block's ``norm1(x)`` (the
    last one's ``final_norm(x)`` with the reference's final ``zero_invalid_rows``). The reference's ops and rounding
    points throughout; ``plan`` as ``block_plan`` gives it."""
    layers = list(model.layers)
    h, qkv = layers[0].norm1(x), None
    for i, block in enumerate(layers):
        attention = block.attention
        context = _attention(attention, h, valid_token_mask, plan, qkv)
        x, h2 = linear_layer_norm(context, attention.out_proj.weight, attention.out_proj.bias, x, valid_token_mask,
                                  block.norm2, "add_masked")
        last = i + 1 == len(layers)
        next_norm = model.final_norm if last else layers[i + 1].norm1
        if plan.get("ffn_chain") and plan.get("ffn_qkv") and not last:  # ... and the next block's Q|K|V
            nxt = layers[i + 1].attention
            x, qkv = ffn_layer_norm_qkv(h2, block.ffn_in, block.ffn_out, x, valid_token_mask, next_norm,
                                        (nxt.q_proj, nxt.k_proj, nxt.v_proj))
            continue
        qkv = None
        if plan.get("ffn_chain"):  # the whole feed-forward in one launch
            x, h = ffn_layer_norm(h2, block.ffn_in, block.ffn_out, x, valid_token_mask, next_norm, zero_invalid=last)
            continue
        g, prologue = _ffn_input(block, h2, plan)
        x, h = linear_layer_norm(g, block.ffn_out.weight, block.ffn_out.bias, x, valid_token_mask, next_norm,
                                 "masked_sum", prologue, zero_invalid=last)
    return h

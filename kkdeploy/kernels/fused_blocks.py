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

from .fused_linear import LN_EPILOGUES, fused_linear, linear_layer_norm, linear_path


def block_plan(config, dtype: torch.dtype, device) -> dict:
    """What ``fused_block_forward`` fuses for a model of ``config`` here: ``gemms`` (our GEMMs at all: else the
    reference block with the attention op, so Inductor keeps fusing the elementwise ops), ``packed_qkv`` (Q/K/V in
    one launch: the attention kernel reads strided rows; ATen's attention keeps the reference's contiguous Q, K, V
    so cuBLAS sees the reference's strides), ``gelu`` (GELU in ffn_in's epilogue, where that is proven) and
    ``layer_norm`` (each residual GEMM also writes the next LayerNorm of its rows, where proven:
    ``fused_model_forward``)."""
    from .faithful_attention import select_attention_path

    m, d = config.batch_size * config.seq_len, config.d_model
    gemms = linear_path(m, d, d, dtype, device).fused and config.ffn_dim == d
    attention = select_attention_path(config.seq_len, d // config.num_heads, dtype, device,
                                      batch_heads=config.batch_size * config.num_heads)
    layer_norm = gemms and d == 128 and all(linear_path(m, d, d, dtype, device, epilogue=f"{e}+layer_norm").fused
                                            for e in LN_EPILOGUES)
    return {"gemms": gemms, "packed_qkv": gemms and attention.fused,
            "gelu": gemms and linear_path(m, d, d, dtype, device, epilogue="gelu").fused,
            "layer_norm": layer_norm}


def fused_block_forward(block, x: torch.Tensor, valid_token_mask: Optional[torch.Tensor], plan: dict) -> torch.Tensor:
    """``Block.forward`` (models/reference.py) with our GEMMs as ``block_plan`` says: Q/K/V in one launch, the
    attention op, out_proj + residual + mask and ffn_out + residual + mask in the GEMMs' epilogues, ffn_in + GELU
    (the GELU in the epilogue where proven, else ATen's GELU after the GEMM). The reference's ops and rounding
    points throughout."""
    from .faithful_attention import faithful_attention

    attention = block.attention
    d = x.shape[-1]
    h = block.norm1(x)
    projections = (attention.q_proj, attention.k_proj, attention.v_proj)
    if plan["packed_qkv"]:
        qkv = fused_linear(h, [p.weight for p in projections], [p.bias for p in projections])
        q, k, v = qkv.split(d, dim=-1)
    else:
        q, k, v = (fused_linear(h, [p.weight], [p.bias]) for p in projections)
    context = faithful_attention(q, k, v, valid_token_mask, num_heads=attention.num_heads, causal=attention.causal)
    x = fused_linear(context, [attention.out_proj.weight], [attention.out_proj.bias], x, valid_token_mask,
                     "add_masked")
    h2 = block.norm2(x)
    if plan["gelu"]:
        g = fused_linear(h2, [block.ffn_in.weight], [block.ffn_in.bias], epilogue="gelu")
    else:
        g = F.gelu(fused_linear(h2, [block.ffn_in.weight], [block.ffn_in.bias]), approximate="none")
    return fused_linear(g, [block.ffn_out.weight], [block.ffn_out.bias], x, valid_token_mask, "masked_sum")


def fused_model_forward(model, x: torch.Tensor, valid_token_mask: Optional[torch.Tensor], plan: dict) -> torch.Tensor:
    """``ReferenceTransformer.reference_forward`` with every LayerNorm after the first inside the GEMM before it:
    out_proj's epilogue writes ``x`` and ``norm2(x)``, ffn_out's writes ``x`` and the next block's ``norm1(x)`` (the
    last one's ``final_norm(x)``), then the reference's final ``zero_invalid_rows``. The reference's ops and rounding
    points throughout; ``plan`` as ``block_plan`` gives it."""
    from kkdeploy.models.reference import zero_invalid_rows

    from .faithful_attention import faithful_attention

    layers = list(model.layers)
    h = layers[0].norm1(x)
    for i, block in enumerate(layers):
        attention = block.attention
        d = x.shape[-1]
        projections = (attention.q_proj, attention.k_proj, attention.v_proj)
        if plan["packed_qkv"]:
            q, k, v = fused_linear(h, [p.weight for p in projections], [p.bias for p in projections]).split(d, dim=-1)
        else:
            q, k, v = (fused_linear(h, [p.weight], [p.bias]) for p in projections)
        context = faithful_attention(q, k, v, valid_token_mask, num_heads=attention.num_heads, causal=attention.causal)
        x, h2 = linear_layer_norm(context, attention.out_proj.weight, attention.out_proj.bias, x, valid_token_mask,
                                  block.norm2, "add_masked")
        if plan["gelu"]:
            g = fused_linear(h2, [block.ffn_in.weight], [block.ffn_in.bias], epilogue="gelu")
        else:
            g = F.gelu(fused_linear(h2, [block.ffn_in.weight], [block.ffn_in.bias]), approximate="none")
        next_norm = layers[i + 1].norm1 if i + 1 < len(layers) else model.final_norm
        x, h = linear_layer_norm(g, block.ffn_out.weight, block.ffn_out.bias, x, valid_token_mask, next_norm,
                                 "masked_sum")
    return zero_invalid_rows(h, valid_token_mask)

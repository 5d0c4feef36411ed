"""The judge-contract fast model: packed QKV + SDPA in every block, for every mask.

Under the strict contract a float16 model cannot use fused attention in early blocks (design.md §6:
the residual stream amplifies its different rounding). A float32 model under the judge contract is a
different regime: SDPA on float32 heads only reorders float32 sums (max abs ~1e-6 on the CPU), so
attention can be fused everywhere, padded calls included, and the surrounding ops can be left to
Inductor's fusion. With TF32 (the organizer's float32 default on CUDA) those tiny differences can flip
the 10-bit rounding of GEMM inputs, so on the H200 the gap grows to max abs 0.85e-3-1.44e-3 (shapes 1-5,
7-12; judge atol 2e-3): still zero failed elements, with less margin, which is why validation gates it. Which blocks may also drop to float16 is chosen per
shape by the same precision repair as ``kkdeploy.mixed`` (``calibrate_layers``); validation decides
whether the result ships, as for every candidate.

Mask semantics equal the reference's: a query attends to earlier-or-same keys that are valid, and the
rows of invalid tokens are zeroed after attention, after each block and after the final LayerNorm.
A valid query always sees itself, so only invalid rows can be fully masked, and those are zeroed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .mixed import fp16_block_set
from .optimized import OptimizedTransformer
from .reference import ReferenceTransformer, zero_invalid_rows


def attention_mask(valid_token_mask: torch.Tensor, causal: bool) -> torch.Tensor:
    """[B,1,S,S] boolean keep-mask for SDPA: causal (when the model is) and valid keys only."""
    b, s = valid_token_mask.shape
    keep = valid_token_mask[:, None, None, :].expand(b, 1, s, s)
    if causal:
        keep = keep & torch.ones(s, s, dtype=torch.bool, device=valid_token_mask.device).tril()
    return keep


def masked_fused_attention(model: OptimizedTransformer, index: int, h: torch.Tensor,
                           valid_token_mask: torch.Tensor | None, keep: torch.Tensor | None) -> torch.Tensor:
    """Packed QKV + SDPA for one block, with the reference's padding semantics when a mask is given
    (``keep`` is ``attention_mask(valid_token_mask, causal)``, built once per forward by the caller)."""
    if valid_token_mask is None:
        return model.fused_attention(index, h)
    attn = model.layers[index].attention
    b, s, d = h.shape
    weight, bias = model.packed_qkv(index)
    qkv = F.linear(h, weight, bias).view(b, s, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
    context = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], attn_mask=keep, scale=attn.scale)
    out = attn.out_proj(context.transpose(1, 2).reshape(b, s, d))
    return zero_invalid_rows(out, valid_token_mask)


def _optimized_twin(reference: ReferenceTransformer, dtype: torch.dtype) -> OptimizedTransformer:
    model = OptimizedTransformer(reference.config, sdpa_layers=0)
    model.load_state_dict(reference.state_dict(), strict=True)
    model = model.to(device=reference.device, dtype=dtype).eval()
    model.freeze_packed_qkv(range(reference.config.num_layers))  # weights are final; traceable by Dynamo
    return model


class FusedTransformer(nn.Module):
    """SDPA in every block for all masks; ``fp16_layers`` compute in float16 (float32 models only).

    ``fused_forward(x, mask)`` takes ``None`` (all valid: SDPA's causal path, no mask tensor, so SDPA may
    pick its fused causal kernels) or a [B,S] bool mask (a [B,1,S,S] boolean attention mask, which keeps
    SDPA off FlashAttention). ``model(x, mask)`` routes by the mask's content; a compiled graph has a
    fixed path, so the compiled runner holds one graph per route (``engines.base.AllValidRouter``).
    """

    def __init__(self, reference: ReferenceTransformer, fp16_layers=()):
        super().__init__()
        layers = fp16_block_set(reference, fp16_layers)
        self.config = reference.config
        self.fp16_layers = layers
        self.main_model = _optimized_twin(reference, reference.dtype)  # its weights, packed and frozen
        self.fp16_model = _optimized_twin(reference, torch.float16) if layers else None

    @property
    def dtype(self) -> torch.dtype:
        return self.main_model.dtype

    @property
    def device(self) -> torch.device:
        return self.main_model.device

    def fused_forward(self, x: torch.Tensor, valid_token_mask: torch.Tensor | None = None) -> torch.Tensor:
        keep = None if valid_token_mask is None else attention_mask(valid_token_mask, self.config.causal)
        for index in range(self.config.num_layers):
            fp16 = index in self.fp16_layers
            model = self.fp16_model if fp16 else self.main_model
            block = model.layers[index]
            h = x.half() if fp16 else x
            h = h + masked_fused_attention(model, index, block.norm1(h), valid_token_mask, keep)
            h = zero_invalid_rows(h + block.feed_forward(h), valid_token_mask)
            x = h.to(self.dtype) if fp16 else h
        return zero_invalid_rows(self.main_model.final_norm(x), valid_token_mask)

    def all_valid_forward(self, x: torch.Tensor, valid_token_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``fused_forward`` for a mask known to be all True (the mask is not read): the causal route."""
        return self.fused_forward(x, None)

    def forward(self, x: torch.Tensor, valid_token_mask: torch.Tensor | None = None) -> torch.Tensor:
        self.main_model.check_call(x, valid_token_mask)
        if valid_token_mask is not None and not bool(valid_token_mask.all()):
            return self.fused_forward(x, valid_token_mask)
        return self.all_valid_forward(x)

"""The reference KernelKraft Transformer: design.md §2, operation for operation.

Every rounding point here is part of the contract that engines must reproduce: Linear via
``F.linear`` (bias added inside the GEMM), scores scaled by a Python float, softmax in FP32 then
cast back, exact-erf GELU, LayerNorm through ``nn.LayerNorm`` (FP32 statistics).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import TransformerConfig
from ..inputs import check_inputs


def zero_invalid_rows(t: torch.Tensor, valid_token_mask: torch.Tensor | None) -> torch.Tensor:
    """Rows of invalid tokens become exactly 0 (``where``, so a NaN row is replaced too)."""
    if valid_token_mask is None:
        return t
    return t.masked_fill(~valid_token_mask[..., None], 0)


def attention_core(q, k, v, valid_token_mask, scale: float, causal: bool) -> torch.Tensor:
    """Scores, scale, masks, FP32 softmax, probabilities and context on split heads [B,H,S,Dh] -> [B,H,S,Dh].

    Every rounding point here is one an engine must reproduce: the fp16 score GEMM, the multiply by the
    Python float ``scale`` (in FP32), the -inf masks, the softmax in FP32 cast back, the context GEMM.
    ``kkdeploy.kernels.faithful_attention`` runs exactly this on the CPU and proves its kernel against it.
    """
    s = q.shape[-2]
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    if causal:
        future = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    if valid_token_mask is not None:
        scores = scores.masked_fill(~valid_token_mask[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.matmul(probs, v)


class Attention(nn.Module):
    def __init__(self, d_model: int, num_heads: int, causal: bool):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.scale = self.head_dim ** -0.5  # a Python float: PyTorch multiplies in FP32 by it
        self.causal = causal
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)

    def split_heads(self, t: torch.Tensor) -> torch.Tensor:
        b, s, _ = t.shape
        return t.view(b, s, self.num_heads, self.head_dim).transpose(1, 2)

    def attend(self, q, k, v, valid_token_mask):
        """Reference-order attention on [B,H,S,Dh] heads; returns merged [B,S,D]."""
        b, _, s, _ = q.shape
        context = attention_core(q, k, v, valid_token_mask, self.scale, self.causal)
        return context.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim)

    def forward(self, h: torch.Tensor, valid_token_mask: torch.Tensor | None = None) -> torch.Tensor:
        q = self.split_heads(self.q_proj(h))
        k = self.split_heads(self.k_proj(h))
        v = self.split_heads(self.v_proj(h))
        out = self.out_proj(self.attend(q, k, v, valid_token_mask))
        return zero_invalid_rows(out, valid_token_mask)


class Block(nn.Module):
    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.d_model)
        self.attention = Attention(config.d_model, config.num_heads, config.causal)
        self.norm2 = nn.LayerNorm(config.d_model)
        self.ffn_in = nn.Linear(config.d_model, config.ffn_dim)
        self.ffn_out = nn.Linear(config.ffn_dim, config.d_model)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ffn_out(F.gelu(self.ffn_in(self.norm2(x)), approximate="none"))

    def forward(self, x, valid_token_mask=None):
        x = x + self.attention(self.norm1(x), valid_token_mask)
        x = x + self.feed_forward(x)
        return zero_invalid_rows(x, valid_token_mask)


class ReferenceTransformer(nn.Module):
    """Pre-norm causal Transformer; output shape equals input shape."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.final_norm = nn.LayerNorm(config.d_model)

    @property
    def dtype(self) -> torch.dtype:
        return self.final_norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.final_norm.weight.device

    def check_call(self, x, valid_token_mask) -> None:
        check_inputs(x, valid_token_mask, self.config.d_model, self.dtype, self.device)

    def reference_forward(self, x, valid_token_mask=None):
        for layer in self.layers:
            x = layer(x, valid_token_mask)
        return self.final(x, valid_token_mask)

    def final(self, x, valid_token_mask=None):
        """The final LayerNorm, then the invalid tokens' rows zeroed: a step of its own so that an engine can run
        the two as one op (engines/inductor.py, with our LayerNorm kernel)."""
        return zero_invalid_rows(self.final_norm(x), valid_token_mask)

    def forward(self, x: torch.Tensor, valid_token_mask: torch.Tensor | None = None) -> torch.Tensor:
        self.check_call(x, valid_token_mask)
        return self.reference_forward(x, valid_token_mask)

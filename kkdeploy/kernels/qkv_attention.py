"""``kkdeploy_faithful::qkv_attention``: the attention of a block from its normalized rows, Q, K and V projected
inside the attention's launch (a study; ``_qkv_attention_triton`` says what the launch computes and why).

The op is the reference's ATen composition everywhere (the model's q_proj, k_proj and v_proj, then
``reference_attention``) except where ``IN_BUILDS`` is set and the launch takes the shape: then the Triton launch.
``IN_BUILDS`` is off. No GPU has run the launch yet; a study flips it (``sed``) to time a whole graph with it, where
the bench validates every trial against the reference, bit for bit under the strict rule. It gives way to a proof of
the launch in the build once a GPU has shown it bit-identical and faster than the two launches it replaces. This
module imports only torch; Triton is imported where the launch runs.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .faithful_attention import reference_attention

OP_NAME = "kkdeploy_faithful::qkv_attention"
#: whether a build's graph takes the one launch (``fused_blocks.block_plan``'s "qkv_attention"); off until a GPU has
#: proven it (docs/faithful-attention.md, "Q, K and V in the attention's launch")
IN_BUILDS = False
#: the launch's options where it runs (``triton_qkv_attention``'s keywords: ``whole``, ``num_warps``, ...)
LAUNCH: dict = {}


def reference_qkv_attention(h, wq, wk, wv, bq, bk, bv, valid_token_mask, num_heads: int, causal: bool):
    """The reference's ops: three Linears of ``h``, then the attention composition; [B, S, D]."""
    return reference_attention(F.linear(h, wq, bq), F.linear(h, wk, bk), F.linear(h, wv, bv), valid_token_mask,
                               num_heads, causal)


def launch_takes(h: torch.Tensor, num_heads: int) -> bool:
    """Whether the one launch can run here on ``h`` [B, S, D]: CUDA, float16, Triton importable, rows and heads it
    takes."""
    from .paths import triton_available

    if h.device.type != "cuda" or h.dtype != torch.float16 or h.dim() != 3 or not triton_available():
        return False
    from ._qkv_attention_triton import qkv_attention_refusal

    return qkv_attention_refusal(h.shape[1], h.shape[2], num_heads) is None


@torch.library.custom_op(OP_NAME, mutates_args=())
def _qkv_attention_op(h: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, bq: torch.Tensor,
                      bk: torch.Tensor, bv: torch.Tensor, valid_token_mask: Optional[torch.Tensor], num_heads: int,
                      causal: bool) -> torch.Tensor:
    """Default (CPU and any non-CUDA device): the reference composition itself."""
    return reference_qkv_attention(h, wq, wk, wv, bq, bk, bv, valid_token_mask, num_heads, causal)


@_qkv_attention_op.register_kernel("cuda")
def _qkv_attention_cuda(h, wq, wk, wv, bq, bk, bv, valid_token_mask, num_heads, causal):
    """CUDA: the one launch where ``IN_BUILDS`` and the launch takes the shape, else the composition."""
    if IN_BUILDS and launch_takes(h, num_heads):
        from ._qkv_attention_triton import triton_qkv_attention

        return triton_qkv_attention(h, (wq, wk, wv), (bq, bk, bv), valid_token_mask, num_heads, causal, **LAUNCH)
    return reference_qkv_attention(h, wq, wk, wv, bq, bk, bv, valid_token_mask, num_heads, causal)


@_qkv_attention_op.register_fake
def _qkv_attention_fake(h, wq, wk, wv, bq, bk, bv, valid_token_mask, num_heads, causal):
    """Shapes only: the context is [B, S, D] like h."""
    return torch.empty_like(h, memory_format=torch.contiguous_format)


def qkv_attention(h: torch.Tensor, attention, valid_token_mask=None) -> torch.Tensor:
    """The context [B, S, D] of the reference ``Attention`` module ``attention`` on the normalized rows ``h``, before
    out_proj, through the op (one opaque call for ``torch.compile`` and CUDA graphs)."""
    return torch.ops.kkdeploy_faithful.qkv_attention(
        h, attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight, attention.q_proj.bias,
        attention.k_proj.bias, attention.v_proj.bias, valid_token_mask, attention.num_heads, attention.causal)

"""An independent, query-tiled reference for sequences whose dense scores cannot exist.

Same semantics and rounding points as ``ReferenceTransformer`` (design.md §2): separate Q/K/V
projections, scores ``(q @ k^T) * python_float`` in the model dtype, -inf for future and invalid
keys, softmax in FP32 then cast, ``probs @ v``, ``out_proj``, invalid rows zeroed. The only change
is the loop: one sequence and one tile of queries at a time, so the largest attention temporary
is ``[b, H, query_tile, S]`` (b = ``sequence_tile``, default the whole batch) instead of
``[B, H, S, S]``.

Every query row still sees its whole key row (``key_extent="full"``), so on one device and dtype
the result is bitwise equal to ``ReferenceTransformer`` (tests/test_longcontext.py checks it).
Tiles span the whole batch by default because the CPU's FP16 batched GEMM rounds differently
when the batch layout changes (measured: per-sequence score GEMMs differ in the last bit from
the reference's [B,H] GEMM); ``sequence_tile=1`` bounds memory by one sequence instead.
``key_extent="visible"`` stops each causal tile at its last query, halving the work; the softmax
and the ``probs @ v`` reduction then run over shorter rows and may differ in the last bit.
"""

from __future__ import annotations

import torch

from ..config import TransformerConfig
from ..errors import KKError
from .reference import ReferenceTransformer, zero_invalid_rows

KEY_EXTENTS = ("full", "visible")
DEFAULT_REFERENCE_QUERY_TILE = 256


def check_tiling(query_tile: int, key_extent: str = "full", sequence_tile: int | None = None) -> None:
    for name, value in (("query_tile", query_tile), ("sequence_tile", sequence_tile)):
        if value is None and name == "sequence_tile":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise KKError(f"{name} must be a positive integer, got {value!r}")
    if key_extent not in KEY_EXTENTS:
        raise KKError(f"key_extent must be one of {', '.join(KEY_EXTENTS)}, got {key_extent!r}")


def tiled_reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
                              valid_token_mask: torch.Tensor | None, query_tile: int,
                              key_extent: str = "full", sequence_tile: int | None = None) -> torch.Tensor:
    """Reference-order attention on [B,H,S,Dh] heads, one query tile (of ``sequence_tile`` sequences) at a time.

    Causality uses global indices (key index > query index is masked), so a tile at offset t0
    masks exactly what the dense reference masks in rows t0..t1.
    """
    check_tiling(query_tile, key_extent, sequence_tile)
    batch, _, seq, _ = q.shape
    step = batch if sequence_tile is None else sequence_tile
    context = torch.empty_like(q)
    key_index = torch.arange(seq, device=q.device)
    for b0 in range(0, batch, step):
        seqs = slice(b0, b0 + step)
        for t0 in range(0, seq, query_tile):
            t1 = min(seq, t0 + query_tile)
            k_end = t1 if (causal and key_extent == "visible") else seq
            scores = torch.matmul(q[seqs, :, t0:t1], k[seqs, :, :k_end].transpose(-2, -1)) * scale
            if causal:
                future = key_index[None, :k_end] > key_index[t0:t1, None]
                scores = scores.masked_fill(future, float("-inf"))
            if valid_token_mask is not None:
                scores = scores.masked_fill(~valid_token_mask[seqs, None, None, :k_end], float("-inf"))
            probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
            context[seqs, :, t0:t1] = torch.matmul(probs, v[seqs, :, :k_end])
            del scores, probs
    return context


class TiledReferenceTransformer(ReferenceTransformer):
    """``ReferenceTransformer`` with query-tiled attention; loads the same state dicts strictly."""

    def __init__(self, config: TransformerConfig, query_tile: int = DEFAULT_REFERENCE_QUERY_TILE,
                 key_extent: str = "full", sequence_tile: int | None = None):
        check_tiling(query_tile, key_extent, sequence_tile)
        super().__init__(config)
        self.query_tile = query_tile
        self.key_extent = key_extent
        self.sequence_tile = sequence_tile

    def tiled_attention_block(self, layer, h: torch.Tensor, valid_token_mask) -> torch.Tensor:
        attn = layer.attention
        q = attn.split_heads(attn.q_proj(h))
        k = attn.split_heads(attn.k_proj(h))
        v = attn.split_heads(attn.v_proj(h))
        context = tiled_reference_attention(q, k, v, attn.scale, attn.causal, valid_token_mask,
                                            self.query_tile, self.key_extent, self.sequence_tile)
        del q, k, v
        b, s, d = h.shape
        out = attn.out_proj(context.transpose(1, 2).reshape(b, s, d))
        return zero_invalid_rows(out, valid_token_mask)

    def reference_forward(self, x, valid_token_mask=None):
        for layer in self.layers:
            x = x + self.tiled_attention_block(layer, layer.norm1(x), valid_token_mask)
            x = x + layer.feed_forward(x)
            x = zero_invalid_rows(x, valid_token_mask)
        return zero_invalid_rows(self.final_norm(x), valid_token_mask)

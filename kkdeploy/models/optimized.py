"""The shipping PyTorch fallback: packed QKV + SDPA in the last ``sdpa_layers`` layers.

Fused attention perturbs FP16 rounding; in early layers the residual stream amplifies that past
the strict rule (design.md §6), so SDPA is confined to the last layers and only used where it
is provably equivalent in semantics: all-valid masks, no autograd.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import TransformerConfig
from ..errors import KKError
from ..inputs import AllValidMaskCache
from .reference import ReferenceTransformer


def packed_attention(attn, qkv: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """SDPA over a packed [B,S,3D] projection; merged [B,S,D] context. ``keep`` None: all keys valid (SDPA's
    causal path when the model is causal), else a [B,1,S,S] boolean keep-mask (``kkdeploy.models.fused.attention_mask``)."""
    b, s, _ = qkv.shape
    q, k, v = qkv.view(b, s, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
    causal = keep is None and attn.causal
    context = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, is_causal=causal, scale=attn.scale)
    return context.transpose(1, 2).reshape(b, s, attn.num_heads * attn.head_dim)


class OptimizedTransformer(ReferenceTransformer):
    def __init__(self, config: TransformerConfig, sdpa_layers: int = 1):
        super().__init__(config)
        if not 0 <= int(sdpa_layers) <= config.num_layers:
            raise KKError(f"sdpa_layers must be between 0 and num_layers={config.num_layers}, got {sdpa_layers}")
        self.sdpa_layers = int(sdpa_layers)
        self._packed: dict[int, tuple[tuple, torch.Tensor, torch.Tensor]] = {}
        self._frozen_packed: set[int] = set()
        self._mask_cache = AllValidMaskCache()

    def mask_is_all_valid(self, mask: torch.Tensor | None) -> bool:
        return self._mask_cache.is_all_valid(mask)

    # -- packed projections --------------------------------------------------------------
    def packed_qkv(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[Wq; Wk; Wv] and [bq; bk; bv], rebuilt whenever a source parameter changed (unless frozen)."""
        if index in self._frozen_packed:
            return getattr(self, f"packed_weight_{index}"), getattr(self, f"packed_bias_{index}")
        attn = self.layers[index].attention
        sources = (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight,
                   attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias)
        signature = tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in sources)
        cached = self._packed.get(index)
        if cached is not None and cached[0] == signature:
            return cached[1], cached[2]
        with torch.no_grad():
            weight = torch.cat(sources[:3], dim=0)
            bias = torch.cat(sources[3:], dim=0)
        self._packed[index] = (signature, weight, bias)
        return weight, bias

    def freeze_packed_qkv(self, indices) -> None:
        """Hold these layers' packed weights as (non-persistent) buffers and stop checking their sources.

        For ``torch.export`` / ``torch.compile``, which cannot trace the ``data_ptr()`` signature check.
        The buffers follow ``.to()``, but not later weight changes: freeze a model whose weights are final.
        """
        for index in indices:
            attn = self.layers[index].attention
            with torch.no_grad():  # no version check: inference tensors (a model made in inference mode) have none
                weight = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight], dim=0)
                bias = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias], dim=0)
            self.register_buffer(f"packed_weight_{index}", weight, persistent=False)
            self.register_buffer(f"packed_bias_{index}", bias, persistent=False)
            self._frozen_packed.add(index)

    def fused_attention(self, index: int, h: torch.Tensor) -> torch.Tensor:
        attn = self.layers[index].attention
        weight, bias = self.packed_qkv(index)
        return attn.out_proj(packed_attention(attn, F.linear(h, weight, bias), None))

    def fast_forward(self, x: torch.Tensor) -> torch.Tensor:
        first_fused = len(self.layers) - self.sdpa_layers
        for index, layer in enumerate(self.layers):
            if index >= first_fused:
                x = x + self.fused_attention(index, layer.norm1(x))
            else:
                x = x + layer.attention(layer.norm1(x), None)
            x = x + layer.feed_forward(x)
        return self.final_norm(x)

    def forward(self, x: torch.Tensor, valid_token_mask: torch.Tensor | None = None) -> torch.Tensor:
        self.check_call(x, valid_token_mask)
        if torch.is_grad_enabled() or not self.mask_is_all_valid(valid_token_mask):
            return self.reference_forward(x, valid_token_mask)
        return self.fast_forward(x)

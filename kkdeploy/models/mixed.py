"""Mixed precision in PyTorch: a float32 model whose chosen blocks compute in float16.

The judge contract lets a float32 candidate compute in float16 internally as long as every
element passes. This is the PyTorch twin of the exporter's ``ExportOptions.fp16_layers`` graph, with
the same semantics: the residual stream is cast to float16 on entry to a listed block, the block runs
exactly as the float16 model runs it (same ops, float16 weights), and its result is cast back to
float32; unlisted blocks and the final LayerNorm stay float32. Which blocks may be float16 is not
guessed: ``kkdeploy.pipeline.calibration.calibrate_layers`` searches it per shape against the validator.

``fast_forward`` (all-valid masks only) also swaps the float16 blocks' attention for packed QKV +
SDPA, as ``OptimizedTransformer`` does; float32 blocks keep the reference order.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import KKError
from ..inputs import AllValidMaskCache
from .optimized import OptimizedTransformer
from .reference import ReferenceTransformer, zero_invalid_rows


def fp16_block_set(reference: ReferenceTransformer, fp16_layers) -> tuple[int, ...]:
    """``fp16_layers`` as a sorted tuple, or a one-line KKError: indices out of range, or float16 blocks asked
    of a model that is not float32 (a float16 model is float16 throughout)."""
    layers = tuple(sorted(set(int(i) for i in fp16_layers)))
    if any(not 0 <= i < reference.config.num_layers for i in layers):
        raise KKError(f"fp16_layers {layers} out of range for a {reference.config.num_layers}-layer model")
    if layers and reference.dtype != torch.float32:
        raise KKError(f"float16 blocks need a float32 model, got {reference.dtype}; build it in float32")
    return layers


class MixedPrecisionTransformer(nn.Module):
    def __init__(self, reference: ReferenceTransformer, fp16_layers=(), sdpa_in_fp16_layers: bool = False):
        super().__init__()
        if reference.dtype != torch.float32:
            raise KKError(f"mixed precision starts from a float32 model, got {reference.dtype}; build it in float32")
        config = reference.config
        self.config = config
        self.fp16_layers = fp16_block_set(reference, fp16_layers)
        self.sdpa_in_fp16_layers = bool(sdpa_in_fp16_layers)
        self.reference = reference
        fp16_model = OptimizedTransformer(config, sdpa_layers=0)
        fp16_model.load_state_dict(reference.state_dict(), strict=True)
        self.fp16_model = fp16_model.to(device=reference.device, dtype=torch.float16).eval()
        self._mask_cache = AllValidMaskCache()

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def device(self) -> torch.device:
        return self.reference.device

    def reference_forward(self, x: torch.Tensor, valid_token_mask: torch.Tensor | None = None) -> torch.Tensor:
        for index, layer in enumerate(self.reference.layers):
            if index in self.fp16_layers:
                x = self.fp16_model.layers[index](x.half(), valid_token_mask).float()
            else:
                x = layer(x, valid_token_mask)
        return zero_invalid_rows(self.reference.final_norm(x), valid_token_mask)

    def fast_forward(self, x: torch.Tensor) -> torch.Tensor:
        """All-valid semantics; float16 blocks use packed SDPA when ``sdpa_in_fp16_layers``."""
        for index, layer in enumerate(self.reference.layers):
            if index not in self.fp16_layers:
                x = layer(x, None)
                continue
            h, block = x.half(), self.fp16_model.layers[index]
            if self.sdpa_in_fp16_layers:
                h = h + self.fp16_model.fused_attention(index, block.norm1(h))
            else:
                h = h + block.attention(block.norm1(h), None)
            x = (h + block.feed_forward(h)).float()
        return self.reference.final_norm(x)

    def forward(self, x: torch.Tensor, valid_token_mask: torch.Tensor | None = None) -> torch.Tensor:
        self.reference.check_call(x, valid_token_mask)
        if torch.is_grad_enabled() or not self._mask_cache.is_all_valid(valid_token_mask):
            return self.reference_forward(x, valid_token_mask)
        return self.fast_forward(x)

"""The judge-contract fast model: packed QKV + SDPA in every block, for every mask.

Under the strict contract a float16 model cannot use fused attention in early blocks (design.md §6:
the residual stream amplifies its different rounding). A float32 model under the judge contract is a
different regime: SDPA on float32 heads only reorders float32 sums (max abs ~1e-6 on the CPU), so
attention can be fused everywhere, padded calls included, and the surrounding ops can be left to
Inductor's fusion. With TF32 (the organizer's float32 default on CUDA) the reference rounds every GEMM
input to a 10-bit mantissa, so on the H200 the gap grows to max abs 0.85e-3-1.44e-3 (shapes 1-5, 7-12;
judge atol 2e-3): still zero failed elements, with less margin, which is why validation gates it. That
gap is TF32's own rounding (on the CPU, exact float32 is 1.09e-3 from an emulated TF32 reference on
shape 3), which opens a faster route with the same fidelity: ``half_gemm`` blocks feed float16 tensor
cores the values TF32 rounds to the same 10-bit mantissa and keep the rest in float32. Which blocks may
also drop to float16 is chosen per shape by the same precision repair as ``kkdeploy.models.mixed``
(``calibrate_layers``); validation decides whether the result ships, as for every candidate.

Mask semantics equal the reference's: a query attends to earlier-or-same keys that are valid, and the
rows of invalid tokens are zeroed after attention, after each block and after the final LayerNorm.
A valid query always sees itself, so only invalid rows can be fully masked, and those are zeroed.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import KKError
from .mixed import fp16_block_set
from .optimized import OptimizedTransformer, packed_attention
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
    attn = model.layers[index].attention
    weight, bias = model.packed_qkv(index)
    out = attn.out_proj(packed_attention(attn, F.linear(h, weight, bias), keep))
    return zero_invalid_rows(out, valid_token_mask)


def half_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``F.linear`` with float16 inputs and float32 accumulation, bias and output.

    Why: TF32 rounds a GEMM's float32 inputs to a 10-bit mantissa, which is float16's; so float16 tensor
    cores (twice TF32's rate) fed with the rounded inputs and accumulating in float32 keep the rounding
    points of the TF32 reference. ``weight`` holds float16 values in the form its route takes (see
    ``half_gemm_kernel``): a float16 weight runs as one cuBLAS GEMM (``aten::mm.dtype``), a float32 one
    (float16-rounded once, by the caller) as the same arithmetic in float32 (a product of two float16
    values is exact in float32).
    """
    x16 = x.to(torch.float16)
    if weight.dtype == torch.float16:
        flat = torch.ops.aten.mm.dtype(x16.reshape(-1, x16.shape[-1]), weight.t(), torch.float32)
        return flat.view(*x16.shape[:-1], weight.shape[0]) + bias  # one float32 rounding, as in the epilogue
    return F.linear(x16.float(), weight, bias)


MM_TO_FLOAT32 = "aten::mm.dtype (float16 x float16 -> float32)"
EMULATED = "float32 GEMM of float16-rounded inputs"


def half_gemm_kernel(device: torch.device | str) -> str:
    """Which GEMM ``half_gemm`` should run on ``device``: both compute the same thing, only the first runs
    on float16 tensor cores (CUDA, where torch can trace ``aten::mm.dtype``)."""
    return MM_TO_FLOAT32 if torch.device(device).type == "cuda" and mm_to_float32_traceable() else EMULATED


@functools.cache
def mm_to_float32_traceable() -> bool:
    """Whether this torch has ``aten::mm.dtype`` (float16 x float16 -> float32) with the meta kernel that
    ``torch.compile`` traces through (the H200's torch failed to fake-trace ``aten::addmm.dtype``: docs/results.md)."""
    try:
        a = torch.empty(2, 2, dtype=torch.float16, device="meta")
        return torch.ops.aten.mm.dtype(a, a, torch.float32).dtype == torch.float32
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def _optimized_twin(reference: ReferenceTransformer, dtype: torch.dtype) -> OptimizedTransformer:
    model = OptimizedTransformer(reference.config, sdpa_layers=0)
    model.load_state_dict(reference.state_dict(), strict=True)
    model = model.to(device=reference.device, dtype=dtype).eval()
    model.freeze_packed_qkv(range(reference.config.num_layers))  # weights are final; traceable by Dynamo
    return model


class FusedTransformer(nn.Module):
    """SDPA in every block for all masks; ``fp16_layers`` compute in float16 (float32 models only); with
    ``half_gemm`` the other blocks of a float32 model keep float32 activations but run every GEMM and
    attention on float16 inputs with float32 accumulation (``half_gemm_block``).

    ``fused_forward(x, mask)`` takes ``None`` (all valid: SDPA's causal path, no mask tensor, so SDPA may
    pick its fused causal kernels) or a [B,S] bool mask (a [B,1,S,S] boolean attention mask, which keeps
    SDPA off FlashAttention). ``model(x, mask)`` routes by the mask's content; a compiled graph has a
    fixed path, so the compiled runner holds one graph per route (``engines.base.AllValidRouter``).
    """

    def __init__(self, reference: ReferenceTransformer, fp16_layers=(), half_gemm: bool = False):
        super().__init__()
        layers = fp16_block_set(reference, fp16_layers)
        if half_gemm and reference.dtype != torch.float32:
            raise KKError(f"half_gemm rounds a float32 model's GEMM inputs to float16, got {reference.dtype}; "
                          "build it in float32")
        self.config = reference.config
        self.fp16_layers = layers
        self.half_gemm = bool(half_gemm)
        # half-GEMM blocks: the route chosen once for this model's device, the weights held as it takes them
        self.half_gemm_kernel = half_gemm_kernel(reference.device) if half_gemm else None
        tensor_cores = self.half_gemm_kernel == MM_TO_FLOAT32
        self.main_model = _optimized_twin(reference, reference.dtype)  # its weights, packed and frozen
        self.fp16_model = _optimized_twin(reference, torch.float16) if layers or tensor_cores else None
        self.gemm_model = None
        if half_gemm:  # float16 weights for tensor cores, else float16 values rounded once and held in float32
            self.gemm_model = self.fp16_model if tensor_cores else _optimized_twin(reference, torch.float16).float()

    @property
    def dtype(self) -> torch.dtype:
        return self.main_model.dtype

    @property
    def device(self) -> torch.device:
        return self.main_model.device

    def half_gemm_block(self, index: int, x: torch.Tensor, valid_token_mask: torch.Tensor | None,
                        keep: torch.Tensor | None) -> torch.Tensor:
        """One block at the TF32 reference's rounding points, on float16 tensor cores.

        Every value that TF32 rounds to a 10-bit mantissa (a GEMM input: LayerNorm outputs, Q, K, V, softmax
        probabilities, the attention context, GELU outputs) is rounded to float16 instead; everything TF32
        keeps in float32 (LayerNorm statistics, softmax, GELU, GEMM sums and biases, the residual stream)
        stays float32. Only Q/K/V and the context are stored in float16, as FlashAttention takes and gives.
        """
        main, half = self.main_model.layers[index], self.gemm_model.layers[index]
        weight, _ = self.gemm_model.packed_qkv(index)
        _, bias = self.main_model.packed_qkv(index)
        attn = main.attention
        qkv = half_gemm(main.norm1(x), weight, bias).to(torch.float16)
        context = packed_attention(attn, qkv, keep)
        x = x + zero_invalid_rows(half_gemm(context, half.attention.out_proj.weight, attn.out_proj.bias),
                                  valid_token_mask)
        hidden = F.gelu(half_gemm(main.norm2(x), half.ffn_in.weight, main.ffn_in.bias), approximate="none")
        x = x + half_gemm(hidden, half.ffn_out.weight, main.ffn_out.bias)
        return zero_invalid_rows(x, valid_token_mask)

    def fused_forward(self, x: torch.Tensor, valid_token_mask: torch.Tensor | None = None) -> torch.Tensor:
        keep = None if valid_token_mask is None else attention_mask(valid_token_mask, self.config.causal)
        for index in range(self.config.num_layers):
            fp16 = index in self.fp16_layers
            if self.half_gemm and not fp16:
                x = self.half_gemm_block(index, x, valid_token_mask, keep)
                continue
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
        if not self.main_model.mask_is_all_valid(valid_token_mask):  # cached: a reused mask costs no sync
            return self.fused_forward(x, valid_token_mask)
        return self.all_valid_forward(x)

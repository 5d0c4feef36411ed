"""Hand-written kernels that must round exactly where the reference rounds.

``faithful_attention`` is a fused attention for sequence lengths <= 1024 that is bit-identical to the
reference's ATen composition (``matmul -> * scale -> masked_fill -> softmax(float32) -> .half() ->
matmul``) on the GPU it was proven on, exposed as the custom op ``kkdeploy_faithful::attention``.
The call is ``kkdeploy.kernels.faithful_attention.faithful_attention(q, k, v, mask, num_heads=H, causal=True)``
(or ``torch.ops.kkdeploy_faithful.attention``); the name ``faithful_attention`` here stays the module.
Importing this package imports only torch; Triton is imported lazily, on CUDA, when the kernel runs.

``block_softmax`` describes and emulates ATen's block softmax for rows longer than 1024 (shape 14's 100,000
keys) and holds a fused causal softmax kernel in CUDA C++ (``csrc/block_softmax.cu``, built by nvcc on demand
through ``cuda_build``), the long-context path's where a build proved it bit-identical.

``layer_norm`` is ATen's float16 LayerNorm, one warp per row, for any width ATen's vector path takes
(``csrc/layer_norm.cu``, ATen's Welford steps from ``csrc/welford.cuh``), as the custom op
``kkdeploy_faithful::layer_norm_rows``, used by the ``torch-compile-faithful-kernels`` candidate.

``fused_linear`` is the reference's Linear with its next elementwise ops (residual add, mask, GELU) in a Triton
GEMM's epilogue, and Q/K/V in one launch, as the custom op ``kkdeploy_faithful::linear``, used by the
``torch-compile-faithful-gemms`` candidate through ``fused_blocks`` (the reference's blocks composed of these ops).
``qkv_attention`` is a block's packed Q|K|V GEMM and its attention in one launch (rows of 17-128 keys), as the
custom op ``kkdeploy_faithful::qkv_attention``, which that candidate's plan takes where its proof beats the two.

Every kernel runs only where a proof made in this environment found it bit-identical to the ATen op it replaces, at
the op shape of the call (``proof``, ``model_proofs``: the build's proof step; docs/kernel-proofs.md).
"""

from .faithful_attention import (
    MAX_FUSED_SEQ_LEN,
    OP_NAME,
    AttentionPath,
    emulate_persistent_softmax,
    reference_attention,
    select_attention_path,
)

__all__ = [
    "MAX_FUSED_SEQ_LEN",
    "OP_NAME",
    "AttentionPath",
    "emulate_persistent_softmax",
    "reference_attention",
    "select_attention_path",
]

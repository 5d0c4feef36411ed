"""Hand-written kernels that must round exactly where the reference rounds.

``faithful_attention`` is a fused attention for sequence lengths <= 1024 that is bit-identical to the
reference's ATen composition (``matmul -> * scale -> masked_fill -> softmax(float32) -> .half() ->
matmul``) on the GPU it was proven on, exposed as the custom op ``kkdeploy_faithful::attention``.
The call is ``kkdeploy.kernels.faithful_attention.faithful_attention(q, k, v, mask, num_heads=H, causal=True)``
(or ``torch.ops.kkdeploy_faithful.attention``); the name ``faithful_attention`` here stays the module.
Importing this package imports only torch; Triton is imported lazily, on CUDA, when the kernel runs.
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

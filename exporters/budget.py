"""Refuse shapes whose dense attention cannot exist, before anything is allocated."""

from __future__ import annotations

import torch

from kkdeploy.config import LONG_CONTEXT_SHAPES, TransformerConfig, format_bytes
from kkdeploy.errors import KKError

DEFAULT_MEMORY_BUDGET_BYTES = 8 << 30  # 8 GiB for the largest single attention tensor
BOUNDED_MEMORY_HINT = "kkdeploy check --shape 14 --reduced"


class DenseAttentionTooLarge(KKError):
    """The [B,H,S,S] scores of this shape do not fit the memory budget."""


def dense_attention_bytes(config: TransformerConfig) -> int:
    """Bytes of the largest tensor the graph holds: the FP32 [B,H,S,S] softmax input.

    The graph also holds the scores in the model dtype, so this is a lower bound on the peak.
    """
    return config.dense_score_bytes(torch.float32)


def dense_attention_bytes_ok(config: TransformerConfig, dtype: torch.dtype | None = None,
                             budget_bytes: int | None = None) -> bool:
    """True when a dense graph of this shape fits the budget (``dtype`` kept for API symmetry)."""
    budget = DEFAULT_MEMORY_BUDGET_BYTES if budget_bytes is None else int(budget_bytes)
    return dense_attention_bytes(config) <= budget


def ensure_dense_attention_fits(config: TransformerConfig, budget_bytes: int | None = None,
                                shape_id: int | None = None) -> int:
    """Raise a one-line error naming the estimate and the bounded-memory path; return the estimate."""
    budget = DEFAULT_MEMORY_BUDGET_BYTES if budget_bytes is None else int(budget_bytes)
    estimate = dense_attention_bytes(config)
    if shape_id in LONG_CONTEXT_SHAPES or estimate > budget:
        what = f"shape {shape_id}" if shape_id is not None else config.describe()
        long_context = shape_id in LONG_CONTEXT_SHAPES
        reason = "is a long-context shape" if long_context and estimate <= budget else f"is over the {format_bytes(budget)} budget"
        fix = "" if long_context else " or raise --memory-budget-gb"
        raise DenseAttentionTooLarge(
            f"{what} needs dense attention scores of {format_bytes(estimate)} ({estimate} bytes, FP32 [B,H,S,S]), "
            f"which {reason}; no dense ONNX graph is exported for it: use the bounded-memory path "
            f"(`{BOUNDED_MEMORY_HINT}`){fix}"
        )
    return estimate

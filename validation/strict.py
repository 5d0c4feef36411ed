"""The strict rule (design.md §5), element by element.

finite(ref) and finite(out) and (|out-ref| <= atol OR |out-ref| <= rtol*|ref|).
This is deliberately *not* ``torch.isclose`` (atol + rtol*|ref| is looser).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
import torch

CONTRACTS: dict[str, tuple[float, float]] = {"strict": (0.001, 0.01), "judge": (0.002, 0.02)}
DEFAULT_CONTRACT = "strict"  # the organizer's rule; "judge" is the looser one the judges score with

_CHUNK = 1 << 24  # elements compared at once in float64, so huge outputs stay bounded in memory
MAX_LISTED_FEATURES = 64


@dataclass
class ComparisonReport:
    atol: float
    rtol: float
    total: int
    failed: int
    nonfinite: int
    max_abs: float
    max_rel: float
    worst_index: list[int] | None
    worst_reference: float | None
    worst_candidate: float | None
    failing_features: list[int] = field(default_factory=list)
    failing_feature_count: int = 0

    @property
    def passed(self) -> bool:
        return self.failed == 0

    def to_dict(self) -> dict:
        data = asdict(self)
        data["passed"] = self.passed
        return data

    def summary(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        return (f"{verdict} failed {self.failed}/{self.total} max_abs {self.max_abs:.3g} "
                f"max_rel {self.max_rel:.3g}")


def _as_tensor(a) -> torch.Tensor:
    if isinstance(a, torch.Tensor):
        return a.detach()
    return torch.from_numpy(np.asarray(a))


def strict_fail_mask(ref: torch.Tensor, out: torch.Tensor, atol: float, rtol: float) -> torch.Tensor:
    """True where an element breaks the rule (inputs already float64)."""
    err = (out - ref).abs()
    ok = torch.isfinite(ref) & torch.isfinite(out) & ((err <= atol) | (err <= rtol * ref.abs()))
    return ~ok


def compare_outputs(reference, candidate, atol: float, rtol: float) -> ComparisonReport:
    """Compare every element of ``candidate`` against ``reference`` under the strict rule."""
    ref_t, out_t = _as_tensor(reference), _as_tensor(candidate)
    if tuple(ref_t.shape) != tuple(out_t.shape):
        raise ValueError(f"output shape {list(out_t.shape)} differs from the reference's {list(ref_t.shape)}")
    shape = tuple(ref_t.shape)
    ref_flat = ref_t.reshape(-1)
    out_flat = out_t.reshape(-1).to(ref_t.device)
    features = shape[-1] if shape else 1
    total = ref_flat.numel()
    failed = nonfinite = 0
    max_abs = max_rel = 0.0
    worst = None  # (abs error, flat index, failing?)
    failing_features = torch.zeros(features, dtype=torch.bool, device=ref_t.device)
    for start in range(0, total, _CHUNK):
        r = ref_flat[start:start + _CHUNK].double()
        o = out_flat[start:start + _CHUNK].double()
        bad = strict_fail_mask(r, o, atol, rtol)
        finite = torch.isfinite(r) & torch.isfinite(o)
        nonfinite += int((~finite).sum())
        err = torch.where(finite, (o - r).abs(), torch.full_like(r, float("inf")))
        rel = torch.where(r != 0, err / r.abs(), torch.where(err == 0, torch.zeros_like(r), torch.full_like(r, float("inf"))))
        chunk_failed = int(bad.sum())
        failed += chunk_failed
        if r.numel():
            max_abs = max(max_abs, float(err.max()))
            max_rel = max(max_rel, float(rel.max()))
            # The worst element is the largest error among failures, or overall if none failed.
            ranked = torch.where(bad, err, torch.full_like(err, -1.0)) if chunk_failed else err
            idx = int(torch.argmax(ranked))
            candidate_worst = (bool(chunk_failed), float(ranked[idx]), start + idx)
            if worst is None or candidate_worst[:2] > worst[:2]:
                worst = candidate_worst
        if chunk_failed:
            feature_idx = (torch.nonzero(bad).reshape(-1) + start) % features
            failing_features[feature_idx] = True
    worst_index = worst_ref = worst_out = None
    if worst is not None:
        flat = worst[2]
        worst_index = [int(i) for i in np.unravel_index(flat, shape)] if shape else []
        worst_ref = float(ref_flat[flat])
        worst_out = float(out_flat[flat])
    feats = torch.nonzero(failing_features).reshape(-1).tolist()
    return ComparisonReport(
        atol=atol, rtol=rtol, total=total, failed=failed, nonfinite=nonfinite,
        max_abs=max_abs, max_rel=max_rel, worst_index=worst_index,
        worst_reference=worst_ref, worst_candidate=worst_out,
        failing_features=feats[:MAX_LISTED_FEATURES], failing_feature_count=len(feats),
    )


def contract(name: str) -> tuple[float, float]:
    from kkdeploy.errors import KKError

    try:
        return CONTRACTS[name]
    except KeyError:
        raise KKError(f"unknown contract {name!r}; use one of {', '.join(CONTRACTS)}") from None

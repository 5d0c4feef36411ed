"""The runtime chooser: the fastest candidate that passed validation, or the PyTorch fallback.

Pure functions over recorded facts (statuses and latencies), so the decision is testable and
every reason lands in the manifest.
"""

from __future__ import annotations

from engines.torch_compile import FUSED_VARIANTS

from ..status import PASSED, PASSED_ALL_VALID_ONLY

FALLBACK = "pytorch-fallback"
# Simplest first: on a tie (within TIE_TOLERANCE) the simpler backend ships.
SIMPLICITY_ORDER = [FALLBACK, "torch-graph", "torch-graph-nomask", "torch-graph-sdpa1", "ort-cpu", "ort-cuda",
                    "ort-cuda-graph", "torch-compile", "torch-compile-sdpa1", "torch-compile-faithful-attention",
                    "torch-compile-faithful-kernels", "torch-compile-faithful-gemms",
                    *FUSED_VARIANTS, "inductor",
                    "inductor-fused", "inductor-sdpa1", "trt"]
TIE_TOLERANCE = 0.02


def simplicity_rank(name: str) -> int:
    return SIMPLICITY_ORDER.index(name) if name in SIMPLICITY_ORDER else len(SIMPLICITY_ORDER)


def choose(candidates: list[dict], latencies_ms: dict[str, float], fallback_latency_ms: float | None) -> dict:
    """Pick what ships. ``candidates`` are manifest entries with a validated ``status``.

    A candidate that passed only all-valid trials ships for all-valid calls; padded calls then
    take the fallback. Among passing candidates the fastest median wins; the fallback itself is a
    contender, because shipping an engine slower than the PyTorch model it replaces helps nobody.
    """
    passed = [c for c in candidates if c["status"] in (PASSED, PASSED_ALL_VALID_ONLY) and c["name"] in latencies_ms]
    contenders = {c["name"]: latencies_ms[c["name"]] for c in passed}
    if fallback_latency_ms is not None:
        contenders[FALLBACK] = fallback_latency_ms
    if not passed:
        failed = ", ".join(f"{c['name']} ({c['status']})" for c in candidates) or "none were built"
        return {"candidate": FALLBACK, "all_valid_only": False,
                "reason": f"no candidate passed the validation gate: {failed}"}
    best = min(contenders.values())
    tied = [n for n, ms in contenders.items() if ms <= best * (1 + TIE_TOLERANCE)]
    winner = min(tied, key=simplicity_rank)
    ranking = ", ".join(f"{n} {ms:.3f} ms" for n, ms in sorted(contenders.items(), key=lambda kv: kv[1]))
    if winner == FALLBACK:
        why = ("the PyTorch fallback was fastest among validated options" if len(tied) == 1 else
               f"the PyTorch fallback ties the fastest validated candidate within {TIE_TOLERANCE:.0%} and is simpler")
        return {"candidate": FALLBACK, "all_valid_only": False, "reason": f"{why} ({ranking})"}
    entry = next(c for c in passed if c["name"] == winner)
    all_valid_only = entry["status"] == PASSED_ALL_VALID_ONLY
    tie_note = f" (tie within {TIE_TOLERANCE:.0%}: simpler backend)" if len(tied) > 1 else ""
    choice = {"candidate": winner, "backend": entry["backend"], "all_valid_only": all_valid_only,
              "reason": f"fastest validated candidate{tie_note}: {ranking}"}
    if all_valid_only:
        # Padded calls go to the fastest option that passed padded trials too.
        full = {c["name"]: contenders[c["name"]] for c in passed if c["status"] == PASSED}
        if fallback_latency_ms is not None:
            full[FALLBACK] = fallback_latency_ms
        padded = min(full, key=lambda n: (full[n], simplicity_rank(n))) if full else FALLBACK
        choice["padded_candidate"] = padded
        choice["reason"] += f"; {winner} was validated on all-valid masks only, padded calls take {padded}"
    return choice

"""Precision repair: which transformer blocks of a float32 export may compute in float16.

Under the judge contract the model is float32 and a candidate may compute in float16 internally as long as
every element passes. ``ExportOptions.fp16_layers`` writes such a mixed graph; this module chooses
the set. It is pure logic: the caller's ``passes(fp16_layers)`` does the work (export with those layers,
build the backend, run ``validate_candidates`` under the contract), so the search is backend-independent.

Strategy (deterministic, prefers later layers: design.md §6 measured that perturbations late in the residual
stream are the least harmful, e.g. SDPA in the last layer only):

1. all layers in float16; if that passes, done;
2. otherwise the suffixes ``[k..L-1]`` for k = 1, 2, ..., L, the first (longest) that passes. This is a linear
   scan, not a binary search over k: pass/fail is a verdict on rounding errors that can cancel, so it is not
   guaranteed monotone in k, and a binary search could skip the longest passing suffix. It costs at most
   L + 1 calls; L is at most a few dozen for the official shapes;
3. then, greedily from the layer just before the failing one down to layer 0, each earlier layer is added
   if the set with it still passes (layer k-1 is skipped: the suffix [k-1..] was just seen to fail).

Every tried set is recorded with its verdict, in the order tried; no set is tried twice.
"""

from __future__ import annotations

from typing import Callable

from kkdeploy.errors import KKError


def bisect_fp16_layers(num_layers: int, passes: Callable[[tuple[int, ...]], bool]) -> dict:
    """Return ``{"fp16_layers": tuple, "passed": bool, "tried": [{"fp16_layers": [...], "passed": bool}, ...]}``.

    ``passed`` is the verdict of the returned set: False only when even the all-float32 set ``()`` failed,
    which means the candidate fails without any float16 and precision repair cannot help.
    """
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 0:
        raise KKError(f"num_layers must be a non-negative integer, got {num_layers!r}")
    tried: list[dict] = []
    verdicts: dict[tuple[int, ...], bool] = {}

    def attempt(layers: tuple[int, ...]) -> bool:
        layers = tuple(sorted(layers))
        if layers not in verdicts:
            verdicts[layers] = bool(passes(layers))
            tried.append({"fp16_layers": list(layers), "passed": verdicts[layers]})
        return verdicts[layers]

    chosen: tuple[int, ...] = ()
    first_passing = None
    for k in range(num_layers + 1):  # k = 0: all layers; k = num_layers: none (pure float32)
        if attempt(tuple(range(k, num_layers))):
            first_passing = k
            chosen = tuple(range(k, num_layers))
            break
    if first_passing is None:
        return {"fp16_layers": (), "passed": False, "tried": tried}
    for j in range(first_passing - 2, -1, -1):  # first_passing - 1 failed with the suffix: skip it
        candidate = tuple(sorted(chosen + (j,)))
        if attempt(candidate):
            chosen = candidate
    return {"fp16_layers": chosen, "passed": True, "tried": tried}

"""The roofline of one call: the least work a call must do, and how close a measured call comes to it.

Eager's launch cost moves with host load, so a ratio to eager says little about what is left to win. The roofline
compares a call with the machine instead. The model (docs/benchmark.md, "Roofline"):

* **FLOPs**: the GEMMs of one forward call, 2 per multiply-add. Per layer: the Q, K, V and output projections
  (4 x 2·T·D²), the FFN (2 x 2·T·D·F), and attention's two GEMMs, Q·Kᵀ and P·V (2 x 2·B·D·pairs). ``pairs``
  is the number of (query, key) pairs a query can see: S(S+1)/2 for a causal model (the causal halving), S² otherwise.
  T = B·S tokens. LayerNorm, softmax, GELU, biases and residuals are left out: their arithmetic is O(T·D) or
  O(B·H·pairs) and runs on other units than the tensor cores, which is a caveat for the attention-bound shapes.
* **Bytes**: the least HBM traffic of one call: every parameter read once, the input (x and its boolean mask)
  read once, the output written once. Activations between ops and layers are not counted: a kernel that keeps a
  sequence's rows on chip from the first layer to the last never writes them, so they are not unavoidable.
* **Launches**: counted per candidate where they can be counted (``kkdeploy.pipeline.launches``), never guessed.

The limits are measured on the spot (``kkdeploy.pipeline.machine_limits``): a large GEMM's FLOP/s, a
device-to-device copy's bytes/s, and the floor and per-launch cost of a CUDA-graph replay (a trivial call on the
CPU). Each gives a time no call can beat:

    compute = FLOPs / GEMM peak      memory = bytes / copy bandwidth
    launch  = floor + (launches - 1) x per-launch cost      (the floor alone where launches are not counted)

The bound is the largest of the three, and ``fraction = bound / measured median``: 1.0 is a call as fast as this
machine showed it can be; 0.1 leaves 10x on the table by this model. Every term is a lower bound, so a fraction
above 1 means a limit was measured low (it is reported as measured, not clipped).
"""

from __future__ import annotations

import torch

from ..config import TransformerConfig

TERMS = ("compute", "memory", "launch")
MASK_ITEMSIZE = 1  # the boolean valid_token_mask: one byte per token


def attention_pairs(config: TransformerConfig) -> int:
    """(query, key) pairs of one sequence and head that the model lets interact: S(S+1)/2 when causal."""
    return seq_pairs(config.seq_len, config.causal)


def seq_pairs(seq_len: int, causal: bool) -> int:
    """(query, key) pairs of a sequence of ``seq_len``: S(S+1)/2 when causal, else S²."""
    return seq_len * (seq_len + 1) // 2 if causal else seq_len * seq_len


def gemm_flops(config: TransformerConfig) -> dict[str, int]:
    """FLOPs of one call's GEMMs, by part and in total (2 per multiply-add; exact integers)."""
    b, d, f, layers = config.batch_size, config.d_model, config.ffn_dim, config.num_layers
    tokens = b * config.seq_len
    per_layer = {
        "projections": 4 * 2 * tokens * d * d,  # q, k, v, out_proj
        "ffn": 2 * 2 * tokens * d * f,  # ffn_in, ffn_out
        "attention": 2 * 2 * b * d * attention_pairs(config),  # Q.K^T and P.V over every head (H * D/H = D)
    }
    flops = {part: n * layers for part, n in per_layer.items()}
    flops["total"] = sum(flops.values())
    return flops


def parameter_count(config: TransformerConfig) -> int:
    """Parameters of the model (design.md §2): four D x D projections, the FFN, two LayerNorms per layer, the final
    one."""
    d, f = config.d_model, config.ffn_dim
    per_layer = 4 * (d * d + d) + (d * f + f) + (f * d + d) + 2 * (2 * d)
    return config.num_layers * per_layer + 2 * d


def minimal_bytes(config: TransformerConfig, dtype: torch.dtype) -> dict[str, int]:
    """The least HBM traffic of one call, by part and in total: weights, inputs (x and mask) read once, output
    written once."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    tokens = config.batch_size * config.seq_len
    parts = {"weights": parameter_count(config) * itemsize,
             "inputs": tokens * config.d_model * itemsize + tokens * MASK_ITEMSIZE,
             "outputs": tokens * config.d_model * itemsize}
    parts["total"] = sum(parts.values())
    return parts


def call_work(config: TransformerConfig, dtype: torch.dtype) -> dict:
    """The shape's model of one call, as recorded once per shape in bench.json (``roofline.work``)."""
    return {"flops": gemm_flops(config), "bytes": minimal_bytes(config, dtype),
            "attention_pairs_per_head": attention_pairs(config), "causal": config.causal}


def launch_term_ms(launches: int | None, launch_limit: dict) -> float:
    """The launch floor of a call of ``launches`` launches: the floor of one, plus the per-launch cost of each other.

    Uncounted launches (the CPU, or a count that failed) contribute the floor of a single call only, which is still a
    lower bound. On a GPU the per-launch cost is that of a kernel node inside a CUDA graph; launches issued from the
    host (an uncaptured call) cost more, so for them the term is a looser lower bound.
    """
    floor = launch_limit["floor_ms"]
    per_launch = launch_limit.get("per_launch_ms")
    if launches is None or per_launch is None:
        return floor
    return floor + max(launches - 1, 0) * per_launch


def time_terms_ms(flops: int, nbytes: int, launches: int | None, limits: dict) -> dict[str, float | None]:
    """Each term of the bound in ms; a term whose limit could not be measured is None."""
    gemm, copy, launch = limits.get("gemm", {}), limits.get("copy", {}), limits.get("launch", {})
    return {
        "compute": flops / (gemm["tflop_s"] * 1e12) * 1e3 if gemm.get("tflop_s") else None,
        "memory": nbytes / (copy["gb_s"] * 1e9) * 1e3 if copy.get("gb_s") else None,
        "launch": launch_term_ms(launches, launch) if launch.get("floor_ms") is not None else None,
    }


def fraction_of_limit(terms_ms: dict[str, float | None],
                      measured_ms: float) -> tuple[float | None, str | None, float | None]:
    """(fraction, binding term, bound ms): the largest term over the measured median; (None, None, None) with no
    term."""
    known = {name: ms for name, ms in terms_ms.items() if ms is not None}
    if not known or not measured_ms or measured_ms <= 0:
        return None, None, None
    bound = max(known, key=known.get)
    return known[bound] / measured_ms, bound, known[bound]


def roofline_record(work: dict, limits: dict | None, launches: dict | None, measured_ms: float) -> dict:
    """One backend's ``roofline`` record in bench.json: the fraction of the limit and what it is made of."""
    flops, nbytes = work["flops"]["total"], work["bytes"]["total"]
    count = (launches or {}).get("count")
    record = {"fraction": None, "bound": None, "bound_ms": None, "terms_ms": dict.fromkeys(TERMS),
              "measured_ms": measured_ms, "flops": flops, "bytes": nbytes, "launches": count,
              "launches_counted_by": (launches or {}).get("method"),
              "achieved_tflop_s": flops / (measured_ms * 1e-3) / 1e12 if measured_ms > 0 else None,
              "achieved_gb_s": nbytes / (measured_ms * 1e-3) / 1e9 if measured_ms > 0 else None}
    if (launches or {}).get("per_process"):  # the processes' plans differed (each proves its own): every count
        record["launches_per_process"] = list(launches["per_process"])
    if count is None:
        record["launches_reason"] = (launches or {}).get("reason", "launches not counted")
    if not limits:
        record["reason"] = "no limits were measured in these processes"
        return record
    terms = time_terms_ms(flops, nbytes, count, limits)
    fraction, bound, bound_ms = fraction_of_limit(terms, measured_ms)
    record.update(fraction=fraction, bound=bound, bound_ms=bound_ms, terms_ms=terms)
    if fraction is None:
        record["reason"] = "no limit could be measured: " + "; ".join(
            f"{k} {limits[k]['error']}" for k in ("gemm", "copy", "launch") if "error" in limits.get(k, {}))
    return record


def pool_limits(per_process: list[dict | None]) -> dict | None:
    """The limits of several processes as one: the best any process measured (highest TFLOP/s and GB/s, lowest
    floor and per-launch cost), so that a slow process cannot flatter a fraction."""
    measured = [p for p in per_process if p]
    if not measured:
        return None
    pooled = {k: measured[0][k] for k in ("device", "dtype", "tf32") if k in measured[0]}
    pooled["gemm"] = _best(measured, "gemm", "tflop_s", max)
    pooled["copy"] = _best(measured, "copy", "gb_s", max)
    launch = _best(measured, "launch", "floor_ms", min)
    per_launch = [p["launch"]["per_launch_ms"] for p in measured
                  if p.get("launch", {}).get("per_launch_ms") is not None]
    if per_launch:
        launch = dict(launch, per_launch_ms=min(per_launch))
    pooled["launch"] = launch
    pooled["processes"] = len(measured)
    pooled["pooled"] = "best of the processes: highest TFLOP/s and GB/s, lowest floor and per-launch cost"
    return pooled


def _best(measured: list[dict], key: str, field: str, pick) -> dict:
    entries = [p[key] for p in measured if p.get(key, {}).get(field) is not None]
    if not entries:  # every process failed this limit: keep the first reason
        return next((p[key] for p in measured if key in p), {"error": "not measured"})
    return dict(pick(entries, key=lambda e: e[field]))


def pool_launches(per_process: list[dict | None]) -> dict | None:
    """A backend's launch count over its processes: one count when they agree, the smallest (the lower bound) and
    every process's count when they do not; the first reason when none counted."""
    records = [r for r in per_process if r]
    counted = [r for r in records if r.get("count") is not None]
    if not counted:
        return records[0] if records else None
    counts = [r["count"] for r in counted]
    pooled = dict(min(counted, key=lambda r: r["count"]))
    if len(set(counts)) > 1:
        pooled["per_process"] = counts
    return pooled


def attach_roofline(backends: dict, work: dict, per_process_limits: list[dict | None],
                    per_backend_launches: dict[str, list[dict | None]]) -> dict:
    """Add a ``roofline`` record to every timed backend (one with ``median_ms``); return the shape's record."""
    limits = pool_limits(per_process_limits)
    for name, entry in backends.items():
        if entry.get("median_ms"):
            launches = pool_launches(per_backend_launches.get(name, []))
            entry["roofline"] = roofline_record(work, limits, launches, entry["median_ms"])
    return {"work": work, "limits": limits, "limits_per_process": per_process_limits}


def format_fraction(record: dict | None) -> str:
    """'0.31 launch' for tables; '-' where there is no fraction. Above 1 the call beat a limit, so that limit was
    measured low (a CPU's float16 GEMM probe, say): the table says so rather than show it as a success."""
    if not record or record.get("fraction") is None:
        return "-"
    fraction = record["fraction"]
    text = f"{fraction:.2f} {record['bound']}" if fraction >= 0.1 else f"{fraction:.2g} {record['bound']}"
    return text + " (limit measured low)" if fraction > 1 else text

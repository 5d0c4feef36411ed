"""Each proven kernel op against the machine: why a shape sits where it does on its roofline.

A call's fraction of the limit (``kkdeploy.pipeline.roofline``) says how far it is from the machine, not where the
distance is. The build's proofs already time every kernel op of a candidate at the model's own op shapes (ours and
ATen's, as graph replays: ``kkdeploy.kernels.proof``). Here each of those op shapes gets the same three terms as a
call, from the same limits measured on the spot:

* **compute**: the op's GEMM FLOPs (2 per multiply-add) / the measured GEMM peak. The attention's two GEMMs count
  the pairs a causal row sees; its softmax, the LayerNorms, the GELU and the epilogues count nothing (they run on
  other units), so an op bound by them shows as far from its limit, which is the point;
* **memory**: the least bytes the op must move (its inputs read once, its outputs written once, its weights) / the
  measured copy bandwidth;
* **launch**: the cost of one kernel launch inside a CUDA graph (an op is one launch).

``fraction = max(terms) / the time of what runs`` (our chosen launch, else ATen's op). Shape 6's proofs in session
47 gave the rows LayerNorm about 0.98 of its memory limit and the Q|K|V attention about 0.17: the attention, not
the LayerNorm passes, is where its time is. The op's time is the proof's (a median of graph replays in its own
graph), not its share of a call: a call also waits between launches.
"""

from __future__ import annotations

from typing import Callable, Optional

from .roofline import seq_pairs, time_terms_ms

ITEMSIZE = 2  # the kernels' ops are float16 (their proofs' shapes say so)
MASK_ITEMSIZE = 1


def linear_work(m: int, n: int, k: int, form: str) -> dict:
    """FLOPs and least bytes of one fused-GEMM launch [m, k] x [k, n] with the parts of ``form``
    (``fused_linear.PARTS``, joined by "+"). The feed-forward chain's op shape is ffn_out's GEMM (M, D, F): its input
    is the normalized rows [m, n], and ffn_in's output never reaches memory; "qkv" adds the next block's Q|K|V."""
    parts = set(form.split("+"))
    if "ffn_chain" in parts:
        flops = 2 * 2 * m * n * k  # ffn_in [m, n] x [n, k], ffn_out [m, k] x [k, n]
        elements = m * n + 2 * n * k + k + n + m * n  # h2, both weights, both biases, x out
    else:
        flops = 2 * m * n * k
        elements = m * k + k * n + n + m * n  # input, weight, bias, output
    extra = 0
    if parts & {"add_masked", "masked_sum"}:
        elements += m * n  # the residual read
        extra += m * MASK_ITEMSIZE
    if "layer_norm" in parts:
        elements += m * n + 2 * n  # the normalized rows written, gamma and beta
    if "layer_norm_prologue" in parts:
        elements += 2 * k  # the input's LayerNorm: gamma and beta (its rows are the input, never written)
    if "qkv" in parts:
        flops += 2 * m * 3 * n * n
        elements += 3 * n * n + 3 * n + 3 * m * n  # Wq|Wk|Wv, their biases, Q|K|V written
    return {"flops": flops, "bytes": elements * ITEMSIZE + extra}


def op_work(op: str, shape: dict) -> Optional[dict]:
    """{"flops", "bytes"} of one call of a proven op at its proof's op shape; None for an op this model does not
    cover (the long-context kernels, the ONNX Runtime custom ops)."""
    try:
        if op == "fused_linear":
            return linear_work(shape["m"], shape["n"], shape["k"], shape["form"])
        if op == "layer_norm_rows":
            rows, width = shape["rows"], shape["width"]
            return {"flops": 0, "bytes": (2 * rows * width + 2 * width) * ITEMSIZE}
        if op == "faithful_attention":
            bh, s, dh = shape["batch_heads"], shape["seq_len"], shape["head_dim"]
            return {"flops": 2 * 2 * bh * dh * seq_pairs(s, shape.get("causal", True)),
                    "bytes": 4 * bh * s * dh * ITEMSIZE}  # Q, K, V read, the context written (the mask left out)
        if op == "qkv_attention":
            b, s, d = shape["batch"], shape["seq_len"], shape["d_model"]
            tokens = b * s
            return {"flops": 2 * tokens * d * 3 * d + 2 * 2 * b * d * seq_pairs(s, shape.get("causal", True)),
                    "bytes": (2 * tokens * d + 3 * d * d + 3 * d) * ITEMSIZE + tokens * MASK_ITEMSIZE}
    except (KeyError, TypeError):
        return None
    return None


def in_plan(entry: dict, config) -> Callable[[str, dict], Optional[bool]]:
    """Whether a candidate's graph computes a proven op shape, from its ``*_path`` records (bench.json's backend entry,
    ``engines.torch_compile.kernel_paths_record``): the GEMM forms its block plan launches
    (``fused_blocks.planned_linear_forms``), the Q|K|V attention where the plan takes it, the attention op where it
    does not, the rows LayerNorm where the candidate has it (the first norm1 always runs as one). None for an op
    this does not know, and for every op of an entry without those records."""
    from kkdeploy.kernels.fused_blocks import planned_linear_forms

    plan = (entry.get("linear_path") or {}).get("plan")
    forms = planned_linear_forms(config, plan)
    qkv_attention = bool(plan and plan.get("qkv_attention"))
    known = any(key in entry for key in ("attention_path", "layer_norm_path", "linear_path"))

    def runs(op: str, shape: dict) -> Optional[bool]:
        if not known:
            return None
        if op == "fused_linear":
            return (shape.get("n"), shape.get("k"), shape.get("form")) in forms
        if op == "qkv_attention":
            return qkv_attention
        if op == "faithful_attention":
            return "attention_path" in entry and not qkv_attention
        if op == "layer_norm_rows":
            return "layer_norm_path" in entry
        return None

    return runs


def op_roofline(record: dict, limits: Optional[dict], runs: Optional[Callable[[str, dict], Optional[bool]]] = None
                ) -> dict:
    """One proof record (``ProofRecord.to_dict``) against ``limits`` (``roofline.pool_limits``): what runs, its ms,
    the three terms, the bound and the fraction (None, with a reason, where the op or the limits are not known), and
    ``in_plan``: whether the candidate's graph computes this op shape (``in_plan``; None where not known)."""
    chosen = record.get("chosen")
    ours = next((r.get("ms") for r in record.get("launches") or [] if r.get("launch") == chosen), None)
    aten = record.get("reference_ms")
    ms = ours if chosen else aten
    shape = record.get("shape") or {}
    row = {"op": record.get("op"), "shape": " ".join(f"{k}={v}" for k, v in shape.items() if k != "dtype"),
           "runs": chosen or "aten", "ours_ms": ours, "aten_ms": aten, "ms": ms,
           "in_plan": runs(record.get("op"), shape) if runs else None,
           "terms_ms": None, "bound": None, "bound_ms": None, "fraction": None}
    work = op_work(record.get("op"), shape)
    if work is None:
        row["reason"] = "no work model for this op"
        return row
    row.update(work)
    if not limits or not ms:
        row["reason"] = "no limits were measured" if not limits else "the proof did not time what runs"
        return row
    terms = time_terms_ms(work["flops"], work["bytes"], None, limits)
    launch = (limits.get("launch") or {}).get("per_launch_ms")
    terms["launch"] = launch  # one launch inside a graph, not a call's floor
    known = {name: t for name, t in terms.items() if t}
    row["terms_ms"] = terms
    if known:
        bound = max(known, key=known.get)
        row.update(bound=bound, bound_ms=known[bound], fraction=known[bound] / ms)
    return row


def op_rooflines(records: list[dict], limits: Optional[dict],
                 runs: Optional[Callable[[str, dict], Optional[bool]]] = None) -> list[dict]:
    """Every proven op shape of one candidate against the machine: those its graph computes first (``runs``, as
    ``in_plan`` gives it), each group the furthest from its limit first (an op without a fraction last)."""
    rows = [op_roofline(r, limits, runs) for r in records or []]
    return sorted(rows, key=lambda r: (r["in_plan"] is False, r["fraction"] is None, r["fraction"] or 0.0))


def furthest_in_plan(rows: list[dict]) -> Optional[dict]:
    """Of ``op_rooflines``' rows, the op shape furthest from its own limit among those the graph computes (or may:
    ``in_plan`` not False), or None."""
    return next((r for r in rows if r.get("fraction") is not None and r.get("in_plan") is not False), None)

"""kkdeploy.pipeline.timeline: a call's span, busy time and the gaps between its kernels, from a profiler trace."""

from __future__ import annotations

import json

import pytest
import torch

from kkdeploy.pipeline import timeline as tl
from tests.conftest import kernel_trace as _trace


def test_a_call_s_span_busy_time_and_gaps():
    # three kernels a call: a gap of 2 µs after the first, the third starts 1 µs before the second ends (overlap)
    kernels = [("gemm_a", 10.0, 5.0), ("ln_b", 17.0, 4.0), ("gemm_c", 20.0, 6.0)]
    t = tl.call_timeline(tl.device_kernels(_trace(4, kernels)), calls=4)
    assert t["calls"] == 4 and t["kernels_per_call"] == 3
    assert t["median_span_us"] == pytest.approx(16.0)  # 10 .. 26
    assert t["median_busy_us"] == pytest.approx(14.0)  # 5 + (17 .. 26)
    assert t["median_idle_us"] == pytest.approx(2.0) and t["busy_fraction"] == pytest.approx(14.0 / 16.0)
    assert t["kernel_sum_us"] == pytest.approx(15.0)
    assert t["gap_sum_us"] == pytest.approx(2.0) and t["overlap_us"] == pytest.approx(1.0)
    assert [p["median_gap_after_us"] for p in t["positions"]] == [pytest.approx(2.0), pytest.approx(-1.0), None]
    assert t["largest_gaps"][0] == {"after": 0, "before_kernel": "gemm_a", "next_kernel": "ln_b",
                                    "median_gap_us": pytest.approx(2.0)}
    assert "3 kernels a call, span 16.0 µs, busy 14.0 µs, idle 2.0 µs (gaps 2.0, overlap 1.0)" in \
        tl.summary_line("x", t)


def test_medians_over_calls_resist_one_slow_call():
    trace = _trace(5, [("a", 0.0, 2.0), ("b", 3.0, 2.0)])
    slow = [e for e in trace["traceEvents"] if e.get("cat") == "kernel" and e["name"] == "b"][0]
    slow["ts"] += 50.0  # one call's second kernel started late
    t = tl.call_timeline(tl.device_kernels(trace), calls=5)
    assert t["median_span_us"] == pytest.approx(5.0) and t["positions"][0]["median_gap_after_us"] == 1.0


def test_busy_time_is_the_union_of_intervals():
    assert tl.busy_time([(0, 4), (2, 6), (8, 9), (8.5, 8.7)]) == pytest.approx(7.0)
    assert tl.busy_time([]) == 0.0


def test_calls_to_profile_shrink_for_slow_calls():
    assert tl.calls_for(0.066) == tl.CALLS and tl.calls_for(None) == tl.CALLS
    assert tl.calls_for(92.0) == 4 and tl.calls_for(1000.0) == 3  # shape 6's eager: a few calls, not seconds


def test_on_the_cpu_the_timeline_says_why_it_is_missing():
    calls = []
    assert tl.profiled_timeline(lambda: calls.append(1), torch.device("cpu")) == {"unavailable": tl.CPU_REASON}
    assert not calls  # nothing ran under a profiler that would record no kernel


def test_a_trace_file_gives_its_timeline_or_the_reason(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(_trace(4, [("a", 0.0, 1.0), ("b", 2.0, 1.0)])))
    assert tl.trace_timeline(path, 4)["kernels_per_call"] == 2
    assert "do not split into 3 equal calls" in tl.trace_timeline(path, 3)["unavailable"]
    assert "cannot read the trace" in tl.trace_timeline(tmp_path / "missing.json", 4)["unavailable"]


def _positions(*kernels: tuple[str, float, float]) -> dict:
    return {"positions": [{"index": i, "kernel": k, "median_us": d, "median_gap_after_us": g}
                          for i, (k, d, g) in enumerate(kernels)]}


def test_comparing_timelines_names_the_fused_run_and_what_moved_around_it():
    """Session 51's question: the prologue fused the rows LayerNorm into ffn_in's GEMM and the call got slower with
    dependent launches. The comparison aligns the kernels by name, gives the fused run's cost against the two it
    replaced, and lists a matched kernel whose cost moved (here the launch after the fused one started later)."""
    base = _positions(("qkv_attention", 6.0, -0.5), ("gemm", 2.0, -0.5), ("layer_norm", 1.5, -0.4),
                      ("gemm", 2.2, -0.5), ("gemm_gelu_in", 2.5, 0.1), ("layer_norm", 1.5, 0.0))
    edit = _positions(("qkv_attention", 6.0, -0.5), ("gemm", 2.0, -0.5), ("norm_gemm", 3.2, 0.2),
                      ("gemm_gelu_in", 3.5, 0.1), ("layer_norm", 1.5, 0.0))
    segments = tl.compare_timelines(base, edit)
    replaced = next(s for s in segments if s["kind"] == "replaced")
    assert replaced["base_kernels"] == ["layer_norm", "gemm"] and replaced["other_kernels"] == ["norm_gemm"]
    assert replaced["base_us"] == pytest.approx(1.1 + 1.7) and replaced["other_us"] == pytest.approx(3.4)
    moved = [s for s in segments if s["kind"] == "moved"]
    assert [(s["base_kernels"], s["delta_us"]) for s in moved] == [(["gemm_gelu_in"], pytest.approx(1.0))]
    assert segments[0]["kind"] == "moved"  # largest change first: 1.0 against the fused run's 0.6
    # the costs add up to each side's span when the kernels run one after another
    assert sum(tl.position_cost(p) for p in base["positions"]) == pytest.approx(13.9)
    sequential = tl.call_timeline(tl.device_kernels(_trace(3, [("a", 0.0, 2.0), ("b", 3.0, 2.0), ("c", 4.5, 1.0)])), 3)
    assert sum(tl.position_cost(p) for p in sequential["positions"]) == pytest.approx(sequential["median_span_us"])
    assert tl.compare_timelines(base, base) == []  # nothing moved
    assert tl.compare_timelines({}, edit)[0]["kind"] == "added"

"""scripts/bench_summary.py: the campaign table, with the conservative speedup next to the protocol's."""

from __future__ import annotations

import json

import pytest

from tests.conftest import load_script


@pytest.fixture(scope="module")
def bench_summary():
    return load_script("bench_summary")


def shape(shape_id: int, eager_rounds: list[float], eager_median: float, candidates: dict) -> dict:
    backends = {"eager": {"status": "reference", "median_ms": eager_median, "round_medians_ms": eager_rounds,
                          "speedup": 1.0}}
    for name, (status, ms) in candidates.items():
        backends[name] = {"status": status, "median_ms": ms, "speedup": eager_median / ms}
    return {"shape_id": shape_id, "label": f"shape-{shape_id:02d}", "processes": 3, "backends": backends,
            "errors": []}


def test_conservative_speedup_divides_eager_fastest_round_by_the_best_passing_median(bench_summary, tmp_path):
    """A session whose eager rounds sat at 4 ms and 2 ms: the protocol's 8x is 4x over the fast rounds."""
    shapes = [shape(1, [4.0, 2.0, 4.0], 4.0, {"a": ("passed", 0.5), "b": ("failed", 0.1)}),
              shape(2, [9.0, 9.0, 9.0], 9.0, {"a": ("passed", 1.0)})]
    summary = bench_summary.summarize(shapes)
    assert summary["geomean_full"] == pytest.approx((8.0 * 9.0) ** 0.5)  # the failed, faster one is not counted
    assert summary["geomean_full_over_eager_floor"] == pytest.approx((4.0 * 9.0) ** 0.5)
    assert summary["min_full_over_eager_floor"] == pytest.approx(4.0)
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"protocol": {"dtype": "float32", "contract": "judge", "processes": 3},
                                "environment": {"gpu": "test"}, "shapes": shapes}))
    loaded, runs = bench_summary.load_shapes([str(tmp_path)])
    text = bench_summary.markdown(bench_summary.summarize(loaded), runs)
    assert "| shape-01 | 3 | 4 (2) | a 0.5 ms, 8.00x |" in text
    assert "conservative): fully passing geomean 6.00x, slowest 4.00x" in text


def test_the_fraction_of_the_limit_follows_the_best_fully_passing_backend(bench_summary, tmp_path):
    """Issue 31: the fastest fully passing backend's roofline fraction is a column, then its geomean and the shapes
    furthest from their limit; a shape from an older bench.json (no roofline) reads '-'."""
    shapes = [shape(1, [4.0], 4.0, {"a": ("passed", 0.5), "b": ("passed", 1.0)}),
              shape(2, [9.0], 9.0, {"a": ("passed", 1.0)}),
              shape(3, [2.0], 2.0, {"a": ("passed", 1.0)}),
              shape(4, [2.0], 2.0, {"a": ("passed", 1.0)})]
    for s, fraction, bound in ((shapes[0], 0.5, "launch"), (shapes[1], 0.02, "compute"), (shapes[2], 0.08, "memory")):
        s["backends"]["a"]["roofline"] = {"fraction": fraction, "bound": bound}
    shapes[0]["backends"]["b"]["roofline"] = {"fraction": 0.9, "bound": "launch"}  # slower: not the one reported
    summary = bench_summary.summarize(shapes)
    assert summary["geomean_fraction_full"] == pytest.approx((0.5 * 0.02 * 0.08) ** (1 / 3))
    assert [(f, label) for f, label, _, _ in summary["furthest_from_limit"]] == [
        (0.02, "shape-02"), (0.08, "shape-03"), (0.5, "shape-01")]
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"protocol": {"dtype": "float16", "contract": "strict", "processes": 3},
                                "environment": {"gpu": "test"}, "shapes": shapes}))
    loaded, runs = bench_summary.load_shapes([str(tmp_path)])
    text = bench_summary.markdown(bench_summary.summarize(loaded), runs)
    assert "| shape-01 | 3 | 4 (4) | a 0.5 ms, 8.00x | 0.50 launch |" in text
    assert "| shape-04 | 3 | 2 (2) | a 1 ms, 2.00x | - |" in text
    assert "geomean 0.0928 over 3 shape(s); furthest from it: shape-02 0.02 (a, compute bound)" in text
    assert "furthest from their own limit" not in text  # no kernel op timed: no line
    assert "kernels busy of its span" not in text  # no timeline (a CPU's, or an older bench.json): no line
    shapes[0]["backends"]["a"]["timeline"] = {"busy_fraction": 0.74, "median_span_us": 70.0, "kernels_per_call": 29,
                                              "gap_sum_us": 18.2}
    shapes[0]["backends"]["b"]["timeline"] = {"busy_fraction": 0.99, "median_span_us": 99.0, "kernels_per_call": 9,
                                              "gap_sum_us": 0.1}  # slower: not the one reported
    text = bench_summary.markdown(bench_summary.summarize(shapes), runs)
    assert "kernels busy of its span (bench.md, Timeline): shape-01 74% of 70.0 µs (29 kernels, gaps 18.2 µs)" in text


def test_the_furthest_shapes_name_their_furthest_kernel_op(bench_summary):
    """Why a shape sits far from its limit: its best backend's kernel op furthest from its own limit (bench.json's
    ``roofline.ops``, the furthest first; an op without a fraction skipped)."""
    shapes = [shape(6, [92.0], 92.0, {"a": ("passed", 11.87)}), shape(3, [2.0], 2.0, {"a": ("passed", 0.08)})]
    shapes[0]["backends"]["a"]["roofline"] = {"fraction": 0.13, "bound": "compute", "ops": [
        {"op": "block_softmax", "runs": "bm64", "fraction": None, "bound": None, "ms": 0.1},
        {"op": "qkv_attention", "runs": "pair", "fraction": 0.167, "bound": "compute", "ms": 1.3227},
        {"op": "layer_norm_rows", "runs": "rows2_full", "fraction": 0.978, "bound": "memory", "ms": 0.2251}]}
    shapes[1]["backends"]["a"]["roofline"] = {"fraction": 0.2, "bound": "launch"}  # an older bench.json: no ops
    summary = bench_summary.summarize(shapes)
    assert summary["furthest_ops"]["shape-06"]["op"] == "qkv_attention" and summary["furthest_ops"]["shape-03"] is None
    text = bench_summary.markdown(summary, [{"environment": {"gpu": "test"}, "protocol": {"processes": 3}}])
    assert ("their kernel ops furthest from their own limit (bench.md, Kernel ops against the machine): shape-06 "
            "qkv_attention pair 0.17 (compute bound, 1.323 ms)") in text


def test_the_summary_names_shapes_whose_best_ran_different_plans_in_its_processes(bench_summary):
    """A best backend whose processes chose different plans (``plans_per_process``) is named with each process's
    launch count: its pooled median mixes them. One whose processes agreed is not."""
    shapes = [shape(3, [2.0], 2.0, {"a": ("passed", 0.084)}), shape(12, [2.0], 2.0, {"a": ("passed", 0.08)})]
    shapes[0]["backends"]["a"].update(plans_per_process=[{"linear_path": {"plan": {"gelu": g}}} for g in (1, 0, 0)],
                                      roofline={"fraction": 0.4, "bound": "launch",
                                                "launches_per_process": [20, 24, 24]})
    summary = bench_summary.summarize(shapes)
    assert summary["plans_differed"] == [("shape-03", "a", [20, 24, 24])]
    text = bench_summary.markdown(summary, [{"environment": {}, "protocol": {"processes": 3}}])
    assert "plans that differed between processes (the best's median pools them): shape-03 a (launches 20/24/24)" \
        in text
    assert "shape-12 a" not in text

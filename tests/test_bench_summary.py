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

"""scripts/trace_gaps.py: a call's span, busy time and the gaps between its kernels, from a Chrome trace."""

from __future__ import annotations

import json

import pytest

from tests.conftest import load_script


@pytest.fixture(scope="module")
def gaps():
    return load_script("trace_gaps")


def _trace(calls: int, kernels: list[tuple[str, float, float]], period: float = 100.0) -> dict:
    """torch.profiler's Chrome format: device kernels are complete events of category "kernel"; host events and
    runtime calls around them must be ignored."""
    events = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 500.0},
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 1.0, "dur": 3.0}]
    for c in range(calls):
        for name, start, dur in kernels:
            events.append({"ph": "X", "cat": "kernel", "name": name, "ts": c * period + start, "dur": dur,
                           "pid": 0, "tid": 7})
    events.reverse()  # the split goes by start time, not by the order events are written
    return {"traceEvents": events}


def test_a_call_s_span_busy_time_and_gaps(gaps):
    # three kernels a call: a gap of 2 µs after the first, the third starts 1 µs before the second ends (overlap)
    kernels = [("gemm_a", 10.0, 5.0), ("ln_b", 17.0, 4.0), ("gemm_c", 20.0, 6.0)]
    t = gaps.timeline(gaps.device_kernels(_trace(4, kernels)), calls=4)
    assert t["calls"] == 4 and t["kernels_per_call"] == 3
    assert t["median_span_us"] == pytest.approx(16.0)  # 10 .. 26
    assert t["median_busy_us"] == pytest.approx(14.0)  # 5 + (17 .. 26)
    assert t["median_idle_us"] == pytest.approx(2.0)
    assert t["kernel_sum_us"] == pytest.approx(15.0)
    assert t["gap_sum_us"] == pytest.approx(2.0) and t["overlap_us"] == pytest.approx(1.0)
    assert [p["median_gap_after_us"] for p in t["positions"]] == [pytest.approx(2.0), pytest.approx(-1.0), None]
    assert t["largest_gaps"][0] == {"after": 0, "before_kernel": "gemm_a", "next_kernel": "ln_b",
                                    "median_gap_us": pytest.approx(2.0)}
    assert "3 kernels a call, span 16.0 µs, busy 14.0 µs, idle 2.0 µs (gaps 2.0, overlap 1.0)" in \
        gaps.summary_line("x", t)


def test_medians_over_calls_resist_one_slow_call(gaps):
    trace = _trace(5, [("a", 0.0, 2.0), ("b", 3.0, 2.0)])
    slow = [e for e in trace["traceEvents"] if e.get("cat") == "kernel" and e["name"] == "b"][0]
    slow["ts"] += 50.0  # one call's second kernel started late
    t = gaps.timeline(gaps.device_kernels(trace), calls=5)
    assert t["median_span_us"] == pytest.approx(5.0) and t["positions"][0]["median_gap_after_us"] == 1.0


def test_busy_time_is_the_union_of_intervals(gaps):
    assert gaps.busy_time([(0, 4), (2, 6), (8, 9), (8.5, 8.7)]) == pytest.approx(7.0)
    assert gaps.busy_time([]) == 0.0


def test_the_cli_writes_json_and_prints_a_table(gaps, tmp_path, capsys):
    path = tmp_path / "trace-engine.json"
    path.write_text(json.dumps(_trace(20, [("k0", 0.0, 2.0), ("k1", 2.5, 3.0)])))
    assert gaps.main([str(path), "--calls", "20", "--json", str(tmp_path / "t.json")]) == 0
    out = capsys.readouterr().out
    assert "trace-engine: 2 kernels a call, span 5.5 µs" in out and "| 0 | k0 | 2.00 | 0.50 |" in out
    assert json.loads((tmp_path / "t.json").read_text())["trace-engine.json"]["kernels_per_call"] == 2


@pytest.mark.parametrize("content, calls, message", [
    (None, 20, "cannot read the trace"),
    ({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1}]}, 20,
     "no device kernels"),
    (_trace(3, [("a", 0.0, 1.0)]), 2, "3 device kernels do not split into 2 equal calls"),
    (_trace(3, [("a", 0.0, 1.0)]), 0, "--calls must be >= 1"),
])
def test_a_trace_that_cannot_be_split_is_one_line_and_exit_2(gaps, tmp_path, capsys, content, calls, message):
    path = tmp_path / "t.json"
    path.write_text("{not json" if content is None else json.dumps(content))
    assert gaps.main([str(path), "--calls", str(calls)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err

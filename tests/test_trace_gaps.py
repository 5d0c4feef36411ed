"""scripts/trace_gaps.py: the timeline of a Chrome trace as a command (the arithmetic: tests/test_timeline.py)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import kernel_trace as _trace, load_script


@pytest.fixture(scope="module")
def gaps():
    return load_script("trace_gaps")


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

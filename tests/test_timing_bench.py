"""The timing protocol, the tie rule, and `kkdeploy bench` end to end on a tiny shape (CPU)."""

import json

import numpy as np
import pytest

from kkdeploy import KKError, TransformerConfig
from kkdeploy.pipeline import timing as timing_module
from kkdeploy.pipeline.bench import (FAILED, ShapeJob, aggregate_shape, jobs_for, markdown_table, plot_speedups,
                            shape_tick_labels)
from kkdeploy.cli import main
from kkdeploy.pipeline.timing import LatencyStats, choose_fastest, measure_latency, race_latency

TINY = ["--batch-size", "2", "--seq-len", "8", "--d-model", "16", "--heads", "2", "--ffn-dim", "24", "--layers", "2"]


class FakeClock:
    """perf_counter that only moves when a timed function says how long it took."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_measure_latency_alternates_rounds_and_counts_samples(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(timing_module.time, "perf_counter", clock)
    calls = []
    durations = {"a": iter(range(1, 1000)), "b": iter(range(1000, 2000))}

    def make(name):
        def fn():
            calls.append(name)
            clock.now += next(durations[name]) / 1000.0  # ms -> s
        return fn

    stats = measure_latency({"a": make("a"), "b": make("b")}, "cpu", warmups=2, repeats=3, rounds=2)
    # round by round, every function in turn: its warmups, then its repeats
    assert calls == ["a"] * 5 + ["b"] * 5 + ["a"] * 5 + ["b"] * 5
    a, b = stats["a"], stats["b"]
    assert a.samples == b.samples == 6
    # a's timed calls took 3,4,5 ms (round 1, after 2 warmups) and 8,9,10 ms (round 2)
    assert a.times_ms == pytest.approx([3, 4, 5, 8, 9, 10])
    assert a.median_ms == pytest.approx(6.5) and a.min_ms == pytest.approx(3) and a.mean_ms == pytest.approx(6.5)
    assert a.p90_ms == pytest.approx(np.percentile([3, 4, 5, 8, 9, 10], 90))
    assert a.round_medians_ms == pytest.approx([4, 9])
    assert a.peak_memory_bytes is None  # CPU
    assert set(a.to_dict()) == {"median_ms", "p90_ms", "mean_ms", "min_ms", "samples", "peak_memory_bytes",
                                "peak_extra_bytes", "round_medians_ms"}
    assert "times_ms" in a.to_dict(include_times=True)


@pytest.fixture
def timed(monkeypatch):
    """``timed(ms)``: functions that each take ``ms[name]`` on a fake clock, and the log of their calls."""
    clock = FakeClock()
    monkeypatch.setattr(timing_module.time, "perf_counter", clock)
    calls = []

    def make(ms: dict):
        def one(name):
            def fn():
                calls.append(name)
                clock.now += ms[name] / 1000.0
            return fn
        return {name: one(name) for name in ms}, calls
    return make


def test_race_latency_runs_the_full_protocol_when_it_fits(timed):
    fns, calls = timed({"a": 1.0, "b": 3.0})
    stats, plan = race_latency(fns, "cpu", warmups=2, repeats=3, rounds=2, budget_s=10.0)
    # the screen (2 warmups + 3 calls each), then exactly measure_latency's protocol
    assert calls == ["a"] * 5 + ["b"] * 5 + (["a"] * 5 + ["b"] * 5) * 2
    assert plan.full_protocol and not plan.screened_out and plan.describe() == ""
    assert stats["a"].samples == stats["b"].samples == 6
    assert plan.estimated_s == pytest.approx(2 * 5 * 4.0 / 1000)


def test_race_latency_screens_out_the_slow_and_cuts_repeats_to_the_budget(timed):
    # shape 6 on the H200, roughly: 14 ms for the best, 17 ms (within 1.25x), 27 and 66 ms (not)
    fns, calls = timed({"gemms": 14.0, "kernels": 17.0, "attention": 27.0, "fallback": 66.0})
    stats, plan = race_latency(fns, "cpu", warmups=20, repeats=100, rounds=3, budget_s=10.0)
    assert set(plan.screened_out) == {"attention", "fallback"}
    assert plan.screened_out["fallback"] == pytest.approx(66.0)
    assert not plan.full_protocol and plan.rounds == 3
    assert timing_module.MIN_REPEATS <= plan.repeats < 100 and 1 <= plan.warmups <= 20
    # the screened-out keep their screen figures. The contenders race round by round: after the first, kernels
    # (1.21x) has lost by more than DECIDED_MARGIN, and gemms finishes alone at the lone contender's floor
    assert stats["attention"].samples == timing_module.SCREEN_REPEATS
    assert plan.decided == {"kernels": 1}
    assert stats["kernels"].samples == plan.repeats and len(stats["kernels"].round_medians_ms) == 1
    assert stats["gemms"].samples == plan.repeats + 2 * timing_module.MIN_REPEATS
    assert stats["gemms"].round_medians_ms == pytest.approx([14.0] * 3)
    assert calls.count("fallback") == 2 + timing_module.SCREEN_REPEATS
    assert plan.seconds <= 10.0 + 1e-9  # the budget held, screen included
    assert list(stats) == list(fns)  # every candidate has figures, in the order given
    assert choose_fastest(stats, []) == "gemms"
    line = plan.describe()
    assert "2 screened out" in line and "fallback 66 ms" in line and "--time-budget 0" in line
    assert "not timed further: kernels after 1 round" in line


def test_contenders_within_the_margin_race_every_round(timed):
    # 3% apart: no round can settle it, so both get the whole (budgeted) protocol and the chooser decides
    fns, calls = timed({"gemms": 14.0, "kernels": 14.4, "fallback": 66.0})
    stats, plan = race_latency(fns, "cpu", warmups=20, repeats=100, rounds=3, budget_s=10.0)
    assert plan.decided == {} and "not timed further" not in plan.describe()
    assert stats["gemms"].samples == stats["kernels"].samples == 3 * plan.repeats
    assert choose_fastest(stats, []) == "gemms"


def test_a_lone_contender_is_timed_at_the_protocols_floor(timed):
    # shape 6 on the H200 in campaign 20: after the screen only the winner was left, and its full protocol took ~5 s
    fns, calls = timed({"gemms": 14.0, "attention": 27.0, "fallback": 66.0})
    stats, plan = race_latency(fns, "cpu", warmups=20, repeats=100, rounds=3, budget_s=10.0)
    assert set(plan.screened_out) == {"attention", "fallback"} and plan.candidates == 3
    assert (plan.warmups, plan.repeats, plan.rounds) == (2, timing_module.MIN_REPEATS, 3)
    assert stats["gemms"].samples == 3 * timing_module.MIN_REPEATS
    assert calls.count("gemms") == 2 + timing_module.SCREEN_REPEATS + 3 * (2 + timing_module.MIN_REPEATS)
    assert "the one left (nothing to decide) timed with 2 warmups" in plan.describe()
    assert choose_fastest(stats, []) == "gemms"


def test_race_latency_never_times_more_than_asked(timed):
    fns, calls = timed({"a": 10.0, "b": 11.0})
    stats, plan = race_latency(fns, "cpu", warmups=1, repeats=3, rounds=1, budget_s=1e-6)
    assert plan.repeats == 3 and plan.warmups == 1 and not plan.full_protocol
    assert stats["a"].samples == stats["b"].samples == 3


def test_race_latency_budget_zero_is_the_full_protocol_without_a_screen(timed):
    fns, calls = timed({"a": 50.0, "b": 500.0})
    stats, plan = race_latency(fns, "cpu", warmups=1, repeats=2, rounds=1, budget_s=0)
    assert calls == ["a"] * 3 + ["b"] * 3
    assert plan.full_protocol and plan.budget_s is None and stats["b"].samples == 2


def test_build_refuses_a_negative_time_budget(capsys):
    assert main(["build", *TINY, "--device", "cpu", "--time-budget", "-1"]) == 2
    err = capsys.readouterr().err
    assert "--time-budget" in err and "Traceback" not in err


def test_measure_latency_rejects_bad_counts():
    with pytest.raises(KKError, match="repeats"):
        measure_latency({"a": lambda: None}, "cpu", warmups=0, repeats=0, rounds=1)
    with pytest.raises(KKError, match="rounds"):
        measure_latency({"a": lambda: None}, "cpu", rounds=0)
    with pytest.raises(KKError, match="nothing to time"):
        measure_latency({}, "cpu")


def _stats(median):
    return LatencyStats.from_times([median])


def test_choose_fastest_ties_go_to_the_simpler_backend():
    order = ["torch-graph", "ort-cuda", "trt"]
    assert choose_fastest({"trt": _stats(1.00), "torch-graph": _stats(1.015)}, order) == "torch-graph"
    assert choose_fastest({"trt": _stats(1.00), "torch-graph": _stats(1.05)}, order) == "trt"
    assert choose_fastest({"trt": _stats(1.00), "torch-graph": _stats(1.015)}, order, tie_tolerance=0) == "trt"
    # names missing from the order rank after it; among themselves the faster wins
    assert choose_fastest({"x": _stats(1.0), "y": _stats(1.01), "trt": _stats(1.019)}, order) == "trt"
    assert choose_fastest({"x": _stats(1.01), "y": _stats(1.0)}, order) == "y"
    with pytest.raises(KKError):
        choose_fastest({}, order)


def test_bench_refuses_long_context_and_conflicting_flags(capsys):
    with pytest.raises(KKError, match="long-context.*kkdeploy check --shape 14"):
        jobs_for([14], None)
    assert main(["bench", "--shape", "14", "--device", "cpu"]) == 2
    assert "long-context" in capsys.readouterr().err
    assert main(["bench", "--shape", "99", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert "unknown shape id 99" in err and len(err.splitlines()) == 1
    assert main(["bench", "--all", "--shape", "3", "--device", "cpu"]) == 2
    assert main(["bench", "--device", "cpu"]) == 2
    assert main(["bench", "--shape", "3", "--device", "cpu", "--repeats", "0"]) == 2


def test_bench_command_writes_json_markdown_and_png(tmp_path, capsys):
    out = tmp_path / "bench"
    code = main(["bench", *TINY, "--device", "cpu", "--processes", "1", "--warmups", "1", "--repeats", "3",
                 "--rounds", "1", "--trials", "1", "--out", str(out)])
    assert code == 0, capsys.readouterr()
    data = json.loads((out / "bench.json").read_text())
    assert data["format"] == "kkdeploy-bench/1"
    assert data["protocol"]["timer"] == "time.perf_counter" and data["protocol"]["repeats"] == 3
    (shape,) = data["shapes"]
    assert shape["label"] == "custom-B2-S8-D16-H2-F24-L2" and shape["processes"] == 1  # the dimensions tell custom runs apart and shape["errors"] == []
    assert shape["config"]["d_model"] == 16 and shape["tokens"] == 16
    # which weights stand behind the figures, hashed as a build's manifest hashes them (seeded here)
    from kkdeploy.config import TransformerConfig
    import torch

    from kkdeploy.models.weights import build_models, weights_sha256

    seeded = build_models(TransformerConfig(2, 8, 16, 2, 24, 2), torch.float32, torch.device("cpu"))[0]
    assert shape["weights_sha256"] == weights_sha256(seeded)
    backends = shape["backends"]
    assert backends["eager"]["status"] == "reference" and backends["eager"]["speedup"] == pytest.approx(1.0)
    for name in ("eager", "optimized-sdpa0", "optimized-sdpa1"):
        b = backends[name]
        assert b["samples"] == 3 and b["min_ms"] <= b["median_ms"] <= b["p90_ms"]
        assert b["tokens_per_s"] == pytest.approx(16 / (b["median_ms"] / 1000.0))
        assert b["speedup"] == pytest.approx(backends["eager"]["median_ms"] / b["median_ms"])
    for name in ("optimized-sdpa0", "optimized-sdpa1"):
        assert backends[name]["status"] == "passed"
        assert backends[name]["failed_elements"] == {"all-valid": 0, "padded": 0}
    assert backends["torch-graph"]["status"] == "skipped" and "CUDA" in backends["torch-graph"]["reason"]
    # the roofline (issue 31): the shape's work, the limits measured in the worker, a fraction per timed backend
    roofline = shape["roofline"]
    # 2 layers x (projections 8·T·D² + FFN 4·T·D·F + attention 2 GEMMs x 2·B·D·S(S+1)/2), T = 16, B 2, S 8 (36 pairs)
    assert roofline["work"]["flops"]["total"] == 2 * (8 * 16 * 16 * 16 + 4 * 16 * 16 * 24 + 2 * 2 * 2 * 16 * 36)
    worker_limits = roofline["limits_per_process"][0]
    assert worker_limits["device"] == "cpu" and worker_limits["gemm"]["tflop_s"] > 0 and worker_limits["copy"]["gb_s"] > 0
    assert roofline["limits"]["launch"]["floor_ms"] == worker_limits["launch"]["floor_ms"] > 0
    for name in ("eager", "optimized-sdpa0", "optimized-sdpa1"):
        r = backends[name]["roofline"]
        assert r["launches"] is None and "not counted on the CPU" in r["launches_reason"]
        assert r["bound"] in ("compute", "memory", "launch") and r["measured_ms"] == backends[name]["median_ms"]
        assert r["fraction"] == pytest.approx(r["bound_ms"] / r["measured_ms"]) and r["fraction"] > 0
        assert r["bound_ms"] == max(v for v in r["terms_ms"].values() if v is not None)
    assert "roofline" not in backends["torch-graph"]  # skipped: nothing measured
    for name in ("eager", "optimized-sdpa0", "optimized-sdpa1"):  # the gaps between kernels need a GPU: said so
        assert "not on the CPU" in backends[name]["timeline"]["unavailable"]
    md = (out / "bench.md").read_text()
    assert "## Timeline" not in md  # no figure to show
    assert "| shape | backend | status |" in md and "| custom-B2-S8-D16-H2-F24-L2 | optimized-sdpa1 | passed |" in md
    assert "fraction of limit (bound) |" in md and "## Roofline" in md
    assert f"- weights: seeded; sha256 per shape: custom-B2-S8-D16-H2-F24-L2 {shape['weights_sha256'][:16]}" in md
    assert "roofline custom-B2-S8-D16-H2-F24-L2: " in capsys.readouterr().out  # the printed summary: work and limits per shape
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    validation = json.loads((out / "logs" / "validation-custom-B2-S8-D16-H2-F24-L2-p0.json").read_text())
    assert validation["statuses"] == {"optimized-sdpa0": "passed", "optimized-sdpa1": "passed"}


def test_bench_without_the_timeline_records_none(tmp_path, capsys):
    out = tmp_path / "bench"
    code = main(["bench", *TINY, "--device", "cpu", "--processes", "1", "--warmups", "1", "--repeats", "3",
                 "--rounds", "1", "--trials", "1", "--candidates", "optimized-sdpa0", "--no-timeline",
                 "--out", str(out)])
    assert code == 0, capsys.readouterr()
    data = json.loads((out / "bench.json").read_text())
    assert data["protocol"]["timeline"] is False
    assert all("timeline" not in b for b in data["shapes"][0]["backends"].values())


def _worker_result(process, status, times):
    entry = {"status": status, "reason": f"{status} in process {process}", "all_valid_only": False,
             "failed_elements": {"all-valid": 0 if status == "passed" else 7, "padded": 0}, "max_abs": 0.0}
    if status == "passed":
        entry["latency"] = LatencyStats.from_times(times, [sorted(times)[len(times) // 2]]).to_dict(include_times=True)
    eager = LatencyStats.from_times([4.0, 4.0, 4.0], [4.0]).to_dict(include_times=True)
    return {"backends": {"eager": {"status": "reference", "reason": "", "latency": eager}, "engine": entry}}


def test_aggregation_pools_processes_and_a_failure_anywhere_fails(tmp_path):
    job = ShapeJob("custom", None, TransformerConfig(2, 8, 16, 2, 24, 2))
    passing = aggregate_shape(job, [_worker_result(0, "passed", [1.0, 2.0, 3.0]),
                                    _worker_result(1, "passed", [2.0, 2.0, 2.0])], [])
    engine = passing["backends"]["engine"]
    assert "weights_sha256" not in passing  # the workers reported none
    mixed = aggregate_shape(job, [dict(_worker_result(0, "passed", [1.0]), weights_sha256="a"),
                                  dict(_worker_result(1, "passed", [1.0]), weights_sha256="b")], [])
    assert mixed["weights_sha256"] == ["a", "b"]  # processes that disagree are shown, not hidden
    assert engine["status"] == "passed" and engine["samples"] == 6
    assert engine["median_ms"] == pytest.approx(2.0) and engine["speedup"] == pytest.approx(2.0)
    assert engine["process_medians_ms"] == pytest.approx([2.0, 2.0])
    failing = aggregate_shape(job, [_worker_result(0, "passed", [1.0, 2.0, 3.0]),
                                    _worker_result(1, FAILED, [])], ["process 2 exited with 1"])
    engine = failing["backends"]["engine"]
    assert engine["status"] == FAILED and "median_ms" not in engine and "speedup" not in engine
    assert engine["failed_elements"] == {"all-valid": 7, "padded": 0}
    data = {"created": "now", "command": "kkdeploy bench", "shapes": [passing, dict(failing, label="other")],
            "protocol": {"dtype": "float32", "device": "cpu", "contract": "strict", "atol": 0.001, "rtol": 0.01,
                         "trials": 5, "seed": 1234, "padding_ratio": 0.25, "warmups": 20, "repeats": 100,
                         "rounds": 3, "processes": 2, "timer": "time.perf_counter"},
            "environment": {"device": "cpu", "cpu": "x86_64", "versions": {"torch": "x"}}}
    md = markdown_table(data)
    assert "| other | engine | **FAILED** |" in md and "process 2 exited with 1" in md
    plot_speedups(data, tmp_path / "bench.png")
    assert (tmp_path / "bench.png").stat().st_size > 0


def test_aggregation_reports_the_speedup_over_eagers_fastest_round_too():
    """Eager slow in one process (4 ms rounds) and fast in the other (2 ms): the pooled median gives the
    protocol's speedup, the fastest round the conservative one; bench.md shows both."""
    job = ShapeJob("custom", None, TransformerConfig(2, 8, 16, 2, 24, 2))
    results = [_worker_result(0, "passed", [1.0, 1.0, 1.0]), _worker_result(1, "passed", [1.0, 1.0, 1.0])]
    results[1]["backends"]["eager"]["latency"] = LatencyStats.from_times([2.0, 2.0], [2.0]).to_dict(include_times=True)
    backends = aggregate_shape(job, results, [])["backends"]
    assert backends["engine"]["speedup"] == pytest.approx(4.0)  # pooled eager samples 4,4,4,2,2: median 4
    assert backends["engine"]["speedup_over_eager_floor"] == pytest.approx(2.0)
    assert backends["eager"]["speedup_over_eager_floor"] == pytest.approx(0.5)  # its pooled median: 2x its floor
    data = {"created": "now", "command": "kkdeploy bench", "shapes": [dict(aggregate_shape(job, results, []))],
            "protocol": {"dtype": "float32", "device": "cpu", "contract": "judge", "atol": 0.002, "rtol": 0.02,
                         "trials": 5, "seed": 1234, "padding_ratio": 0.25, "warmups": 20, "repeats": 100,
                         "rounds": 3, "processes": 2, "timer": "time.perf_counter"},
            "environment": {"device": "cpu", "cpu": "x86_64", "versions": {"torch": "x"}}}
    assert "| 4.00x | 2.00x |" in markdown_table(data)


def test_chart_labels_name_a_shape_measured_in_fewer_processes():
    shapes = [{"label": "shape-01", "processes": 3}, {"label": "shape-06", "processes": 1}]
    assert shape_tick_labels(shapes) == ["shape-01", "shape-06 (1 proc)"]
    assert shape_tick_labels(shapes[:1]) == ["shape-01"]  # all alike: nothing to say


def test_bench_judge_float32_calibrates_mixed_precision_and_compiles_on_request(tmp_path, capsys):
    """float32 under the judge contract: the mixed-precision candidate carries its calibration record;
    torch-compile (opt-in on the CPU) is faithful, so it passes with zero failed elements."""
    out = tmp_path / "bench"
    code = main(["bench", *TINY, "--device", "cpu", "--dtype", "float32", "--contract", "judge",
                 "--candidates", "mixed,torch-compile,torch-graph-mixed,torch-compile-mixed-sdpa,fused-mixed,torch-compile-fused,"
                 "fused-half-gemm-mixed",
                 "--processes", "1", "--warmups", "1",
                 "--repeats", "2", "--rounds", "1", "--trials", "1", "--out", str(out)])
    assert code == 0, capsys.readouterr()
    data = json.loads((out / "bench.json").read_text())
    assert data["protocol"]["candidates"] == ["mixed", "torch-compile", "torch-graph-mixed", "torch-compile-mixed-sdpa",
                                              "fused-mixed", "torch-compile-fused", "fused-half-gemm-mixed"]
    assert data["protocol"]["tf32"] is None  # auto; and off on the CPU:
    worker = json.loads((out / "logs" / "result-custom-B2-S8-D16-H2-F24-L2-p0.json").read_text())
    assert worker["tf32"] is False
    backends = data["shapes"][0]["backends"]
    mixed = backends["mixed"]
    assert mixed["status"] == "passed" and mixed["failed_elements"] == {"all-valid": 0, "padded": 0}
    chosen = mixed["calibration"]["fp16_layers"]
    assert mixed["fp16_layers_per_process"] == [chosen] and mixed["calibration"]["passed"]
    assert mixed["calibration"]["tried"][-1]["fp16_layers"] == chosen or chosen == [0, 1]
    assert backends["torch-compile"]["status"] == "passed"
    assert backends["torch-compile"]["failed_elements"] == {"all-valid": 0, "padded": 0}
    assert backends["torch-compile"]["max_abs"] == 0.0  # bitwise
    assert backends["torch-compile"]["compile_seconds_per_process"][0] > 0
    assert backends["torch-graph-mixed"]["status"] == "skipped" and "CUDA" in backends["torch-graph-mixed"]["reason"]
    compiled_mixed = backends["torch-compile-mixed-sdpa"]  # calibrated on its eager twin, then compiled
    assert compiled_mixed["status"] == "passed-all-valid-only" and compiled_mixed["failed_elements"] == {"all-valid": 0}
    assert "eager twin" in compiled_mixed["calibration"]["calibrated_on"]
    assert "reused_from" not in compiled_mixed["calibration"]  # the only SDPA-mixed candidate calibrated itself
    assert compiled_mixed["compile_seconds_per_process"][0] > 0
    fused_mixed = backends["fused-mixed"]  # SDPA in every block serves padded calls too, so it calibrates on both
    assert fused_mixed["status"] == "passed" and set(fused_mixed["failed_elements"]) == {"all-valid", "padded"}
    assert "reused_from" not in fused_mixed["calibration"] and fused_mixed["calibration"]["passed"]
    fused = backends["torch-compile-fused"]  # float32 throughout: SDPA and fusion only reorder float32 sums
    assert fused["status"] == "passed" and 0 < fused["max_abs"] < 1e-4 and "calibration" not in fused
    half = backends["fused-half-gemm-mixed"]  # another base model, so its own calibration, not fused-mixed's
    assert half["status"] == "passed" and "reused_from" not in half["calibration"] and half["calibration"]["passed"]
    assert half["half_gemm_kernel"] == "float32 GEMM of float16-rounded inputs" and "half_gemm_kernel" not in fused_mixed
    assert "Mixed-precision calibration" in (out / "bench.md").read_text()
    assert "fused-half-gemm-mixed: float32 GEMM of float16-rounded inputs" in (out / "bench.md").read_text()


def test_bench_rejects_unknown_candidates(capsys):
    assert main(["bench", *TINY, "--device", "cpu", "--candidates", "optimized-sdpa0,warp-drive"]) == 2
    assert "unknown bench candidate 'warp-drive'" in capsys.readouterr().err


def test_aggregation_keeps_which_of_our_kernels_ran():
    """A kernel candidate's record says which attention and LayerNorm kernels its ops ran in the processes."""
    job = ShapeJob("custom", None, TransformerConfig(2, 8, 16, 2, 24, 2))
    results = [_worker_result(p, "passed", [1.0, 1.0, 1.0]) for p in (0, 1)]
    for r in results:
        r["backends"]["engine"].update(attention_path={"kernel": "triton", "reason": "r"},
                                       layer_norm_path={"kernel": "rows", "reason": "proven"})
    engine = aggregate_shape(job, results, [])["backends"]["engine"]
    assert engine["attention_path"]["kernel"] == "triton" and engine["layer_norm_path"]["kernel"] == "rows"


def test_build_over_its_time_budget_says_what_it_cut_and_records_it(tmp_path, capsys):
    out = tmp_path / "a"
    # a budget no protocol fits: the screen runs, and what ran is printed, written and shown by inspect
    code = main(["build", *TINY, "--device", "cpu", "--backends", "ort-cpu", "--trials", "1", "--warmups", "2",
                 "--repeats", "40", "--rounds", "2", "--time-budget", "0.000001", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    manifest = json.loads((out / "manifest.json").read_text())
    plan = manifest["timing"]
    assert plan["budget_s"] == pytest.approx(1e-6) and plan["full_protocol"] is False
    assert plan["rounds"] == 2 and plan["repeats"] == timing_module.MIN_REPEATS
    assert json.loads((out / "bench.json").read_text())["protocol"]["timing"] == plan
    assert "timing: " in printed and "--time-budget 0 runs it" in printed
    assert ("every candidate timed with" in printed) == (not plan["screened_out"])
    for candidate in manifest["candidates"]:
        if "latency" in candidate and candidate["name"] not in plan["screened_out"]:
            assert candidate["latency"]["samples"] == 2 * timing_module.MIN_REPEATS
    assert main(["inspect", str(out)]) == 0
    assert "timing: " in capsys.readouterr().out
    # the default budget fits this shape's full protocol: nothing cut, nothing printed
    code = main(["build", *TINY, "--device", "cpu", "--backends", "ort-cpu", "--trials", "1", "--warmups", "1",
                 "--repeats", "3", "--rounds", "1", "--out", str(tmp_path / "b")])
    assert code == 0 and "timing: " not in capsys.readouterr().out
    assert json.loads((tmp_path / "b" / "manifest.json").read_text())["timing"]["full_protocol"] is True

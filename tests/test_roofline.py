"""The roofline (issue 31): the FLOP and byte model against hand-computed numbers, the fraction of the limit, the
limits measured on the CPU, the launch count's plumbing, and bench.json / bench.md / bench.png carrying it."""

from __future__ import annotations

import struct
from types import SimpleNamespace

import pytest
import torch

from kkdeploy import ReferenceTransformer, TransformerConfig
from kkdeploy.config import official_config
from kkdeploy.pipeline import launches as launches_module
from kkdeploy.pipeline import machine_limits
from kkdeploy.pipeline.bench import ShapeJob, aggregate_shape, markdown_table, plot_speedups
from kkdeploy.pipeline.roofline import (call_work, fraction_of_limit, gemm_flops, minimal_bytes, parameter_count,
                                        pool_launches, pool_limits, roofline_record, time_terms_ms)
from kkdeploy.pipeline.timing import LatencyStats

# The contract of bench.json's per-backend ``roofline`` record: key -> allowed types.
NUMBER = (int, float)
ROOFLINE_SCHEMA = {"fraction": NUMBER, "bound": (str,), "bound_ms": NUMBER, "terms_ms": (dict,), "measured_ms": NUMBER,
                   "flops": (int,), "bytes": (int,), "launches": (int, type(None)),
                   "launches_counted_by": (str, type(None)), "achieved_tflop_s": NUMBER, "achieved_gb_s": NUMBER}

LIMITS = {"device": "cuda:0", "dtype": "float16", "tf32": False,
          "gemm": {"tflop_s": 100.0, "n": 8192, "ms": 11.0},
          "copy": {"gb_s": 1000.0, "bytes_moved": 2, "ms": 1.0},
          "launch": {"floor_ms": 0.005, "per_launch_ms": 0.001}}


# -- the model of one call -------------------------------------------------------------------------------------------
def test_flops_of_shape_3_by_hand():
    """B4 S128 D128 F128 L4, T = 512 tokens. Per layer: projections 4 x 2·T·D² = 67,108,864; FFN 2 x 2·T·D·F =
    33,554,432; attention 2 GEMMs x 2·B·D·S(S+1)/2 = 2·4·128·128·129 = 16,908,288 (causal: 129/256 of dense)."""
    flops = gemm_flops(official_config(3))
    assert flops == {"projections": 4 * 67_108_864, "ffn": 4 * 33_554_432, "attention": 4 * 16_908_288,
                     "total": 470_286_336}
    dense = gemm_flops(TransformerConfig(4, 128, 128, 4, 128, 4, causal=False))
    assert dense["attention"] == 4 * 4 * 4 * 128 * 128 * 128 == 134_217_728  # 4·B·S²·D per layer
    assert flops["attention"] * 256 == dense["attention"] * 129  # the causal halving, diagonal included
    assert dense["projections"] == flops["projections"] and dense["ffn"] == flops["ffn"]


def test_flops_and_bytes_of_shape_14_by_hand():
    """B32 S100000 D1024 H16 F1024 L2: 1.39 PFLOP, almost all of it attention; 13.1 GB, almost all of it activations
    in and out (the weights are 25 MB)."""
    config = official_config(14)
    flops = gemm_flops(config)
    assert flops["projections"] == 2 * 8 * 3_200_000 * 1024 * 1024 == 53_687_091_200_000
    assert flops["ffn"] == 26_843_545_600_000
    assert flops["attention"] == 2 * 2 * 2 * 32 * 1024 * (100_000 * 100_001 // 2) == 1_310_733_107_200_000
    assert flops["total"] == 1_391_263_744_000_000
    nbytes = minimal_bytes(config, torch.float16)
    # per layer 4·(D²+D) + (D·F+F) + (F·D+D) + 2·2D = 6,301,696 parameters; 2 layers + the final norm's 2D
    assert parameter_count(config) == 12_605_440
    assert nbytes == {"weights": 25_210_880, "inputs": 6_553_600_000 + 3_200_000, "outputs": 6_553_600_000,
                      "total": 13_135_610_880}


def test_bytes_of_shape_3_by_hand_and_the_parameter_count_is_the_models():
    nbytes = minimal_bytes(official_config(3), torch.float16)
    assert nbytes == {"weights": 2 * 398_592, "inputs": 512 * 128 * 2 + 512, "outputs": 512 * 128 * 2,
                      "total": 1_059_840}
    assert minimal_bytes(official_config(3), torch.float32)["weights"] == 4 * 398_592
    from kkdeploy.models.reference import ReferenceTransformer

    config = TransformerConfig(2, 8, 16, 2, 24, 3)
    model = ReferenceTransformer(config)
    assert parameter_count(config) == sum(p.numel() for p in model.state_dict().values())


def test_issue_31_orders_of_magnitude():
    """The issue's table: shape 8 ~0.41 TFLOP, shape 13 ~0.14 TFLOP (its attention causal-halved here)."""
    assert gemm_flops(official_config(8))["total"] / 1e12 == pytest.approx(0.42, abs=0.01)
    assert gemm_flops(official_config(13))["total"] / 1e12 == pytest.approx(0.12, abs=0.01)


# -- the fraction ----------------------------------------------------------------------------------------------------
def test_a_fraction_above_one_is_shown_as_a_limit_measured_low():
    from kkdeploy.pipeline.roofline import format_fraction

    assert format_fraction({"fraction": 0.31, "bound": "launch"}) == "0.31 launch"
    assert format_fraction({"fraction": 0.057, "bound": "compute"}) == "0.057 compute"
    # a CPU's float16 GEMM probe ran slower than the model's own GEMMs: the call "beat" the limit
    assert format_fraction({"fraction": 2.7, "bound": "compute"}) == "2.70 compute (limit measured low)"
    assert format_fraction(None) == "-" and format_fraction({"fraction": None}) == "-"


def test_fraction_is_the_largest_term_over_the_median():
    work = {"flops": {"total": 10**9}, "bytes": {"total": 2 * 10**6}}
    # compute 1e9 / 100e12 s = 0.01 ms; memory 2e6 / 1e12 s = 0.002 ms; launch 0.005 + 40 x 0.001 = 0.045 ms
    record = roofline_record(work, LIMITS, {"count": 41, "method": "CUDA-graph nodes"}, 0.09)
    assert record["terms_ms"] == pytest.approx({"compute": 0.01, "memory": 0.002, "launch": 0.045})
    assert record["bound"] == "launch" and record["bound_ms"] == pytest.approx(0.045)
    assert record["fraction"] == pytest.approx(0.5)
    assert record["achieved_tflop_s"] == pytest.approx(1e9 / 0.09e-3 / 1e12)
    assert record["achieved_gb_s"] == pytest.approx(2e6 / 0.09e-3 / 1e9)
    # launches not counted: the floor of one call only, so compute binds
    uncounted = roofline_record(work, LIMITS, {"count": None, "reason": "not counted on the CPU"}, 0.09)
    assert uncounted["terms_ms"]["launch"] == pytest.approx(0.005) and uncounted["bound"] == "compute"
    assert uncounted["fraction"] == pytest.approx(0.01 / 0.09)
    assert uncounted["launches_reason"] == "not counted on the CPU"
    # a limit that could not be measured drops out of the max; with none, no fraction and a reason
    no_gemm = dict(LIMITS, gemm={"error": "RuntimeError: out of memory"})
    assert time_terms_ms(10**9, 2 * 10**6, None, no_gemm)["compute"] is None
    assert roofline_record(work, no_gemm, None, 0.09)["bound"] == "launch"
    failed = {"gemm": {"error": "x"}, "copy": {"error": "y"}, "launch": {"error": "z"}}
    nothing = roofline_record(work, failed, None, 0.09)
    assert nothing["fraction"] is None and "gemm x" in nothing["reason"]
    assert roofline_record(work, None, None, 0.09)["reason"] == "no limits were measured in these processes"
    assert fraction_of_limit({"compute": 0.2, "memory": None, "launch": 0.1}, 0.1) == (pytest.approx(2.0), "compute",
                                                                                      pytest.approx(0.2))


def test_limits_pool_to_the_best_process_and_launches_to_the_agreed_count():
    slow = dict(LIMITS, gemm={"tflop_s": 50.0}, copy={"gb_s": 2000.0},
                launch={"floor_ms": 0.004, "per_launch_ms": 0.002})
    pooled = pool_limits([LIMITS, None, slow])
    assert pooled["gemm"]["tflop_s"] == 100.0 and pooled["copy"]["gb_s"] == 2000.0
    assert pooled["launch"] == {"floor_ms": 0.004, "per_launch_ms": 0.001} and pooled["processes"] == 2
    assert pool_limits([None, None]) is None
    failed = pool_limits([dict(LIMITS, gemm={"error": "boom"})])
    assert failed["gemm"] == {"error": "boom"}
    counted = {"count": 40, "method": "CUDA-graph nodes"}
    assert pool_launches([counted, dict(counted)]) == counted
    assert pool_launches([{"count": None, "reason": "first process only"}, counted])["count"] == 40
    differing = pool_launches([counted, dict(counted, count=38)])
    assert differing["count"] == 38 and differing["per_process"] == [40, 38]
    assert pool_launches([{"count": None, "reason": "r"}]) == {"count": None, "reason": "r"}
    assert pool_launches([]) is None


# -- the limits, measured on the CPU -----------------------------------------------------------------------------------
def test_cpu_limits_are_measured_once_per_process_and_bounded():
    machine_limits._measure.cache_clear()
    limits = machine_limits.measure_limits("cpu", torch.float32)
    assert limits["device"] == "cpu" and limits["dtype"] == "float32" and limits["tf32"] is False
    gemm, copy, launch = limits["gemm"], limits["copy"], limits["launch"]
    assert gemm["tflop_s"] > 0 and machine_limits.CPU_START_N <= gemm["n"] <= machine_limits.CPU_MAX_N
    assert gemm["tflop_s"] == pytest.approx(2 * gemm["n"] ** 3 / (gemm["ms"] * 1e-3) / 1e12)
    assert copy["gb_s"] == pytest.approx(2 * machine_limits.CPU_COPY_BYTES / (copy["ms"] * 1e-3) / 1e9)
    assert launch["floor_ms"] > 0 and launch["per_launch_ms"] is None and "not counted" in launch["method"]
    assert gemm["seconds"] + copy["seconds"] + launch["seconds"] < 10  # bounded on 2 shared cores
    again = machine_limits.measure_limits("cpu", torch.float32)
    assert again == limits and machine_limits._measure.cache_info().hits >= 1  # cached, not measured again
    again["gemm"]["tflop_s"] = -1.0  # the caller's copy
    assert machine_limits.measure_limits("cpu", torch.float32)["gemm"]["tflop_s"] > 0


def test_a_limit_that_fails_is_an_error_in_the_record(monkeypatch):
    def broken(device, dtype):
        raise RuntimeError("CUBLAS_STATUS_NOT_INITIALIZED\nmore lines")

    monkeypatch.setattr(machine_limits, "gemm_limit", broken)
    machine_limits._measure.cache_clear()
    try:
        limits = machine_limits.measure_limits("cpu", torch.float16)
    finally:
        machine_limits._measure.cache_clear()
    assert limits["gemm"] == {"error": "RuntimeError: CUBLAS_STATUS_NOT_INITIALIZED"}
    assert limits["copy"]["gb_s"] > 0


# -- launches ----------------------------------------------------------------------------------------------------------
class FakeDriver:
    """A graph of 3 kernels, a memcpy, an empty node and a child graph of 2 kernels and a memset."""

    graphs = {1: [10, 11, 12, 13, 14, 15], 2: [20, 21, 22]}
    types = {10: 0, 11: 0, 12: 0, 13: 1, 14: 5, 15: 4, 20: 0, 21: 0, 22: 2}

    def nodes(self, graph):
        return self.graphs[graph]

    def node_type(self, node):
        return self.types[node]

    def child_graph(self, node):
        return 2


def fake_capture(all_valid_only: bool, raw: int | None = 1):
    from engines.cuda_graph import CapturedCall

    capture = CapturedCall.__new__(CapturedCall)  # no CUDA here: only what the count reads
    capture.all_valid_only = all_valid_only
    capture.graph_kept = raw is not None
    capture.graph = SimpleNamespace(raw_cuda_graph=lambda: raw)
    return capture


def test_graph_nodes_are_counted_with_child_graphs_and_the_ops_around_the_replay():
    from kkdeploy.pipeline.launches import captured_launches, graph_node_counts

    assert graph_node_counts(1, FakeDriver()) == {"kernel": 5, "memcpy": 1, "memset": 1, "empty": 1}
    counted = captured_launches(fake_capture(all_valid_only=False), FakeDriver())
    # 7 device nodes (5 kernels, 1 memcpy, 1 memset), plus input copy, mask copy, output clone
    assert counted["count"] == 10 and counted["in_graph"] == 7 and counted["outside_graph"] == 3
    assert captured_launches(fake_capture(all_valid_only=True), FakeDriver())["count"] == 9  # no mask copy
    assert captured_launches(fake_capture(False, raw=None))["count"] is None


def test_the_timed_capture_follows_the_routers():
    from engines.base import AllValidRouter
    from kkdeploy.pipeline.launches import timed_capture
    from kkdeploy.pipeline.runtime import ServedRunner

    valid, padded = fake_capture(True), fake_capture(False)
    router = AllValidRouter.__new__(AllValidRouter)
    router.all_valid, router.padded = SimpleNamespace(captured=valid), SimpleNamespace(captured=padded)
    assert timed_capture(router) is valid  # the timed input is all-valid
    fallback = ReferenceTransformer(TransformerConfig(1, 4, 8, 2, 8, 1))  # a ServedRunner is a Runner of its shape
    served = ServedRunner(fallback=fallback, engine=router)
    assert timed_capture(served) is valid
    assert timed_capture(ServedRunner(fallback=fallback)) is None  # the fallback is not captured
    assert timed_capture(torch.nn.Linear(2, 2)) is None


def test_launches_are_not_counted_on_the_cpu_and_profiler_events_are_tallied():
    from torch.autograd import DeviceType

    from kkdeploy.pipeline.launches import CPU_REASON, count_launches, tally_device_events

    assert count_launches(torch.nn.Identity(), lambda: None, "cpu") == {"count": None, "reason": CPU_REASON}
    averages = [SimpleNamespace(key="ampere_fp16_s16816gemm", count=8, device_type=DeviceType.CUDA),
                SimpleNamespace(key="Memcpy DtoD (Device -> Device)", count=2, device_type=DeviceType.CUDA),
                SimpleNamespace(key="Memset (Device)", count=1, device_type=DeviceType.CUDA),
                SimpleNamespace(key="aten::addmm", count=8, device_type=DeviceType.CPU)]
    assert tally_device_events(averages) == {"kernel": 8, "memcpy": 2, "memset": 1}
    assert launches_module.device_event_kind("triton_poi_fused_0") == "kernel"


# -- bench.json, bench.md, bench.png -----------------------------------------------------------------------------------
def _worker(limits, launches_count):
    eager = LatencyStats.from_times([4.0, 4.0, 4.0], [4.0]).to_dict(include_times=True)
    engine = LatencyStats.from_times([0.09, 0.09, 0.09], [0.09]).to_dict(include_times=True)
    return {"dtype": "float16", "limits": limits, "backends": {
        "eager": {"status": "reference", "reason": "", "latency": eager,
                  "launches": {"count": None, "reason": "an uncaptured call: counted in the first process only"}},
        "engine": {"status": "passed", "reason": "", "all_valid_only": False, "latency": engine,
                   "failed_elements": {"all-valid": 0, "padded": 0}, "max_abs": 0.0,
                   "launches": {"count": launches_count, "method": "CUDA-graph nodes"}},
        "broken": {"status": "failed", "reason": "3 elements", "failed_elements": {"all-valid": 3}, "max_abs": 1.0}}}


def _png_size(path) -> tuple[int, int]:
    return struct.unpack(">II", path.read_bytes()[16:24])


def _data(shapes):
    return {"created": "now", "command": "kkdeploy bench", "shapes": shapes,
            "protocol": {"dtype": "float16", "device": "cuda", "contract": "strict", "atol": 0.001, "rtol": 0.01,
                         "trials": 5, "seed": 1234, "padding_ratio": 0.25, "warmups": 20, "repeats": 100,
                         "rounds": 3, "processes": 2, "timer": "CUDA events"},
            "environment": {"device": "cuda", "gpu": "test GPU", "versions": {"torch": "x"}}}


def test_aggregated_shape_carries_the_roofline_per_timed_backend_in_bench_md_and_png(tmp_path):
    config = official_config(3)
    shape = aggregate_shape(ShapeJob("shape-03", 3, config), [_worker(LIMITS, 41), _worker(None, 41)], [])
    work = shape["roofline"]["work"]
    assert work == call_work(config, torch.float16) and work["flops"]["total"] == 470_286_336
    assert shape["roofline"]["limits"]["processes"] == 1 and shape["roofline"]["limits_per_process"][1] is None
    engine = shape["backends"]["engine"]["roofline"]
    for key, types in ROOFLINE_SCHEMA.items():  # the JSON contract of the record
        assert isinstance(engine[key], types), (key, engine[key])
    assert set(engine["terms_ms"]) == {"compute", "memory", "launch"}
    assert engine["launches"] == 41 and engine["bound"] == "launch"
    assert engine["fraction"] == pytest.approx(0.045 / 0.09)
    eager = shape["backends"]["eager"]["roofline"]  # uncounted: the floor of one call (0.005 ms > compute's 0.0047)
    assert eager["launches"] is None and "first process" in eager["launches_reason"]
    assert eager["terms_ms"]["compute"] == pytest.approx(470_286_336 / 100e12 * 1e3)
    assert eager["bound"] == "launch" and eager["fraction"] == pytest.approx(0.005 / 4.0)
    assert "roofline" not in shape["backends"]["broken"]  # not timed, no fraction
    md = markdown_table(_data([shape]))
    assert "| fraction of limit (bound) |" in md and "| 0.50 launch |" in md
    assert "## Roofline" in md and "0.4703 GFLOP" in md and "GEMM 100 TFLOP/s (n=8192)" in md
    assert "| shape-03 | engine | 0.09 | 41 |" in md
    plot_speedups(_data([shape]), tmp_path / "bench.png")
    assert _png_size(tmp_path / "bench.png")[1] == 1100  # two panels: speedup, fraction of the limit


def test_the_first_process_s_timeline_reaches_bench_json_and_a_section_of_bench_md(capsys):
    """The gaps between kernels (kkdeploy.pipeline.timeline), profiled once per backend in the first process:
    aggregation keeps that record, and bench.md shows span, busy share, gaps and the largest gap."""
    first, second = _worker(LIMITS, 29), _worker(LIMITS, 29)
    first["backends"]["engine"]["timeline"] = {
        "calls": 20, "kernels_per_call": 29, "median_span_us": 70.0, "median_busy_us": 52.5, "median_idle_us": 17.5,
        "busy_fraction": 0.75, "kernel_sum_us": 54.0, "gap_sum_us": 19.0, "overlap_us": 1.5,
        "largest_gaps": [{"after": 27, "before_kernel": "_fused_linear_kernel", "next_kernel": "triton_poi_0",
                          "median_gap_us": 2.25}], "positions": []}
    first["backends"]["eager"]["timeline"] = {"unavailable": "profiling failed: RuntimeError: CUPTI"}
    shape = aggregate_shape(ShapeJob("shape-03", 3, official_config(3)), [first, second], [])
    assert shape["backends"]["engine"]["timeline"]["median_span_us"] == 70.0
    assert "CUPTI" in shape["backends"]["eager"]["timeline"]["unavailable"]
    md = markdown_table(_data([shape]))
    assert "## Timeline" in md
    assert "| shape-03 | engine | 29 | 70.0 | 52.5 (75%) | 19.0 | 1.5 | 2.25 after 27 (_fused_linear_kernel) |" in md
    assert "| shape-03 | eager |" not in md.split("## Timeline")[1].split("##")[0]  # no figure, no row
    from kkdeploy.commands.bench import print_summary

    print_summary(_data([shape]))  # the console's summary: one line per backend with a timeline
    out = capsys.readouterr().out
    assert "timeline shape-03 engine: 29 kernels a call, span 70.0 µs, busy 52.5 µs" in out
    assert "timeline shape-03 eager" not in out


def test_old_bench_results_without_a_roofline_still_read():
    """A bench.json written before the roofline: no section, '-' in the column, one panel in the chart."""
    shape = aggregate_shape(ShapeJob("shape-03", 3, official_config(3)), [_worker(None, 41)], [])
    for b in shape["backends"].values():
        b.pop("roofline", None)
    shape.pop("roofline")
    md = markdown_table(_data([shape]))
    assert "## Roofline" not in md and md.count("| - |") >= 1


def test_old_bench_png_has_one_panel(tmp_path):
    shape = aggregate_shape(ShapeJob("shape-03", 3, official_config(3)), [_worker(None, 41)], [])
    assert shape["backends"]["engine"]["roofline"]["fraction"] is None  # no limits: nothing to draw
    plot_speedups(_data([shape]), tmp_path / "bench.png")
    assert _png_size(tmp_path / "bench.png")[1] == 605


def test_processes_that_chose_different_plans_are_shown_with_each_ones_launches():
    """A bench process that proves anew can choose another plan: proof timings 0.1 µs apart gave shape 3 20 launches
    in one process and 24 in the next (session 46, a proof cache per process). The pooled entry keeps every process's
    plan where they differ (reasons, which quote timings, left out), the roofline every process's count, and bench.md
    says which choices differed."""
    from kkdeploy.pipeline.bench import kernel_plan

    def plan(gelu: bool, reason: str) -> dict:
        return {"layer_norm_path": {"kernel": "rows", "launch": "rows2", "reason": reason},
                "linear_path": {"kernel": "triton", "reason": reason, "plan": {"gemms": True, "gelu": gelu},
                                "launches": {"ffn_in": {"kernel": "triton", "launch": "m64", "reason": reason}}}}

    results = [_worker(LIMITS, 20), _worker(LIMITS, 24), _worker(LIMITS, 24)]
    for result, (gelu, reason) in zip(results, [(True, "at 0.0056 ms"), (False, "at 0.0057 ms"),
                                                (False, "at 0.0055 ms")]):
        result["backends"]["engine"].update(plan(gelu, reason))
    shape = aggregate_shape(ShapeJob("shape-03", 3, official_config(3)), results, [])
    engine = shape["backends"]["engine"]
    assert [p["linear_path"]["plan"]["gelu"] for p in engine["plans_per_process"]] == [True, False, False]
    assert "reason" not in engine["plans_per_process"][0]["layer_norm_path"]
    assert engine["roofline"]["launches"] == 20 and engine["roofline"]["launches_per_process"] == [20, 24, 24]
    md = markdown_table(_data([shape]))
    assert "| shape-03 | engine | 0.09 | 20 (20/24/24) |" in md
    assert "- shape-03 engine: launches per process 20/24/24; linear_path.plan.gelu: True/False/False" in md
    # processes that agree (their timings differ, their choices do not): one plan, one count
    same = [_worker(LIMITS, 24), _worker(LIMITS, 24)]
    for result, reason in zip(same, ["at 0.0057 ms", "at 0.0055 ms"]):
        result["backends"]["engine"].update(plan(False, reason))
    agreed = aggregate_shape(ShapeJob("shape-03", 3, official_config(3)), same, [])["backends"]["engine"]
    assert "plans_per_process" not in agreed and "launches_per_process" not in agreed["roofline"]
    assert kernel_plan({}) == {}

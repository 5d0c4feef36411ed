"""scripts/ncu_profile.py on the CPU: reading ncu's raw CSV, the per-call summary, the command, the refusals.

The GPU run itself is the device's (docs/benchmark.md); here ncu's output is written as ncu prints it with
``--csv --page raw --print-units base``: notes first, a header row, a units row, one row per kernel launch."""

from __future__ import annotations

import pytest

from kkdeploy.errors import KKError
from tests.conftest import load_script


@pytest.fixture(scope="module")
def ncu():
    return load_script("ncu_profile")


HEADER = ['ID', 'Process ID', 'Process Name', 'Host Name', 'Kernel Name', 'Context', 'Stream', 'Block Size',
          'Grid Size', 'Device', 'CC']


def _csv(ncu, launches, time_unit="nsecond"):
    metrics = list(ncu.METRICS.values())[::-1]  # ncu orders columns its own way: read them by name
    units = {"gpu__time_duration.sum": time_unit, "dram__bytes_read.sum": "byte", "dram__bytes_write.sum": "byte",
             "launch__registers_per_thread": "register/thread", "launch__grid_size": "", "launch__block_size": ""}
    quote = lambda row: ",".join(f'"{v}"' for v in row)  # noqa: E731
    lines = ["==PROF== Connected to process 4242 (/usr/bin/python3.12)",
             "==PROF== Profiling \"_fused_linear_kernel\" - 0: 0%....50%....100% - 9 passes",
             quote(HEADER + metrics), quote([""] * len(HEADER) + [units.get(m, "%") for m in metrics])]
    key_of = {metric: key for key, metric in ncu.METRICS.items()}
    for i, (name, values) in enumerate(launches):
        lines.append(quote([i, 4242, "python3.12", "h200", name, 1, 7, "(256, 1, 1)", "(80, 4, 1)", 0, "9.0"]
                           + [values[key_of[m]] for m in metrics]))
    lines.append("==PROF== Disconnected from process 4242")
    return "\n".join(lines) + "\n"


def _launch(duration, dram_pct, sm_pct, read=1000, write=500, **extra):
    values = {"duration": duration, "dram_read": read, "dram_write": write, "dram_pct": dram_pct, "memory_pct": dram_pct,
              "sm_pct": sm_pct, "occupancy_pct": 40, "registers": 128, "grid": 320, "block": 256}
    values.update(extra)
    return values


def test_the_raw_csv_is_read_by_column_name_with_units_and_separators(ncu):
    text = _csv(ncu, [("_fused_linear_kernel", _launch("1,500", 70.5, 20)),
                      ("layer_norm_rows2_f16_kernel", _launch(2500, 10, 15, read="2,000,000"))], time_unit="usecond")
    first, second = ncu.parse_raw_csv(text)
    assert first["name"] == "_fused_linear_kernel" and first["stream"] == "7"
    assert first["duration"] == 1500.0 and first["dram_pct"] == 70.5  # microseconds already
    assert second["dram_read"] == 2e6 and second["registers"] == 128
    nanoseconds = ncu.parse_raw_csv(_csv(ncu, [("k", _launch(2500, 10, 15))]))
    assert nanoseconds[0]["duration"] == 2.5  # nsecond -> µs


def test_the_summary_is_per_call_with_shares_bounds_and_the_largest_terms(ncu):
    call = [("_fused_linear_kernel", _launch(3000, 75, 30, read=3_000_000, write=1_000_000)),  # memory
            ("_faithful_attention_kernel", _launch(5000, 20, 80)),  # compute
            ("triton_poi_fused_add_0", _launch(1000, 5, 10)),  # latency
            ("_fused_linear_kernel", _launch(1000, 65, 20, read=1_000_000, write=0))]
    kernels = ncu.parse_raw_csv(_csv(ncu, call + call))  # two calls
    summary = ncu.summarize(kernels, calls=2)
    assert summary["kernels_per_call"] == 4 and summary["us_per_call"] == pytest.approx(10.0)
    rows = {r["name"]: r for r in summary["kernels"]}
    gemm = rows["_fused_linear_kernel"]
    assert gemm["launches_per_call"] == 2 and gemm["us_per_call"] == pytest.approx(4.0) and gemm["share"] == 0.4
    assert gemm["dram_bytes_per_call"] == 5e6 and gemm["dram_gb_s"] == pytest.approx(5e6 / 4e3)  # bytes per ns
    assert gemm["dram_pct"] == pytest.approx(70.0) and gemm["bound"] == "memory" and gemm["class"] == "gemm"
    assert rows["_faithful_attention_kernel"]["bound"] == "compute"
    assert rows["triton_poi_fused_add_0"]["bound"] == "latency"
    assert [r["name"] for r in summary["largest"]] == ["_faithful_attention_kernel", "_fused_linear_kernel",
                                                      "triton_poi_fused_add_0"]
    assert summary["classes_us_per_call"] == {"attention": 5.0, "gemm": 4.0, "triton": 1.0}
    md = ncu.markdown(summary, "ncu: test", top=10)
    assert "| 5.00 | 50.0% | 1 | attention | compute | 20 | 80 |" in md and "4 kernels, 10.0 µs per call" in md


@pytest.mark.parametrize("name, cls", [
    ("_fused_linear_kernel", "gemm"), ("_fused_linear_tma_kernel", "gemm"),
    ("_faithful_attention_kernel", "attention"), ("layer_norm_block4_f16_kernel", "layer norm"),
    ("triton_per_fused_native_layer_norm_0", "triton"), ("triton_poi_fused_where_1", "triton"),
    ("nvjet_hsh_128x256_64x4_1x2_h_bz_coopA_NTN", "gemm"), ("causal_block_softmax_kernel", "attention"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", "other"),
])
def test_kernel_classes_name_our_kernels(ncu, name, cls):
    assert ncu.kernel_class(name) == cls


def test_what_ncu_cannot_give_is_a_one_line_reason(ncu):
    with pytest.raises(KKError, match="no kernel rows"):
        ncu.parse_raw_csv("==PROF== Connected to process 1\n==ERROR== ERR_NVGPUCTRPERM\n")
    text = _csv(ncu, [("k", _launch(1, 1, 1))]).replace("dram__bytes_read.sum", "dram__bytes_read.total")
    with pytest.raises(KKError, match="lacks dram__bytes_read.sum"):
        ncu.parse_raw_csv(text)


def test_the_command_profiles_only_the_calls_and_each_graph_node(ncu, tmp_path):
    command = ncu.ncu_command("/usr/local/cuda/bin/ncu", tmp_path / "ncu.csv", ["python3", "ncu_profile.py", "--inner"],
                              400)
    joined = " ".join(command)
    assert "--profile-from-start off" in joined and "--graph-profiling node" in joined
    assert "--target-processes application-only" in joined  # not Inductor's compile workers
    assert "--csv --page raw --print-units base" in joined and f"--log-file {tmp_path / 'ncu.csv'}" in joined
    assert command[command.index("--metrics") + 1].split(",") == list(ncu.METRICS.values())
    assert command[-3:] == ["python3", "ncu_profile.py", "--inner"]


def test_find_ncu_honours_NCU_and_names_the_fix(ncu, monkeypatch, tmp_path):
    monkeypatch.setenv("NCU", str(tmp_path / "missing-ncu"))
    with pytest.raises(KKError, match="NCU=.* is not an executable"):
        ncu.find_ncu()
    fake = tmp_path / "ncu"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("NCU", str(fake))
    assert ncu.find_ncu() == str(fake)


@pytest.mark.parametrize("argv, message", [
    (["--shape", "3"], "Nsight Compute profiles CUDA kernels"),
    (["--shape", "99"], "unknown shape id 99"),
    (["--shape", "14"], "shape 14 is long-context"),
    (["--dims", "2,16,32"], "--dims takes six integers"),
    (["--shape", "3", "--candidate", "tensorrt"], "unknown bench candidate"),
    (["--shape", "3", "--calls", "0"], "--calls and --launch-count must be >= 1"),
])
def test_bad_arguments_and_the_cpu_get_one_line(ncu, tmp_path, capsys, argv, message):
    import torch

    if torch.cuda.is_available() and message.startswith("Nsight"):
        pytest.skip("this machine has a GPU")
    assert ncu.main(argv + ["--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and not (tmp_path / "o").exists()


def test_the_inner_process_builds_the_candidate_as_the_bench_does_and_runs_the_calls(ncu, capsys):
    # What runs under ncu on the GPU, here without it: the bench's own make_candidate, then the calls.
    import json

    code = ncu.main(["--dims", "2,16,32,2,64,2", "--device", "cpu", "--dtype", "float32", "--candidate",
                     "optimized-sdpa0", "--calls", "2", "--warmups", "1", "--inner"])
    assert code == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["candidate"] == "optimized-sdpa0" and record["config"]["d_model"] == 32


def test_warp_stall_reasons_are_read_by_pattern_and_ranked_per_kernel(ncu, tmp_path):
    """The WarpStateStats section's raw metrics (stalled warps per issued instruction, one column per reason) become
    each kernel's ``stalls``, largest first, each averaged over the launches that report it; the markdown shows the
    three largest. A
    CSV without them (an older ncu, or no section) leaves ``stalls`` empty."""
    long_sb = "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio"
    math = "smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio"
    text = _csv(ncu, [("_faithful_attention_kernel", _launch(5000, 20, 80)),
                      ("_faithful_attention_kernel", _launch(5000, 20, 80)),
                      ("_fused_linear_kernel", _launch(1000, 70, 20))])
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith('"ID",'))
    lines[header] += f',"{long_sb}","{math}"'
    lines[header + 1] += ',"",""'
    extra = [(',"6.5","1.0"'), (',"7.5","n/a"'), (',"0.5","2.25"')]
    for k, row in enumerate(range(header + 2, header + 5)):
        lines[row] += extra[k]
    kernels = ncu.parse_raw_csv("\n".join(lines) + "\n")
    assert kernels[0]["stalls"] == {"long_scoreboard": 6.5, "math_pipe_throttle": 1.0}
    assert kernels[1]["stalls"] == {"long_scoreboard": 7.5}  # n/a: not a number, left out
    summary = ncu.summarize(kernels, calls=1)
    rows = {r["name"]: r for r in summary["kernels"]}
    assert list(rows["_faithful_attention_kernel"]["stalls"].items()) == [("long_scoreboard", 7.0),
                                                                         ("math_pipe_throttle", 1.0)]
    assert list(rows["_fused_linear_kernel"]["stalls"]) == ["math_pipe_throttle", "long_scoreboard"]
    assert summary["largest"][0]["stalls"] == {"long_scoreboard": 7.0, "math_pipe_throttle": 1.0}
    assert "| long_scoreboard 7.0, math_pipe_throttle 1.0 | _faithful_attention_kernel |" in ncu.markdown(
        summary, "t", 5)
    plain = ncu.parse_raw_csv(_csv(ncu, [("k", _launch(1, 1, 1))]))
    assert plain[0]["stalls"] == {} and ncu.summarize(plain, 1)["kernels"][0]["stalls"] == {}
    command = ncu.ncu_command("ncu", tmp_path / "ncu.csv", ["python3"], 10)
    assert command[command.index("--section") + 1] == "WarpStateStats"

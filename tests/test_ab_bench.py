"""scripts/ab_bench.py: an A/B of a code change with the kernels' plan held, its bench processes faked."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import load_script


@pytest.fixture(scope="module")
def ab():
    return load_script("ab_bench")


def _record(op: str, n: int, form: str, ms: float) -> dict:
    return {"op": op, "shape": {"m": 512, "n": n, "k": 128, "form": form, "dtype": "float16"},
            "environment": {"launches": "abc"}, "chosen": "m64n16", "launches": [{"launch": "m64n16", "ms": ms}]}


def _bench_json(folder, ms: float, launches: int, gelu: bool, proofs=()):
    folder.mkdir(parents=True)
    plan = {"linear_path": {"kernel": "triton", "reason": f"timed at {ms}", "plan": {"gelu": gelu}}}
    backend = {"status": "passed", "median_ms": ms, "failed_elements": {"all-valid": 0, "padded": 0},
               "roofline": {"launches": launches}, "kernel_proofs": list(proofs), **plan}
    (folder / "bench.json").write_text(json.dumps({"shapes": [{"backends": {
        "eager": {"status": "reference", "median_ms": 2.0}, "engine": backend}}]}))


def test_every_later_side_starts_from_the_first_side_s_proof_records_and_the_table_says_whether_the_plan_held(
        ab, tmp_path, monkeypatch):
    """Session 46's A/B proved each side in its own cache and measured two plans instead of the edit. Here the
    edited copy holds the edit, every later side's cache starts as a copy of the first's, each side runs in its own
    tree, and the table marks a side whose plan still differs, naming the choice."""
    runs = []
    times = {"base": (0.0845, 24, False), "edit": (0.0817, 24, False), "base2": (0.0848, 24, False)}

    def fake_bench(cmd, cwd, env, log):
        label = next(lab for lab in times if cmd[cmd.index("--out") + 1].endswith(f"/{lab}-3"))
        cache = Path(env["KKDEPLOY_CACHE_DIR"])
        runs.append((label, cwd, sorted(p.name for p in cache.glob("*"))))
        cache.mkdir(parents=True, exist_ok=True)
        (cache / f"proof-from-{label}").write_text("record")
        _bench_json(Path(cmd[cmd.index("--out") + 1]), *times[label])
        return 0

    monkeypatch.setattr(ab.subprocess, "run", _make_weights_only(ab.subprocess.run))
    out = tmp_path / "ab"
    edit = "sed -i 's/^MASKED_FINAL = False$/MASKED_FINAL = True/' kkdeploy/kernels/layer_norm.py"
    assert ab.main(["--edit", edit, "--shapes", "3", "--out", str(out), "--device", "cpu"], bench=fake_bench) == 0
    assert "MASKED_FINAL = True" in (out / "tree-edit" / "kkdeploy" / "kernels" / "layer_norm.py").read_text()
    assert "MASKED_FINAL = False" in (ab.ROOT / "kkdeploy" / "kernels" / "layer_norm.py").read_text()
    assert [(label, cwd == ab.ROOT) for label, cwd, _ in runs] == [("base", True), ("edit", False), ("base2", True)]
    assert [caches for _, _, caches in runs] == [[], ["proof-from-base"], ["proof-from-base"]]
    result = json.loads((out / "ab.json").read_text())
    (row,) = result["rows"]
    assert result["changed"] == ["kkdeploy/kernels/layer_norm.py"] and result["sides"] == ["base", "edit", "base2"]
    assert row["plan_held"] and row["verdict"] == "faster" and row["ms"]["edit"] == 0.0817
    assert "| 3 | engine | 0.0845 (24) | 0.0817 (24) | 0.0848 (24) | edit 0, base2 0 | yes | faster |" in \
        (out / "ab.md").read_text()
    # a side whose proofs still chose otherwise: named, and the times read against it
    runs.clear()
    times["edit"] = (0.0837, 20, True)
    assert ab.main(["--edit", edit, "--shapes", "3", "--out", str(out), "--device", "cpu"], bench=fake_bench) == 0
    (row,) = json.loads((out / "ab.json").read_text())["rows"]
    assert not row["plan_held"] and row["plan_difference"] == "linear_path.plan.gelu: False/True/False"
    # the op shapes a side proved again (a record not the first side's) are counted and named: session 51's edit of
    # the LayerNorm prologue's tiles proved every GEMM again, not only its own launches
    kept = [_record("fused_linear", 128, "add_masked", 0.002), _record("fused_linear", 384, "none", 0.003)]
    times.update(base=(*times["base"], kept), base2=(*times["base2"], kept),
                 edit=(*times["edit"], [kept[0], _record("fused_linear", 384, "none", 0.0031),
                                        _record("fused_linear", 128, "layer_norm_prologue+gelu", 0.004)]))
    assert ab.main(["--edit", edit, "--shapes", "3", "--out", str(out), "--device", "cpu"], bench=fake_bench) == 0
    (row,) = json.loads((out / "ab.json").read_text())["rows"]
    assert row["proven_anew"] == {"edit": ["fused_linear form=layer_norm_prologue+gelu k=128 m=512 n=128",
                                           "fused_linear form=none k=128 m=512 n=384"], "base2": []}
    assert "| edit 2, base2 0 |" in (out / "ab.md").read_text()


def test_profile_runs_in_each_side_s_tree_and_cache_and_the_timeline_stays_the_bench_s(ab, tmp_path, monkeypatch):
    """--profile runs profile_candidate.py after each side's bench, in that side's tree with that side's cache (the
    plan the bench timed). The timeline table is the benches' own: a later profile in another process never stands
    in for it."""
    profiles = []
    timeline = {"kernels_per_call": 29, "median_span_us": 77.0, "median_busy_us": 50.0, "busy_fraction": 50 / 77,
                "gap_sum_us": 16.0, "overlap_us": 2.0,
                "largest_gaps": [{"after": 3, "before_kernel": "_fused_linear_kernel", "median_gap_us": 1.5}]}

    def fake(cmd, cwd, env, log):
        out = Path(cmd[cmd.index("--out") + 1])
        if str(cmd[1]).endswith("profile_candidate.py"):
            label = out.parent.name.rsplit("-", 1)[0]
            profiles.append((label, Path(cmd[1]).parents[1] == cwd, env["KKDEPLOY_CACHE_DIR"].endswith(f"-{label}-3")))
            out.mkdir(parents=True)
            (out / "profile.json").write_text(json.dumps({"backends": {"engine": {"timeline": {
                **timeline, "median_span_us": 99.0}}}}))
            return 0
        _bench_json(out, 0.07, 29, False)
        if out.name.startswith("edit"):
            data = json.loads((out / "bench.json").read_text())
            data["shapes"][0]["backends"]["engine"]["timeline"] = timeline
            (out / "bench.json").write_text(json.dumps(data))
        return 0

    monkeypatch.setattr(ab.subprocess, "run", _make_weights_only(ab.subprocess.run))
    out = tmp_path / "ab"
    edit = "sed -i 's/^MASKED_FINAL = False$/MASKED_FINAL = True/' kkdeploy/kernels/layer_norm.py"
    assert ab.main(["--edit", edit, "--shapes", "3", "--out", str(out), "--device", "cpu", "--profile"],
                   bench=fake) == 0
    assert profiles == [("base", True, True), ("edit", True, True), ("base2", True, True)]
    assert (out / "edit-3" / "profile" / "profile.json").is_file()
    (row,) = json.loads((out / "ab.json").read_text())["rows"]
    assert row["timeline"] == {"base": None, "edit": timeline, "base2": None}  # the benches', not the profiles'
    table = (out / "ab.md").read_text()
    assert "| 3 | engine | edit | 29 | 77.0 | 50.0 (65%) | 16.0 | 2.0 | 1.50 after 3 (_fused_linear_kernel) |" in table
    # no bench recorded one: no timeline table
    profiles.clear()
    timeline = None
    assert ab.main(["--edit", edit, "--shapes", "3", "--out", str(out), "--device", "cpu"], bench=fake) == 0
    assert not profiles and "timeline" not in (out / "ab.md").read_text()


def test_the_table_says_where_each_side_s_time_moved_against_the_first(ab, tmp_path, monkeypatch):
    """With the benches' timelines (a GPU's), each later side's kernels are aligned with the first side's by name,
    and the table gives what each change adds to the call's span."""
    def timeline(*kernels):
        positions = [{"index": i, "kernel": k, "median_us": d, "median_gap_after_us": g}
                     for i, (k, d, g) in enumerate(kernels)]
        return {"kernels_per_call": len(kernels), "median_span_us": 10.0, "median_busy_us": 9.0, "gap_sum_us": 1.0,
                "overlap_us": 0.0, "largest_gaps": [], "positions": positions}

    committed = timeline(("_fused_linear_kernel", 2.0, -0.5), ("layer_norm_rows2", 1.5, -0.4),
                         ("_fused_linear_kernel", 2.2, 0.1))
    fused = timeline(("_fused_linear_kernel", 2.0, -0.5), ("_fused_linear_kernel", 3.9, 0.1))

    def fake(cmd, cwd, env, log):
        out = Path(cmd[cmd.index("--out") + 1])
        _bench_json(out, 0.07, 3, False)
        data = json.loads((out / "bench.json").read_text())
        data["shapes"][0]["backends"]["engine"]["timeline"] = fused if out.name.startswith("edit") else committed
        (out / "bench.json").write_text(json.dumps(data))
        return 0

    monkeypatch.setattr(ab.subprocess, "run", _make_weights_only(ab.subprocess.run))
    out = tmp_path / "ab"
    edit = "sed -i 's/^MASKED_FINAL = False$/MASKED_FINAL = True/' kkdeploy/kernels/layer_norm.py"
    assert ab.main(["--edit", edit, "--shapes", "3", "--out", str(out), "--device", "cpu"], bench=fake) == 0
    (row,) = json.loads((out / "ab.json").read_text())["rows"]
    assert row["timeline_changes"]["base2"] == []  # the same tree: nothing moved
    # the fused launch is the same Triton kernel as the GEMM it absorbed the LayerNorm into, so it aligns with that
    # GEMM: the LayerNorm's launch is removed and the GEMM's cost moved, the two changes read together
    moved, removed = row["timeline_changes"]["edit"]
    assert (moved["kind"], moved["base"], moved["other"], moved["delta_us"]) == ("moved", [2], [1], pytest.approx(1.7))
    assert (removed["kind"], removed["base_kernels"], removed["delta_us"]) == \
        ("removed", ["layer_norm_rows2"], pytest.approx(-1.1))
    table = (out / "ab.md").read_text()
    assert "Where the time moved against base" in table
    assert "| 3 | engine | edit | moved | 2:_fused_linear_kernel | 1:_fused_linear_kernel | 2.30 | 4.00 | +1.70 |" in table
    assert "| 3 | engine | edit | removed | 1:layer_norm_rows2 | - | 1.10 | 0.00 | -1.10 |" in table


def _make_weights_only(real_run):
    """subprocess.run with make_weights.py answered without running it (the fake bench never reads the file)."""
    def run(cmd, *args, **kwargs):
        if isinstance(cmd, list) and any(str(c).endswith("make_weights.py") for c in cmd):
            return subprocess.CompletedProcess(cmd, 0, b"", b"")
        return real_run(cmd, *args, **kwargs)
    return run


@pytest.mark.parametrize("argv, message", [
    (["--edit", "true"], "the edit changed no file in the copy: true"),
    (["--edit", "exit 3"], "the edit exited 3 in the copy"),
    (["--edit", "true", "--shapes", "3,15"], "--shapes takes official shape ids 1-14, got '3,15'"),
    (["--edit", "true", "--order", "base,base"], "--order needs at least one base and one edit side"),
    (["--edit", "true", "--order", "base,new"], "--order takes base and edit, got 'new'"),
])
def test_bad_input_is_one_line_and_exit_2(ab, tmp_path, capsys, argv, message):
    assert ab.main([*argv, "--out", str(tmp_path / "ab")], bench=lambda *a: pytest.fail("no bench should run")) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ab_bench: ") and message in err and "\n" not in err


def test_the_verdict_reads_the_edit_against_the_committed_sides_spread(ab):
    assert ab.verdict([0.081], [0.084, 0.086]) == "faster"
    assert ab.verdict([0.089], [0.084, 0.086]) == "slower"
    assert ab.verdict([0.085], [0.084, 0.086]) == "within the drift"
    assert ab.verdict([0.083], [0.084, 0.086]) == "within the drift"  # below both, not by more than their spread
    assert ab.verdict([0.0852], [0.0860, 0.1051]) == "within the drift"  # session 47's shape 7
    assert ab.verdict([0.083], [0.084]) == "faster"  # one committed side: no spread to read
    assert ab.verdict([], [0.084]) == "not timed"
    assert ab.side_labels(["base", "edit", "base", "edit"]) == ["base", "edit", "base2", "edit2"]


def test_a_real_a_b_on_the_cpu_runs_make_weights_and_three_bench_processes(ab, tmp_path):
    """The script's commands as they run (make_weights.py, ``kkdeploy bench`` in the committed tree and in the edited
    copy), on the CPU with a short protocol: every side times the candidate and holds the plan (no kernels here)."""
    out = tmp_path / "ab"
    edit = "sed -i 's/^MASKED_FINAL = False$/MASKED_FINAL = True/' kkdeploy/kernels/layer_norm.py"
    assert ab.main(["--edit", edit, "--shapes", "3", "--device", "cpu", "--dtype", "float32", "--candidates",
                    "optimized-sdpa0", "--bench-args", "--trials 1 --warmups 1 --repeats 3 --rounds 1",
                    "--out", str(out)]) == 0
    (row,) = json.loads((out / "ab.json").read_text())["rows"]
    assert row["candidate"] == "optimized-sdpa0" and row["plan_held"]
    assert row["exits"] == {"base": 0, "edit": 0, "base2": 0} and all(v > 0 for v in row["ms"].values())
    assert (out / "w3.safetensors").is_file() and (out / "edit-3" / "bench.json").is_file()


def _edited_tuples(tmp_path, edit, lines):
    """Run scripts/ab_edits/EDIT on a copy of the two kernel tables; the build tuples it leaves, by name."""
    import ast
    import re
    import shutil

    root = Path(__file__).resolve().parents[1]
    (tmp_path / "kkdeploy" / "kernels").mkdir(parents=True, exist_ok=True)
    for name in ("fused_linear.py", "qkv_attention.py", "fused_blocks.py"):
        shutil.copy(root / "kkdeploy" / "kernels" / name, tmp_path / "kkdeploy" / "kernels" / name)
    run = subprocess.run(["bash", str(root / "scripts" / "ab_edits" / edit)], cwd=tmp_path, capture_output=True,
                         text=True)
    assert run.returncode == 0 and run.stdout.strip() == str(lines), (run.stdout, run.stderr)
    text = "".join((tmp_path / "kkdeploy" / "kernels" / name).read_text()
                   for name in ("fused_linear.py", "qkv_attention.py"))
    return {m.group(1): ast.literal_eval(m.group(2))
            for m in re.finditer(r"^(BUILD_TILES|LN_BUILD_TILES|NORM_BUILD_TILES|BUILD_LAUNCHES)\b[^=]*= (\(.*\))$",
                                 text, re.M)}


def test_the_ab_edits_apply_to_this_tree_and_name_only_known_launches(tmp_path):
    """scripts/ab_edits/ (the A/Bs docs/fused-linear.md gives) still find the lines they edit, and change only the
    launches they name: the small launches leave the build tuples (the tree before they joined), the LayerNorm
    epilogue's study tiles join them, and with them the plan may be forced to take the epilogues; the Q|K|V
    attention's whole_pv leaves the build's forms and the launch-bound ones. The committed tree is untouched."""
    from kkdeploy.kernels import fused_linear as fl
    from kkdeploy.kernels import qkv_attention as qa

    before = _edited_tuples(tmp_path / "leave", "small_launches_leave_builds.sh", 2)
    assert set(fl.BUILD_TILES) - set(before["BUILD_TILES"]) == {"m64n32", "m64n16", "m32n32"} <= set(fl.SMALL_TILES)
    assert set(qa.BUILD_LAUNCHES) - set(before["BUILD_LAUNCHES"]) == {"whole_w8", "whole_em", "whole_pv"}
    assert set(before["BUILD_TILES"]) < set(fl.BUILD_TILES) and before["LN_BUILD_TILES"] == fl.LN_BUILD_TILES
    joined = _edited_tuples(tmp_path / "join", "layer_norm_tiles_join_builds.sh", 1)
    assert set(joined["LN_BUILD_TILES"]) == set(fl.LN_TILES)
    assert joined["BUILD_TILES"] == fl.BUILD_TILES and joined["BUILD_LAUNCHES"] == qa.BUILD_LAUNCHES
    assert "regs_m16" not in fl.LN_BUILD_TILES and "whole_em" in qa.BUILD_LAUNCHES
    forced = _edited_tuples(tmp_path / "forced", "layer_norm_epilogues_forced.sh", 2)
    assert forced == joined  # the same tiles, and the plan's rule ...
    blocks = (tmp_path / "forced" / "kkdeploy" / "kernels" / "fused_blocks.py").read_text()
    rule = "    return sum(ms[0] for ms in fused) < sum(_best(ms) for ms in plain) + 2 * _best(norm)\n"
    assert rule in (Path(__file__).resolve().parents[1] / "kkdeploy" / "kernels" / "fused_blocks.py").read_text()
    assert rule not in blocks and "return True  # forced by" in blocks  # ... taken wherever both are proven
    pv = _edited_tuples(tmp_path / "pv", "whole_pv_leaves_builds.sh", 2)
    assert set(qa.BUILD_LAUNCHES) - set(pv["BUILD_LAUNCHES"]) == {"whole_pv"} and "whole_pv" in qa.LAUNCHES
    assert pv["BUILD_TILES"] == fl.BUILD_TILES and pv["LN_BUILD_TILES"] == fl.LN_BUILD_TILES
    edited = (tmp_path / "pv" / "kkdeploy" / "kernels" / "qkv_attention.py").read_text()
    assert '"whole_em"), 2\n' in edited and "whole_pv" in qa.LAUNCH_BOUND_FORMS
    # the LayerNorm prologue's tiles join the build's proofs: all four, or those named
    norm = _edited_tuples(tmp_path / "norm", "norm_prologue_joins_builds.sh", 1)
    assert fl.NORM_BUILD_TILES == () and norm["NORM_BUILD_TILES"] == tuple(fl.NORM_TILES)
    assert norm["BUILD_TILES"] == fl.BUILD_TILES and norm["BUILD_LAUNCHES"] == qa.BUILD_LAUNCHES
    os.environ["NORM_TILES"] = "ln_m64n32_w8 ln_m64_w8"
    try:
        named = _edited_tuples(tmp_path / "norm2", "norm_prologue_joins_builds.sh", 1)
    finally:
        del os.environ["NORM_TILES"]
    assert named["NORM_BUILD_TILES"] == ("ln_m64n32_w8", "ln_m64_w8")
    # the final LayerNorm's masked launch joins builds: one flag, nothing else
    (tmp_path / "masked" / "kkdeploy" / "kernels").mkdir(parents=True)
    norm = Path(__file__).resolve().parents[1] / "kkdeploy" / "kernels" / "layer_norm.py"
    (tmp_path / "masked" / "kkdeploy" / "kernels" / "layer_norm.py").write_text(norm.read_text())
    run = subprocess.run(["bash", str(norm.parents[2] / "scripts" / "ab_edits" / "masked_final_joins_builds.sh")],
                         cwd=tmp_path / "masked", capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip() == "1", run.stderr
    edited = (tmp_path / "masked" / "kkdeploy" / "kernels" / "layer_norm.py").read_text().splitlines()
    assert [a for a, b in zip(norm.read_text().splitlines(), edited) if a != b] == ["MASKED_FINAL = False"]

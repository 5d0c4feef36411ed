"""The H200 campaign script's plumbing, on the CPU.

Device time is scarce (30 minutes a session), so a misspelt flag or a summary script that no longer takes its
options must fail here, not in the first 600-second call on the GPU. The GPU figures themselves come from the
device runs; these tests only check that the steps are wired to the commands they name.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CAMPAIGN = ROOT / "scripts" / "h200_campaign.sh"


@pytest.mark.parametrize("script", sorted((ROOT / "scripts").glob("*.sh")), ids=lambda p: p.name)
def test_every_shell_script_parses(script):
    run = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_the_header_lists_exactly_the_steps_the_script_defines():
    text = CAMPAIGN.read_text()
    header = re.search(r"^# Steps: (.*?)\. A step's", text, re.S | re.M).group(1)
    listed = {s.strip() for s in header.replace("#", " ").split(",")}
    defined = set(re.findall(r"^step_(\w+)\(\)", text, re.M))
    assert listed == defined


def _campaign(tmp_path, *steps, **env):
    env = dict(os.environ, CAMPAIGN_DEVICE="cpu", OUT=str(tmp_path / "out"), WORK=str(tmp_path / "work"),
               KKDEPLOY_CACHE_DIR=str(tmp_path / "cache"), PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
               **env)
    subprocess.run(["bash", str(CAMPAIGN), *steps], cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    return (tmp_path / "out" / "campaign.log").read_text()


def test_the_env_step_reports_the_machine_through_kkdeploy_env(tmp_path):
    log = _campaign(tmp_path, "env=60")
    assert "=== step env done: exit 0" in log and "What this machine can do" in log, log[-3000:]


@pytest.mark.parametrize("step, variable, kind", [("linear", "LINEAR_ARGS", "linear"),
                                                   ("attention", "ATTENTION_ARGS", "attention")])
def test_the_study_steps_take_every_launch_unless_some_are_named(tmp_path, step, variable, kind):
    """The kernel self-test's arguments reach it whole: --all-launches by default, or the launches named (the two
    cannot go together); on the CPU the script then stops at its GPU check, past its argument parsing."""
    named = f"{kind}=auto" if kind == "linear" else f"{kind}=cached64w4_mdiv"
    for args, every in (("--shapes 8", True), (f"--shapes 8 --launches {named}", False)):
        log = _campaign(tmp_path, f"{step}=60", **{variable: args})
        assert "needs a CUDA GPU" in log and "not allowed with" not in log, log[-2000:]
        assert "command not found" not in log, log[-2000:]  # the step's helpers reach its shell
        command = [line for line in log.splitlines() if line.startswith("+ scripts/")][-1]  # the log is appended to
        assert ("--all-launches" in command) == every and command.endswith(args), command


def test_the_pdl_step_runs_end_to_end_and_pairs_each_graph_with_its_pdl_form(tmp_path):
    # A tiny custom shape with weights of our own: make_weights, the bench, the tarball and the paired summary.
    # On the CPU the -pdl form is refused in one line and recorded skipped; the pairing table must still say so.
    log = _campaign(tmp_path, "pdl=300", PDL_SHAPES="", PDL_DIMS="9:2,16,32,2,64,1",
                    PDL_CANDIDATES="torch-compile,torch-compile-pdl")
    assert "=== step pdl done: exit 0" in log, log[-3000:]
    assert (tmp_path / "out" / "pdl.tgz").stat().st_size > 0
    pairs = (tmp_path / "out" / "pdl.md").read_text()
    row = next(line for line in pairs.splitlines() if "| torch-compile |" in line and "plain / pdl" not in line)
    assert "(passed)" in row and "skipped" in row, pairs
    assert "pdl custom-2,16,32,2,64,1: exit" not in log, log[-3000:]  # the bench itself exited 0


def test_the_ab_step_runs_an_edit_script_and_profiles_every_side(tmp_path):
    # The committed edit script in a copy of the tree, three bench processes and (asked for) three profiles; on the
    # CPU there are no device kernels, so the timeline says why instead of a figure.
    log = _campaign(tmp_path, "ab=400", AB_EDITS="masked_final_joins_builds.sh",
                    AB_ARGS="--dtype float32 --candidates optimized-sdpa0 --profile",
                    AB_BENCH_ARGS="--trials 1 --warmups 1 --repeats 3 --rounds 1")
    assert "=== step ab done: exit 0" in log, log[-3000:]
    assert "| 3 | optimized-sdpa0 |" in log and "shape 3 edit: profile exit 0" in log
    result = json.loads((tmp_path / "work" / "ab" / "masked_final_joins_builds" / "ab.json").read_text())
    (row,) = result["rows"]
    assert row["exits"] == {"base": 0, "edit": 0, "base2": 0}
    assert all("not on the CPU" in t["unavailable"] for t in row["timeline"].values())  # the bench's own
    with tarfile.open(tmp_path / "out" / "ab.tgz") as tar:
        names = tar.getnames()
    assert "ab/masked_final_joins_builds/ab.md" in names and "ab/masked_final_joins_builds/edit-3/profile/profile.json" \
        in names
    assert not any("tree-edit" in n or "cache-" in n or n.endswith(".safetensors") for n in names)


def test_the_customprofile_step_profiles_what_can_run_and_names_what_cannot(tmp_path):
    # On the CPU the three our-kernel candidates are refused (CUDA-only kernels); torch-compile and eager are still
    # profiled, as an unproven candidate on the GPU must not cost the others.
    log = _campaign(tmp_path, "customprofile=300", CUSTOMPROFILE_SHAPES="9:2,16,32,2,64,1")
    assert "=== step customprofile done: exit 0" in log, log[-3000:]
    text = (tmp_path / "out" / "customprofile" / "prof-2,16,32,2,64,1.txt").read_text()
    assert "torch-compile: " in text and "ms per call" in text
    assert "torch-compile-faithful-gemms: skipped:" in text
    assert (tmp_path / "out" / "customprofile" / "prove-2,16,32,2,64,1.json").is_file()


def test_every_script_that_imports_the_project_runs_from_a_checkout_without_an_install():
    # The GPU machine gets a copy of the working tree, not an install; a script that relies on one fails there.
    imports = re.compile(r"^\s*(from|import) (kkdeploy|engines|validation|exporters)\b", re.M)
    lacking = [p.name for p in sorted((ROOT / "scripts").glob("*.py"))
               if imports.search(p.read_text()) and not re.search(r"sys\.path(\.insert\(0|\[:0\])", p.read_text())]
    assert lacking == []


def test_the_ncu_step_makes_weights_of_our_own_and_calls_the_profiler_per_shape(tmp_path):
    # On the CPU the profiler refuses in one line (a GPU tool); the step still made each shape's weights, called
    # it with them (official and custom shapes) and kept every log in ncu.tgz.
    log = _campaign(tmp_path, "ncu=120", NCU_SHAPES="3", NCU_DIMS="9:2,16,32,2,64,1")
    assert "=== step ncu done: exit 0" in log, log[-3000:]
    assert log.count("Nsight Compute profiles CUDA kernels") == 2
    work = tmp_path / "work"
    assert (work / "w-ncu-shape-3.safetensors").is_file() and (work / "w-ncu-custom-2,16,32,2,64,1.safetensors").is_file()

    with tarfile.open(tmp_path / "out" / "ncu.tgz") as tar:
        assert {"ncu/shape-3.log", "ncu/custom-2,16,32,2,64,1.log"} <= set(tar.getnames())

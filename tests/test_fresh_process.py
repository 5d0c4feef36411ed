"""Issue 17: a native crash never takes down a build or a served process.

The backends in tests/native_backends.py kill their own process with SIGSEGV or hang when they load.
The build records them with their status and ships something else; ``kkdeploy.load`` probes an engine
whose environment record differs, falls back when the probe dies, and caches the answer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kkdeploy
from engines import registry
from engines.fresh_process import CRASHED, HUNG, OK, probe, signal_reason
from kkdeploy.cli import main as cli_main
from kkdeploy.pipeline import runtime
from tests.native_backends import CRASH_ENV

REPO = Path(__file__).resolve().parents[1]
SHAPE = ["--batch-size", "2", "--seq-len", "8", "--d-model", "16", "--heads", "2", "--ffn-dim", "16", "--layers", "1",
         "--device", "cpu", "--dtype", "float32", "--trials", "1", "--warmups", "1", "--repeats", "3", "--rounds", "1"]
TEST_BACKENDS = {"segfault-on-load": "tests.native_backends:SEGFAULT", "hang-on-load": "tests.native_backends:HANG",
                 "segfault-all-valid-only": "tests.native_backends:SEGFAULT_ALL_VALID_ONLY",
                 "faithful-native": "tests.native_backends:FAITHFUL"}


def descriptor(key: str, spec: str) -> registry.BackendDescriptor:
    """A test backend as a module registers one: its own --backends name, outside the recipe grammar."""
    return registry.BackendDescriptor(key, spec, choices=(registry.BackendChoice(key),))


@pytest.fixture
def native_backends(monkeypatch):
    for key, spec in TEST_BACKENDS.items():
        monkeypatch.setitem(registry.DESCRIPTORS, key, descriptor(key, spec))


def manifest_of(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def entry(manifest: dict, name: str) -> dict:
    return next(c for c in manifest["candidates"] if c["name"] == name)


def test_signal_reason_names_the_signal():
    assert signal_reason(-11) == "SIGSEGV (signal 11)"
    assert signal_reason(-9) == "SIGKILL (signal 9)"


def test_build_survives_a_segfaulting_and_a_hanging_loader_and_ships_another(native_backends, tmp_path, capsys):
    out = tmp_path / "art"
    code = cli_main(["build", *SHAPE, "--backends", "segfault-on-load,hang-on-load,faithful-native",
                     "--probe-timeout", "20", "--out", str(out)])
    assert code == 0  # the build process is alive and finished
    m = manifest_of(out)
    crashed, hung, good = (entry(m, n) for n in ("segfault-on-load", "hang-on-load", "faithful-native"))
    assert crashed["status"] == CRASHED
    assert crashed["reason"] == "load-crashed: SIGSEGV (signal 11) in a fresh process"
    assert crashed["fresh_process"]["status"] == CRASHED and "validation" not in crashed
    assert hung["status"] == HUNG and "no answer within 20 s in a fresh process" in hung["reason"]
    assert good["status"] == "passed" and good["fresh_process"]["status"] == OK
    assert good["fresh_process"]["fingerprint"] and good["fresh_process"]["environment_key"]
    assert good["fresh_process"]["environment"]["versions"]["torch"] == torch.__version__
    assert m["choice"]["candidate"] not in ("segfault-on-load", "hang-on-load")
    assert m["choice"].get("padded_candidate") not in ("segfault-on-load", "hang-on-load")
    printed = capsys.readouterr().out
    assert "load-crashed" in printed and "load-hung" in printed  # the summary table says why


def test_no_probe_child_outlives_a_hang(native_backends, tmp_path):
    from kkdeploy import TransformerConfig

    config = TransformerConfig(2, 8, 16, 2, 16, 1)
    result = probe("tests.native_backends:HANG", tmp_path, {"name": "hang-on-load", "backend": "hang-on-load"},
                   config, torch.float32, torch.device("cpu"), timeout_s=5)
    assert result.status == HUNG
    leftover = subprocess.run(["pgrep", "-f", "engines.fresh_process"], capture_output=True, text=True).stdout
    assert leftover.strip() == ""


@pytest.fixture
def shipped_native(native_backends, tmp_path):
    """An artifact whose choice is the native-loader engine (the chooser would tie it with the fallback,
    which it prefers: the manifest is set as a build that found it fastest would have written it)."""
    out = tmp_path / "art"
    assert cli_main(["build", *SHAPE, "--backends", "faithful-native", "--out", str(out)]) == 0
    m = manifest_of(out)
    assert entry(m, "faithful-native")["status"] == "passed"
    m["choice"] = {"candidate": "faithful-native", "all_valid_only": False, "reason": "fastest (test)"}
    (out / "manifest.json").write_text(json.dumps(m))
    return out


def set_environment_key(out: Path, key: str) -> None:
    m = manifest_of(out)
    entry(m, "faithful-native")["fresh_process"]["environment_key"] = key
    (out / "manifest.json").write_text(json.dumps(m))


def test_load_in_the_checked_environment_loads_without_a_probe(shipped_native, monkeypatch):
    monkeypatch.setattr("engines.fresh_process.probe", lambda *a, **k: pytest.fail("probed a checked environment"))
    runner = kkdeploy.load(shipped_native, device="cpu")
    assert runner.backend == "faithful-native"


def test_load_in_another_environment_probes_and_falls_back_when_the_probe_dies(shipped_native, monkeypatch):
    set_environment_key(shipped_native, "another-machine")
    monkeypatch.setenv(CRASH_ENV, "1")  # this environment's loader segfaults; the child inherits it
    runner = kkdeploy.load(shipped_native, device="cpu")
    assert runner.backend == "pytorch-fallback"
    assert "load-crashed: SIGSEGV (signal 11) in a fresh process" in runner.reason
    cached = list((shipped_native / runtime.PROBE_CACHE_DIR).glob("faithful-native-*.json"))
    assert len(cached) == 1 and json.loads(cached[0].read_text())["status"] == CRASHED
    x = torch.randn(2, 8, 16)
    assert runner(x).shape == x.shape  # the process is alive and serves


def test_a_passing_probe_is_cached_per_environment(shipped_native, monkeypatch):
    set_environment_key(shipped_native, "another-machine")
    assert kkdeploy.load(shipped_native, device="cpu").backend == "faithful-native"
    monkeypatch.setattr("engines.fresh_process.probe", lambda *a, **k: pytest.fail("probed twice"))
    assert kkdeploy.load(shipped_native, device="cpu").backend == "faithful-native"


def test_kkdeploy_run_serves_the_fallback_when_the_engine_crashes_on_load(shipped_native, monkeypatch):
    set_environment_key(shipped_native, "another-machine")
    env = {**os.environ, CRASH_ENV: "1"}
    code = ("import sys; from engines import registry as r; "
            f"[r.register(r.BackendDescriptor(k, s, (r.BackendChoice(k),))) for k, s in {TEST_BACKENDS!r}.items()]; "
            "from kkdeploy.cli import main; sys.exit(main(sys.argv[1:]))")
    done = subprocess.run([sys.executable, "-c", code, "run", "--artifacts", str(shipped_native)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "load-crashed" in done.stdout + done.stderr


def test_inspect_exits_nonzero_and_names_a_flipped_byte(tmp_path):
    out = tmp_path / "art"
    assert cli_main(["build", *SHAPE, "--backends", "ort-cpu", "--out", str(out)]) == 0
    assert cli_main(["inspect", str(out)]) == 0
    target = out / "model.onnx"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01
    target.write_bytes(bytes(data))
    done = subprocess.run([sys.executable, "-m", "kkdeploy", "inspect", str(out)], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 1
    assert "model.onnx was modified" in done.stdout + done.stderr


def test_fresh_process_table_loads_every_built_candidate(shipped_native, capsys):
    from tests.conftest import load_script

    table = load_script("fresh_process_table")
    assert table.main([str(shipped_native)]) == 0
    printed = capsys.readouterr().out
    row = next(line for line in printed.splitlines() if "faithful-native" in line)
    assert "| ok |" in row and "| yes |" in row  # loaded in a fresh process, same output as the build's check


def test_a_build_whose_every_candidate_crashes_ships_the_fallback(native_backends, tmp_path):
    """The H200's `kkdeploy build --shape 3 --backends inductor`: every package (inductor-sdpa1 is all-valid-only)
    segfaults in its fresh process; the build exits 0 and ships the fallback, naming each crash."""
    out = tmp_path / "art"
    assert cli_main(["build", *SHAPE, "--backends", "segfault-on-load,segfault-all-valid-only", "--out", str(out)]) == 0
    m = manifest_of(out)
    assert {c["name"]: c["status"] for c in m["candidates"]} == {"segfault-on-load": CRASHED,
                                                                  "segfault-all-valid-only": CRASHED}
    assert m["choice"]["candidate"] == "pytorch-fallback"
    assert "segfault-all-valid-only (load-crashed)" in m["choice"]["reason"]


def test_fresh_process_table_skips_a_missing_directory_in_one_line(shipped_native, tmp_path, capsys):
    from tests.conftest import load_script

    table = load_script("fresh_process_table")
    assert table.main([str(tmp_path / "never-built"), str(shipped_native)]) == 0
    captured = capsys.readouterr()
    assert "skipped" in captured.err and "never-built" in captured.err
    assert "faithful-native" in captured.out

"""Artifact directories (atomic, locked, hashed) and the chooser's decisions."""

import os
import subprocess
import sys

import pytest

from kkdeploy.status import FAILED, PASSED, PASSED_ALL_VALID_ONLY, UNAVAILABLE
from kkdeploy import artifacts
from kkdeploy.pipeline.chooser import FALLBACK, choose
from kkdeploy.errors import KKError


def test_staged_directory_replaces_only_on_success(tmp_path):
    target = tmp_path / "out"
    with artifacts.staged_directory(target) as stage:
        (stage / "a.txt").write_text("one")
        assert not target.exists()
    assert (target / "a.txt").read_text() == "one"
    with pytest.raises(RuntimeError):
        with artifacts.staged_directory(target, force=True) as stage:
            (stage / "a.txt").write_text("two")
            artifacts.write_json(stage / artifacts.MANIFEST, {"status": "claims a pass"})
            raise RuntimeError("interrupted mid-build")
    assert (target / "a.txt").read_text() == "one"
    assert not (target / artifacts.MANIFEST).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging or lock left behind


def test_a_killed_builds_leftovers_are_removed_by_the_next_build(tmp_path):
    """SIGKILL (the out-of-memory killer, say) runs no cleanup: the next build of that target removes what
    the dead one staged, and never serves it."""
    target = tmp_path / "out"
    for leftover in (".out.staging-999999", ".out.old-999999"):
        (tmp_path / leftover).mkdir()
        (tmp_path / leftover / "model.onnx").write_text("half written")
    (tmp_path / ".other.staging-999999").mkdir()  # another target's: not ours to touch
    with artifacts.staged_directory(target) as stage:
        (stage / "a.txt").write_text("fresh")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.staging-999999", "out"]
    assert [p.name for p in target.iterdir()] == ["a.txt"]


def test_non_empty_target_needs_force(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "keep").write_text("x")
    with pytest.raises(KKError, match="not empty; pass --force"):
        with artifacts.staged_directory(target):
            pass
    with artifacts.staged_directory(target, force=True) as stage:
        (stage / "new").write_text("y")
    assert [p.name for p in target.iterdir()] == ["new"]


def test_concurrent_build_is_refused(tmp_path):
    target = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        (tmp_path / ".out.lock").write_text(str(holder.pid))
        with pytest.raises(KKError, match=f"another build \\(pid {holder.pid}\\) is writing"):
            with artifacts.staged_directory(target):
                pass
    finally:
        holder.kill()
        holder.wait()
    # the holder died: its stale lock is taken over
    with artifacts.staged_directory(target) as stage:
        (stage / "f").write_text("z")
    assert (target / "f").exists() and not (tmp_path / ".out.lock").exists()


def test_unwritable_parent(tmp_path):
    if os.geteuid() == 0:
        target = tmp_path / "file-not-dir"
        target.write_text("x")
        with pytest.raises(KKError, match="cannot write to .*choose a writable --out"):
            with artifacts.staged_directory(target / "sub"):
                pass
    else:  # pragma: no cover
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(KKError, match="not writable"):
            with artifacts.staged_directory(ro / "out"):
                pass


def test_hash_tree_and_json_safety(tmp_path):
    (tmp_path / "a").write_bytes(b"abc")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "b").write_bytes(b"")
    hashes = artifacts.hash_tree(tmp_path)
    assert hashes == {"a": "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad",
                      "d/b": "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"}
    artifacts.write_json(tmp_path / "j.json", {"x": float("inf"), "y": [float("nan")]})
    assert '"inf"' in (tmp_path / "j.json").read_text()


def _c(name, status, backend="ort"):
    return {"name": name, "status": status, "backend": backend}


def test_choose_fastest_passing():
    cands = [_c("ort-cuda", PASSED), _c("trt", FAILED, "trt"), _c("torch-graph", PASSED, "torch_graph")]
    choice = choose(cands, {"ort-cuda": 1.0, "torch-graph": 0.5, "trt": 0.1}, fallback_latency_ms=2.0)
    assert choice["candidate"] == "torch-graph" and not choice["all_valid_only"]


def test_choose_tie_goes_to_simpler_backend():
    cands = [_c("ort-cuda", PASSED), _c("torch-graph", PASSED, "torch_graph")]
    assert choose(cands, {"ort-cuda": 1.0, "torch-graph": 1.01}, 5.0)["candidate"] == "torch-graph"
    assert "tie" in choose(cands, {"ort-cuda": 1.0, "torch-graph": 1.01}, 5.0)["reason"]


def test_choose_falls_back_when_nothing_passed():
    cands = [_c("ort-cpu", FAILED), _c("trt", UNAVAILABLE, "trt")]
    choice = choose(cands, {}, 3.0)
    assert choice["candidate"] == FALLBACK
    assert "ort-cpu (failed)" in choice["reason"] and "trt (unavailable)" in choice["reason"]


def test_choose_fallback_when_it_is_faster():
    choice = choose([_c("ort-cpu", PASSED)], {"ort-cpu": 4.0}, 1.0)
    assert choice["candidate"] == FALLBACK and "ort-cpu 4.000 ms" in choice["reason"]


def test_a_fallback_that_only_ties_is_not_called_the_fastest():
    # The CPU build of shape 3 saw ort-cpu at 4.915 ms and the fallback at 4.929 ms: the fallback ships as the
    # simpler of two tied options, and the reason must say so rather than call it the fastest.
    choice = choose([_c("ort-cpu", PASSED)], {"ort-cpu": 4.915}, 4.929)
    assert choice["candidate"] == "pytorch-fallback"
    assert "ties the fastest" in choice["reason"] and "fastest among" not in choice["reason"]
    assert "ort-cpu 4.915 ms" in choice["reason"]


def test_choose_all_valid_only_scope():
    choice = choose([_c("torch-graph-sdpa1", PASSED_ALL_VALID_ONLY, "torch_graph")], {"torch-graph-sdpa1": 0.2}, 1.0)
    assert choice["candidate"] == "torch-graph-sdpa1" and choice["all_valid_only"]
    assert choice["padded_candidate"] == FALLBACK and f"padded calls take {FALLBACK}" in choice["reason"]


def test_padded_calls_go_to_the_fastest_fully_passing_option():
    cands = [_c("torch-graph-sdpa1", PASSED_ALL_VALID_ONLY, "torch_graph"), _c("torch-graph", PASSED, "torch_graph"),
             _c("ort-cuda", FAILED)]
    choice = choose(cands, {"torch-graph-sdpa1": 0.2, "torch-graph": 0.3}, 1.5)
    assert choice["candidate"] == "torch-graph-sdpa1" and choice["padded_candidate"] == "torch-graph"

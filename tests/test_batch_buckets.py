"""Batch buckets (issue 30): ``kkdeploy build --batch-buckets`` builds and validates one engine per batch size, and
``kkdeploy.load`` runs any batch up to the largest on the smallest bucket that holds it, padding inside it only."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import kkdeploy
from kkdeploy import artifacts
from kkdeploy.cli import main as cli
from kkdeploy.config import TransformerConfig
from kkdeploy.errors import KKError
from kkdeploy.inputs import generate_case
from kkdeploy.pipeline.build import parse_batch_buckets
from kkdeploy.pipeline.runtime import BucketedRunner, ServedRunner, bucketed
from tests.conftest import bits_equal
from validation import CONTRACTS, compare_outputs

SHAPE = ["--batch-size", "4", "--seq-len", "16", "--d-model", "16", "--heads", "2", "--ffn-dim", "16", "--layers", "2",
         "--device", "cpu"]
QUICK = ["--trials", "2", "--warmups", "2", "--repeats", "5", "--rounds", "1"]


@pytest.fixture(scope="module")
def bucketed_artifacts(tmp_path_factory):
    out = tmp_path_factory.mktemp("buckets") / "a"
    assert cli(["build", *SHAPE, *QUICK, "--batch-buckets", "1,2", "--out", str(out)]) == 0
    return out


def reference_for(root):
    from safetensors.torch import load_file

    manifest = artifacts.read_json(root / artifacts.MANIFEST)
    model = kkdeploy.ReferenceTransformer(TransformerConfig.from_dict(manifest["config"]))
    model.load_state_dict(load_file(str(root / manifest["weights"]["file"])), strict=True)
    return model.eval()


def test_parse_batch_buckets():
    assert parse_batch_buckets(None, 4) is None
    assert parse_batch_buckets("2,1,2", 4) == [1, 2, 4]  # sorted, unique, the artifact's batch always included
    assert parse_batch_buckets("1,2,4", 4) == [1, 2, 4]
    for text, message in [("1,8", "exceeds the artifact's batch 4"), ("0,2", "positive"), ("a,b", "commas"),
                          ("", "positive")]:
        with pytest.raises(KKError, match=message):
            parse_batch_buckets(text, 4)


def test_each_bucket_is_its_own_validated_build(bucketed_artifacts):
    manifest = artifacts.read_json(bucketed_artifacts / artifacts.MANIFEST)
    record = manifest["batch_buckets"]
    assert record["sizes"] == [1, 2, 4]
    for bucket in record["buckets"]:
        root = bucketed_artifacts / bucket["dir"]
        sub = artifacts.read_json(root / artifacts.MANIFEST)
        assert sub["config"]["batch_size"] == bucket["batch"]
        assert sub["choice"]["candidate"] == bucket["candidate"] and bucket["status"] == "passed"
        assert bucket["failed_elements"] == 0 and bucket["weights_sha256"] == manifest["weights"]["sha256"]
        report = artifacts.read_json(root / "validation.json")
        assert report  # validated at this batch, by this bucket's own build
        if bucket["dir"] != ".":
            assert bucket["manifest_sha256"] == artifacts.file_sha256(root / artifacts.MANIFEST)
            # The top manifest hashes every file of the bucket, its manifest included.
            assert f"{bucket['dir']}/{artifacts.MANIFEST}" in manifest["files"]
    assert not list(bucketed_artifacts.parent.glob(".a.*"))  # one atomic rename, no staging left


def test_load_takes_any_batch_up_to_the_largest_bucket(bucketed_artifacts):
    runner = kkdeploy.load(bucketed_artifacts)
    assert isinstance(runner, BucketedRunner) and runner.sizes == [1, 2, 4]
    assert [runner.bucket_for(n) for n in (1, 2, 3, 4)] == [1, 2, 4, 4]
    reference = reference_for(bucketed_artifacts)
    config = TransformerConfig.from_dict(artifacts.read_json(bucketed_artifacts / artifacts.MANIFEST)["config"])
    x, mask = generate_case(config, "cpu", torch.float32, 77, padding_ratio=0.25)
    calls = []
    for size, bucket in runner.buckets.items():  # record which bucket ran each call, and with what
        def spy(x_, m_, _bucket=bucket, _size=size):
            calls.append((_size, x_.shape[0], m_))
            return _bucket(x_, m_)
        runner.buckets[size] = spy
    with torch.inference_mode():
        for n in (1, 2, 3, 4):
            y = runner(x[:n], mask[:n])
            expected = reference(x[:n], mask[:n])
            assert y.shape == (n, config.seq_len, config.d_model)
            assert compare_outputs(expected, y, *CONTRACTS["strict"]).passed, n
            size, rows, m = calls[-1]
            assert size == runner.bucket_for(n) and rows == size
            assert not m[n:].any()  # padding rows only inside the bucket, fully masked
        y = runner(x[:3], None)  # no mask: every token valid; the padding row still masked out
        assert calls[-1][2][:3].all() and not calls[-1][2][3:].any()
    with pytest.raises(KKError, match="exceeds the largest validated bucket"):
        runner(torch.cat([x, x[:1]]), None)


def test_padding_inside_a_bucket_is_bitwise_the_bucket_run_by_hand(bucketed_artifacts):
    runner = kkdeploy.load(bucketed_artifacts)
    config = TransformerConfig.from_dict(artifacts.read_json(bucketed_artifacts / artifacts.MANIFEST)["config"])
    x, mask = generate_case(config, "cpu", torch.float32, 78, padding_ratio=0.25)
    padded_x = torch.zeros_like(x)
    padded_x[:3] = x[:3]
    padded_mask = torch.zeros_like(mask)
    padded_mask[:3] = mask[:3]
    with torch.inference_mode():
        assert bits_equal(runner(x[:3], mask[:3]), runner.run_bucket(4, padded_x, padded_mask)[:3])


def test_old_artifacts_without_buckets_load_as_before(tmp_path):
    out = tmp_path / "plain"
    assert cli(["build", *SHAPE, *QUICK, "--out", str(out)]) == 0
    assert "batch_buckets" not in artifacts.read_json(out / artifacts.MANIFEST)
    runner = kkdeploy.load(out)
    assert isinstance(runner, ServedRunner)
    wrapped = bucketed(runner)
    assert wrapped.sizes == [4] and wrapped.bucket_for(1) == 4


def test_a_swapped_bucket_manifest_serves_that_bucket_from_the_fallback(bucketed_artifacts, tmp_path):
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(bucketed_artifacts), str(copy)], check=True)
    sub = copy / "buckets" / "b2" / artifacts.MANIFEST
    data = artifacts.read_json(sub)
    data["created"] = "edited"
    artifacts.write_json(sub, data)
    runner = kkdeploy.load(copy)
    assert runner.buckets[2].backend == "pytorch-fallback" and "differs" in runner.buckets[2].reason
    assert runner.buckets[1].backend != "pytorch-fallback"  # an untouched bucket keeps its engine
    # The top level's own manifest hashes every bucket file: it sees the edit too, and falls back, saying so.
    assert runner.buckets[4].backend == "pytorch-fallback" and "buckets/b2/manifest.json" in runner.buckets[4].reason


def test_bad_batch_buckets_are_one_line_errors(tmp_path):
    done = subprocess.run([sys.executable, "-m", "kkdeploy", "build", *SHAPE, *QUICK, "--batch-buckets", "1,8",
                           "--out", str(tmp_path / "x")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "exceeds the artifact's batch 4" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    assert not (tmp_path / "x").exists()


WITHOUT_POLYGRAPHY = """
import importlib.abc, sys
class NoPolygraphy(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "polygraphy":
            raise ModuleNotFoundError("No module named 'polygraphy'")
sys.meta_path.insert(0, NoPolygraphy())
import torch, kkdeploy
import kkdeploy.serving.triton_model  # the Triton model's module, as the backend stub imports it
from kkdeploy.inputs import generate_case
runner = kkdeploy.load(sys.argv[1])
x, mask = generate_case(runner.config, "cpu", torch.float32, 79, padding_ratio=0.25)
with torch.inference_mode():
    torch.save(runner(x[:3], mask[:3]), sys.argv[2])
assert "polygraphy" not in sys.modules
"""


def test_a_served_artifact_loads_without_polygraphy(bucketed_artifacts, tmp_path):
    # A serving image needs torch and the artifact, not the build's validator: the Triton model's stub once failed
    # to load on the H200 with "No module named 'polygraphy'" (kkdeploy.load imported the validation package whole).
    answer = tmp_path / "y.pt"
    done = subprocess.run([sys.executable, "-c", WITHOUT_POLYGRAPHY, str(bucketed_artifacts), str(answer)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    runner = kkdeploy.load(bucketed_artifacts)
    x, mask = generate_case(runner.config, "cpu", torch.float32, 79, padding_ratio=0.25)
    with torch.inference_mode():
        assert bits_equal(torch.load(answer), runner(x[:3], mask[:3]))

"""AOTInductor packages on the CPU (C++ backend): bitwise equal to the reference in a fresh process.

Every compile is shared through module-scoped fixtures and the build cache points at a private
directory, so the first build is a real compile and the second a real cache hit.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch._inductor.config

from engines.base import BUILT, BuildContext
from engines.inductor import BACKEND, InductorRunner, faithful_inductor_configs
from kkdeploy import KKError, TransformerConfig, generate_case
from kkdeploy.models.weights import build_models

TINY = TransformerConfig(batch_size=2, seq_len=8, d_model=16, num_heads=2, ffn_dim=16, num_layers=2, causal=True)
CPU = torch.device("cpu")
REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(BACKEND.unavailable_reason(CPU, torch.float32) is not None,
                                reason=str(BACKEND.unavailable_reason(CPU, torch.float32)))


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory):
    return tmp_path_factory.mktemp("inductor-cache")


def build(tmp_path_factory, cache_root, dtype, variant, name):
    reference, _ = build_models(TINY, dtype, CPU)
    out = tmp_path_factory.mktemp(name)
    ctx = BuildContext(TINY, dtype, CPU, reference, out, options={"cache_dir": str(cache_root)})
    before = {k: getattr(torch._inductor.config, k) for k in faithful_inductor_configs()}
    result = BACKEND.build(ctx, variant)
    # The compile-time settings are scoped to the build: nothing leaks into the process.
    assert {k: getattr(torch._inductor.config, k) for k in before} == before
    assert result.status == BUILT, result.reason
    return out, result


@pytest.fixture(scope="module")
def fp32_build(tmp_path_factory, cache_root):
    return build(tmp_path_factory, cache_root, torch.float32, "inductor", "fp32")


@pytest.fixture(scope="module")
def fp16_build(tmp_path_factory, cache_root):
    reason = BACKEND.unavailable_reason(CPU, torch.float16)
    if reason:
        pytest.skip(reason)
    return build(tmp_path_factory, cache_root, torch.float16, "inductor", "fp16")


def padded_case(dtype, seed):
    """A generated case whose mask really pads (tiny S can draw full lengths)."""
    for offset in range(100):
        x, mask = generate_case(TINY, CPU, dtype, seed + offset, padding_ratio=0.5)
        if not bool(mask.all()):
            return x, mask
    raise AssertionError("generator never produced padding")


FRESH_PROCESS = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import torch
    from engines.inductor import BACKEND
    from kkdeploy import TransformerConfig, generate_case
    from kkdeploy.config import parse_dtype
    from kkdeploy.models.weights import build_models

    art, entry_path, dtype_name, seeds = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    entry = json.loads(Path(entry_path).read_text())
    config = TransformerConfig.from_dict(entry["options"]["config"])
    dtype = parse_dtype(dtype_name)
    runner = BACKEND.load(Path(art), entry, config, dtype, torch.device("cpu"))
    reference, _ = build_models(config, dtype, "cpu")
    report = []
    for seed, ratio in seeds:
        x, mask = generate_case(config, "cpu", dtype, seed, padding_ratio=ratio)
        with torch.no_grad():
            ref = reference(x, mask)
        out = runner(x, mask)
        report.append({"seed": seed, "padded": not bool(mask.all()), "bitwise": bool(torch.equal(ref, out)),
                       "differing": int((ref != out).sum())})
    print(json.dumps(report))
""")


def run_fresh_process(out_dir: Path, result, dtype_name: str) -> list[dict]:
    entry_path = out_dir / "entry.json"
    entry_path.write_text(json.dumps(result.to_dict()))
    seeds = [[1234, 0.0], [1235, 0.0]]
    for seed in range(1234, 1334):  # two seeds whose masks really pad
        if len(seeds) == 4:
            break
        if not bool(generate_case(TINY, CPU, torch.float32, seed, padding_ratio=0.5)[1].all()):
            seeds.append([seed, 0.5])
    proc = subprocess.run([sys.executable, "-c", FRESH_PROCESS, str(out_dir), str(entry_path), dtype_name,
                           json.dumps(seeds)], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("dtype_name", ["float32", "float16"])
def test_fresh_process_load_is_bitwise(request, dtype_name):
    out_dir, result = request.getfixturevalue("fp32_build" if dtype_name == "float32" else "fp16_build")
    assert result.options["emulate_precision_casts"] is True
    assert result.options["opaque_ops"] == ["layer_norm", "gelu", "softmax"]
    assert result.options["all_valid_only"] is False
    report = run_fresh_process(out_dir, result, dtype_name)
    assert {r["padded"] for r in report} == {False, True}
    assert all(r["bitwise"] for r in report), report


def test_caller_owns_every_output(fp32_build):
    out_dir, result = fp32_build
    runner = BACKEND.load(out_dir, result.to_dict(), TINY, torch.float32, CPU)
    assert isinstance(runner, InductorRunner)
    x1, m1 = generate_case(TINY, CPU, torch.float32, 1)
    x2, m2 = padded_case(torch.float32, 2)
    out1 = runner(x1, m1)
    kept = out1.clone()
    out2 = runner(x2, m2)
    assert torch.equal(out1, kept)
    assert not torch.equal(out1, out2)
    out3 = runner(x1)  # valid_token_mask=None means all valid
    assert torch.equal(out3, kept)


def test_second_build_hits_cache_with_same_bytes(tmp_path_factory, cache_root, fp32_build):
    first_dir, first = fp32_build
    assert first.options["cache"] == "miss"
    second_dir, second = build(tmp_path_factory, cache_root, torch.float32, "inductor", "fp32-again")
    assert second.options["cache"] == "hit"
    assert second.build_seconds < first.build_seconds / 3, (second.build_seconds, first.build_seconds)
    first_pkg, second_pkg = first_dir / first.files[0], second_dir / second.files[0]
    assert first_pkg.read_bytes() == second_pkg.read_bytes()
    assert not second_pkg.is_symlink() and second_pkg.stat().st_ino != first_pkg.stat().st_ino


@pytest.mark.parametrize("key,value,reason", [
    ("torch", "0.0.0+other", "compiled with torch 0.0.0+other"),
    ("device_type", "cuda", "compiled for device cuda"),
])
def test_package_for_another_environment_is_refused(fp32_build, key, value, reason):
    out_dir, result = fp32_build
    entry = result.to_dict()
    entry["options"] = {**entry["options"], "keys": {**entry["options"]["keys"], key: value}}
    with pytest.raises(KKError, match=re.escape(reason)):
        BACKEND.load(out_dir, entry, TINY, torch.float32, CPU)


def test_tampered_package_is_refused(tmp_path, fp32_build):
    out_dir, result = fp32_build
    name = result.files[0]
    shutil.copyfile(out_dir / name, tmp_path / name)
    data = bytearray((tmp_path / name).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (tmp_path / name).write_bytes(bytes(data))
    with pytest.raises(KKError, match="sha256"):
        BACKEND.load(tmp_path, result.to_dict(), TINY, torch.float32, CPU)


def test_sdpa_variant_matches_optimized_and_refuses_padding(tmp_path_factory, cache_root):
    out_dir, result = build(tmp_path_factory, cache_root, torch.float32, "inductor-sdpa1", "sdpa1")
    assert result.options["all_valid_only"] is True and result.options["mask_modes"] == ["all-valid"]
    runner = BACKEND.load(out_dir, result.to_dict(), TINY, torch.float32, CPU)
    _, optimized = build_models(TINY, torch.float32, CPU, sdpa_layers=1)
    for seed in (1234, 1235):
        x, mask = generate_case(TINY, CPU, torch.float32, seed)
        with torch.no_grad():
            assert torch.equal(runner(x, mask), optimized(x, mask))
    x, mask = padded_case(torch.float32, 1234)
    with pytest.raises(KKError, match="all-valid masks only"):
        runner(x, mask)


def test_variant_names_are_checked():
    reference, _ = build_models(TINY, torch.float32, CPU)
    ctx = BuildContext(TINY, torch.float32, CPU, reference, Path("unused"))
    assert BACKEND.candidates(ctx) == ["inductor"]
    ctx.options["inductor_variants"] = "inductor,inductor-fused,inductor-sdpa2"
    assert BACKEND.candidates(ctx) == ["inductor", "inductor-fused", "inductor-sdpa2"]
    for bad in ("inductor-sdpa3", "inductor-fast"):
        ctx.options["inductor_variants"] = [bad]
        with pytest.raises(KKError, match=bad):
            BACKEND.candidates(ctx)


@pytest.fixture(scope="module")
def shipped(tmp_path_factory, cache_root, fp32_build):
    """``kkdeploy build`` with the inductor backend only (a cache hit: no second compile)."""
    from kkdeploy.pipeline.build import BuildRequest, run_build

    out = tmp_path_factory.mktemp("shipped") / "artifacts"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KKDEPLOY_CACHE_DIR", str(cache_root))
        run_build(BuildRequest(TINY, torch.float32, CPU, out, backends=["inductor"], trials=2,
                               warmups=1, repeats=3, rounds=1))
    manifest_path = out / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    entry = next(c for c in manifest["candidates"] if c["name"] == "inductor")
    assert entry["status"] == "passed" and entry["options"]["cache"] == "hit"
    # Pin the choice: which of engine and fallback timed faster on a shared CPU is not the subject here.
    manifest["choice"] = {**manifest["choice"], "candidate": "inductor", "backend": "inductor", "all_valid_only": False}
    manifest_path.write_text(json.dumps(manifest))
    return out, manifest


def assert_load_serves_bitwise(out, backend: str) -> None:
    """``kkdeploy.load(out)`` serves ``backend``, bitwise equal to the reference on all-valid and padded calls."""
    import kkdeploy

    runner = kkdeploy.load(out, device="cpu")
    assert runner.backend == backend, runner.reason
    reference, _ = build_models(TINY, torch.float32, CPU)
    for x, mask in (generate_case(TINY, CPU, torch.float32, 7), padded_case(torch.float32, 8)):
        with torch.no_grad():
            assert torch.equal(runner(x, mask), reference(x, mask))


def test_kkdeploy_load_serves_the_package_bitwise(shipped):
    assert_load_serves_bitwise(shipped[0], "inductor")


def test_kkdeploy_load_refuses_package_keys_of_another_torch(shipped):
    import kkdeploy

    out, manifest = shipped
    for entry in manifest["candidates"]:
        if entry["name"] == "inductor":
            entry["options"]["keys"]["torch"] = "0.0.0+other"
    (out / "manifest.json").write_text(json.dumps(manifest))
    runner = kkdeploy.load(out, device="cpu")
    assert runner.backend != "inductor"
    assert "compiled with torch 0.0.0+other" in runner.reason

"""Shape 14's bounded-memory path: the tiled reference, the long-context model, check and build."""

import functools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend

from kkdeploy import KKError, ReferenceTransformer, TransformerConfig, generate_case
from kkdeploy.cli import main
from kkdeploy.pipeline.long_context import DENSE_CANDIDATES, build_long_context, validate_long_context
from kkdeploy.models.long_context import LongContextTransformer, fused_backends
from kkdeploy.models.tiled_reference import TiledReferenceTransformer
from kkdeploy.models.weights import init_weights
from validation import CONTRACTS, compare_outputs

REPO = Path(__file__).resolve().parents[1]
STRICT = CONTRACTS["strict"]
LONG = TransformerConfig(batch_size=2, seq_len=4096, d_model=64, num_heads=4, ffn_dim=64, num_layers=2)


def models(config, dtype, reference_tile=48, micro_batch=None, query_tile=32, seed=0):
    reference = init_weights(ReferenceTransformer(config), seed)
    tiled = TiledReferenceTransformer(config, query_tile=reference_tile)
    tiled.load_state_dict(reference.state_dict(), strict=True)
    path = LongContextTransformer(config, micro_batch=micro_batch, query_tile=query_tile)
    path.load_state_dict(tiled.state_dict(), strict=True)
    return tuple(m.to(dtype).eval() for m in (reference, tiled, path))


def spy_block_softmax(monkeypatch) -> list[int]:
    """Record the row length of every call the long-context path makes to the fused block softmax."""
    import kkdeploy.kernels.block_softmax as bs

    calls, real = [], bs.causal_block_softmax
    monkeypatch.setattr(bs, "causal_block_softmax", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    return calls


@functools.lru_cache(maxsize=None)
def cpu_gemm_ignores_trailing_zero_keys(dtype, rows: int = 1024, keys: int = 12400, cut: int = 12288) -> bool:
    """Whether this CPU's GEMM gives P.V over ``keys`` keys the bits it gives over the first ``cut`` when P is zero
    past the cut: what an aligned key cut's bits rest on (cuBLAS's, measured on the H200 by
    scripts/shape14_tile_study.py). A BLAS that blocks K by its extent regroups the sums: MKL on a 2-core Xeon with
    AVX-512 (session 43) splits K = 12,400 at 12,152, so rows with keys in 12,152-12,287 differ by an ulp."""
    g = torch.Generator().manual_seed(0)
    p = torch.rand(rows, keys, generator=g).to(dtype)
    p[:, cut:] = 0
    v = torch.randn(keys, 8, generator=g).to(dtype)
    return torch.equal(p @ v, p[:, :cut] @ v[:cut])


CUT_BITS_ELSEWHERE = ("this CPU's GEMM regroups P.V's sums with the key extent (cpu_gemm_ignores_trailing_zero_keys), "
                      "so an aligned cut's bits here are the BLAS's, not the path's: the GPU's proof and full-length "
                      "validation decide them")


def cpu_kernels_for(dtype) -> bool:
    try:
        torch.matmul(torch.ones(2, 2, dtype=dtype), torch.ones(2, 2, dtype=dtype))
        torch.nn.functional.layer_norm(torch.ones(2, 4, dtype=dtype), (4,))
        return True
    except RuntimeError:
        return False


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("padding_ratio", [0.0, 0.5])
def test_tiled_reference_is_bitwise_equal_to_reference(dtype, causal, padding_ratio):
    if not cpu_kernels_for(dtype):
        pytest.skip(f"this CPU build has no {dtype} matmul/layer_norm kernels")
    config = TransformerConfig(3, 200, 32, 4, 48, 2, causal=causal)  # 200 = 4 full tiles of 48 + a partial one
    reference, tiled, _ = models(config, dtype)
    for seed in (11, 12):
        x, mask = generate_case(config, "cpu", dtype, seed, padding_ratio=padding_ratio)
        with torch.inference_mode():
            expected, got = reference(x, mask), tiled(x, mask)
        assert compare_outputs(expected, got, *STRICT).passed
        assert torch.equal(expected, got), "each query row sees its whole key row, so it must be bitwise equal"


def test_tiled_reference_visible_keys_and_sequence_tiles_stay_strict():
    """The cheaper variants change summation lengths/layouts: strict, not necessarily bitwise."""
    config = TransformerConfig(2, 300, 32, 4, 32, 2)
    reference, _, _ = models(config, torch.float32)
    x, mask = generate_case(config, "cpu", torch.float32, 5, padding_ratio=0.3)
    for kwargs in ({"key_extent": "visible"}, {"sequence_tile": 1}):
        tiled = TiledReferenceTransformer(config, query_tile=64, **kwargs)
        tiled.load_state_dict(reference.state_dict(), strict=True)
        with torch.inference_mode():
            report = compare_outputs(reference(x, mask), tiled(x, mask), *STRICT)
        assert report.passed and report.max_abs < 1e-5, (kwargs, report.summary())


def test_long_context_path_matches_tiled_reference_at_4096():
    _, tiled, path = models(LONG, torch.float32, reference_tile=512, query_tile=256)
    for padding_ratio, expected_path in ((0.0, "sdpa-flash_attention"), (0.5, "tiled")):
        x, mask = generate_case(LONG, "cpu", torch.float32, 1234, padding_ratio=padding_ratio)
        with torch.inference_mode():
            out = path(x, mask)
            ref = tiled(x, mask)
        assert path.last_attention_path == expected_path
        report = compare_outputs(ref, out, *STRICT)
        assert report.passed, report.summary()
        if padding_ratio:
            assert not out[~mask].any(), "padded rows must be exactly zero"


def test_micro_batching_does_not_change_results_beyond_strict():
    config = TransformerConfig(5, 64, 32, 4, 32, 2)
    _, tiled, path = models(config, torch.float32, micro_batch=2)
    x, mask = generate_case(config, "cpu", torch.float32, 3, padding_ratio=0.4)
    with torch.inference_mode():
        ref = tiled(x, mask)
        assert compare_outputs(ref, path(x, mask), *STRICT).passed
        assert path.sequences_per_micro_batch(5, 64) == 2
        path.micro_batch = None  # automatic: bounded by the activation budget
        path.activation_budget = 1
        assert path.sequences_per_micro_batch(5, 64) == 1
        assert compare_outputs(ref, path(x, mask), *STRICT).passed


def test_gradient_enabled_call_uses_tiles_and_matches_reference_gradients():
    config = TransformerConfig(2, 96, 32, 4, 32, 2)
    reference, _, path = models(config, torch.float32, query_tile=16)
    x, mask = generate_case(config, "cpu", torch.float32, 9, padding_ratio=0.0)
    grads = []
    for model in (reference, path):
        xg = x.clone().requires_grad_(True)
        out = model(xg, mask)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        grads.append((out.detach(), xg.grad, model.layers[0].attention.q_proj.weight.grad))
    assert path.last_attention_path == "tiled"  # grad-enabled calls never take the fused path
    for expected, got in zip(grads[0], grads[1]):
        assert compare_outputs(expected, got, *STRICT).passed


def test_sdpa_refusal_is_a_one_line_error_not_a_math_fallback():
    config = TransformerConfig(1, 32, 32, 4, 32, 1)
    _, _, path = models(config, torch.float32)
    path.backends = [SDPBackend.EFFICIENT_ATTENTION]  # CUDA-only: the CPU must refuse it
    x, _ = generate_case(config, "cpu", torch.float32, 0)
    with torch.inference_mode(), pytest.raises(KKError) as info:
        path(x)
    message = str(info.value)
    assert "refused" in message and "efficient_attention" in message and "\n" not in message
    assert fused_backends(torch.device("cpu")) == [SDPBackend.FLASH_ATTENTION]
    assert SDPBackend.MATH not in fused_backends(torch.device("cuda"))


def test_bad_arguments_are_one_line_errors():
    config = TransformerConfig(1, 16, 32, 4, 32, 1)
    for bad in ({"micro_batch": 0}, {"query_tile": -1}, {"query_tile": True}):
        with pytest.raises(KKError, match="positive integer"):
            LongContextTransformer(config, **bad)
    with pytest.raises(KKError, match="key_extent"):
        TiledReferenceTransformer(config, key_extent="half")
    path = LongContextTransformer(config).eval()
    with pytest.raises(KKError, match="dtype"):
        path(torch.zeros(1, 16, 32, dtype=torch.float64))
    with pytest.raises(KKError, match="valid_token_mask"):
        path(torch.zeros(1, 16, 32), torch.ones(1, 16))
    with pytest.raises(KKError, match="seq_len"):
        build_long_context(config, "float32", "cpu", seq_len=0)
    with pytest.raises(KKError, match="contract"):
        validate_long_context(config, "float32", "cpu", trials=1, contract="loose")


MEMORY_PROBE = textwrap.dedent("""
    import json, sys, torch
    from kkdeploy import ReferenceTransformer, TransformerConfig, generate_case
    from kkdeploy.models.long_context import LongContextTransformer
    torch.set_num_threads(2)

    def status_bytes(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    config = TransformerConfig(**json.loads(sys.argv[2]))
    model = (LongContextTransformer(config) if sys.argv[1] == "long" else ReferenceTransformer(config)).eval()
    x, mask = generate_case(config, "cpu", torch.float32, 1234, padding_ratio=float(sys.argv[3]))
    with torch.inference_mode():
        model(x, mask)  # first call pages in library code and kernel workspaces: not the model's memory
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux: reset the peak RSS (VmHWM) to the current RSS
        rss_before = status_bytes("VmRSS")
        out = model(x, mask)
        peak = status_bytes("VmHWM")
    print(json.dumps({"peak_increase": peak - rss_before}))
""")


def peak_increase(kind: str, config: TransformerConfig, padding_ratio: float) -> int:
    """Peak RSS during one (warm) forward in a fresh process, above its RSS just before it.

    The kernel's peak-RSS counter is reset right before the measured call, and glibc's mmap
    threshold is pinned at 64 KiB so every tensor buffer is mapped on allocation and unmapped on
    free: RSS follows live tensor memory instead of a heap that only grows.
    """
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    result = subprocess.run([sys.executable, "-c", MEMORY_PROBE, kind, json.dumps(config.to_dict()),
                             str(padding_ratio)], capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    if result.returncode and "clear_refs" in result.stderr:
        pytest.skip("this kernel does not allow resetting the peak RSS (/proc/self/clear_refs)")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])["peak_increase"]


def test_peak_memory_stays_far_below_the_dense_score_size():
    dense = LONG.dense_score_bytes(torch.float32)  # 2*4*4096*4096*4 = 512 MiB
    long_all_valid = peak_increase("long", LONG, 0.0)
    long_padded = peak_increase("long", LONG, 0.5)
    print(f"dense scores {dense / 2**20:.0f} MiB; long-context peak increase all-valid "
          f"{long_all_valid / 2**20:.1f} MiB, padded {long_padded / 2**20:.1f} MiB")
    # padded: a few [b,H,tile,S] tile temporaries (16 MiB each here); all-valid: no S x S term at all
    assert long_all_valid < dense / 16 and long_padded < dense / 4
    # The instrument sees score tensors: the dense reference rises by more than one [B,H,S,S] tensor.
    control = TransformerConfig(1, 2048, 64, 4, 64, 1)
    dense_peak = peak_increase("dense", control, 0.0)
    print(f"dense reference (B1) peak increase {dense_peak / 2**20:.0f} MiB")
    assert dense_peak > control.dense_score_bytes(torch.float32)


def test_check_reduced_through_the_cli(capsys):
    argv = ["check", "--shape", "14", "--reduced", "--seq-len", "256", "--d-model", "64", "--heads", "4",
            "--ffn-dim", "64", "--trials", "2", "--device", "cpu"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("trial ")]
    assert len(lines) == 4 and sum("all-valid" in l for l in lines) == 2 and sum("padded" in l for l in lines) == 2
    assert all("PASS failed 0/32768" in l for l in lines)
    assert out.strip().splitlines()[-1].startswith("PASS")


def test_check_refusals_are_one_line(capsys):
    assert main(["check", "--shape", "14", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "not run on the CPU" in err and "TiB" in err and "--reduced" in err and "Traceback" not in err
    assert main(["check", "--shape", "14", "--seq-len", "128", "--device", "cpu"]) == 2
    assert "only to the reduced validation" in capsys.readouterr().err
    assert main(["check", "--shape", "3", "--reduced", "--device", "cpu"]) == 2
    assert "drop it for shape 3" in capsys.readouterr().err
    assert main(["check", "--shape", "14", "--reduced", "--heads", "5", "--device", "cpu"]) == 2
    assert "not divisible" in capsys.readouterr().err


def test_build_long_context_refuses_dense_and_reports_validation(tmp_path):
    logical = TransformerConfig(32, 100000, 64, 4, 64, 2)
    result = build_long_context(logical, "float32", "cpu", tmp_path, trials=1, seq_len=192, full_length_budget_s=30)
    names = [c["name"] for c in result["candidates"]]
    skipped = result["candidates"][-1]["calibration"][0]  # SDPA at 100,000 keys: full-length trials take hours here
    assert skipped["sdpa_layers"] == 2 and skipped["status"] == "skipped" and "would take" in skipped["reason"]
    assert names == list(DENSE_CANDIDATES) + ["torch-long-context"]
    for dense in result["candidates"][:-1]:
        assert dense["status"] == "skipped" and dense["estimated_bytes"] == logical.dense_score_bytes(torch.float32)
        assert str(dense["estimated_bytes"]) in dense["reason"]
    chosen = result["candidates"][-1]
    assert chosen["status"] == "passed" and chosen["failed_elements"] == 0 and chosen["trial_count"] == 2
    assert result["choice"]["backend"] == "torch-long-context" and result["choice"]["validated"]
    assert result["validated_shape"]["seq_len"] == 192 and result["validated_shape"]["batch_size"] == 2
    modes = [(r["mask_mode"], r["attention_path"]) for r in result["validation"]["reports"]]
    assert modes == [("all-valid", "tiled"), ("padded", "tiled")]  # the tiled path: the reduced shape covers it
    written = json.loads(Path(result["validation_file"]).read_text())
    assert written["passed"] and written["weights_sha256"] == result["validation"]["weights_sha256"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("padding_ratio", [0.0, 0.5])
def test_unfused_long_context_path_is_bitwise_reference(dtype, padding_ratio):
    """sdpa_layers=0 with full key rows: the calibration's last resort is exactly the reference."""
    if not cpu_kernels_for(dtype):
        pytest.skip(f"this CPU build has no {dtype} matmul/layer_norm kernels")
    config = TransformerConfig(2, 200, 32, 4, 48, 2, causal=True)
    reference, _, _ = models(config, dtype)
    path = LongContextTransformer(config, query_tile=48, sdpa_layers=0, micro_batch=2)
    path.load_state_dict(reference.state_dict(), strict=True)
    path = path.to(dtype).eval()
    for seed in (3, 4):
        x, mask = generate_case(config, "cpu", dtype, seed, padding_ratio=padding_ratio)
        with torch.inference_mode():
            assert torch.equal(reference(x, mask), path(x, mask))
    assert path.last_attention_path == "tiled"


def test_fused_layers_are_confined_to_the_last_ones():
    config = TransformerConfig(2, 64, 32, 4, 48, 3)
    path = LongContextTransformer(config, sdpa_layers=1).eval()
    x, _ = generate_case(config, "cpu", torch.float32, 0)
    with torch.inference_mode():
        path(x)
    assert "last 1 layer(s)" in path.last_attention_path
    with pytest.raises(KKError, match="sdpa_layers must be between 0 and num_layers=3"):
        LongContextTransformer(config, sdpa_layers=4)


def test_aligned_key_extent_cuts_causal_tiles_at_4096_key_multiples_that_take_atens_regular_kernel():
    from kkdeploy.kernels.block_softmax import block_softmax_layout
    from kkdeploy.models.long_context import ALIGNED_MIN_KEYS, key_end

    # the shortest cut is the first 4096 multiple past ATen's shared-memory softmax (a different order)
    assert block_softmax_layout(ALIGNED_MIN_KEYS)[0] == "regular"
    assert block_softmax_layout(ALIGNED_MIN_KEYS - 4096)[0] == "smem"
    assert key_end(100, 100000, True, "aligned") == 12288 and key_end(12288, 100000, True, "aligned") == 12288
    assert key_end(12289, 100000, True, "aligned") == 16384 and key_end(50000, 100000, True, "aligned") == 53248
    assert key_end(99000, 100000, True, "aligned") == 100000  # past the last multiple: the whole row
    assert key_end(100, 9000, True, "aligned") == 9000  # a row shorter than the shortest cut: whole
    assert key_end(100, 100000, False, "aligned") == 100000  # not causal: every key
    assert key_end(100, 100000, True, "full") == 100000 and key_end(100, 100000, True, "visible") == 100
    with pytest.raises(KKError, match="key_extent must be one of auto, full, visible, aligned"):
        LongContextTransformer(TransformerConfig(1, 16, 32, 4, 32, 1), key_extent="half")


def test_aligned_long_context_path_stays_with_the_reference_past_the_shortest_cut():
    """Rows longer than 12,288 keys, so early tiles really are cut; whether the cut is bitwise is the GPU's
    question (scripts/shape14_h200.py --path-key-extent aligned); here it must stay within float32 noise of
    the tiled reference (full key rows)."""
    config = TransformerConfig(1, 13000, 16, 2, 16, 1, causal=True)
    _, tiled, _ = models(config, torch.float32, reference_tile=1024)
    path = LongContextTransformer(config, query_tile=1024, sdpa_layers=0, key_extent="aligned")
    path.load_state_dict(tiled.state_dict(), strict=True)
    path = path.eval()
    x, mask = generate_case(config, "cpu", torch.float32, 5)
    with torch.inference_mode():
        torch.testing.assert_close(path(x, mask), tiled(x, mask), rtol=1e-5, atol=1e-6)


def test_block_kernel_branch_runs_only_for_rows_the_kernel_reproduces(monkeypatch):
    """The fused softmax stands in for ATen's regular block softmax only (rows >= 12,256 keys); shorter rows,
    which ATen gives its shared-memory kernel, stay with the composition. Off the GPU both are the composition,
    so the outputs agree either way."""
    if not cpu_kernels_for(torch.float16):
        pytest.skip("this CPU build has no float16 matmul/layer_norm kernels")
    from kkdeploy.models.long_context import attend_tile

    calls = spy_block_softmax(monkeypatch)
    g = torch.Generator().manual_seed(4)
    q, k, v = ((torch.randn(1, 2, 13000, 8, generator=g)).half() for _ in range(3))
    t0, t1 = 12000, 12016
    for row_len, width in ((13000, 12288), (4096, 4096)):
        with torch.no_grad():  # the kernel has no backward: with autograd on, ATen's ops run
            fused = attend_tile(q[:, :, t0 - 12000:t1 - 12000] if row_len == 4096 else q[:, :, t0:t1],
                                k[:, :, :width], v[:, :, :width], 0.125, t0 if row_len == 13000 else 0, True, None,
                                None, row_len, "block-kernel")
        assert fused.shape == (1, 2, 16, 8) and torch.isfinite(fused).all()
    assert calls == [13000]  # the 4096-key row took ATen's ops
    attend_tile(q[:, :, t0:t1], k[:, :, :12288], v[:, :, :12288], 0.125, t0, True, None, None, 13000, "block-kernel")
    assert calls == [13000]  # autograd on: ATen's ops


@pytest.mark.parametrize("key_extent", ["full", "aligned"])
def test_block_kernel_softmax_path_is_wired_to_the_reference_composition(key_extent):
    """Off the GPU the fused softmax is the reference composition over the whole row, so the path stays bitwise
    with full key rows; padded calls keep ATen's ops. (The kernel itself: scripts/block_softmax_selftest.py.)"""
    if not cpu_kernels_for(torch.float16):
        pytest.skip("this CPU build has no float16 matmul/layer_norm kernels")
    config = TransformerConfig(1, 300, 32, 4, 48, 2, causal=True)
    reference, _, _ = models(config, torch.float16)
    path = LongContextTransformer(config, query_tile=64, sdpa_layers=0, softmax="block-kernel", key_extent=key_extent)
    path.load_state_dict(reference.state_dict(), strict=True)
    path = path.to(torch.float16).eval()
    for ratio in (0.0, 0.4):
        x, mask = generate_case(config, "cpu", torch.float16, 9, padding_ratio=ratio)
        with torch.inference_mode():
            assert torch.equal(path(x, mask), reference(x, mask))
    with pytest.raises(KKError, match="softmax must be one of auto, aten, block-kernel"):
        LongContextTransformer(config, softmax="fast")


def test_auto_tiled_settings_take_the_proven_fast_path_only(monkeypatch):
    """"auto" (the default) runs aligned key cuts with the block-softmax kernel only where a proof made in this
    environment holds for the op shape, and full key rows with ATen's ops everywhere else; explicit settings are
    kept; an all-valid mask is dropped so the kernel applies."""
    import kkdeploy.kernels.block_softmax as bs
    from kkdeploy.models.long_context import resolve_tiled_settings, tiled_attention

    assert resolve_tiled_settings("auto", "auto", "cpu", torch.float16, 12400, 8) == ("full", "aten")
    assert resolve_tiled_settings("visible", "aten", "cpu", torch.float16) == ("visible", "aten")
    assert "CUDA-only" in bs.fast_path_reason("cpu", torch.float16)
    monkeypatch.setattr(bs, "fast_path_reason", lambda device, dtype, row_len=None, rows=None: None)
    assert resolve_tiled_settings("auto", "auto", "cpu", torch.float16, 12400, 8) == ("aligned", "block-kernel")
    assert resolve_tiled_settings("auto", "auto", "cpu", torch.float16) == ("full", "aten")  # no op shape: no proof
    assert resolve_tiled_settings("full", "auto", "cpu", torch.float16, 12400, 8) == ("full", "block-kernel")
    path = LongContextTransformer(TransformerConfig(1, 64, 16, 2, 16, 1))
    assert (path.key_extent, path.softmax) == ("auto", "auto")
    if not cpu_kernels_for(torch.float16):
        pytest.skip("this CPU build has no float16 matmul/layer_norm kernels")
    seen = spy_block_softmax(monkeypatch)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 12400, 8, generator=g).half() for _ in range(3))
    with torch.no_grad():
        masked = tiled_attention(q, k, v, 0.125, True, torch.ones(1, 12400, dtype=torch.bool), 4096, "auto", "auto")
    assert seen and set(seen) == {12400}  # all-valid mask dropped: every tile took the kernel branch
    with torch.no_grad():
        assert torch.equal(masked, tiled_attention(q, k, v, 0.125, True, None, 4096, "auto", "auto"))


def test_strict_builds_validate_the_bitwise_tiled_path_first_where_it_is_fast(monkeypatch):
    import kkdeploy.kernels.block_softmax as bs
    from kkdeploy.pipeline.long_context import calibration_order

    config = TransformerConfig(32, 100000, 1024, 16, 1024, 2)
    assert calibration_order(config, torch.float16, "cpu", "strict") == [2, 1, 0]  # most fused first
    monkeypatch.setattr(bs, "fast_path_reason", lambda device, dtype, row_len=None, rows=None: None)
    assert calibration_order(config, torch.float16, "cpu", "strict") == [0, 2, 1]
    assert calibration_order(config, torch.float16, "cpu", "judge") == [2, 1, 0]


# -- issue 29: padded calls cut where unpadded ones may, and the build validates what ships --------------------
def test_padded_tiles_are_cut_only_where_an_unpadded_tile_may_be_cut():
    """Every cut drops only keys that are -inf in every row, and lands on the whole row or a 4096-key multiple past
    ATen's shared-memory rows, padding or not (a cut at the padding itself regroups ATen's GPU sums: see
    tests/test_block_softmax.py). "full" reads whole rows in padded calls too."""
    from kkdeploy.models.long_context import ALIGNED_KEY_BLOCK, ALIGNED_MIN_KEYS, key_end

    for seq_len in (100000, 13000, 12400, 4096):
        for limit in (1, 777, 4096, 9001, 12289, 75123, 98305, 99999, 100000):
            if limit > seq_len:
                continue
            for t1 in range(128, seq_len + 128, 4999):
                t1 = min(t1, seq_len)
                cut = key_end(t1, limit, True, "aligned", seq_len)
                assert cut >= min(t1, limit) and cut <= seq_len
                assert cut == seq_len or (cut % ALIGNED_KEY_BLOCK == 0 and cut >= ALIGNED_MIN_KEYS), (seq_len, limit, t1)
                assert key_end(t1, limit, True, "full", seq_len) == seq_len
                assert key_end(t1, limit, False, "aligned", seq_len) >= limit
    assert key_end(50000, 75123, True, "aligned", 100000) == 53248  # the all-valid cut: padding past it
    assert key_end(90000, 75123, True, "aligned", 100000) == 77824  # padding first: the next multiple past it
    assert key_end(99000, 98305, True, "aligned", 100000) == 100000  # past the last multiple: the whole row


def test_padded_calls_keep_the_all_valid_tile_boundaries():
    from kkdeploy.models.long_context import tile_schedule

    full = tile_schedule(13000, 13000, 1024, True, "aligned", "aten", False, dtype=torch.float32)
    padded = tile_schedule(13000, 9100, 1024, True, "aligned", "aten", True, dtype=torch.float32)
    assert [(t.t0, t.t1) for t in padded] == [(t.t0, t.t1) for t in full][:len(padded)]
    assert padded[-1].t1 == 9216  # the tile holding the last valid query keeps its 1024 rows (same GEMM shapes)
    assert {t.k_end for t in padded} == {12288} and full[-1].k_end == 13000
    kernel = tile_schedule(13000, 13000, 1024, True, "aligned", "block-kernel", True, prefix_mask=False)
    assert {t.softmax for t in kernel} == {"aten"}  # a mask that is not a prefix: ATen's ops
    assert {t.softmax for t in tile_schedule(13000, 13000, 1024, True, "aligned", "block-kernel", True)} == \
        {"block-kernel"}


@pytest.mark.parametrize("dtype, softmax, ratio", [(torch.float32, "aten", 0.25), (torch.float32, "aten", 0.001),
                                                   (torch.float16, "block-kernel", 0.001)])
def test_padded_aligned_path_is_bitwise_the_tiled_reference_past_one_4096_block(dtype, softmax, ratio):
    """Rows of 12,400 keys: early tiles are cut at 12,288, the last read whole rows; padded masks (0.25: every
    tile cut; 0.001: sequences end in the last block, so both kinds) against full key rows, bit for bit. On the
    CPU the block-softmax kernel is the reference composition, with each sequence's length masking its keys."""
    if not cpu_kernels_for(dtype):
        pytest.skip(f"this CPU build has no {dtype} matmul/layer_norm kernels")
    config = TransformerConfig(1, 12400, 8, 1, 8, 1)
    _, tiled, _ = models(config, dtype, reference_tile=1024)
    path = LongContextTransformer(config, query_tile=1024, sdpa_layers=0, key_extent="aligned", softmax=softmax)
    path.load_state_dict(tiled.state_dict(), strict=True)
    path = path.to(dtype).eval()
    x, mask = generate_case(config, "cpu", dtype, 3, padding_ratio=ratio)
    assert not mask.all()
    with torch.inference_mode():
        out, ref = path(x, mask), tiled(x, mask)
    expected = {f"padded/tiled/cut-rows/{softmax}"} | ({f"padded/tiled/full-rows/{softmax}"} if ratio < 0.01 else set())
    assert path.last_path_features == expected
    if not torch.equal(out, ref) and not cpu_gemm_ignores_trailing_zero_keys(dtype):
        pytest.skip(CUT_BITS_ELSEWHERE)
    assert torch.equal(out, ref)


def test_validation_plan_adds_full_length_trials_only_for_paths_the_reduced_shape_misses(monkeypatch):
    import kkdeploy.kernels.block_softmax as bs
    from kkdeploy.pipeline.long_context_plan import plan_validation

    config = TransformerConfig(32, 100000, 1024, 16, 1024, 2)
    reduced = TransformerConfig(2, 4096, 1024, 16, 1024, 2)
    tiled = plan_validation(config, reduced, 0, torch.float16, "cpu", query_tile=128, rate=1e10, bandwidth=1e10)
    assert tiled.full_length is None and tiled.feasible  # full rows with ATen's ops: the reduced shape runs them
    sdpa = plan_validation(config, reduced, 2, torch.float16, "cpu", query_tile=128, rate=1e10, bandwidth=1e10)
    assert sdpa.uncovered == ["all-valid/sdpa@100000"] and not sdpa.feasible  # SDPA rounds anew at every length
    assert "would take" in sdpa.reason and sdpa.full_length.batch_size == 2
    monkeypatch.setattr(bs, "fast_path_reason", lambda device, dtype, row_len=None, rows=None: None)
    import kkdeploy.kernels.scores_attention as sa  # no scores kernel here: where Triton is importable it would
    monkeypatch.setattr(sa, "triton_available", lambda: False)  # look up a proof for this (absent) GPU
    fast = plan_validation(config, reduced, 0, torch.float16, "cuda", query_tile=128, rate=5e14, bandwidth=4e12)
    assert set(fast.uncovered) == {f"{m}/tiled/{r}/block-kernel" for m in ("all-valid", "padded")
                                   for r in ("cut-rows", "full-rows")}
    assert fast.feasible and fast.full_length.seq_len == 100000 and fast.estimated_seconds < 600
    assert not plan_validation(config, reduced, 0, torch.float16, "cuda", query_tile=128, rate=5e14,
                               bandwidth=4e12, budget_s=1).feasible


def test_build_runs_full_length_trials_where_the_reduced_shape_misses_the_cut_rows(monkeypatch):
    """With a fast path (here: aligned cuts, float32 so ATen's softmax), rows of 12,400 keys are cut and the
    reduced shape (S1024) cannot reach the cuts: the build validates at full length, checks every planned path
    ran, and records it all."""
    import kkdeploy.kernels.block_softmax as bs

    monkeypatch.setattr(bs, "fast_path_reason", lambda device, dtype, row_len=None, rows=None: None)
    config = TransformerConfig(2, 12400, 8, 1, 8, 1)
    result = build_long_context(config, torch.float32, "cpu", seq_len=1024, trials=1, padding_ratio=0.5,
                                query_tile=1024)
    chosen = next(c for c in result["candidates"] if c["name"] == "torch-long-context")
    assert chosen["status"] == "passed" and chosen["sdpa_layers"] == 0 and result["choice"]["validated"]
    shipped = chosen["calibration"][0]
    stages = [s["stage"] for s in shipped["stages"]]
    assert stages == ["reduced", "full-length"]  # ATen's whole padded rows: the reduced shape runs them too
    assert shipped["not_exercised"] == [] and set(shipped["plan"]["full_features"]) <= set(shipped["exercised_features"])
    assert "padded/tiled/cut-rows/aten" in shipped["stages"][1]["exercised_features"]
    assert {r["stage"] for r in result["validation"]["reports"]} == set(stages)
    assert all(r["failed"] == 0 for r in result["validation"]["reports"])
    assert chosen["validated_shapes"][1]["seq_len"] == 12400
    assert result["kernel_proofs"][0]["chosen"] is None  # the CPU cannot prove the CUDA kernel: it says why
    assert "CUDA-only" in result["kernel_proofs"][0]["reason"]
    bitwise = all(r["bitwise_equal"] for r in result["validation"]["reports"])
    if not bitwise and not cpu_gemm_ignores_trailing_zero_keys(torch.float32):
        pytest.skip(CUT_BITS_ELSEWHERE)
    assert bitwise


def test_build_does_not_ship_a_path_no_trial_can_exercise(monkeypatch):
    """SDPA at the full length cannot be validated within the budget: that candidate is skipped with the reason,
    and the tiled path, which the reduced shape covers, ships."""
    config = TransformerConfig(2, 2048, 16, 2, 16, 2)
    result = build_long_context(config, torch.float32, "cpu", seq_len=256, trials=1, full_length_budget_s=0.0)
    chosen = next(c for c in result["candidates"] if c["name"] == "torch-long-context")
    statuses = {c["sdpa_layers"]: c["status"] for c in chosen["calibration"]}
    assert statuses == {2: "skipped", 1: "skipped", 0: "passed"} and chosen["sdpa_layers"] == 0
    assert "all-valid/sdpa@2048" in chosen["calibration"][0]["reason"]


def test_run_on_a_long_context_artifact_checks_sequences_with_the_tiled_reference(tmp_path, capsys):
    out = tmp_path / "lc"
    argv = ["build", "--batch-size", "3", "--seq-len", "600", "--d-model", "16", "--heads", "2", "--ffn-dim", "16",
            "--layers", "1", "--long-context", "--seq-len-validate", "256", "--device", "cpu", "--trials", "1",
            "--out", str(out)]
    assert main(argv) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["choice"]["backend"] == "long_context" and manifest["kernel_proofs"]
    assert manifest["validation"]["exercised_features"] and "build_seconds" in manifest
    capsys.readouterr()
    report = tmp_path / "run.json"
    assert main(["run", "--artifacts", str(out), "--padding-ratio", "0.25", "--check-sequences", "2",
                 "--json", str(report)]) == 0
    text = capsys.readouterr().out
    assert "against the tiled reference" in text and "peak GPU memory n/a on the CPU" in text
    result = json.loads(report.read_text())
    assert [c["sequence"] for c in result["checks"]] == [0, 2] and result["passed"]
    assert result["shape"]["batch_size"] == 3 and result["path_features"]
    assert main(["run", "--artifacts", str(out), "--batch-size", "1", "--seq-len", "300", "--check-sequences",
                 "1"]) == 0
    assert main(["run", "--artifacts", str(out), "--check-sequences", "-1"]) == 2
    assert "--check-sequences must be >= 0" in capsys.readouterr().err


def test_checked_sequences_spread_over_the_batch():
    from kkdeploy.pipeline.long_context_run import checked_sequences

    assert checked_sequences(32, 2) == [0, 31] and checked_sequences(32, 3) == [0, 16, 31]
    assert checked_sequences(1, 2) == [0] and checked_sequences(5, 0) == [] and checked_sequences(3, 9) == [0, 1, 2]


def test_calibration_adds_a_tail_trial_for_padded_paths_the_official_inputs_miss_and_refuses_unexercised_ones():
    """The calibration's logic with a stand-in validation: a padded path the full-length trial did not reach gets
    one padded trial whose sequences end in the last 4096-key block; a path still not run fails the candidate."""
    import kkdeploy.pipeline.long_context_plan as plan_module
    from kkdeploy.pipeline.long_context import calibrate, tail_padding_ratio
    from kkdeploy.pipeline.long_context_plan import ValidationPlan

    full = ["all-valid/tiled/cut-rows/block-kernel", "padded/tiled/cut-rows/block-kernel",
            "padded/tiled/full-rows/block-kernel"]
    config, reduced = TransformerConfig(2, 100000, 64, 4, 64, 1), TransformerConfig(2, 4096, 64, 4, 64, 1)

    def fake_plan(config, validated, sdpa_layers, dtype, device, **kw):
        return ValidationPlan(sdpa_layers, full, [], full, config)

    def run(reaches_tail):
        calls = []

        def validate(shape, sdpa_layers, stage, trials, modes):
            calls.append((stage, modes))
            ran = {"reduced": [], "full-length": full[:2], "full-length-tail": full[2:] if reaches_tail else []}
            return {"passed": True, "failed_elements": 0, "seconds": 0.1, "exercised_features": ran[stage]}

        return calls, calibrate(config, reduced, torch.float16, "cpu", [0], validate=validate, query_tile=128,
                                full_length_batch=2, full_length_trials=1, full_length_budget_s=900)

    original = plan_module.plan_validation
    plan_module.plan_validation = fake_plan
    try:
        calls, (layers, _, calibration) = run(True)
        assert calls == [("reduced", None), ("full-length", None), ("full-length-tail", ("padded",))]
        assert calibration[0]["passed"] and calibration[0]["not_exercised"] == []
        calls, (layers, _, calibration) = run(False)
        assert not calibration[0]["passed"] and calibration[0]["not_exercised"] == full[2:]
        assert "not exercised by any trial: padded/tiled/full-rows/block-kernel" in calibration[0]["reason"]
    finally:
        plan_module.plan_validation = original
    ratio = tail_padding_ratio(100000)
    lowest = max(1, round(100000 * (1 - ratio)))
    assert lowest > 98304  # every generated length ends in the last block: the last tiles read whole rows

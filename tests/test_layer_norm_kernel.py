"""kkdeploy.kernels.layer_norm: ATen's float16 LayerNorm, one warp per row (issue 19).

CI has no GPU: here the op's CPU kernel (ATen itself), its schema and fake kernel, the dispatch rules, and the
CUDA source compiling with nvcc's defaults. Bit-identity on the GPU is scripts/layer_norm_selftest.py's.
"""

import shutil
from dataclasses import replace
import subprocess

import pytest
import torch
import torch.nn.functional as F

import kkdeploy.kernels.layer_norm as ln
from kkdeploy.errors import KKError


def test_the_op_is_atens_layer_norm_on_the_cpu_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(3, 5, 128, generator=g) * 7 + 1).to(dtype)
        w, b = torch.randn(128, generator=g).to(dtype), torch.randn(128, generator=g).to(dtype)
        got = torch.ops.kkdeploy_faithful.layer_norm_rows(x, [128], w, b, 1e-5)
        assert torch.equal(got, F.layer_norm(x, (128,), w, b, 1e-5))


def test_opcheck_schema_fake_and_dispatch():
    x = torch.randn(4, 32)
    torch.library.opcheck(torch.ops.kkdeploy_faithful.layer_norm_rows.default, (x, [32], torch.ones(32),
                                                                                torch.zeros(32), 1e-5))


def test_the_path_says_why_the_rows_kernel_runs_or_not(monkeypatch, proof_sandbox):
    from kkdeploy.kernels import cuda_build

    monkeypatch.delenv(ln.PATH_ENV, raising=False)
    assert ln.layer_norm_path("cpu", 512, 128).kernel == "aten"
    monkeypatch.setattr(ln, "_load", lambda device: object())  # the library builds and loads
    cuda_build.load_problem.cache_clear()
    try:
        path = ln.layer_norm_path("cuda", 512, 128)
        assert path.kernel == "aten" and "no proof in this environment" in path.reason
        record = proof_sandbox.ProofRecord(op=ln.OP, shape=ln.proof_shape(512, 128),
                                           environment=ln.proof_environment("cuda"), chosen="rows1", reason="test")
        proof_sandbox.remember_proof(record)
        path = ln.layer_norm_path("cuda", 512, 128)
        assert path.fused and path.launch == "rows1"
        assert not ln.layer_norm_path("cuda", 1024, 128).fused  # another op shape
        monkeypatch.setenv(ln.PATH_ENV, "kernel")
        forced = ln.layer_norm_path("cuda", 1024, 128)
        assert forced.fused and forced.launch == ln.DEFAULT_LAUNCH
        monkeypatch.setenv(ln.PATH_ENV, "aten")
        assert not ln.layer_norm_path("cuda", 512, 128).fused
        monkeypatch.setenv(ln.PATH_ENV, "fast")
        with pytest.raises(KKError, match="KKDEPLOY_LAYER_NORM='fast': use auto, aten or kernel"):
            ln.layer_norm_path("cuda", 512, 128)
    finally:
        cuda_build.load_problem.cache_clear()


def test_calls_the_kernel_does_not_cover_are_named():
    x = torch.randn(4, 128).half()
    assert "float16 CUDA only" in ln.rows_kernel_reason(x, [128], torch.ones(128).half(), torch.zeros(128).half())
    with pytest.raises(KKError, match="layer_norm_rows_kernel: cpu torch.float16: the kernel is float16 CUDA only"):
        ln.layer_norm_rows_kernel(x, torch.ones(128).half(), torch.zeros(128).half(), 1e-5)
    with pytest.raises(KKError, match=r"rows_per_warp is one of \[1, 2, 3, 4, 5, 6\] \(the launches rows2, rows1, "
                                      r"block4, rows2_full, block4_full, rows2_full_early\), got 7"):
        ln.layer_norm_rows_kernel(x, torch.ones(128).half(), torch.zeros(128).half(), 1e-5, rows_per_warp=7)
    assert ln.DEFAULT_ROWS_PER_WARP == 2  # proven with 1 on the H200 (campaign 11) and faster: the op's launch


def test_wide_rows_take_the_block_launch_and_narrow_rows_keep_theirs():
    # rows of exactly 128, and of the block widths it is compiled for, first try the launches with every count known
    assert ln.launches_for(128) == ["rows2_full", "rows2", "rows1"] and ln.launches_for(4) == ["rows2", "rows1"]
    assert ln.launches_for(32) == ["rows2_full", "rows2", "rows1"] and ln.launches_for(96) == ["rows2", "rows1"]
    assert ln.launches_for(132) == ["block4"] and ln.launches_for(1024) == ["block4_full", "block4"]
    assert ln.launches_for(384) == ["block4_full", "block4"] and ln.launches_for(256) == ["block4_full", "block4"]
    assert ln.launches_for(2048) == ["block4"] and ln.launches_for(640) == ["block4"]  # the widths of our shapes only
    assert ln.LAUNCHES["block4"] == 4  # the C entry's rows_per_warp for one warp playing ATen's block
    assert ln.LAUNCHES["rows2_full"] == 3 and ln.LAUNCHES["block4_full"] == 5
    # the proofs' key holds the widths the full forms take: a record made for other widths is not found
    from kkdeploy.kernels.proof import launch_table_digest

    assert ln.LAUNCHES_DIGEST == launch_table_digest(ln.LAUNCHES, ln.FULL_ROW_WIDTHS, ln.FULL_BLOCK_WIDTHS)
    assert ln.LAUNCHES_DIGEST != launch_table_digest(ln.LAUNCHES, (), ())
    assert ln.row_reason(384, torch.float16) is None and ln.row_reason(1 << 24, torch.float16) is None
    assert "rows of 130" in ln.row_reason(130, torch.float16)
    assert "rows of 33554432" in ln.row_reason(1 << 25, torch.float16)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH on this machine")
def test_the_full_row_launches_leave_the_reciprocals_and_the_counts_shuffles_to_the_compiler(tmp_path):
    """Compiled to PTX for sm_90 with the build's flags: rows2_full and block4_full take ATen's steps with every count
    known, so no reciprocal is computed at run time and only the mean and m2 cross lanes (two shuffles per step of a
    tree, and one broadcast each of the mean and the variance); rows2 and block4, as proven, compute each merge's
    reciprocal and shuffle its count too. Whether the bits are ATen's is the GPU proof's (``prove_layer_norm``)."""
    import re

    import numpy as np

    from tests.conftest import layer_norm_ptx_entries

    kernels = layer_norm_ptx_entries(tmp_path)
    shuffles = lambda body: len(re.findall(r"shfl\.sync\.(?:down|idx)", body))  # noqa: E731
    for proven in ("rows2<plain>", "block4<plain>"):
        assert "rcp.rn.f32" in kernels[proven], proven
    assert shuffles(kernels["rows2<plain>"]) == 4 * 3 + 2  # offsets 8..1: mean, m2 and count; then the broadcasts
    full = {**{f"rows2_full{n}<plain>": 4 * 2 + 2 for n in (16, 32, 64, 128)},
            **{f"block4_full{n}<plain>": 4 * 5 * 2 + 2 for n in (512, 768, 1024)}}
    for width in (16, 32, 64, 128):  # each step's count of the other side, in delta * delta * other.count
        literals = set(re.findall(r"0f[0-9A-F]{8}", kernels[f"rows2_full{width}<plain>"]))
        for _, other in _tree_schedule(width):
            if other:
                assert f"0f{int(np.array(other, dtype=np.float32).view(np.uint32)):08X}" in literals, (width, other)
    for name, expected in full.items():
        body = kernels[name]
        assert "rcp." not in body, name
        # the variance's m2 / N: a multiplication by 2^-k for a power of two, ATen's division for 768
        assert body.count("div.rn.f32") == (1 if "768" in name else 0), name
        assert shuffles(body) == expected, name
        assert "rsqrt.approx.f32" in body and "cvt.rn.f16.f32" in body, name  # ATen's rsqrtf, one rounding per output


def _tree_schedule(width: int) -> list[tuple[int, int]]:
    """rows2_full's (own, other) counts at each step of the tree (offsets 16 .. 1), as csrc/layer_norm.cu's
    kTreeOwn / kTreeOther give them."""
    v = width // 4
    steps = []
    for offset in (16, 8, 4, 2, 1):
        own = 4 * (v // (2 * offset) if v >= 2 * offset else 1)
        steps.append((own, own if v >= 2 * offset else 0))
    return steps


def test_the_full_rows_launch_s_counts_are_the_ones_aten_s_lane_0_depends_on():
    """ATen's warp for rows of 16, 32, 64 and 128 (lane t holds 4-wide vector t, a power of two of them), folded by
    its shuffle-down tree: at each step every lane that holds elements and that lane 0's result depends on merges the
    same counts, the ones rows2_full fixes when compiled; a lane without elements only ever merges empty states
    (whose merge is empty whatever the counts say); and the tree ends with the row's width."""
    for width in (16, 32, 64, 128):
        counts = [4 if t < width // 4 else 0 for t in range(32)]
        for (own, other), offset in zip(_tree_schedule(width), (16, 8, 4, 2, 1)):
            pairs = {(counts[i], counts[i + offset]) for i in range(offset)}
            assert pairs - {(0, 0)} == {(own, other)}, (width, offset, pairs)
            counts = [counts[i] + counts[i + offset] for i in range(offset)]
        assert counts == [width], width


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH on this machine")
def test_the_full_block_launch_s_shares_are_the_correctly_rounded_ones(tmp_path):
    """Where ATen's tree over its warps merges counts whose sum is not a power of two (rows of 384 and 768: warps of
    128 and 256 elements merge into 384), the shares a merge multiplies by (``coef * other.count``, ``own.count *
    coef``) are not exact: block4 rounds them at run time (``rcp.rn.f32``, ``mul.rn``), block4_full has the compiler
    fold them. Each folded share in the PTX is the float32 value IEEE arithmetic gives, computed here with numpy
    from the same schedule of counts (``kLaneElements``)."""
    import re

    import numpy as np

    from tests.conftest import layer_norm_ptx_entries

    def lane_elements(n: int, warp: int) -> int:
        vectors = n // 4
        return 4 * ((vectors - 32 * warp + 127) // 128) if vectors > 32 * warp else 0

    kernels = layer_norm_ptx_entries(tmp_path)
    f32 = np.float32
    for n in (384, 768):
        c = [32 * lane_elements(n, w) for w in range(4)]
        shares = set()
        for own, other in ((c[0], c[2]), (c[1], c[3]), (c[0] + c[2], c[1] + c[3])):  # ATen's block step
            coef = f32(1) / f32(own + other)
            shares |= {f32(coef * f32(other)), f32(f32(own) * coef)}
        inexact = {int(np.array(v, dtype=np.float32).view(np.uint32)) for v in shares if v not in (0, 0.5, 1)}
        assert inexact, n  # 1/3 and 2/3 of a merge of 256 and 128
        literals = {int(h, 16) for h in re.findall(r"0f([0-9A-F]{8})", kernels[f"block4_full{n}<plain>"])}
        assert inexact <= literals, (n, sorted(map(hex, inexact - literals)))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH on this machine")
def test_the_cuda_kernel_compiles_for_hopper_with_nvcc_defaults(tmp_path):
    from kkdeploy.kernels.cuda_build import NVCC_FLAGS, gencode

    cmd = ["nvcc", *NVCC_FLAGS, "-shared", "-gencode", gencode("sm_90"), str(ln.SOURCE), "-o", str(tmp_path / "k.so")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_ort_custom_op_and_the_torch_op_share_atens_welford_steps():
    """One source for the arithmetic both kernels were (or will be) proven with; the ORT library's build key
    hashes the shared header too, so a change to it rebuilds that library."""
    from engines.custom_op_library import CUDA_SOURCES, SOURCE_DIR

    ort = (SOURCE_DIR / CUDA_SOURCES[0]).read_text()
    assert '#include "../../kkdeploy/kernels/csrc/welford.cuh"' in ort and "kk_welford::merge" in ort
    assert (SOURCE_DIR / CUDA_SOURCES[-1]).resolve() == ln.HEADER
    assert '#include "welford.cuh"' in ln.SOURCE.read_text()


def test_the_gpu_selftest_says_it_needs_a_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the script would run")
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "layer_norm_selftest.py"
    spec = importlib.util.spec_from_file_location("layer_norm_selftest", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--out", "/dev/null"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_a_machine_that_cannot_build_the_kernel_runs_atens_layer_norm_and_says_why(monkeypatch):
    """A serving image without nvcc: ATen's kernel runs (the same bits), the build is tried once, and the path's
    reason names the problem."""
    from kkdeploy.kernels import cuda_build

    monkeypatch.delenv(ln.PATH_ENV, raising=False)
    tries = []

    def no_nvcc(device):
        tries.append(device)
        raise KKError("the kkdeploy CUDA kernels need nvcc (the CUDA toolkit) and none was found")

    monkeypatch.setattr(ln, "_load", no_nvcc)
    cuda_build.load_problem.cache_clear()
    try:
        for _ in range(3):
            path = ln.layer_norm_path("cuda", 512, 128)
            assert path.kernel == "aten" and "cannot be built or loaded here" in path.reason and "nvcc" in path.reason
        assert tries == ["cuda"]
    finally:
        cuda_build.load_problem.cache_clear()


def test_rows_outside_the_kernel_are_named_once_for_calls_and_manifests(monkeypatch):
    from engines.torch_compile import KERNELS, kernel_paths_record
    from kkdeploy import OFFICIAL_SHAPES
    from kkdeploy.kernels import faithful_attention, fused_linear

    # the other kernels' records would look up proofs for this (absent) GPU where Triton is importable
    monkeypatch.setattr(faithful_attention, "triton_available", lambda: False)
    monkeypatch.setattr(fused_linear, "triton_available", lambda: False)

    assert ln.row_reason(128, torch.float16) is None and ln.row_reason(1024, torch.float16) is None
    assert "rows of 130" in ln.row_reason(130, torch.float16)
    assert "float16 only" in ln.row_reason(128, torch.float32)
    # rows ATen's vector path does not take, on a GPU: recorded as ATen's LayerNorm without asking the device anything
    odd = replace(OFFICIAL_SHAPES[3], d_model=130, num_heads=2)
    record = kernel_paths_record(KERNELS, odd, torch.float16, torch.device("cuda"))["layer_norm_path"]
    assert record == {"kernel": "aten", "reason": "rows of 130: the kernel takes rows of a multiple of 4 elements up "
                                                  "to 2^24 (ATen's vector path); ATen's layer_norm runs"}


def test_the_proof_tries_only_the_launches_that_take_the_rows(monkeypatch, proof_sandbox):
    from kkdeploy.kernels.proof import ProofRecord

    tried = []

    def record_launches(op, shape, launches, cases, device, **kwargs):
        tried.append(list(launches))
        return ProofRecord(op=op, shape=shape, environment={}, reason="not proven here")

    monkeypatch.setattr(ln, "kernel_refusal", lambda device: None)
    monkeypatch.setattr(ln, "proof_environment", lambda device: {"fake": True})
    monkeypatch.setattr(ln, "prove_launches", record_launches)
    ln.prove_layer_norm("cpu", [], 64, 384)  # a build: the launches that take wide rows
    ln.prove_layer_norm("cpu", [], 64, 384, launches=["rows2", "block4"])  # a study asking for every launch
    ln.prove_layer_norm("cpu", [], 64, 128)
    ln.prove_layer_norm("cpu", [], 64, 128, launches=list(ln.LAUNCHES))
    ln.prove_layer_norm("cpu", [], 64, 1024)
    ln.prove_layer_norm("cpu", [], 64, 96, launches=["rows2_full_early", "rows2"])  # a study launch's width only
    assert tried == [["block4_full", "block4"], ["block4"], ["rows2_full", "rows2", "rows1"],
                     ["rows2", "rows1", "rows2_full", "rows2_full_early"], ["block4_full", "block4"], ["rows2"]]


def test_the_early_rows_launch_is_a_study_launch_with_rows2_full_s_arithmetic(tmp_path):
    """``rows2_full_early`` loads the lane's gamma and beta before the tree instead of after its last shuffle. A build
    does not prove it (a study names it) until a GPU build ships it; compiled to PTX for sm_90 with the build's
    flags, it has rows2_full's floating-point instructions, as many of each and in its order (but for where the
    kernel reads eps), plain and as a dependent launch; and gamma's loads come before the first shuffle."""
    import collections
    import re

    from kkdeploy.kernels.dependent_launch import arithmetic_opcodes
    from tests.conftest import layer_norm_ptx_entries

    assert "rows2_full_early" not in ln.launches_for(128) and ln.takes("rows2_full_early", 128)
    assert not ln.takes("rows2_full_early", 96) and ln.LAUNCHES["rows2_full_early"] == 6
    kernels = layer_norm_ptx_entries(tmp_path)
    floating = lambda body: [op for op in arithmetic_opcodes(body) if not op.startswith(("mov", "ld.param"))]  # noqa
    for width in (16, 32, 64, 128):
        for mode in ("plain", "pdl"):
            full, early = kernels[f"rows2_full{width}<{mode}>"], kernels[f"rows2_full_early{width}<{mode}>"]
            assert floating(early) == floating(full), (width, mode)
            assert collections.Counter(arithmetic_opcodes(early)) == collections.Counter(arithmetic_opcodes(full))
            first_shuffle = early.index("shfl.sync")
            assert len(re.findall(r"ld\.global\.nc", early[:first_shuffle])) > \
                len(re.findall(r"ld\.global\.nc", full[:full.index("shfl.sync")])), (width, mode)


def test_a_build_captures_activations_for_rows_of_any_width_the_kernel_takes(monkeypatch):
    from kkdeploy import TransformerConfig
    from kkdeploy.kernels import model_proofs

    monkeypatch.setattr(ln, "kernel_refusal", lambda device: None)
    wide = TransformerConfig(batch_size=2, seq_len=8, d_model=384, num_heads=6, ffn_dim=768, num_layers=1)
    assert model_proofs._refusal("layer_norm", wide, torch.float16, torch.device("cuda")) is None  # block4 proves it
    narrow = replace(wide, d_model=128, num_heads=4)
    assert model_proofs._refusal("layer_norm", narrow, torch.float16, torch.device("cuda")) is None
    odd = replace(wide, d_model=130, num_heads=2)
    assert "multiple of 4" in model_proofs._refusal("layer_norm", odd, torch.float16, torch.device("cuda"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_final_layer_norm_op_is_the_references_final_step_bit_for_bit_on_the_cpu(dtype):
    """``layer_norm_rows_zero_invalid`` is ``ReferenceTransformer.final``: ATen's layer_norm, then the invalid tokens'
    rows +0 (a NaN row too), valid rows untouched; its schema and fake kernel pass opcheck."""
    from kkdeploy.models.reference import zero_invalid_rows

    g = torch.Generator().manual_seed(3)
    x = (torch.randn(3, 6, 64, generator=g) * 5 + 2).to(dtype)
    x[1, 4] = float("nan")
    w, b = torch.randn(64, generator=g).to(dtype), torch.randn(64, generator=g).to(dtype)
    mask = torch.ones(3, 6, dtype=torch.bool)
    mask[1, 3:] = False
    mask[2, 5] = False
    op = torch.ops.kkdeploy_faithful.layer_norm_rows_zero_invalid
    got = op(x, [64], w, b, 1e-5, mask)
    expected = zero_invalid_rows(F.layer_norm(x, (64,), w, b, 1e-5), mask)
    assert torch.equal(got, expected) and not got[1, 4].isnan().any()
    assert torch.equal(got[~mask].view(torch.int16 if dtype != torch.float32 else torch.int32),
                       torch.zeros_like(got[~mask].view(torch.int16 if dtype != torch.float32 else torch.int32)))
    torch.library.opcheck(op.default, (x, [64], w, b, 1e-5, mask))


@pytest.mark.parametrize("mask, message", [
    (torch.ones(2, 5, dtype=torch.uint8), "valid_token_mask must have dtype torch.bool, got torch.uint8"),
    (torch.ones(5, dtype=torch.bool), "valid_token_mask must have shape [B, S] = [2, 5], got [5]"),
])
def test_a_mask_that_does_not_fit_the_rows_is_refused_in_one_line(mask, message):
    """The final LayerNorm's op checks its mask as every kkdeploy call does (``inputs.check_mask``): a misshapen one
    is a one-line error, never broadcast by masked_fill into a silently wrong answer."""
    x = torch.zeros(2, 5, 32)
    with pytest.raises(KKError, match=message.replace("[", r"\[").replace("]", r"\]")):
        torch.ops.kkdeploy_faithful.layer_norm_rows_zero_invalid(x, [32], torch.ones(32), torch.zeros(32), 1e-5,
                                                                  mask)


def test_the_final_norm_proof_cases_run_the_launch_masked(monkeypatch):
    """Where builds take the masked final LayerNorm, the proof of a LayerNorm op shape holds the final norm's cases
    with the reference's zero_invalid_rows after it, and runs each launch masked on them: a launch proven there is
    proven masked and plain."""
    from kkdeploy import TransformerConfig
    from kkdeploy.kernels import model_proofs
    from kkdeploy.models.weights import build_models

    calls = []

    def fake_kernel(x, weight, bias, eps, rows_per_warp=ln.DEFAULT_ROWS_PER_WARP, valid=None):
        calls.append((rows_per_warp, valid))
        out = F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
        return out if valid is None else out.masked_fill(~valid[..., None], 0)

    monkeypatch.setattr(ln, "layer_norm_rows_kernel", fake_kernel)
    config = TransformerConfig(batch_size=2, seq_len=8, d_model=32, num_heads=2, ffn_dim=64, num_layers=2)
    model = build_models(config, torch.float32, "cpu")[0]
    for case in model_proofs._Cases(model, config, torch.float32, torch.device("cpu"), 1234).layer_norm():
        case.run("rows2")  # until builds take the masked final norm (MASKED_FINAL), every case is plain
    assert all(valid is None for _, valid in calls)
    monkeypatch.setattr(ln, "MASKED_FINAL", True)
    cases = model_proofs._Cases(model, config, torch.float32, torch.device("cpu"), 1234).layer_norm()
    finals = [c for c in cases if c.label.endswith("final_norm")]
    assert [c.label for c in finals] == ["all-valid, final_norm", "padded 0.25, final_norm"]
    padded = finals[1]
    reference = padded.reference()
    invalid = (reference == 0).all(dim=-1)
    assert invalid.any() and not invalid.all()  # the padded tokens' rows are the reference's zeros
    assert torch.equal(padded.run("rows2_full"), reference)
    assert calls[-1][0] == ln.LAUNCHES["rows2_full"] and torch.equal(~calls[-1][1], invalid)
    others = [c for c in cases if not c.label.endswith("final_norm")]
    others[0].run("rows2")
    assert calls[-1][1] is None  # norm1, norm2 and the random cases stay plain


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH on this machine")
def test_the_masked_launches_have_their_plain_forms_arithmetic_and_write_zeros(tmp_path):
    """Compiled to PTX for sm_90 with the build's flags: each masked kernel (rows2, rows2_full, rows2_full_early; plain
    and dependent) has its plain form's floating-point instructions, as many of each and in its order; it reads its
    row's flag before the first shuffle (in flight with the row); and it has a store of zeros its plain form lacks.
    Every plain kernel's PTX is as before (``rows2_full_early``'s test and the proofs' keys rely on that)."""
    import collections
    import re

    from kkdeploy.kernels.dependent_launch import arithmetic_opcodes
    from tests.conftest import layer_norm_ptx_entries

    kernels = layer_norm_ptx_entries(tmp_path)
    floating = lambda body: [op for op in arithmetic_opcodes(body) if not op.startswith(("mov", "ld.param"))]  # noqa
    pairs = [("rows2", "rows2_masked")] + [(f"rows2_full{early}{n}", f"rows2_full{early}_masked{n}")
                                          for early in ("", "_early") for n in (16, 32, 64, 128)]
    for plain, masked in pairs:
        for mode in ("plain", "pdl"):
            a, b = kernels[f"{plain}<{mode}>"], kernels[f"{masked}<{mode}>"]
            assert floating(b) == floating(a), (masked, mode)
            assert collections.Counter(arithmetic_opcodes(b)) == collections.Counter(arithmetic_opcodes(a))
            assert re.search(r"ld\.global(\.nc)?\.u8", b[:b.index("shfl.sync")]), (masked, mode)
            zero_stores = re.findall(r"st\.global\.v2\.u32\s+\[[^]]+\], \{(%r\d+), \1\};", b)
            assert zero_stores and all(re.search(rf"mov\.(b|u)32\s+{r}, 0;", b) for r in zero_stores), (masked, mode)
            assert "st.global.v2.u32" not in a, (plain, mode)
            assert ("griddepcontrol.wait" in b) == (mode == "pdl")
    assert not any("_masked" in name for name in kernels if name.startswith(("rows<", "block4")))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH on this machine")
def test_the_masked_entry_refuses_what_it_cannot_launch_in_one_line(tmp_path):
    """The C entry's checks run on the host before any launch, so a library built here answers them without a GPU:
    a launch without a masked form, a width rows2_full does not take, rows past one warp, no mask; and both entries a
    misaligned buffer."""
    import ctypes

    from kkdeploy.kernels.cuda_build import NVCC_FLAGS, gencode

    so = tmp_path / "k.so"
    proc = subprocess.run(["nvcc", *NVCC_FLAGS, "-shared", "-gencode", gencode("sm_90"), str(ln.SOURCE), "-o",
                           str(so)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lib = ctypes.CDLL(str(so))
    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.kk_layer_norm_last_error.restype = ctypes.c_char_p
    lib.kk_layer_norm_rows_masked_f16.argtypes = [vp, vp, vp, vp, vp, i64, i64, ctypes.c_float, ctypes.c_int,
                                                  ctypes.c_int, vp]
    aligned, mask = 4096, 8192

    def call(n, rows_per_warp, valid=mask):
        rc = lib.kk_layer_norm_rows_masked_f16(aligned, aligned, aligned, valid, aligned, 64, n, 1e-5, rows_per_warp,
                                               0, None)
        return rc, lib.kk_layer_norm_last_error().decode()

    for rows_per_warp, n in ((1, 128), (4, 128), (5, 128), (3, 96), (6, 48)):
        rc, error = call(n, rows_per_warp)
        assert rc == 1 and "masked launches are rows2 (rows_per_warp 2)" in error, (rows_per_warp, n)
    assert "rows of 4..128 elements" in call(256, 2)[1]
    assert "no valid-token mask" in call(128, 3, valid=None)[1]
    lib.kk_layer_norm_rows_f16.argtypes = [vp, vp, vp, vp, i64, i64, ctypes.c_float, ctypes.c_int, ctypes.c_int, vp]
    for entry, args in ((lib.kk_layer_norm_rows_masked_f16, (aligned, aligned, aligned + 4, mask, aligned)),
                        (lib.kk_layer_norm_rows_f16, (aligned, aligned, aligned + 4, aligned))):  # bias misaligned
        assert entry(*args, 64, 128, 1e-5, 3, 0, None) == 1
        assert "buffers must be 8-byte aligned" in lib.kk_layer_norm_last_error().decode()
    assert lib.kk_layer_norm_rows_masked_f16(None, None, None, None, None, 0, 128, 1e-5, 1, 0, None) == 0  # no rows

"""kkdeploy.kernels.block_softmax on the CPU: ATen's kernel choice and element order for long rows, the
emulation, the cut property that lets shape 14 skip masked keys, the reference composition, and that the CUDA
kernel compiles with nvcc (its bitwise equality is the GPU self-test's: scripts/block_softmax_selftest.py)."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

from kkdeploy.errors import KKError
from kkdeploy.kernels import block_softmax as bs


@pytest.mark.parametrize("length, expected", [(1028, ("smem", 0)), (4096, ("smem", 0)), (12252, ("smem", 0)),
                                              (12256, ("regular", 12256 - 8192)), (16384, ("regular", 0)),
                                              (100000, ("regular", 100000 - 24 * 4096))])
def test_kernel_choice_follows_atens_host_code(length, expected):
    # Smem while the row fits 48 KiB minus one float per warp: (49152 - 32 * 4) / 4 = 12256 floats (strictly less).
    assert bs.block_softmax_layout(length) == expected


def test_rows_the_description_does_not_cover_are_refused_in_one_line():
    for length, message in ((1024, "warp softmax"), (12255, "not a multiple of 4")):
        with pytest.raises(KKError, match=message) as info:
            bs.block_softmax_layout(length)
        assert "\n" not in str(info.value)


@pytest.mark.parametrize("length", [4100, 12256, 100000])
def test_every_element_belongs_to_one_thread_in_atens_order(length):
    order = bs.thread_order(length)
    owned = order[order >= 0]
    assert owned.numel() == length and torch.equal(owned.sort().values, torch.arange(length))
    assert order[5, :4].tolist() == [20, 21, 22, 23]  # thread 5: vector 5 first ...
    if length > 8192:
        assert order[5, 4:8].tolist() == [4116, 4117, 4118, 4119]  # ... then vector 5 + 1024
    kind, tail = bs.block_softmax_layout(length)
    if tail:  # the regular kernel's scalar tail: element main_end + t + 1024 i goes to thread t
        main_end = length - tail
        steps = -(-tail // bs.THREADS)  # ceil
        tail_part = order[:, -steps:]
        assert tail_part[7, 0].item() == main_end + 7
        assert tail_part[7, 1].item() == (main_end + 7 + 1024 if tail > 1024 + 7 else -1)


def test_emulation_is_a_softmax():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(6, 5000, generator=g) * 4).half().float()
    x[:3, 2500:] = float("-inf")
    y = bs.emulate_block_softmax(x)
    torch.testing.assert_close(y, torch.softmax(x, dim=-1), rtol=2e-6, atol=1e-9)
    torch.testing.assert_close(y.sum(-1), torch.ones(6), rtol=1e-5, atol=0)
    assert (y[:3, 2500:] == 0).all()
    with pytest.raises(KKError, match="float32"):
        bs.emulate_block_softmax(x.half())


@pytest.mark.parametrize("length, cut", [(100000, 4096), (100000, 49152), (20000, 8192), (12256, 4096)])
def test_a_row_cut_at_a_multiple_of_4096_keys_is_bitwise_the_full_row(length, cut):
    """The property shape 14's skip rests on: every thread keeps its elements (minus trailing -inf ones)."""
    g = torch.Generator().manual_seed(length + cut)
    x = (torch.randn(3, length, generator=g) * 4).half().float()
    x[:, cut:] = float("-inf")
    full = bs.emulate_block_softmax(x)
    short = bs.emulate_block_softmax(x[:, :cut].contiguous())
    assert torch.equal(full[:, :cut], short) and (full[:, cut:] == 0).all()


def test_causal_softmax_on_the_cpu_is_the_reference_composition_and_checks_its_arguments():
    g = torch.Generator().manual_seed(3)
    raw = (torch.randn(2 * 8, 4096, generator=g) * 20).half()
    out = bs.causal_block_softmax(raw, 0.125, 6000, first_query=4000, queries=8)
    manual = torch.full((16, 6000), float("-inf"), dtype=torch.float16)
    manual[:, :4096] = raw * 0.125
    query = 4000 + torch.arange(16) % 8
    manual = manual.masked_fill(torch.arange(6000)[None, :] > query[:, None], float("-inf"))
    assert torch.equal(out, torch.softmax(manual.float(), -1).half()[:, :4096])
    assert torch.equal(out, bs.reference_causal_softmax(raw, 0.125, 6000, 4000, 8))
    with pytest.raises(KKError, match="must hold every visible key"):
        bs.causal_block_softmax(raw[:, :2048].contiguous(), 0.125, 6000, first_query=4000, queries=8)
    with pytest.raises(KKError, match="float16 scores"):
        bs.causal_block_softmax(raw.float(), 0.125, 6000, first_query=4000, queries=8)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH on this machine")
def test_the_cuda_kernel_compiles_for_hopper_with_nvcc_defaults(tmp_path):
    from kkdeploy.kernels.cuda_build import NVCC_FLAGS, gencode

    cmd = ["nvcc", *NVCC_FLAGS, "-gencode", gencode("sm_90"), "-c", str(bs.SOURCE), "-o", str(tmp_path / "k.o")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not any("fast" in f for f in NVCC_FLAGS)


def test_the_gpu_selftest_says_it_needs_a_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the script would run")
    from tests.conftest import load_script

    assert load_script("block_softmax_selftest").main([]) == 2
    assert capsys.readouterr().err.strip() == "block_softmax_selftest: needs a CUDA GPU"


def test_the_kernel_is_a_custom_op_whose_cpu_kernel_is_the_composition():
    """One opaque op with a fake kernel (torch.compile and FX see one node); on the CPU it is the reference."""
    g = torch.Generator().manual_seed(8)
    raw = (torch.randn(2 * 4, 12288, generator=g) * 20).half()
    args = (raw, 0.125, 13000, 12000, 4, True, bs.DEFAULT_SMEM_PER_BLOCK)
    torch.library.opcheck(torch.ops.kkdeploy_faithful.causal_block_softmax.default, args)
    assert torch.equal(torch.ops.kkdeploy_faithful.causal_block_softmax(*args),
                       bs.reference_causal_softmax(raw, 0.125, 13000, 12000, 4))


def test_the_fast_path_needs_a_loadable_kernel_and_a_proof_here(monkeypatch, tmp_path):
    """Where the kernel cannot be built (no nvcc), the long-context default falls back to full key rows and
    ATen's ops (the reference's bits), and says why; where it can, it still runs only once a proof made in this
    environment found a bit-identical launch for the op shape."""
    from kkdeploy.kernels import cuda_build, proof
    from kkdeploy.models.long_context import resolve_tiled_settings

    monkeypatch.setenv("KKDEPLOY_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "Test GPU")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(bs, "_load", lambda device: (_ for _ in ()).throw(KKError("no nvcc here")))
    cuda_build.load_problem.cache_clear()
    proof._kernel_environment.cache_clear()
    proof.forget_proofs()
    try:
        reason = bs.fast_path_reason("cuda", torch.float16, 100000, 2048)
        assert reason == "the block-softmax kernel cannot be built or loaded here (no nvcc here)"
        assert resolve_tiled_settings("auto", "auto", "cuda", torch.float16, 100000, 2048) == ("full", "aten")
        monkeypatch.setattr(bs, "_load", lambda device: object())
        cuda_build.load_problem.cache_clear()
        assert bs.fast_path_reason("cuda", torch.float16) is None  # the kernel can run here...
        assert "no proof in this environment" in bs.fast_path_reason("cuda", torch.float16, 100000, 2048)
        assert resolve_tiled_settings("auto", "auto", "cuda", torch.float16, 100000, 2048) == ("full", "aten")
        record = proof.ProofRecord(op=bs.OP, shape=bs.proof_shape(100000, 2048),
                                   environment=bs.proof_environment("cuda"), chosen="raw-max", reason="test")
        proof.remember_proof(record)  # ...and may, once proven
        assert bs.proven_launch("cuda", torch.float16, 100000, 2048) == "raw-max"
        assert resolve_tiled_settings("auto", "auto", "cuda", torch.float16, 100000, 2048) == ("aligned",
                                                                                                 "block-kernel")
        assert bs.proven_launch("cuda", torch.float16, 100000, 4096) is None  # another op shape: not proven
        proof.forget_proofs()  # a new process of the same environment finds it on disk
        assert bs.proven_launch("cuda", torch.float16, 100000, 2048) == "raw-max"
    finally:
        cuda_build.load_problem.cache_clear()
        proof._kernel_environment.cache_clear()
        proof.forget_proofs()


def test_padded_rows_mask_keys_past_each_sequence_for_every_query():
    """With ``lengths``, the composition masks keys at or past each sequence's length in every row, valid query
    or not, exactly as the reference masks invalid keys; the CPU op is that composition."""
    g = torch.Generator().manual_seed(11)
    heads, queries, row_len, width = 2, 4, 13000, 12288
    raw = (torch.randn(2 * heads * queries, width, generator=g) * 20).half()
    lengths = torch.tensor([12001, 9000])
    out = bs.causal_block_softmax(raw, 0.125, row_len, 12000, queries, lengths=lengths,
                                  rows_per_sequence=heads * queries)
    manual = torch.full((raw.shape[0], row_len), float("-inf"), dtype=torch.float16)
    manual[:, :width] = raw * 0.125
    query = 12000 + torch.arange(raw.shape[0]) % queries
    valid = lengths[torch.arange(raw.shape[0]) // (heads * queries)]
    keys = torch.arange(row_len)[None, :]
    manual = manual.masked_fill((keys > query[:, None]) | (keys >= valid[:, None]), float("-inf"))
    assert torch.equal(out, torch.softmax(manual.float(), -1).half()[:, :width])
    assert (out[heads * queries:, 9000:] == 0).all() and (out[:heads * queries, 12001:] == 0).all()
    with pytest.raises(KKError, match="one length per 4 rows"):
        bs.causal_block_softmax(raw, 0.125, row_len, 12000, queries, lengths=lengths, rows_per_sequence=4)
    narrow = raw[:, :9216].contiguous()  # keys past every length need not be stored, but keys before it must
    bs.causal_block_softmax(narrow[heads * queries:], 0.125, row_len, 12000, queries, lengths=lengths[1:],
                            rows_per_sequence=heads * queries)
    with pytest.raises(KKError, match="must hold every visible key"):
        bs.causal_block_softmax(narrow, 0.125, row_len, 12000, queries, lengths=lengths,
                                rows_per_sequence=heads * queries)
    with pytest.raises(KKError, match=r"launch must be one of exact, raw-max, markstein, raw-max\+markstein"):
        bs.causal_block_softmax(raw, 0.125, row_len, 12000, queries, launch="fast")


def test_a_cut_at_the_padding_regroups_atens_gpu_sums_and_a_4096_multiple_does_not():
    """Why padded calls cut only at 4096-key multiples (kkdeploy.models.long_context.key_end): in ATen's GPU order
    (emulated), a row cut where the padding starts moves elements between threads and changes probabilities, a row
    cut at the next multiple of 4096 leaves every thread its elements."""
    g = torch.Generator().manual_seed(21)
    length, padding_starts = 100000, 75123
    x = (torch.randn(4, length, generator=g) * 4).half().float()
    x[:, padding_starts:] = float("-inf")
    full = bs.emulate_block_softmax(x)
    aligned = -(-padding_starts // bs.CHUNK) * bs.CHUNK
    assert torch.equal(bs.emulate_block_softmax(x[:, :aligned].contiguous()), full[:, :aligned])
    at_padding = bs.emulate_block_softmax(x[:, :padding_starts + 1].contiguous())  # not a multiple of 4
    assert not torch.equal(at_padding, full[:, :padding_starts + 1])

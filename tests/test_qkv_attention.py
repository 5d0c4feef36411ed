"""kkdeploy.kernels._qkv_attention_triton: the attention with its Q, K and V projections in one launch (a study).

Its claim is that it computes what the two launches a build runs now compute: the packed Q|K|V GEMM tile, then the
register-cached attention launch. Under Triton's interpreter (CPU) the launch is checked against exactly those two
launches, bit for bit, on causal and non-causal rows, padded and not, head dims of 8 to 32, D not a power of two;
on a GPU ``scripts/qkv_attention_study.py`` counts its bits against ATen's composition. The refusals are one line.
"""

from __future__ import annotations

import textwrap

import pytest

from tests.conftest import run_interpreter_script

INTERPRETER_SCRIPT = textwrap.dedent(
    """
    import json
    import torch
    from kkdeploy.kernels._fused_linear_triton import triton_linear
    from kkdeploy.kernels._faithful_attention_triton import triton_attention
    from kkdeploy.kernels._qkv_attention_triton import triton_qkv_attention

    g = torch.Generator().manual_seed(0)
    results = []
    for b, s, d, heads, causal, padded in [(2, 128, 128, 4, True, True), (1, 80, 64, 2, False, True),
                                           (3, 32, 128, 4, True, False), (2, 17, 32, 4, True, True),
                                           (1, 100, 96, 3, True, True), (1, 65, 64, 4, True, False)]:
        # h and the weights on grids whose products and sums are exact in float32: the interpreter's dots then
        # agree whatever their tile, and the softmax inputs are spread out
        h = torch.randint(-16, 17, (b, s, d), generator=g).half() / 16
        ws = [torch.randint(-8, 9, (d, d), generator=g).half() / 64 for _ in range(3)]
        bs = [torch.randn(d, generator=g).half() for _ in range(3)]
        mask = None
        if padded:
            lengths = torch.randint(max(1, s // 2), s + 1, (b,), generator=g)
            mask = torch.arange(s)[None, :] < lengths[:, None]
        q, k, v = triton_linear(h, torch.cat(ws), torch.cat(bs)).split(d, dim=-1)
        two = triton_attention(q, k, v, mask, heads, causal, cached=True, block_m=64, num_warps=4, fast_div=True)
        one = triton_qkv_attention(h, ws, bs, mask, heads, causal)
        results.append(dict(case=[b, s, d, heads, causal, padded], elements=two.numel(),
                            differing=int((one.view(torch.int16) != two.view(torch.int16)).sum()),
                            finite=bool(torch.isfinite(one).all())))
    print("RESULTS " + json.dumps(results))
    """
)


def test_one_launch_equals_the_two_it_replaces_under_the_interpreter():
    results = run_interpreter_script(INTERPRETER_SCRIPT)
    assert len(results) == 6
    for r in results:
        assert r["differing"] == 0, r
        assert r["finite"], r


@pytest.mark.parametrize("s, d, heads, fragment", [
    (16, 128, 4, "takes 17 to 128 keys"),
    (129, 128, 4, "takes 17 to 128 keys"),
    (64, 130, 4, "does not split into 4 heads"),
    (64, 512, 2, "head dims up to 128"),
])
def test_refusals_name_the_limit(s, d, heads, fragment):
    pytest.importorskip("triton")
    from kkdeploy.kernels._qkv_attention_triton import qkv_attention_refusal

    refusal = qkv_attention_refusal(s, d, heads)
    assert refusal is not None and fragment in refusal and "\n" not in refusal
    assert qkv_attention_refusal(128, 128, 4) is None


def test_launcher_refuses_wrong_weights_in_one_line():
    pytest.importorskip("triton")
    import torch

    from kkdeploy.errors import KKError
    from kkdeploy.kernels._qkv_attention_triton import triton_qkv_attention

    h = torch.zeros(1, 32, 64, dtype=torch.float16)
    w = torch.zeros(64, 64, dtype=torch.float16)
    bias = torch.zeros(64, dtype=torch.float16)
    with pytest.raises(KKError, match="three float16"):
        triton_qkv_attention(h, [w, w, w[:32]], [bias] * 3, None, 4, True)
    with pytest.raises(KKError, match="takes 17 to 128 keys"):
        triton_qkv_attention(torch.zeros(1, 8, 64, dtype=torch.float16), [w] * 3, [bias] * 3, None, 4, True)
    with pytest.raises(KKError, match="float16"):
        triton_qkv_attention(h.float(), [w] * 3, [bias] * 3, None, 4, True)


def test_compiled_for_sm90_it_runs_the_cached_launchs_tiles_and_a_pdl_form_of_the_same_arithmetic():
    """Compiled here for sm_90a (``scripts/offline_ptx.py``, this Triton): every dot is a 64-row wgmma tile of the
    cached launch's own shape (m64n32k16 at Dh = 32), the exps are as many as the cached launch's (one per score,
    each chunk taken once), and the dependent-launch form adds only the two griddepcontrol instructions."""
    pytest.importorskip("triton")
    import re

    from kkdeploy.kernels.dependent_launch import ptx_difference
    from tests.conftest import load_script

    script = load_script("offline_ptx")
    values = script.KERNELS["qkv_attention"][3]
    plain = script.compile_ptx("qkv_attention", values, 4, 3)
    cached = script.compile_ptx("attention", {**script.KERNELS["attention"][3], "NCACHED": 4, "FAST_DIV": True}, 4,
                                3)
    shapes = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", plain))
    assert shapes == set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", cached)) == {"m64n32k16"}
    assert len(re.findall(r"ex2\.approx", plain)) == len(re.findall(r"ex2\.approx", cached))
    assert "mma.sync" not in plain
    assert ptx_difference(plain, script.compile_ptx("qkv_attention", {**values, "PDL": True}, 4, 3)) == []

"""Foundation: config, generator, reference semantics, optimized model, strict rule."""

import math

import pytest
import torch
import torch.nn.functional as F

from kkdeploy import (OFFICIAL_SHAPES, OptimizedTransformer, ReferenceTransformer, TransformerConfig,
                      generate_case, official_config)
from kkdeploy.errors import KKError
from kkdeploy.models.weights import init_weights, load_weights, weights_sha256
from validation import CONTRACTS, compare_outputs

from .conftest import SMALL, SMALL_NONCAUSAL, models_for

STRICT = CONTRACTS["strict"]


# -- config and shapes -------------------------------------------------------------------
def test_official_table_matches_design():
    expected = {1: (64, 128, 128, 4, 128, 4), 2: (1, 128, 128, 4, 128, 4), 3: (4, 128, 128, 4, 128, 4),
                4: (16, 128, 128, 4, 128, 4), 5: (128, 128, 128, 4, 128, 4), 6: (10000, 128, 128, 4, 128, 4),
                7: (64, 128, 32, 4, 32, 4), 8: (64, 128, 1024, 4, 1024, 4), 9: (64, 128, 128, 1, 128, 4),
                10: (64, 128, 128, 2, 128, 4), 11: (64, 128, 128, 16, 128, 4), 12: (64, 32, 128, 4, 128, 4),
                13: (64, 1024, 128, 4, 128, 4), 14: (32, 100000, 1024, 16, 1024, 2)}
    assert sorted(OFFICIAL_SHAPES) == list(range(1, 15))
    for sid, dims in expected.items():
        c = official_config(sid)
        assert (c.batch_size, c.seq_len, c.d_model, c.num_heads, c.ffn_dim, c.num_layers) == dims
        assert c.causal


@pytest.mark.parametrize("bad", [0, 15, "x", None])
def test_unknown_shape_id(bad):
    with pytest.raises(KKError, match="unknown shape id"):
        official_config(bad)


@pytest.mark.parametrize("kwargs, match", [
    (dict(batch_size=1, seq_len=4, d_model=30, num_heads=4, ffn_dim=8, num_layers=1), "not divisible"),
    (dict(batch_size=0, seq_len=4, d_model=32, num_heads=4, ffn_dim=8, num_layers=1), "batch_size must be a positive"),
    (dict(batch_size=1, seq_len=-4, d_model=32, num_heads=4, ffn_dim=8, num_layers=1), "seq_len must be a positive"),
    (dict(batch_size=1, seq_len=4, d_model=32, num_heads=4, ffn_dim=8, num_layers=1.5), "num_layers must be"),
])
def test_config_validation(kwargs, match):
    with pytest.raises(KKError, match=match):
        TransformerConfig(**kwargs)


# -- generator ---------------------------------------------------------------------------
def test_generator_reproducible_and_matches_recipe():
    x1, m1 = generate_case(SMALL, "cpu", torch.float32, 7)
    x2, m2 = generate_case(SMALL, "cpu", torch.float32, 7)
    assert torch.equal(x1, x2) and torch.equal(m1, m2) and bool(m1.all())
    g = torch.Generator().manual_seed(7)
    assert torch.equal(x1, torch.randn(3, 16, 32, generator=g))
    x3, _ = generate_case(SMALL, "cpu", torch.float32, 8)
    assert not torch.equal(x1, x3)


def test_generator_padding_recipe_and_zeroing():
    config = TransformerConfig(64, 20, 8, 2, 8, 1)
    x, mask = generate_case(config, "cpu", torch.float32, 3, padding_ratio=0.25, input_scale=2.0)
    g = torch.Generator().manual_seed(3)
    raw = torch.randn(64, 20, 8, generator=g) * 2.0
    min_valid = max(1, round(20 * 0.75))
    lengths = torch.randint(min_valid, 21, (64,), generator=g)
    assert torch.equal(mask.sum(1), lengths)
    assert int(lengths.min()) >= min_valid and int(lengths.max()) <= 20
    assert not bool(mask.all())
    assert torch.equal(x[~mask], torch.zeros_like(x[~mask]))
    assert torch.equal(x[mask], raw[mask])
    # masks are prefixes: valid tokens first
    assert torch.equal(mask, torch.arange(20)[None] < lengths[:, None])


# -- reference semantics -----------------------------------------------------------------
@pytest.fixture(scope="module")
def ref_model():
    return init_weights(ReferenceTransformer(SMALL), 0).eval()


def test_causality(ref_model):
    x, _ = generate_case(SMALL, "cpu", torch.float32, 1)
    t = 9
    y = ref_model(x)
    x2 = x.clone()
    x2[:, t + 1:] = torch.randn_like(x2[:, t + 1:]) * 5
    y2 = ref_model(x2)
    assert torch.equal(y[:, :t + 1], y2[:, :t + 1])
    assert not torch.equal(y[:, t + 1:], y2[:, t + 1:])


def test_padding_semantics(ref_model):
    x, mask = generate_case(SMALL, "cpu", torch.float32, 2, padding_ratio=0.4)
    assert not bool(mask.all())
    y = ref_model(x, mask)
    assert bool((y[~mask] == 0).all())
    garbage = x.clone()
    garbage[~mask] = torch.randn_like(garbage[~mask]) * 100
    y2 = ref_model(garbage, mask)
    assert torch.equal(y[mask], y2[mask])
    assert bool((y2[~mask] == 0).all())


def test_non_causal_sees_the_future():
    model = init_weights(ReferenceTransformer(SMALL_NONCAUSAL), 0).eval()
    x, _ = generate_case(SMALL_NONCAUSAL, "cpu", torch.float32, 1)
    x2 = x.clone()
    x2[:, -1] += 1.0
    assert not torch.equal(model(x)[:, 0], model(x2)[:, 0])


def test_exact_erf_gelu(ref_model):
    """The block's FFN must equal an erf GELU built by hand and differ from the tanh form."""
    layer = ref_model.layers[0]
    h = torch.randn(2, 16, 32) * 3
    inner = layer.ffn_in(layer.norm2(h))
    erf = layer.ffn_out(inner * 0.5 * (1 + torch.erf(inner / math.sqrt(2))))
    tanh = layer.ffn_out(F.gelu(inner, approximate="tanh"))
    got = layer.feed_forward(h)
    assert compare_outputs(erf, got, 1e-6, 1e-6).passed
    assert (got - tanh).abs().max() > 1e-5


# -- optimized model ---------------------------------------------------------------------
@pytest.mark.parametrize("config", [SMALL, SMALL_NONCAUSAL], ids=["causal", "noncausal"])
@pytest.mark.parametrize("sdpa_layers, dtype", [
    (0, torch.float32), (1, torch.float32), (2, torch.float32),
    # FP16 with SDPA is not strict-safe by construction (design.md §6; on this CPU one element of
    # 1536 fails with sdpa_layers=1 on an unmasked padded input): how many layers may use it is
    # calibrated per shape by validation, so only the reference order is asserted here.
    (0, torch.float16),
])
@pytest.mark.parametrize("padding", [0.0, 0.3])
def test_optimized_matches_reference(config, sdpa_layers, padding, dtype):
    ref, opt = models_for(config, dtype=dtype, sdpa_layers=sdpa_layers)
    with torch.inference_mode():
        for seed in range(3):
            x, mask = generate_case(config, "cpu", dtype, seed, padding_ratio=padding)
            report = compare_outputs(ref(x, mask), opt(x, mask), *STRICT)
            assert report.passed, report.summary()
            report = compare_outputs(ref(x), opt(x), *STRICT)
            assert report.passed, report.summary()


@pytest.mark.parametrize("sdpa_layers", [1, 2])
def test_fp16_padded_calls_are_bitwise_reference(sdpa_layers):
    ref, opt = models_for(SMALL, dtype=torch.float16, sdpa_layers=sdpa_layers)
    with torch.inference_mode():
        for seed in range(3):
            x, mask = generate_case(SMALL, "cpu", torch.float16, seed, padding_ratio=0.3)
            assert torch.equal(ref(x, mask), opt(x, mask))


def test_optimized_takes_fused_path_only_when_allowed(monkeypatch):
    ref, opt = models_for(SMALL, sdpa_layers=1)
    calls = []
    monkeypatch.setattr(opt, "fast_forward", lambda x: calls.append("fast") or ref(x))
    x, mask = generate_case(SMALL, "cpu", torch.float32, 0, padding_ratio=0.3)
    with torch.no_grad():
        opt(x, mask)
        assert calls == []
        opt(x, torch.ones_like(mask))
        assert calls == ["fast"]
    opt(x)  # gradients enabled: reference path
    assert calls == ["fast"]


def test_mask_cache_sees_in_place_mutation():
    _, opt = models_for(SMALL)
    mask = torch.ones(3, 16, dtype=torch.bool)
    assert opt.mask_is_all_valid(mask)
    mask[1, 5:] = False
    assert not opt.mask_is_all_valid(mask)
    mask.fill_(True)
    assert opt.mask_is_all_valid(mask)


def test_mask_cache_never_caches_inference_tensors():
    _, opt = models_for(SMALL)
    with torch.inference_mode():
        mask = torch.ones(3, 16, dtype=torch.bool)
        assert opt.mask_is_all_valid(mask)
        mask[0, 3:] = False
        assert not opt.mask_is_all_valid(mask)
    assert not opt._mask_cache.cached


def test_optimized_padded_results_after_mask_mutation():
    ref, opt = models_for(SMALL)
    x, _ = generate_case(SMALL, "cpu", torch.float32, 0)
    mask = torch.ones(3, 16, dtype=torch.bool)
    with torch.no_grad():
        opt(x, mask)
        mask[2, 10:] = False
        assert compare_outputs(ref(x, mask), opt(x, mask), *STRICT).passed
        assert bool((opt(x, mask)[2, 10:] == 0).all())


def test_repack_after_weight_mutation_and_load_state_dict():
    ref, opt = models_for(SMALL, sdpa_layers=2)
    x, _ = generate_case(SMALL, "cpu", torch.float32, 0)
    with torch.no_grad():
        opt(x)
        with torch.no_grad():
            opt.layers[1].attention.k_proj.weight.mul_(1.5)
            ref.layers[1].attention.k_proj.weight.mul_(1.5)
        assert compare_outputs(ref(x), opt(x), *STRICT).passed
        other = init_weights(ReferenceTransformer(SMALL), 5)
        opt.load_state_dict(other.state_dict())
        assert compare_outputs(other(x), opt(x), *STRICT).passed
        w, b = opt.packed_qkv(0)
        a = other.layers[0].attention
        assert torch.equal(w, torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]))
        assert torch.equal(b, torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]))


def test_repack_after_dtype_move():
    ref, opt = models_for(SMALL, sdpa_layers=1)
    x, _ = generate_case(SMALL, "cpu", torch.float32, 0)
    with torch.no_grad():
        opt(x)
        opt.half()
        ref.half()
        assert opt.packed_qkv(1)[0].dtype == torch.float16
        assert compare_outputs(ref(x.half()), opt(x.half()), *STRICT).passed


def test_state_dict_round_trips_both_ways():
    ref = init_weights(ReferenceTransformer(SMALL), 3)
    opt = OptimizedTransformer(SMALL, sdpa_layers=1)
    opt.load_state_dict(ref.state_dict(), strict=True)
    back = ReferenceTransformer(SMALL)
    back.load_state_dict(opt.state_dict(), strict=True)
    assert weights_sha256(back) == weights_sha256(ref)
    names = set(ref.state_dict())
    assert {"layers.0.norm1.weight", "layers.1.attention.q_proj.bias", "layers.0.ffn_out.weight",
            "final_norm.bias"} <= names


def test_sdpa_layers_bounds():
    with pytest.raises(KKError, match="sdpa_layers"):
        OptimizedTransformer(SMALL, sdpa_layers=3)


# -- weights files -----------------------------------------------------------------------
def test_weights_files_round_trip_and_mismatch(tmp_path):
    from safetensors.torch import save_file

    ref = init_weights(ReferenceTransformer(SMALL), 4)
    st = tmp_path / "w.safetensors"
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(st))
    pt = tmp_path / "w.pt"
    torch.save(ref.state_dict(), pt)
    for path in (st, pt):
        other = load_weights(ReferenceTransformer(SMALL), path)
        assert weights_sha256(other) == weights_sha256(ref)
    state = ref.state_dict()
    state.pop("final_norm.bias")
    state["extra.weight"] = torch.zeros(1)
    bad = tmp_path / "bad.pt"
    torch.save(state, bad)
    with pytest.raises(KKError, match=r"missing keys \['final_norm.bias'\].*unexpected keys \['extra.weight'\]"):
        load_weights(ReferenceTransformer(SMALL), bad)


# -- bad input ---------------------------------------------------------------------------
@pytest.mark.parametrize("make, match", [
    (lambda: (torch.randn(3, 16), None), r"x must have shape \[B, S, 32\]"),
    (lambda: (torch.randn(3, 16, 31), None), r"x must have shape"),
    (lambda: (torch.randn(3, 16, 32).double(), None), "dtype torch.float64"),
    (lambda: (torch.randn(3, 16, 32), torch.ones(3, 15, dtype=torch.bool)), r"valid_token_mask must have shape \[B, S\]"),
    (lambda: (torch.randn(3, 16, 32), torch.ones(3, 16)), "dtype torch.bool"),
    (lambda: (torch.randn(3, 16, 32), [[True] * 16] * 3), "bool torch.Tensor"),
])
def test_bad_calls_are_one_line_errors(ref_model, make, match):
    x, mask = make()
    with pytest.raises(KKError, match=match) as info:
        ref_model(x, mask)
    assert "\n" not in str(info.value)


# -- strict rule -------------------------------------------------------------------------
def test_strict_rule_examples():
    ref = torch.tensor([0.1])
    assert not compare_outputs(ref, torch.tensor([0.103]), *CONTRACTS["strict"]).passed
    assert not compare_outputs(ref, torch.tensor([0.103]), *CONTRACTS["judge"]).passed
    for bad in (float("nan"), float("inf")):
        r = compare_outputs(torch.tensor([1.0, 2.0]), torch.tensor([1.0, bad]), *STRICT)
        assert r.failed == 1 and r.nonfinite == 1
    assert not compare_outputs(torch.tensor([float("nan")]), torch.tensor([float("nan")]), *STRICT).passed
    # isclose accepts (|d| <= atol + rtol*|ref|) but the OR rule rejects
    ref, out = torch.tensor([0.05]), torch.tensor([0.05 + 0.0012])
    assert torch.isclose(out, ref, atol=0.001, rtol=0.01).all()
    assert not compare_outputs(ref, out, *STRICT).passed
    # each branch alone accepts
    assert compare_outputs(torch.tensor([0.0]), torch.tensor([0.0009]), *STRICT).passed
    assert compare_outputs(torch.tensor([10.0]), torch.tensor([10.09]), *STRICT).passed


def test_strict_report_fields():
    ref = torch.zeros(2, 3, 4)
    out = ref.clone()
    out[1, 2, 3] = 0.5
    out[0, 1, 1] = 0.01
    r = compare_outputs(ref, out, *STRICT)
    assert (r.total, r.failed) == (24, 2)
    assert r.worst_index == [1, 2, 3] and r.worst_reference == 0.0 and r.worst_candidate == 0.5
    assert r.failing_features == [1, 3] and r.failing_feature_count == 2
    assert r.max_abs == pytest.approx(0.5) and r.max_rel == float("inf")
    assert "FAIL failed 2/24" in r.summary()


def test_strict_rule_shape_mismatch():
    with pytest.raises(ValueError, match="differs"):
        compare_outputs(torch.zeros(2), torch.zeros(3), *STRICT)


def test_tf32_default_and_mode_restore_the_callers_setting():
    from kkdeploy.config import tf32_default, tf32_mode

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert tf32_default(cuda, torch.float32, "judge") is True  # the organizer's default
    assert tf32_default(cuda, torch.float32, "strict") is False
    assert tf32_default(cuda, torch.float32, "strict", requested=True) is True
    assert tf32_default(cuda, torch.float16, "judge", requested=True) is False  # float16 never uses TF32
    assert tf32_default(cpu, torch.float32, "judge") is False
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    with pytest.raises(RuntimeError):
        with tf32_mode(not before[0]):
            assert torch.backends.cuda.matmul.allow_tf32 is (not before[0])
            assert torch.backends.cudnn.allow_tf32 is (not before[0])
            raise RuntimeError("a failing build")
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == before

"""The validator: trial plan, Polygraphy glue, the reference-as-denominator rule, reports."""

import copy
import json
import math
from collections import OrderedDict

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from polygraphy.comparator import Comparator, SimpleCompareFunc

from kkdeploy.status import FAILED, PASSED, PASSED_ALL_VALID_ONLY
from kkdeploy import KKError, TransformerConfig, generate_case
from validation import (
    CallableRunner,
    StrictCompareFunc,
    TrialDataLoader,
    compare_outputs,
    model_input_metadata,
    trial_plan,
    validate_candidates,
)
from validation.polygraphy_glue import quiet_polygraphy

from .conftest import SMALL, models_for

ATOL, RTOL = 0.001, 0.01  # the strict contract


# -- trial plan ---------------------------------------------------------------------------------
def test_trial_plan_seeds_modes_and_inputs_match_the_generator():
    plan = trial_plan(SMALL, torch.float32, "cpu", seed=77, trials=3, padding_ratio=0.25)
    assert iter(plan) is plan  # lazy: a generator, not a list
    trials = list(plan)
    assert [(t.mode, t.index, t.seed) for t in trials] == [
        ("all-valid", 0, 77), ("all-valid", 1, 78), ("all-valid", 2, 79),
        ("padded", 0, 77), ("padded", 1, 78), ("padded", 2, 79),
    ]
    for t in trials:
        ratio = 0.25 if t.mode == "padded" else 0.0
        x, mask = generate_case(SMALL, "cpu", torch.float32, t.seed, padding_ratio=ratio)
        assert torch.equal(t.x, x) and torch.equal(t.mask, mask)
        assert t.mask.dtype == torch.bool and tuple(t.mask.shape) == (SMALL.batch_size, SMALL.seq_len)
        if t.mode == "all-valid":
            assert bool(t.mask.all())
        else:
            assert torch.count_nonzero(t.x[~t.mask]) == 0  # invalid rows zeroed
        assert list(t.feed_dict()) == ["x", "valid_token_mask"]
    padded = [t for t in trials if t.mode == "padded"]
    assert any(not bool(t.mask.all()) for t in padded)  # padding actually happened
    # min_valid = round(S * 0.75): no row is shorter than that
    assert all(int(t.mask.sum(1).min()) >= round(SMALL.seq_len * 0.75) for t in padded)


def test_trial_plan_rejects_bad_arguments_eagerly():
    with pytest.raises(KKError, match="trials"):
        trial_plan(SMALL, torch.float32, "cpu", trials=0)
    with pytest.raises(KKError, match="modes"):
        trial_plan(SMALL, torch.float32, "cpu", modes=("sideways",))
    with pytest.raises(KKError, match="padding_ratio"):
        trial_plan(SMALL, torch.float32, "cpu", padding_ratio=0.0)
    only_valid = list(trial_plan(SMALL, torch.float32, "cpu", trials=2, padding_ratio=0.0, modes=("all-valid",)))
    assert [t.mode for t in only_valid] == ["all-valid", "all-valid"]


# -- Polygraphy glue ----------------------------------------------------------------------------
def test_callable_runner_works_inside_polygraphys_comparator():
    reference, optimized = models_for(SMALL)
    meta = model_input_metadata(SMALL, torch.float32)
    runners = [CallableRunner(reference, "reference", meta), CallableRunner(optimized, "optimized", meta)]
    loader = TrialDataLoader(trial_plan(SMALL, torch.float32, "cpu", trials=2))
    compare = StrictCompareFunc(ATOL, RTOL)
    with quiet_polygraphy(), torch.inference_mode():
        results = Comparator.run(runners, data_loader=loader)
        accuracy = Comparator.compare_accuracy(results, compare_func=compare)
    assert [name for name, _ in results] == ["reference", "optimized"]
    for _, iterations in results:
        assert len(iterations) == 4  # 2 all-valid + 2 padded
        for it in iterations:
            assert isinstance(it["y"], torch.Tensor) and it.runtime is not None and it.runtime >= 0
    with torch.inference_mode():
        for i, t in enumerate(trial_plan(SMALL, torch.float32, "cpu", trials=2)):
            assert torch.equal(results[0][1][i]["y"], reference(t.x, t.mask))
    assert bool(accuracy)
    assert len(compare.reports) == 4 and all(r["y"].passed for r in compare.reports)


def _fixed_runner(name, value, meta):
    return CallableRunner(lambda x, mask: value.clone(), name, meta)


@pytest.mark.parametrize("ref_value,out_value,rule_passes", [
    (1.0, 1.0101, False),  # |d|/|ref| = 0.0101 > rtol, but |d|/|out| = 0.009999 <= rtol
    (1.0101, 1.0, True),  # |d|/|ref| = 0.009999 <= rtol, but |d|/|out| = 0.0101 > rtol
])
def test_compare_func_uses_the_reference_as_denominator(ref_value, out_value, rule_passes):
    config = TransformerConfig(1, 2, 4, 1, 4, 1)
    meta = model_input_metadata(config, torch.float32)
    ref = torch.full((1, 2, 4), ref_value, dtype=torch.float64)
    out = torch.full((1, 2, 4), out_value, dtype=torch.float64)
    assert compare_outputs(ref, out, ATOL, RTOL).passed is rule_passes  # design.md §5 directly
    feed = [OrderedDict(x=torch.zeros(1, 2, 4), valid_token_mask=torch.ones(1, 2, dtype=torch.bool))]
    with quiet_polygraphy():
        ref_first = Comparator.run([_fixed_runner("ref", ref, meta), _fixed_runner("out", out, meta)],
                                   data_loader=feed)
        ref_second = Comparator.run([_fixed_runner("out", out, meta), _fixed_runner("ref", ref, meta)],
                                    data_loader=feed)
        simple = SimpleCompareFunc(atol=ATOL, rtol=RTOL, check_error_stat="elemwise")
        # Polygraphy's simple rule divides by the second runner: right only when the reference is second.
        assert bool(Comparator.compare_accuracy(ref_second, compare_func=simple)) is rule_passes
        assert bool(Comparator.compare_accuracy(ref_first, compare_func=simple)) is not rule_passes
        # Ours follows §5 on either side, because it is told which side the reference is.
        ours_first = StrictCompareFunc(ATOL, RTOL, reference_side=0)
        ours_second = StrictCompareFunc(ATOL, RTOL, reference_side=1)
        assert bool(Comparator.compare_accuracy(ref_first, compare_func=ours_first)) is rule_passes
        assert bool(Comparator.compare_accuracy(ref_second, compare_func=ours_second)) is rule_passes
    assert ours_first.reports[0]["y"].failed == (0 if rule_passes else 8)
    assert ours_first.reports[0]["y"].worst_reference == pytest.approx(ref_value)


# -- the validator ------------------------------------------------------------------------------
def _strict_failures_numpy(ref: torch.Tensor, out: torch.Tensor) -> np.ndarray:
    """An independent implementation of design.md §5, to count what the validator should report."""
    r = ref.detach().double().numpy()
    o = out.detach().double().numpy()
    with np.errstate(invalid="ignore"):
        err = np.abs(o - r)
        ok = np.isfinite(r) & np.isfinite(o) & ((err <= ATOL) | (err <= RTOL * np.abs(r)))
    return ~ok


PERTURBED = [(0, 1, 5), (1, 3, 7), (2, 10, 5), (2, 15, 30)]  # (batch, token, feature); token 15 may be padding


def test_perturbed_candidate_is_failed_with_exact_counts_and_features():
    reference, optimized = models_for(SMALL)

    def perturbed(x, mask):
        y = reference(x, mask).clone()
        for b, s, d in PERTURBED:
            y[b, s, d] = y[b, s, d] + 0.5 * y[b, s, d].abs() + 0.01  # abs > atol and rel > rtol, always
        return y

    progress_calls = []

    class Progress:
        def advance(self, n=1):
            progress_calls.append(n)

        def describe(self, text):
            pass

    report = validate_candidates(reference, {"optimized": optimized, "perturbed": perturbed}, SMALL,
                                 torch.float32, "cpu", trials=3, progress=Progress())
    assert len(progress_calls) == 6
    assert report.status("optimized") == PASSED
    assert report.status("perturbed") == FAILED
    cand = report.candidates["perturbed"]
    assert len(cand.records) == 6
    for record in cand.records:
        assert record.report.failed == len(PERTURBED)
        assert record.report.total == SMALL.batch_size * SMALL.seq_len * SMALL.d_model
        assert record.report.failing_features == sorted({d for _, _, d in PERTURBED})
        assert record.report.worst_index is not None and tuple(record.report.worst_index) in PERTURBED
    assert cand.failed_elements("all-valid") == cand.failed_elements("padded") == 3 * len(PERTURBED)
    data = report.to_dict()
    assert data["statuses"] == {"optimized": "passed", "perturbed": "failed"}
    assert data["candidates"]["perturbed"]["failed_elements"] == {"all-valid": 12, "padded": 12}
    rows = {row[0]: row for row in report.summary_rows()}
    assert rows["perturbed"][1] == "failed" and "all-valid 12" in rows["perturbed"][2]
    assert "12 failed elements in 3/3 trials" in report.reason("perturbed")


def test_a_build_stops_a_candidate_at_its_first_failing_trial_with_the_same_verdict():
    reference, optimized = models_for(SMALL)
    calls = {"all-valid": 0, "padded": 0}

    def perturbed(x, mask):  # fails every all-valid trial
        calls["padded" if not bool(mask.all()) else "all-valid"] += 1
        y = reference(x, mask).clone()
        y[0, 0, 0] = y[0, 0, 0] + 1.0
        return y

    def padded_wrong(x, mask):  # exact on all-valid inputs, wrong on padded ones
        y = reference(x, mask).clone()
        if not bool(mask.all()):
            y[0, 0, 0] = y[0, 0, 0] + 1.0
        return y

    candidates = {"optimized": optimized, "perturbed": perturbed, "padded-wrong": padded_wrong}
    full = validate_candidates(reference, candidates, SMALL, torch.float32, "cpu", trials=3)
    calls.update({"all-valid": 0, "padded": 0})
    fast = validate_candidates(reference, candidates, SMALL, torch.float32, "cpu", trials=3, stop_after_failure=True)
    for name in candidates:
        assert fast.status(name) == full.status(name)
    assert fast.status("padded-wrong") == PASSED_ALL_VALID_ONLY and fast.status("perturbed") == FAILED
    assert calls == {"all-valid": 1, "padded": 0}  # nothing after the first failing all-valid trial
    assert len(fast.candidates["perturbed"].records) == 1 and len(full.candidates["perturbed"].records) == 6
    assert [r.mode for r in fast.candidates["padded-wrong"].records] == ["all-valid"] * 3 + ["padded"]
    assert len(fast.candidates["optimized"].records) == 6
    assert "1 failed elements in 1/1 trials" in fast.reason("perturbed")
    assert "stopped after" in fast.reason("perturbed") and "padded: not run (stopped after" in fast.reason("perturbed")
    assert "1 failed elements in 1/1 trials" in fast.reason("padded-wrong")


def test_tanh_gelu_candidate_is_rejected_with_the_exact_failure_count():
    # fp16, 4 layers: the tanh approximation of GELU breaks the strict rule on a few elements.
    config = TransformerConfig(2, 16, 32, 4, 128, 4)
    reference, _ = models_for(config, dtype=torch.float16)
    tanh_model = copy.deepcopy(reference)
    for block in tanh_model.layers:
        block.feed_forward = (lambda b: lambda x: b.ffn_out(F.gelu(b.ffn_in(b.norm2(x)), approximate="tanh")))(block)
    report = validate_candidates(reference, {"tanh-gelu": tanh_model}, config, torch.float16, "cpu",
                                 trials=3, modes=("all-valid",))
    expected_count, expected_features = 0, set()
    with torch.inference_mode():
        for t in trial_plan(config, torch.float16, "cpu", trials=3, modes=("all-valid",)):
            bad = _strict_failures_numpy(reference(t.x, t.mask), tanh_model(t.x, t.mask))
            expected_count += int(bad.sum())
            expected_features |= set(np.nonzero(bad)[2].tolist())
    assert expected_count > 0
    cand = report.candidates["tanh-gelu"]
    assert report.status("tanh-gelu") == FAILED
    assert cand.failed_elements("all-valid") == expected_count
    assert set().union(*(r.report.failing_features for r in cand.records)) == expected_features


def test_a_raising_candidate_is_recorded_failed_and_the_others_still_run():
    reference, optimized = models_for(SMALL)
    calls = []

    def raising(x, mask):
        calls.append(1)
        raise RuntimeError("engine exploded\nstack details")

    def wrong_shape(x, mask):
        return reference(x, mask)[:, :-1]

    report = validate_candidates(reference, {"raising": raising, "optimized": optimized, "wrong-shape": wrong_shape},
                                 SMALL, torch.float32, "cpu", trials=2)
    assert report.status("raising") == FAILED
    assert report.status("wrong-shape") == FAILED
    assert report.status("optimized") == PASSED
    assert len(calls) == 2  # once per mode: the rest of a mode is skipped after a raise
    errors = report.to_dict()["candidates"]["raising"]["errors"]
    assert errors == {"all-valid": "RuntimeError: engine exploded", "padded": "RuntimeError: engine exploded"}
    assert "raised RuntimeError: engine exploded" in report.reason("raising")
    assert "output shape" in report.to_dict()["candidates"]["wrong-shape"]["errors"]["all-valid"]


def test_report_json_is_strict_json_even_with_nan_and_inf(tmp_path):
    reference, _ = models_for(SMALL)

    def non_finite(x, mask):
        y = reference(x, mask).clone()
        y[0, 0, 0] = float("nan")
        y[0, 0, 1] = float("inf")
        return y

    report = validate_candidates(reference, {"non-finite": non_finite}, SMALL, torch.float32, "cpu", trials=1)
    assert report.status("non-finite") == FAILED
    record = report.candidates["non-finite"].records[0].report
    assert record.failed == 2 and record.nonfinite == 2 and math.isinf(record.max_abs)
    path = report.write_json(tmp_path / "validation.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["validation.json"]  # no temp file left
    text = path.read_text()
    data = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    assert data["candidates"]["non-finite"]["max_abs"] == "inf"
    assert data["candidates"]["non-finite"]["trials"][0]["report"]["failed"] == 2
    assert data["atol"] == ATOL and data["rtol"] == RTOL and data["modes"] == ["all-valid", "padded"]


def test_all_valid_only_candidates():
    reference, optimized = models_for(SMALL)

    def wrong_when_padded(x, mask):
        y = reference(x, mask)
        return y if bool(mask.all()) else y + 1.0

    report = validate_candidates(
        reference, {"marked": optimized, "padded-breaks": wrong_when_padded, "full": optimized},
        SMALL, torch.float32, "cpu", trials=2, all_valid_only={"marked"},
    )
    assert report.status("marked") == PASSED_ALL_VALID_ONLY
    assert [r.mode for r in report.candidates["marked"].records] == ["all-valid", "all-valid"]
    assert "padded: not run (all-valid-only candidate)" in report.reason("marked")
    assert report.status("padded-breaks") == PASSED_ALL_VALID_ONLY  # may ship for all-valid calls only
    assert report.candidates["padded-breaks"].failed_elements("padded") > 0
    assert report.status("full") == PASSED
    assert set(report.passed()) == {"marked", "padded-breaks", "full"}
    with pytest.raises(KKError, match="unknown candidates"):
        validate_candidates(reference, {"a": optimized}, SMALL, torch.float32, "cpu", all_valid_only={"b"})
    with pytest.raises(KKError, match="all-valid"):
        validate_candidates(reference, {"a": optimized}, SMALL, torch.float32, "cpu", modes=("padded",))
    with pytest.raises(KKError, match="contract"):
        validate_candidates(reference, {"a": optimized}, SMALL, torch.float32, "cpu", contract="lenient")

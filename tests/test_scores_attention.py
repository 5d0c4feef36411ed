"""Shape 14's attention without stored scores (issue 29): the Triton kernels' order, the proof, and the wiring.

The kernels' arithmetic order is checked under TRITON_INTERPRET=1 where Triton is importable (row sums bit for bit
against ``emulate_block_sums``, ATen's block-softmax order). Everything else runs on every CPU: which path a call
takes, what the validation plan asks for, what the proof says off the GPU, and how a loaded artifact adopts or
re-makes the proofs. The GPU figures (bitwise on 2 full-size sequences, 11.4 s a call) are in docs/results.md.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from tests.conftest import run_interpreter_script
from kkdeploy import KKError, ReferenceTransformer, TransformerConfig, generate_case
from kkdeploy.models.long_context import LongContextTransformer
from kkdeploy.models.tiled_reference import tiled_reference_attention
from kkdeploy.models.weights import init_weights


def fake_scores_attention(calls):
    """A CPU stand-in for ``scores_attention`` with its contract: the reference's attention for rows < queries,
    keys masked at or past each sequence's length, rows past ``queries`` zero."""
    def run(q, k, v, scale, lengths=None, launch="m128-markstein", queries=None):
        seq_len = q.shape[2]
        queries = seq_len if queries is None else queries
        calls.append({"launch": launch, "lengths": None if lengths is None else lengths.tolist(), "queries": queries})
        mask = None if lengths is None else torch.arange(seq_len)[None, :] < lengths[:, None]
        out = tiled_reference_attention(q, k, v, scale, True, mask, 16)
        out[:, :, queries:] = 0
        return out
    return run


def patched_model(monkeypatch, calls, config):
    import kkdeploy.kernels.scores_attention as sa
    import kkdeploy.models.long_context as lc

    monkeypatch.setattr(lc, "scores_kernel_launch", lambda device, dtype, seq_len, heads, head_dim: "m128-markstein")
    monkeypatch.setattr(sa, "scores_attention", fake_scores_attention(calls))
    reference = init_weights(ReferenceTransformer(config), 3).eval()
    path = LongContextTransformer(config, query_tile=16, sdpa_layers=0)
    path.load_state_dict(reference.state_dict(), strict=True)
    return reference, path.eval()


def test_proven_scores_kernels_run_whole_sequences_all_valid_and_prefix_padded(monkeypatch):
    """Where a proof chose a launch, every tiled layer hands the whole micro-batch to the kernels: all-valid calls
    with no lengths, prefix-padded calls with each sequence's length and only the rows up to the longest; the
    path records it. Other masks and autograd calls keep the query tiles."""
    config = TransformerConfig(2, 48, 16, 2, 16, 2, causal=True)
    calls = []
    import kkdeploy.models.long_context as lc

    reference, path = patched_model(monkeypatch, calls, config)
    dtype = torch.float32  # the kernels are float16-only: the wiring is checked in float32 past the dtype check
    monkeypatch.setattr(LongContextTransformer, "scores_launch",
                        lambda self, device, dtype, seq_len, inference=True: "m128-markstein" if inference else None)
    x, _ = generate_case(config, "cpu", dtype, 5)
    with torch.inference_mode():
        out = path(x)
        assert torch.equal(out, reference(x))
    assert [c["lengths"] for c in calls] == [None, None] and all(c["queries"] == 48 for c in calls)
    assert path.last_path_features == {"all-valid/scores-kernel"}
    assert path.last_softmax_launch == "scores-attention m128-markstein"

    calls.clear()
    x, mask = generate_case(config, "cpu", dtype, 6, padding_ratio=0.4)
    lengths = mask.sum(dim=1).tolist()
    with torch.inference_mode():
        assert torch.equal(path(x, mask), reference(x, mask))
    assert [c["lengths"] for c in calls] == [lengths, lengths] and calls[0]["queries"] == max(lengths)
    assert path.last_path_features == {"padded/scores-kernel"}

    calls.clear()
    holes = mask.clone()
    holes[0, 1] = False  # not a prefix: the tiles take any mask
    with torch.inference_mode():
        assert torch.equal(path(x, holes), reference(x, holes))
    assert calls == [] and all("/tiled/" in f for f in path.last_path_features)

    x.requires_grad_(True)
    path(x).sum().backward()  # autograd: the kernels have no backward
    assert calls == [] and x.grad is not None
    assert lc.SOFTMAX_PATHS == ("auto", "aten", "block-kernel", "scores-kernel")


def test_scores_launch_is_chosen_by_the_proof_and_only_for_float16_causal_inference(monkeypatch):
    import kkdeploy.kernels.scores_attention as sa
    import kkdeploy.models.long_context as lc

    config = TransformerConfig(1, 100000, 1024, 16, 1024, 2)
    model = LongContextTransformer(config)
    assert model.scores_launch("cpu", torch.float16, 100000) is None  # no proof on a CPU
    monkeypatch.setattr(lc, "scores_kernel_launch", lambda device, dtype, seq_len, heads, head_dim: "m128-markstein")
    assert model.scores_launch("cuda", torch.float16, 100000) == "m128-markstein"
    assert model.scores_launch("cuda", torch.float32, 100000) is None
    assert model.scores_launch("cuda", torch.float16, 100000, inference=False) is None
    assert LongContextTransformer(config, softmax="block-kernel").scores_launch("cuda", torch.float16, 100000) is None
    assert LongContextTransformer(TransformerConfig(1, 100000, 1024, 16, 1024, 2, causal=False)).scores_launch(
        "cuda", torch.float16, 100000) is None
    # explicit "scores-kernel" without a proof: the default launch wherever the kernels can run at all
    monkeypatch.setattr(lc, "scores_kernel_launch", lambda device, dtype, seq_len, heads, head_dim: None)
    explicit = LongContextTransformer(config, softmax="scores-kernel")
    monkeypatch.setattr(sa, "kernel_refusal", lambda device, dtype, row_len=None, head_dim=None: None)
    assert explicit.scores_launch("cuda", torch.float16, 100000) == sa.DEFAULT_LAUNCH
    monkeypatch.setattr(sa, "kernel_refusal", lambda device, dtype, row_len=None, head_dim=None: "no triton")
    assert explicit.scores_launch("cuda", torch.float16, 100000) is None


def test_the_plan_validates_the_scores_kernels_at_full_length_and_builds_try_them_first(monkeypatch):
    """The reduced shape's rows (4096 keys) take ATen's shared-memory softmax, which the kernels do not reproduce:
    a full-size call's scores-kernel paths are validated at the full length, and a strict build tries the tiled
    layers (sdpa_layers=0) first where the kernels are proven."""
    import kkdeploy.kernels.scores_attention as sa
    from kkdeploy.pipeline.long_context import calibration_order
    from kkdeploy.pipeline.long_context_plan import plan_validation

    config = TransformerConfig(32, 100000, 1024, 16, 1024, 2)
    reduced = TransformerConfig(2, 4096, 1024, 16, 1024, 2)
    assert calibration_order(config, torch.float16, "cpu", "strict") == [2, 1, 0]

    def proven(device, dtype, row_len, heads, head_dim):
        return "m128-markstein" if row_len == 100000 else None

    monkeypatch.setattr(sa, "proven_launch", proven)
    plan = plan_validation(config, reduced, 0, torch.float16, "cuda", query_tile=128, rate=5e14, bandwidth=4e12)
    assert set(plan.uncovered) == {"all-valid/scores-kernel", "padded/scores-kernel"}
    assert plan.feasible and plan.full_length.seq_len == 100000 and plan.full_length.batch_size == 2
    assert calibration_order(config, torch.float16, "cuda", "strict") == [0, 2, 1]


def test_off_the_gpu_the_proof_says_why_and_nothing_is_proven(monkeypatch, tmp_path):
    import kkdeploy.kernels.scores_attention as sa

    monkeypatch.setenv("KKDEPLOY_CACHE_DIR", str(tmp_path))
    record = sa.prove_scores_attention("cpu", [], 100000, 16, 64)
    assert record.chosen is None and "CUDA-only" in record.reason and record.op == "scores_attention"
    assert sa.proven_launch("cpu", torch.float16, 100000, 16, 64) is None
    assert "float16" in sa.kernel_refusal("cuda", torch.float32)
    monkeypatch.setattr(sa, "triton_available", lambda: True)
    assert "another ATen softmax" in sa.kernel_refusal("cuda", torch.float16, 4096)  # ATen's shared-memory rows
    assert "head_dim 512" in sa.kernel_refusal("cuda", torch.float16, 100000, 512)
    assert sa.kernel_refusal("cuda", torch.float16, 100000, 64) is None
    with pytest.raises(KKError, match="scores-attention launch must be one of"):
        sa.launch_config("fastest")
    for name in sa.LAUNCHES:  # every launch is a configuration of the same arithmetic, copied on each use
        config = sa.launch_config(name)
        config.get("sum_launch", {})["block_m"] = 1
        assert sa.launch_config(name) == sa.LAUNCHES[name]


def test_a_loaded_artifact_adopts_both_proofs_or_makes_the_missing_one(monkeypatch, tmp_path):
    import kkdeploy.kernels.block_softmax as bs
    import kkdeploy.kernels.scores_attention as sa
    import kkdeploy.pipeline.long_context_plan as plan
    from kkdeploy.kernels.proof import ProofRecord, forget_proofs
    from kkdeploy.pipeline.runtime import adopt_long_context_proofs

    monkeypatch.setenv("KKDEPLOY_CACHE_DIR", str(tmp_path / "cache"))
    env_block, env_scores = {"device": "gpu", "op": bs.OP}, {"device": "gpu", "op": sa.OP}
    monkeypatch.setattr(bs, "kernel_refusal", lambda device, dtype: None)
    monkeypatch.setattr(sa, "kernel_refusal", lambda device, dtype, row_len=None, head_dim=None: None)
    monkeypatch.setattr(bs, "proof_environment", lambda device: env_block)
    monkeypatch.setattr(sa, "proof_environment", lambda device: env_scores)
    config = TransformerConfig(32, 100000, 1024, 16, 1024, 2)
    model = LongContextTransformer(config, query_tile=128)
    block = ProofRecord(op=bs.OP, shape=bs.proof_shape(100000, 2048), environment=env_block, chosen="markstein")
    scores = ProofRecord(op=sa.OP, shape=sa.proof_shape(100000, 16, 64), environment=env_scores,
                         chosen="m128-markstein")
    made = []

    def prove(*args, **kwargs):
        made.append(kwargs)
        return [block.to_dict(), scores.to_dict()]

    monkeypatch.setattr(plan, "prove_long_context_kernels", prove)
    manifest = {"kernel_proofs": [block.to_dict(), scores.to_dict()], "validation": {"seed": 7}}
    note = adopt_long_context_proofs(tmp_path, manifest, model, config, torch.float16, torch.device("cpu"))
    assert made == [] and note.count("the build's proof holds here") == 2 and "m128-markstein" in note
    forget_proofs()  # a fresh process
    manifest = {"kernel_proofs": [block.to_dict()], "validation": {"seed": 7}}  # built before the scores kernels
    note = adopt_long_context_proofs(tmp_path, manifest, model, config, torch.float16, torch.device("cpu"))
    assert len(made) == 1 and made[0]["seed"] == 7
    assert "scores-attention kernels: m128-markstein (proven again here at load)" in note
    assert list((tmp_path / "proofs").glob("scores_attention-*.json"))  # cached beside the artifacts
    made.clear()
    forget_proofs()
    note = adopt_long_context_proofs(tmp_path, manifest, model, config, torch.float16, torch.device("cpu"))
    assert made == [] and "scores-attention kernels: m128-markstein" in note  # from the artifact's cache
    forget_proofs()



def test_on_a_gpu_the_long_context_proofs_run_in_a_child_and_a_dead_one_leaves_aten_s_paths(monkeypatch, tmp_path):
    """Shape 14's kernels are ours too: a fault while proving them ends the proving child, not the build or the
    server; both kernels then run ATen's paths with the reason (the scores kernels are proven on the block softmax's
    choice). What a child proved is adopted by the calling process."""
    import kkdeploy.kernels.scores_attention as sa
    import kkdeploy.pipeline.long_context_plan as plan
    from kkdeploy.kernels import proof_process as pp
    from kkdeploy.kernels.proof import ProofRecord, forget_proofs, lookup_proof

    monkeypatch.setenv("KKDEPLOY_CACHE_DIR", str(tmp_path / "cache"))
    config = TransformerConfig(2, 64, 32, 2, 32, 1)
    model = LongContextTransformer(config, query_tile=16)
    monkeypatch.setattr(pp, "isolation_wanted", lambda device: True)
    asked = []

    def dead(task, model_, config_, dtype, device, args, **kw):
        asked.append((task, args))
        return pp.ChildOutcome(pp.CRASHED, None, "crashed: SIGSEGV (signal 11)", "block_softmax", 3.0)

    monkeypatch.setattr(pp, "run_proof_child", dead)
    records = plan.prove_long_context_kernels_isolated(model, config, torch.float16, "cuda", seed=7,
                                                       padding_ratio=0.25)
    assert asked == [("kkdeploy.pipeline.long_context_plan:long_context_proof_task",
                      {"query_tile": 16, "seed": 7, "padding_ratio": 0.25, "budget_s": 60.0})]
    assert [r["op"] for r in records] == ["block_softmax", sa.OP] and not any(r["chosen"] for r in records)
    assert records[0]["reason"] == ("the long-context kernels' proof crashed: SIGSEGV (signal 11) in a fresh process "
                                    "(proving block_softmax), so ATen's paths run")
    made = ProofRecord(op=sa.OP, shape=sa.proof_shape(64, 2, 16), environment={"device": "gpu"}, chosen="m128")
    monkeypatch.setattr(pp, "run_proof_child", lambda *a, **kw: pp.ChildOutcome(
        pp.OK, {"records": [{"op": "block_softmax", "chosen": None, "reason": "not here"}, made.to_dict()]}, "",
        None, 1.0))
    forget_proofs()
    records = plan.prove_long_context_kernels_isolated(model, config, torch.float16, "cuda", seed=7,
                                                       padding_ratio=0.25)
    assert records[1] == made.to_dict() and lookup_proof({"device": "gpu"}, sa.OP, made.shape) == made
    forget_proofs()
    # the child's side builds the long-context model on the weights it was given and proves with them
    reports = []
    answer = plan.long_context_proof_task(ReferenceTransformer(config), config, torch.float32, torch.device("cpu"),
                                          {"query_tile": 16, "seed": 7, "padding_ratio": 0.25, "budget_s": 5.0},
                                          lambda key, message: reports.append(key))
    assert [r["op"] for r in answer["records"]] == ["block_softmax", sa.OP] and reports == []  # the CPU runs none


def test_a_real_proving_child_builds_the_long_context_model_and_returns_its_records(monkeypatch, tmp_path):
    # The child's plumbing end to end on the CPU: the long-context model rebuilt there from the weights it was sent,
    # its kernels' records (refusals on the CPU) back as JSON, the same as this process makes.
    import kkdeploy.pipeline.long_context_plan as plan
    from kkdeploy.kernels import proof_process as pp

    monkeypatch.setenv("KKDEPLOY_CACHE_DIR", str(tmp_path / "cache"))
    config = TransformerConfig(2, 64, 32, 2, 32, 1)
    model = LongContextTransformer(config, query_tile=16)
    init_weights(model, 3)
    here = plan.prove_long_context_kernels(model, config, torch.float32, torch.device("cpu"), seed=7,
                                           padding_ratio=0.25)
    monkeypatch.setattr(pp, "isolation_wanted", lambda device: True)
    child = plan.prove_long_context_kernels_isolated(model, config, torch.float32, torch.device("cpu"), seed=7,
                                                     padding_ratio=0.25)
    strip = lambda r: {k: v for k, v in r.items() if k not in ("seconds", "wall_seconds")}  # noqa: E731
    assert [strip(r) for r in child] == [strip(r) for r in here] and len(child) == 2

INTERPRETED = textwrap.dedent("""
    import json, numpy as np, torch
    from kkdeploy.kernels._scores_softmax_triton import scores_softmax
    from kkdeploy.kernels.block_softmax import block_softmax_layout, emulate_block_softmax, emulate_block_sums

    np_exp = lambda t: torch.from_numpy(np.exp(t.numpy()))
    row_len = 12300  # ATen's regular block softmax, a scalar tail of 12
    _, tail = block_softmax_layout(row_len)
    results = []
    g = torch.Generator().manual_seed(0)
    b, H, T, dh = 2, 2, 16, 16
    cases = [(12284, 12300, None, 0.25), (12284, 12300, torch.tensor([12290, 6000]), 0.3), (5000, 5016, None, 0.25)]
    for first, width, lengths, scale in cases:
        # sixteenths in [-2, 2]: every dot product is exact, so the raw scores do not depend on the GEMM's order
        q = (torch.randint(-16, 17, (b, H, T, dh), generator=g) / 8).half()
        k = (torch.randint(-16, 17, (b, H, width, dh), generator=g) / 8).half()
        v = (torch.randint(-2, 3, (b, H, width, dh), generator=g) / 4).half()
        raw = (q.float() @ k.float().transpose(-2, -1)).half()
        s = torch.full((b, H, T, row_len), float("-inf"), dtype=torch.float16)
        s[..., :width] = (raw.float() * scale).half()
        keys, query = torch.arange(row_len), first + torch.arange(T)
        s = s.masked_fill(keys[None, :] > query[:, None], float("-inf"))
        if lengths is not None:
            s = s.masked_fill(keys[None, None, None, :] >= lengths[:, None, None, None], float("-inf"))
        rows = s.float().reshape(-1, row_len)
        _, sums = emulate_block_sums(rows, exp=np_exp)
        probs = emulate_block_softmax(rows, exp=np_exp).half()[:, :width]
        context = (probs.float().reshape(b, H, T, width) @ v.float()).half()
        for group, strided in ((1, False), (2, True), (4, False)):
            # IEEE division here: the interpreter's fma rounds twice, so Markstein's division is a GPU question
            p, got = scores_softmax(q, k, None, scale, row_len, tail, first, True, lengths, fast_div=False,
                                    group=group, strided=strided, block_m=16, block_n=128, nsplit=3, psplit=2,
                                    stats=True)
            results.append({"case": [first, width, scale, lengths is not None], "group": group, "strided": strided,
                            "sums_differing": int((got != sums).sum()),
                            "probs_differing": int((p.view(torch.int16) != probs.view(torch.int16)).sum())})
        out = scores_softmax(q, k, v, scale, row_len, tail, first, True, lengths, fast_div=False, fuse_pv=True,
                             block_m=16, block_n=128)
        results.append({"case": [first, width, scale, lengths is not None], "fused_pv_max_abs":
                        float((out.float() - context.float()).abs().max())})
    print("RESULTS " + json.dumps(results))
""")


def test_kernels_follow_atens_block_order_bit_for_bit_under_the_interpreter():
    """Row sums, probabilities and the fused P.V against ATen's order (emulated), for the sum pass's groupings
    and strided tiles, with a scalar tail, padding and a scale that is not a float16 value."""
    results = run_interpreter_script(INTERPRETED)
    for entry in results:
        if "fused_pv_max_abs" in entry:
            assert entry["fused_pv_max_abs"] == 0.0, entry
        else:
            assert entry["sums_differing"] == 0 and entry["probs_differing"] == 0, entry

"""The custom-op library's ops proven in the build (engines/custom_op_proof.py): the cases taken from the model, the
rule (0 differing bits on every case, per op shape), the gate on ORT candidates, and the one-node sessions run on
the CPU with the real library. The CUDA kernels themselves are proven on a GPU; here their proof's logic is tested
with stand-ins for the session, as the kernel proofs' is (tests/test_proof.py)."""

from __future__ import annotations

import pytest
import torch

from engines import custom_op_proof as cop
from engines.base import BuildContext, SKIPPED
from exporters import ExportOptions
from kkdeploy.config import TransformerConfig
from kkdeploy.kernels.proof import ProofCase, ProofRecord, prove_launches
from tests.conftest import models_for

CONFIG = TransformerConfig(batch_size=2, seq_len=8, d_model=16, num_heads=2, ffn_dim=32, num_layers=3)


@pytest.fixture(scope="module")
def model():
    reference, _ = models_for(CONFIG)
    return reference


def test_cases_are_the_models_own_activations_at_each_op_shape(model):
    cases = cop.model_cases(model, CONFIG, torch.float32, "cpu", seed=1234, padding_ratio=0.25)
    real = [c for c in cases if not c.label.startswith("random")]
    # first and last layer (0 and 2), each: q, k, v, out_proj, ffn_in, ffn_out, 2 norms, one GELU; plus the final
    # norm; for all-valid and padded inputs
    per_mode = 2 * (6 + 2 + 1) + 1
    assert len(real) == 2 * per_mode
    assert {c.label.split()[-1] for c in real} == {"all-valid", "padded"}
    shapes = {tuple(sorted(cop.shape_of(c).items())) for c in cases}
    tokens = CONFIG.batch_size * CONFIG.seq_len
    assert {(dict(s)["op"], dict(s).get("n"), dict(s).get("width")) for s in shapes} == {
        ("Linear", 16, None), ("Linear", 32, None), ("LayerNorm", None, 16), ("Gelu", None, 32)}
    assert all(c.inputs[0].shape[0] == tokens for c in cases)
    randoms = [c for c in cases if c.label.startswith("random")]
    assert len(randoms) == len(cop.RANDOM_INPUTS) * len(shapes)  # each kind of random input at each op shape
    for case in cases:  # every reference is the ATen op on the case's own inputs, bit for bit
        again = cop.reference_output(case.op, case.inputs, case.attrs)
        assert torch.equal(again, case.reference), case.label


def test_packed_qkv_is_proven_at_the_packed_shape(model):
    cases = cop.model_cases(model, CONFIG, torch.float32, "cpu", 1234, 0.25, packed_qkv=True, ops=("Linear",))
    packed = [c for c in cases if "qkv" in c.label]
    assert packed and all(c.inputs[1].shape == (3 * CONFIG.d_model, CONFIG.d_model) for c in packed)
    assert not any(c.label.split()[0].endswith(("q_proj", "k_proj", "v_proj")) for c in cases)
    assert {c.op for c in cases} == {"Linear"}


def test_an_op_that_differs_by_one_bit_refuses_the_candidate(model, proof_sandbox):
    cases = cop.model_cases(model, CONFIG, torch.float32, "cpu", 1234, 0.25)
    env = {"device_type": "cpu", "kernel": "test", "library": "exact"}
    ran = []

    def exact_node(case):
        ran.append(case.label)
        return cop.reference_output(case.op, case.inputs, case.attrs)

    exact = cop.prove_custom_ops(cases, exact_node, "cpu", env)
    assert all(r.proven and r.chosen == cop.LAUNCH for r in exact) and cop.refusal_of(exact) is None
    assert len(ran) == len(cases)
    again = cop.prove_custom_ops(cases, exact_node, "cpu", env)  # the same environment: the proofs are reused
    assert len(ran) == len(cases) and [r.to_dict() for r in again] == [r.to_dict() for r in exact]
    env = {**env, "library": "off by one bit"}  # another library build: proven again
    assert len(exact) == 5  # one record per op shape: LayerNorm, Gelu, Linear 16x16, ffn_in 16->32, ffn_out 32->16

    def off_by_one_bit(case):
        y = cop.reference_output(case.op, case.inputs, case.attrs).clone()
        if case.op == "LayerNorm" and "padded" in case.label:
            y.view(torch.int32)[0, 0] ^= 1
        return y

    records = cop.prove_custom_ops(cases, off_by_one_bit, "cpu", env)
    layer_norm = next(r for r in records if r.shape["op"] == "LayerNorm")
    assert not layer_norm.proven and layer_norm.launches[0].differing == 1
    reason = cop.refusal_of(records)
    assert reason.startswith("kkdeploy::LayerNorm (rows=16, width=16) is not bit-identical to ATen here")


def test_an_untimed_proof_chooses_its_one_bit_identical_launch():
    x = torch.arange(6.0)
    case = [ProofCase("a", reference=lambda: x * 2, run=lambda launch: x * 2)]
    record = prove_launches("op", {"n": 6}, ["only"], case, "cpu", environment={}, timed=False)
    assert record.chosen == "only" and record.launches[0].ms is None and "not timed" in record.reason


def test_only_float16_cuda_builds_prove_and_the_gate_skips_the_candidate(monkeypatch, tmp_path):
    assert cop.proof_refusal("cpu", torch.float16).startswith("the library's CPU kernels")
    assert "float16 only" in cop.proof_refusal(torch.device("cuda"), torch.float32)
    assert cop.proof_refusal(torch.device("cuda"), torch.float16) is None
    assert cop.ops_in_graph(ExportOptions(linear="custom", gelu="custom")) == ["Linear", "Gelu"]
    assert cop.ops_in_graph(ExportOptions()) == []

    from engines import ort as ort_engine

    record = ProofRecord(op="custom-op Linear", shape={"op": "Linear", "m": 16, "n": 16, "k": 16,
                                                       "dtype": "torch.float16"}, environment={}, reason="differs")
    monkeypatch.setattr(ort_engine, "custom_ops_library", lambda ctx: tmp_path / "libkkdeploy_ops.so")
    monkeypatch.setattr(ort_engine, "custom_op_proofs",
                        lambda ctx, library: ([record.to_dict()], cop.refusal_of([record])))
    ctx = BuildContext(CONFIG, torch.float16, torch.device("cpu"), None, tmp_path, onnx_path=tmp_path / "m.onnx")
    result = ort_engine.OrtBackend().build(ctx, "ort-cuda")
    assert result.status == SKIPPED and "kkdeploy::Linear (m=16, n=16, k=16)" in result.reason
    assert result.options["custom_op_proofs"][0]["op"] == "custom-op Linear"
    from kkdeploy.pipeline.build import proofs_table

    summary = proofs_table({"candidates": [{"options": result.options}]})
    assert summary.row_count == 1 and "candidate skipped" in str(summary.columns[2]._cells)
    # A CPU session's kernels are not proven: the gate is not asked
    asked = []
    monkeypatch.setattr(ort_engine, "custom_op_proofs", lambda ctx, library: asked.append(1) or (None, None))
    monkeypatch.setattr(ort_engine.OrtBackend, "_build", lambda self, ort, ctx, name, library: ort_engine.CandidateResult(
        name, "ort", "built", "", files=[], options={}))
    (tmp_path / "record.json").write_text("{}")
    monkeypatch.setattr(ort_engine, "library_record_path", lambda library: tmp_path / "record.json")
    assert ort_engine.OrtBackend().build(ctx, "ort-cpu").status == "built" and not asked


def test_a_cpu_build_proves_nothing(model, tmp_path):
    from engines import ort as ort_engine

    ctx = BuildContext(CONFIG, torch.float32, torch.device("cpu"), model, tmp_path,
                       export_options=ExportOptions(linear="custom"))
    assert ort_engine.custom_op_proofs(ctx, tmp_path / "lib.so") == (None, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_one_node_sessions_run_each_op_with_the_real_library(model, dtype):
    # The session plumbing the GPU proof uses, on the CPU EP: graph, attributes, inputs and output. The CPU kernels
    # are not ATen's order, so only closeness is asserted here; bits are the GPU proof's business.
    from engines.custom_op_library import build_library

    library = build_library("cpu")
    cases = cop.model_cases(model.to(dtype), CONFIG, dtype, "cpu", 1234, 0.25)
    sessions = cop.NodeSessions(library, torch.device("cpu"))
    try:
        for op in cop.OPS:
            case = next(c for c in cases if c.op == op)
            got = sessions.run(case)
            assert got.shape == case.reference.shape and got.dtype == case.reference.dtype, op
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            assert torch.allclose(got.float(), case.reference.float(), atol=tol, rtol=tol), op
        assert len(sessions.sessions) == 3
    finally:
        sessions.close()
        model.to(torch.float32)


def test_on_a_gpu_the_library_is_proven_in_a_fresh_process_and_a_dead_child_skips_its_candidates(
        model, monkeypatch, proof_sandbox, tmp_path):
    """The library's CUDA kernels are ours: one that faults ends the proving child, not the build. The op shape it
    was proving gets a record saying so, which skips the candidates that use it; records the child made are adopted."""
    from engines import ort as ort_engine
    from kkdeploy.kernels import proof_process as pp

    named = []
    exact = lambda case: cop.reference_output(case.op, case.inputs, case.attrs)  # noqa: E731
    args = {"library": str(tmp_path / "lib.so"), "seed": 1234, "padding_ratio": 0.25, "packed_qkv": False,
            "ops": ["Linear", "LayerNorm", "Gelu"]}
    (tmp_path / "lib.so").write_bytes(b"a library")
    records = cop.prove_library_ops(model, CONFIG, torch.float32, "cpu", args, on_op=named.append, run_node=exact)
    assert named == [cop.shape_key(r.shape) for r in records] and all(r.proven for r in records)
    cop.prove_library_ops(model, CONFIG, torch.float32, "cpu", args, on_op=named.append, run_node=exact)
    assert len(named) == len(records)  # proven already here: nothing runs, nothing is named

    ctx = BuildContext(CONFIG, torch.float16, torch.device("cpu"), model, tmp_path,
                       export_options=ExportOptions(linear="custom"), validation_plan={"seed": 7})
    monkeypatch.setattr(cop, "proof_refusal", lambda device, dtype: None)
    monkeypatch.setattr(pp, "isolation_wanted", lambda device: True)
    culprit = cop.shape_key({"op": "Linear", "m": 16, "n": 48, "k": 16, "dtype": "torch.float16"})
    asked = []

    def dead(task, *a, **kw):
        asked.append((task, a[4]))
        return pp.ChildOutcome(pp.FAULTED, None, "faulted: AcceleratorError: CUDA error: an illegal memory access "
                               "was encountered", culprit, 2.0)

    monkeypatch.setattr(pp, "run_proof_child", dead)
    proofs, refusal = ort_engine.custom_op_proofs(ctx, tmp_path / "lib.so")
    assert asked[0][0] == "engines.custom_op_proof:library_proof_task" and asked[0][1]["seed"] == 7
    assert refusal == ("kkdeploy::Linear (k=16, m=16, n=48) could not be proven here: its proof faulted: "
                       "AcceleratorError: CUDA error: an illegal memory access was encountered in a fresh process")
    assert ort_engine.custom_op_proofs(ctx, tmp_path / "lib.so")[1] == refusal and len(asked) == 1  # once a build
    ctx.custom_op_proofs = None
    made = [r.to_dict() for r in records]
    monkeypatch.setattr(pp, "run_proof_child", lambda *a, **kw: pp.ChildOutcome(pp.OK, {"records": made}, "", None, 1))
    proofs, refusal = ort_engine.custom_op_proofs(ctx, tmp_path / "lib.so")
    assert refusal is None and proofs == made


def test_a_real_proving_child_returns_the_records_this_process_would_make(model, proof_sandbox, tmp_path):
    # The child's plumbing end to end on the CPU, with the real library: the model rebuilt from its weights there,
    # the one-node sessions, the records back as JSON and adopted here. (The CPU kernels are not ATen's order, so
    # the records' verdicts are whatever they are; they must be the same in both processes.)
    from engines import ort as ort_engine
    from engines.custom_op_library import build_library
    from kkdeploy.kernels.proof import lookup_proof

    library = build_library("cpu")
    args = {"library": str(library), "seed": 1234, "padding_ratio": 0.25, "packed_qkv": False,
            "ops": ["Linear", "LayerNorm", "Gelu"]}
    ctx = BuildContext(CONFIG, torch.float32, torch.device("cpu"), model, tmp_path,
                       export_options=ExportOptions(linear="custom", layer_norm="custom", gelu="custom"))
    child = ort_engine.prove_library_ops_isolated(ctx, args)
    assert child and all(lookup_proof(r.environment, r.op, r.shape) is r for r in child)  # adopted here
    proof_sandbox.forget_proofs()
    here = cop.prove_library_ops(model, CONFIG, torch.float32, "cpu", args)
    strip = lambda r: {k: v for k, v in r.to_dict().items() if k != "seconds"}  # noqa: E731
    assert [strip(r) for r in child] == [strip(r) for r in here]

"""The build's proof step (kkdeploy.kernels.model_proofs) with fake kernels on the CPU: which launch is chosen, what
is recorded and cached, that a failing launch is rejected, that another environment proves again, and that a
candidate whose kernels are unproven is not built. The real kernels' arithmetic is the GPU's and the interpreter
tests'; here every "kernel" is the ATen op itself (bitwise) or a copy of it with one bit flipped."""

from __future__ import annotations

import pytest
import torch

from engines.base import SKIPPED, BuildContext, CandidateSkipped
from engines.torch_compile import BACKEND, GEMMS, KERNEL_ATTENTION, KERNELS, prove_candidate_kernels
from kkdeploy import TransformerConfig
from kkdeploy.kernels import faithful_attention as fa
from kkdeploy.kernels import fused_linear as fl
from kkdeploy.kernels import layer_norm as ln
from kkdeploy.kernels import model_proofs as mp
from kkdeploy.models.weights import build_models

CONFIG = TransformerConfig(batch_size=2, seq_len=8, d_model=16, num_heads=2, ffn_dim=32, num_layers=2)
CPU = torch.device("cpu")


def flipped(t: torch.Tensor) -> torch.Tensor:
    """``t`` with one bit of its first element changed (one ulp)."""
    t = t.clone()
    t.view(-1).view(torch.int16)[0] ^= 1
    return t


class FakeKernels:
    """Kernels that are the reference op's answer, computed once per input set (so they time faster than ATen),
    except the launches in ``bad``, which flip one bit on padded inputs. ``calls`` counts kernel runs."""

    def __init__(self, monkeypatch, bad=(), refuse=()):
        self.bad, self.calls, self.memo = set(bad), [], {}
        monkeypatch.setattr(fa, "kernel_refusal", lambda *a: "no attention here" if "attention" in refuse else None)
        monkeypatch.setattr(ln, "kernel_refusal", lambda *a: "no nvcc here" if "layer_norm" in refuse else None)
        monkeypatch.setattr(fl, "kernel_refusal", lambda *a: "no triton here" if "linear" in refuse else None)
        monkeypatch.setattr(fa, "run_launch", self.attention)
        monkeypatch.setattr(ln, "layer_norm_rows_kernel", self.layer_norm)
        monkeypatch.setattr(fl, "run_launch", self.linear)
        monkeypatch.setattr(fl, "run_layer_norm_launch", self.linear_layer_norm)
        monkeypatch.setattr(fl, "run_ffn_launch", self.ffn_layer_norm)
        monkeypatch.setattr(fl, "run_norm_launch", self.norm_linear)

    def _answer(self, launch, key, padded, compute):
        self.calls.append(launch)
        if key not in self.memo:
            self.memo[key] = compute()
        out = self.memo[key]
        return flipped(out) if launch in self.bad and padded else out

    def attention(self, q, k, v, mask, heads, causal, launch):
        return self._answer(launch, ("a", q.data_ptr(), mask.data_ptr()), not bool(mask.all()),
                            lambda: fa.reference_attention(q, k, v, mask, heads, causal))

    def layer_norm(self, x, weight, bias, eps, rows_per_warp=2, valid=None):
        launch = {v: k for k, v in ln.LAUNCHES.items()}[rows_per_warp]

        def compute():  # the final norm's cases pass the mask (ln.layer_norm_case): zero_invalid_rows after it
            out = torch.nn.functional.layer_norm(x, (x.shape[-1],), weight, bias, eps)
            return out if valid is None else out.masked_fill(~valid[..., None], 0)

        key = ("ln", x.data_ptr(), weight.data_ptr(), None if valid is None else valid.data_ptr())
        return self._answer(launch, key, True, compute)

    def linear_layer_norm(self, x, weight, bias, residual, mask, ln_weight, ln_bias, eps, epilogue, prologue="none",
                          zero_invalid=False, launch=None):
        return self._answer(launch or "auto", ("lln", x.data_ptr(), weight.data_ptr(), zero_invalid), False,
                            lambda: fl.reference_linear_layer_norm(x, weight, bias, residual, mask, ln_weight, ln_bias,
                                                                   eps, epilogue, prologue, zero_invalid))

    def ffn_layer_norm(self, x, w_in, b_in, w_out, b_out, residual, mask, ln_weight, ln_bias, eps, zero_invalid=False,
                       launch=None, qkv_weights=None, qkv_biases=None):
        if qkv_weights is not None:
            return self._answer(launch or "auto", ("ffnqkv", x.data_ptr(), w_in.data_ptr()), False,
                                lambda: fl.reference_ffn_layer_norm_qkv(x, w_in, b_in, w_out, b_out, residual, mask,
                                                                        ln_weight, ln_bias, eps, qkv_weights,
                                                                        qkv_biases))
        return self._answer(launch or "auto", ("ffn", x.data_ptr(), w_in.data_ptr(), zero_invalid), False,
                            lambda: fl.reference_ffn_layer_norm(x, w_in, b_in, w_out, b_out, residual, mask, ln_weight,
                                                                ln_bias, eps, zero_invalid))

    def norm_linear(self, x, ln_weight, ln_bias, eps, weights, biases, epilogue, launch=None):
        return self._answer(launch, ("nl", x.data_ptr(), weights[0].data_ptr(), epilogue), True,
                            lambda: fl.reference_norm_linear(x, ln_weight, ln_bias, eps, weights, biases, epilogue))

    def linear(self, x, weights, biases, residual, mask, epilogue, prologue, launch):
        padded = mask is not None and not bool(mask.all())
        return self._answer(launch, ("l", x.data_ptr(), weights[0].data_ptr(), epilogue), padded,
                            lambda: fl.reference_linear(x, weights, biases, residual, mask, epilogue, prologue))


@pytest.fixture
def model():
    return build_models(CONFIG, torch.float16, CPU)[0]


def test_each_op_gets_its_fastest_bit_identical_launch_and_a_failing_one_is_rejected(monkeypatch, proof_sandbox,
                                                                                     model):
    FakeKernels(monkeypatch, bad={"cached64w4_mdiv", "rows2", "rows2_full", "m64"})
    monkeypatch.setattr(fl, "FFN_BUILD_TILES", ("auto", "regs", "regs_w4"))  # the feed-forward launches proven too
    proofs = mp.prove_model_kernels(model, CONFIG, torch.float16, CPU)
    by_op = {}
    for record in proofs.records:
        by_op.setdefault(record.op, []).append(record)
    (attention,) = by_op[fa.OP]
    assert attention.shape == fa.proof_shape(4, 8, 8, True)
    # where the step's time went (no compile ahead on the CPU), inside its own clock
    assert set(proofs.phases) == {"lookups", "cases", "prove"} and sum(proofs.phases.values()) <= proofs.seconds + 0.01
    status = {r.launch: r for r in attention.launches}
    assert status["cached64w4_mdiv"].status == "differs" and status["cached64w4_mdiv"].cases == 3  # then dropped
    assert attention.chosen in ("cached64w4", "bm64") and status[attention.chosen].differing == 0
    # two inputs (all-valid, padded) x two layers (first, last) + four random inputs
    assert attention.cases == ["all-valid, layer 0", "all-valid, layer 1", "padded 0.25, layer 0",
                               "padded 0.25, layer 1", "random x1, padded", "random x8, padded",
                               "random x1, a quarter zeros, padded", "random x1, magnitudes 2^-12..2^3, padded"]
    assert attention.reference_ms is not None and attention.environment == fa.proof_environment(CPU)
    (norm,) = by_op[ln.OP]
    assert norm.shape == ln.proof_shape(16, 16) and norm.chosen == "rows1"
    assert {r.launch: r.status for r in norm.launches} == {"rows2_full": "differs", "rows2": "differs",
                                                             "rows1": "proven"}
    assert {(r.shape["n"], r.shape["k"], r.shape["form"]) for r in by_op[fl.OP]} == {
        (48, 16, "none"), (16, 16, "add_masked"), (32, 16, "none"), (16, 32, "masked_sum"), (32, 16, "gelu"),
        (16, 16, "add_masked+layer_norm"), (16, 32, "masked_sum+layer_norm"),
        (16, 32, fl.FFN_FORM), (16, 32, fl.FFN_QKV_FORM)}  # D = 16: rows fit one tile, the feed-forward one launch
    for record in by_op[fl.OP]:
        if "layer_norm" in record.shape["form"]:  # the epilogue's one tile; the final norm's zeroing included
            assert record.proven and [r.launch for r in record.launches] == ["auto"], record.reason
            continue
        # the fake m64 flips a bit only where a padded mask reaches it
        residual = record.shape["form"] in ("add_masked", "masked_sum")
        assert record.proven and (record.chosen != "m64" or not residual), record.reason
        assert ({r.launch: r.status for r in record.launches}["m64"] == "differs") is residual
    assert all(proofs.proven(kind) for kind in mp.KINDS) and proofs.reused == 0
    assert [r.op for r in proofs.records] == [fa.OP, ln.OP] + [fl.OP] * 9


def test_a_study_proves_the_layer_norm_prologue_and_rejects_a_differing_tile(monkeypatch, proof_sandbox, model):
    """A study that names LayerNorm-prologue tiles adds their launches (norm2 inside ffn_in, with and without its
    GELU, and norm1 inside the packed Q|K|V) to the model's proof; each keeps only its bit-identical tiles, and the
    other GEMM forms take only the GEMM tiles named."""
    FakeKernels(monkeypatch, bad={"ln_m64n16_w8"})
    proofs = mp.prove_model_kernels(model, CONFIG, torch.float16, CPU, ("linear",), reuse=False,
                                    launches={"linear": ["ln_m64n32_w8", "ln_m64n16_w8", "m64n64"]})
    norm = {(r.shape["n"], r.shape["form"]): r for r in proofs.records if fl.NORM_PROLOGUE in r.shape["form"]}
    assert set(norm) == {(32, fl.norm_form("none")), (32, fl.norm_form("gelu")), (48, fl.norm_form("none"))}
    for record in norm.values():
        assert record.proven and record.chosen == "ln_m64n32_w8", record.reason
        assert {r.launch: r.status for r in record.launches} == {"ln_m64n32_w8": "proven", "ln_m64n16_w8": "differs"}
    others = [r for r in proofs.records if r.op == fl.OP and fl.NORM_PROLOGUE not in r.shape["form"]
              and "layer_norm" not in r.shape["form"].split("+")]
    assert others and all([x.launch for x in r.launches] == ["m64n64"] for r in others)


def test_proofs_are_reused_in_the_same_environment_and_made_again_in_another(monkeypatch, proof_sandbox, model):
    fakes = FakeKernels(monkeypatch)
    first = mp.prove_model_kernels(model, CONFIG, torch.float16, CPU)
    runs = len(fakes.calls)
    proof_sandbox.forget_proofs()  # a new process: the on-disk cache answers
    again = mp.prove_model_kernels(model, CONFIG, torch.float16, CPU)
    assert again.reused == len(first.records) and len(fakes.calls) == runs
    assert [r.to_dict() for r in again.records] == first.to_list()
    monkeypatch.setattr(torch, "__version__", "9.9.9+other")  # another torch build: other machine code
    proof_sandbox._kernel_environment.cache_clear()
    other = mp.prove_model_kernels(model, CONFIG, torch.float16, CPU)
    assert other.reused == 0 and len(fakes.calls) > runs
    assert {r.environment["torch"] for r in other.records} == {"9.9.9+other"}


def test_manifest_records_are_adopted_only_in_their_own_environment(monkeypatch, proof_sandbox, model):
    FakeKernels(monkeypatch)
    recorded = mp.prove_model_kernels(model, CONFIG, torch.float16, CPU).to_list()
    proof_sandbox.forget_proofs()
    assert mp.adopt_recorded(recorded, CPU) == (len(recorded), 0)
    changed = [dict(r, environment=dict(r["environment"], device_name="Another GPU")) for r in recorded]
    assert mp.adopt_recorded(changed, CPU) == (0, len(recorded))
    # a GEMM record whose shape lacks its form (its key needs it) is foreign, not an error at load
    gemms = [r for r in recorded if r["op"] == fl.OP]
    formless = [dict(r, shape={k: v for k, v in r["shape"].items() if k != "form"}) for r in gemms]
    assert gemms and mp.adopt_recorded(formless, CPU) == (0, len(gemms))


def test_a_candidate_is_not_built_when_the_kernel_it_adds_is_unproven(monkeypatch, proof_sandbox, model):
    FakeKernels(monkeypatch, refuse={"layer_norm"})
    siblings = (KERNEL_ATTENTION, KERNELS, GEMMS)
    assert prove_candidate_kernels(KERNEL_ATTENTION, model, CONFIG, torch.float16, CPU, siblings).proven("attention")
    with pytest.raises(CandidateSkipped, match="the layer_norm kernel it adds to torch-compile-faithful-attention "
                                               "is not proven here.*no nvcc here"):
        prove_candidate_kernels(KERNELS, model, CONFIG, torch.float16, CPU, siblings)
    # asked for alone, it still runs the attention kernel: built
    assert prove_candidate_kernels(KERNELS, model, CONFIG, torch.float16, CPU, (KERNELS,)).proven("attention")
    assert prove_candidate_kernels(GEMMS, model, CONFIG, torch.float16, CPU, siblings).proven("linear")


def test_a_dependent_launch_candidate_is_not_built_when_the_kernel_it_adds_to_the_plain_graph_is_unproven(
        monkeypatch, proof_sandbox, model):
    """A default GPU build may time ``GEMMS-pdl`` beside the plain graphs: with the GEMM unproven it would be the
    plain ``KERNELS`` graph with dependent launches, which the build already compiles plainly: not built."""
    FakeKernels(monkeypatch, refuse={"linear"})
    pdl = f"{GEMMS}-pdl"
    with pytest.raises(CandidateSkipped, match="the linear kernel it adds to torch-compile-faithful-kernels is not"):
        prove_candidate_kernels(pdl, model, CONFIG, torch.float16, CPU, (KERNEL_ATTENTION, KERNELS, GEMMS, pdl))
    # beside its own smaller "-pdl" form it names that one
    with pytest.raises(CandidateSkipped, match="adds to torch-compile-faithful-kernels-pdl is not"):
        prove_candidate_kernels(pdl, model, CONFIG, torch.float16, CPU, (f"{KERNELS}-pdl", pdl, KERNELS))
    # alone, its other kernels are proven: built
    assert prove_candidate_kernels(pdl, model, CONFIG, torch.float16, CPU, (pdl,)).proven("attention")


def test_on_a_machine_without_our_kernels_the_candidates_are_skipped_with_the_reason(proof_sandbox, tmp_path):
    """The CPU: every kernel op refuses, so an our-kernel candidate would be plain ATen: not built, and the
    manifest's entry says why (the end-to-end build summary shows it)."""
    model = build_models(CONFIG, torch.float32, CPU)[0]
    shown = []
    ctx = BuildContext(CONFIG, torch.float32, CPU, model, tmp_path, options={"torch_compile_candidates": [GEMMS]},
                       progress=shown.append)
    result = BACKEND.build(ctx, GEMMS)
    assert result.status == SKIPPED and result.reason.startswith("skipped: none of its kernel ops is proven")
    assert "cpu device" in result.reason and not result.files
    assert shown and all(line.startswith("proving ") for line in shown)  # the build's bar shows each op shape


def test_the_build_summary_lists_each_proven_op_shape_once(monkeypatch, proof_sandbox, model):
    from kkdeploy.pipeline.build import proofs_table

    FakeKernels(monkeypatch)
    records = mp.prove_model_kernels(model, CONFIG, torch.float16, CPU).to_list()
    manifest = {"candidates": [{"name": KERNELS, "options": {"kernel_proofs": records[:2]}},
                               {"name": GEMMS, "options": {"kernel_proofs": records}}, {"name": "torch-compile"}]}
    table = proofs_table(manifest)
    assert table.row_count == len(records)
    assert table.title == "Kernel proofs (bit-identical launches; timing: wall clock, one call at a time)"
    gpu = [dict(r, timer="16 calls per graph under 0.05 ms") for r in records]  # how the records say they were timed
    title = proofs_table({"candidates": [{"name": GEMMS, "options": {"kernel_proofs": gpu}}]}).title
    assert title == "Kernel proofs (bit-identical launches; timing: 16 calls per graph under 0.05 ms)"
    assert proofs_table({"candidates": [{"name": "torch-compile", "options": {}}]}) is None


def test_loading_elsewhere_proves_again_and_names_a_kernel_that_no_longer_holds(monkeypatch, proof_sandbox, model,
                                                                               tmp_path):
    """``kkdeploy.load`` in the build's environment adopts the manifest's proofs; elsewhere it proves again (cached
    beside the artifacts), and a kernel op no longer bit-identical there runs ATen with a sentence saying so."""
    from engines.torch_compile import adopt_kernel_proofs

    fakes = FakeKernels(monkeypatch)
    recorded = mp.prove_model_kernels(model, CONFIG, torch.float16, CPU, kinds=("attention",)).to_list()
    options = {"kernel_proofs": recorded}
    proof_sandbox.forget_proofs()
    runs = len(fakes.calls)
    assert adopt_kernel_proofs(tmp_path, KERNEL_ATTENTION, options, model, CONFIG, torch.float16, CPU) == ""
    assert len(fakes.calls) == runs  # the build's environment: adopted, nothing proven again
    # another machine, where the attention's launches all differ: proven again, lost, and said
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "Other GPU")
    monkeypatch.setattr(torch, "__version__", "9.9.9+other")
    proof_sandbox._kernel_environment.cache_clear()
    proof_sandbox.forget_proofs()
    fakes.bad = set(fa.LAUNCHES)
    note = adopt_kernel_proofs(tmp_path, KERNEL_ATTENTION, options, model, CONFIG, torch.float16, CPU)
    assert note.startswith(f"{KERNEL_ATTENTION}: 1 kernel op(s) proven at build time are not bit-identical here")
    assert "run ATen's ops (the same bits, slower)" in note and fa.OP in note
    assert list((tmp_path / "proofs").glob(f"{fa.OP}-*.json"))  # cached beside the artifacts


def test_the_kernel_self_test_is_the_proof_step_and_reads_its_records(monkeypatch, proof_sandbox, model):
    """scripts/kernel_selftest.py: the same ``prove_model_kernels`` (every launch with --all-launches), one row per
    op shape; bad --kinds is a one-line usage error."""
    from tests.conftest import load_script

    script = load_script("kernel_selftest")
    FakeKernels(monkeypatch, bad={"rows2", "rows2_full", "rows2_full_early"})
    proofs = mp.prove_model_kernels(model, CONFIG, torch.float16, CPU, ("layer_norm",), reuse=False,
                                    launches=script.all_launches())
    (row,) = script.rows(3, proofs.to_list())
    # every launch that takes rows of 16, the study launch rows2_full_early among them: one of four bit-identical
    assert row[:5] == [3, ln.OP, "rows=16 width=16", "1/4", "rows1"] and row[-1] > 0
    with pytest.raises(SystemExit):
        script.parse_args(["--kinds", "softmax", "--out", "x"])
    args = script.parse_args(["--shapes", "--dims", "16,200,384,6,768,3", "--out", "x"])
    assert args.shapes == [] and args.dims == [(16, 200, 384, 6, 768, 3)]  # non-official shapes, as the builds take
    for bad in ("16,200,384", "16,200,384,6,768,x"):
        with pytest.raises(SystemExit):
            script.parse_args(["--dims", bad, "--out", "x"])
    # a study of a few launches, named; the other kinds as a build proves them
    args = script.parse_args(["--launches", "linear=auto,tma_ws", "attention=cached64w8_mdiv", "--out", "x"])
    assert args.launches == {"linear": ["auto", "tma_ws"], "attention": ["cached64w8_mdiv"]}
    assert script.parse_args(["--out", "x"]).launches is None
    for bad in (["--launches", "linear=tma_nope"], ["--launches", "softmax=auto"], ["--launches", "linear="],
                ["--launches", "linear=auto", "--all-launches"], ["--stall-s", "0"]):
        with pytest.raises(SystemExit):
            script.parse_args([*bad, "--out", "x"])
    # every launch, less the tiles known never to return (still studied when named)
    assert set(fl.HANGS) and not set(fl.HANGS) & set(script.all_launches()["linear"])
    assert script.parse_args(["--launches", "linear=tma_ws", "--out", "x"]).launches == {"linear": ["tma_ws"]}
    # the Q|K|V attention's forms are the linear kind's launches too (proven beside the GEMMs)
    from kkdeploy.kernels import qkv_attention as qa

    assert set(qa.LAUNCHES) <= set(script.all_launches()["linear"])
    assert set(fl.NORM_TILES) <= set(script.all_launches()["linear"])  # and the LayerNorm prologue's tiles
    args = script.parse_args(["--launches", "linear=m64n64,regs_m16,whole,whole_w8", "--out", "x"])
    assert args.launches == {"linear": ["m64n64", "regs_m16", "whole", "whole_w8"]}
    # a study small enough for one device call bounds a hung launch's silence below the call's limit
    assert script.parse_args(["--out", "x"]).stall_s == script.STUDY_STALL_S
    assert script.parse_args(["--stall-s", "150", "--out", "x"]).stall_s == 150.0


def test_bench_json_keeps_each_candidates_proofs(monkeypatch, proof_sandbox, model):
    """What the bench's processes proved (or found cached) reaches bench.json: the records once, the seconds per
    process."""
    from kkdeploy.config import official_config
    from kkdeploy.pipeline.bench import ShapeJob, aggregate_shape

    FakeKernels(monkeypatch)
    records = mp.prove_model_kernels(model, CONFIG, torch.float16, CPU, ("attention",)).to_list()

    def worker(seconds):
        return {"dtype": "float16", "limits": None, "backends": {
            GEMMS: {"status": "passed", "reason": "", "failed_elements": {"all-valid": 0}, "max_abs": 0.0,
                    "proof_seconds": seconds, "kernel_proofs": records}}}

    shape = aggregate_shape(ShapeJob("shape-03", 3, official_config(3)), [worker(1.5), worker(0.0)], [])
    entry = shape["backends"][GEMMS]
    assert entry["kernel_proofs"] == records and entry["proof_seconds_per_process"] == [1.5, 0.0]


def test_the_first_our_kernel_candidate_proves_for_all_of_them_in_one_step(monkeypatch, proof_sandbox, model):
    fakes = FakeKernels(monkeypatch)
    siblings = (KERNEL_ATTENTION, KERNELS, GEMMS)
    first = prove_candidate_kernels(KERNEL_ATTENTION, model, CONFIG, torch.float16, CPU, siblings)
    assert [r.op for r in first.records] == [fa.OP] and first.reused == 0  # its own kind's records only
    runs = len(fakes.calls)
    kernels = prove_candidate_kernels(KERNELS, model, CONFIG, torch.float16, CPU, siblings)
    gemms = prove_candidate_kernels(GEMMS, model, CONFIG, torch.float16, CPU, siblings)
    assert len(fakes.calls) == runs  # the LayerNorm and the GEMMs were proven in the first step
    assert [r.op for r in kernels.records] == [fa.OP, ln.OP] and kernels.reused == 2
    assert [r.op for r in gemms.records] == [fa.OP, ln.OP] + [fl.OP] * 7 and gemms.reused == 9
    alone = prove_candidate_kernels(KERNEL_ATTENTION, model, CONFIG, torch.float16, CPU)  # bench: its kinds only
    assert [r.op for r in alone.records] == [fa.OP]


def test_the_random_inputs_hold_zeros_and_spread_magnitudes_and_key_the_proofs():
    """The proofs' random inputs (``proof.RANDOM_INPUTS``): besides N(0, 1) at two scales, one with a quarter exact
    zeros (signed) and one whose magnitudes spread over 2^-12..2^3, the inputs where two MMA instructions can round a
    k-step's sum apart. Drawn from the generator alone, so a seed gives the same inputs; their recipe is in every
    proof's environment key, so a record proven on other random inputs is not found."""
    from kkdeploy.kernels import proof

    t = torch.zeros(64, 128, dtype=torch.float16)
    draw = {spec.label: proof.random_like(t, spec, torch.Generator().manual_seed(5)) for spec in proof.RANDOM_INPUTS}
    assert list(draw) == ["x1", "x8", "x1, a quarter zeros", "x1, magnitudes 2^-12..2^3"]
    assert all(d.dtype == torch.float16 and d.shape == t.shape and torch.isfinite(d).all() for d in draw.values())
    zeros = draw["x1, a quarter zeros"] == 0
    assert 0.2 < zeros.float().mean() < 0.3 and (zeros & draw["x1, a quarter zeros"].signbit()).any()
    assert (zeros & ~draw["x1, a quarter zeros"].signbit()).any() and (draw["x1"] == 0).sum() == 0
    spread = draw["x1, magnitudes 2^-12..2^3"].float().abs()
    assert spread.max() / spread[spread > 0].median() > 8 and (spread < 2 ** -10).any()
    assert 4 < draw["x8"].float().std() < 12
    again = proof.random_like(t, proof.RANDOM_INPUTS[2], torch.Generator().manual_seed(5))
    assert torch.equal(again.view(torch.int16), draw["x1, a quarter zeros"].view(torch.int16))
    assert fa.proof_environment(CPU)["cases"] == proof.RANDOM_INPUTS_DIGEST
    assert proof.launch_table_digest([{"label": "x1"}]) != proof.RANDOM_INPUTS_DIGEST

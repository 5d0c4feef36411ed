"""engines.layer_graph: the layer launches as build candidates, proven op by op before they are built or served.

On the CPU: availability, the row limit, the candidate names, the proof against the reference's intermediates
(with stand-in kernels that are the reference, then one element changed), and the one-line reason that names the
first differing part. Under Triton's interpreter, the real launches on the CPU differ from the CPU's ATen float16
ops, and the proof says where: that is the refusal path a GPU build takes when a part is not bit-identical.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from engines import layer_graph, recipe, registry
from kkdeploy import TransformerConfig
from kkdeploy.errors import KKError
from kkdeploy.kernels import layer_kernels as lk
from kkdeploy.models.weights import build_models
from tests.conftest import run_interpreter_script

CONFIG = TransformerConfig(batch_size=2, seq_len=24, d_model=32, num_heads=2, ffn_dim=64, num_layers=2, causal=True)


def test_names_availability_and_the_row_limit():
    backend = layer_graph.BACKEND
    assert "CUDA devices" in backend.unavailable_reason(torch.device("cpu"), torch.float16)
    assert "float16 only" in backend.unavailable_reason(torch.device("cuda"), torch.float32)
    assert backend.unavailable_reason(torch.device("cuda"), torch.float16) is None
    assert registry.choice("layer-graph")[1].variants == ("layer-graph", )
    assert registry.choice("layer-graph-split")[1].variants == ("layer-graph-split", )
    assert "layer-graph" not in registry.default_choices("cuda")  # opt-in until it is measured faster
    assert recipe.parse("layer-graph-split").split_launches and not recipe.parse("layer-graph").split_launches
    assert recipe.parse("layer-graph").describe() == "reference, one persistent launch"
    with pytest.raises(KKError, match="-split applies to layer-graph only"):
        recipe.parse("torch-graph-split")
    big = TransformerConfig(batch_size=10000, seq_len=128, d_model=128, num_heads=4, ffn_dim=128, num_layers=4)
    assert "1,280,000 rows" in layer_graph.refusal(big, torch.float16, torch.device("cuda"))
    assert layer_graph.launch_for("layer-graph", CONFIG).persistent
    assert not layer_graph.launch_for("layer-graph-split", CONFIG).persistent
    # on a GPU (this process: no interpreter) the row chain is in registers where that form has run there: the
    # persistent launch at D = 128, the split launches at 32 and 128; never the next block's Q|K|V (slower)
    assert not lk.INTERPRET
    d128 = TransformerConfig(batch_size=2, seq_len=24, d_model=128, num_heads=2, ffn_dim=128, num_layers=2)
    persistent = layer_graph.launch_for("layer-graph", d128)
    assert persistent.chain_in_registers and not persistent.qkv_in_chain
    assert persistent.name() == "persistent_cached_mdiv_w8_p1_regs"
    assert layer_graph.launch_for("layer-graph", CONFIG).name() == "persistent_cached_mdiv_w8_p1"  # D = 32: faulted
    wide = TransformerConfig(batch_size=2, seq_len=24, d_model=256, num_heads=2, ffn_dim=512, num_layers=2)
    assert not layer_graph.launch_for("layer-graph", wide).chain_in_registers  # rows of 256: through L2
    split = layer_graph.launch_for("layer-graph-split", CONFIG)  # the block launches' parts B-E in registers
    assert split.chain_in_registers and not split.qkv_in_chain and split.name() == "cached_mdiv_split_w8_regs"
    d64 = TransformerConfig(batch_size=2, seq_len=24, d_model=64, num_heads=2, ffn_dim=256, num_layers=2)
    assert layer_graph.launch_for("layer-graph-split", d64).name() == "cached_mdiv_split_w8"  # never run on a GPU


def test_a_machine_without_cuda_s_libdevice_is_told_what_to_install(monkeypatch, tmp_path):
    from kkdeploy.kernels import libdevice

    monkeypatch.setattr(lk, "refusal", lambda config, dtype, device: None)  # as on a GPU
    monkeypatch.setattr(lk, "INTERPRET", False)
    found = libdevice.cuda_libdevice
    monkeypatch.setattr(libdevice, "cuda_libdevice", lambda: None)
    why = layer_graph.refusal(CONFIG, torch.float16, torch.device("cuda"))
    assert why.startswith("CUDA's libdevice.10.bc not found") and libdevice.LIBDEVICE_ENV in why
    monkeypatch.setattr(libdevice, "cuda_libdevice", found)
    monkeypatch.setenv(libdevice.LIBDEVICE_ENV, str(tmp_path / "missing.bc"))
    assert "missing.bc: no such file" in layer_graph.refusal(CONFIG, torch.float16, torch.device("cuda"))


class ReferenceAsKernels:
    """Stand-in kernels whose buffers are the reference's own intermediates (optionally one element changed)."""

    def __init__(self, model, spoil=None):
        self.model, self.spoil = model, spoil
        self.launch = lk.LayerLaunch(persistent=True)

    def __call__(self, x, mask):
        self.last = lk.reference_intermediates(self.model, x, mask)
        if self.spoil:
            block, part = self.spoil
            self.last["blocks"][block][part][0, 0] += 1
        return self.last["blocks"][-1]["hn"]

    def intermediates(self, batch, seq_len):
        return self.last


def test_the_proof_passes_kernels_that_are_the_reference_and_names_the_first_differing_part():
    model = build_models(CONFIG, torch.float32, "cpu")[0]
    record = layer_graph.prove_layers(ReferenceAsKernels(model), model, CONFIG, torch.float32, torch.device("cpu"), 7)
    assert record["differing"] == 0 and layer_graph.proof_failure(record) is None
    assert [(c["seed"], c["padding_ratio"]) for c in record["cases"]] == [(7, 0.0), (7, 0.25), (8, 0.0), (8, 0.25)]
    assert record["launch"] == "persistent_cached_mdiv_w8_p1"
    spoiled = layer_graph.prove_layers(ReferenceAsKernels(model, spoil=(1, "x1")), model, CONFIG, torch.float32,
                                       torch.device("cpu"), 7)
    assert all(c["first"] == "block 1 x1" for c in spoiled["cases"])
    stalled = dict(record, stalls=3)
    assert layer_graph.proof_failure(stalled) == (
        "persistent_cached_mdiv_w8_p1: 3 waits between its programs gave up (a readiness counter never reached its "
        "count); its answers are not trusted")
    assert layer_graph.proof_failure(spoiled) == (
        "persistent_cached_mdiv_w8_p1 is not bit-identical to the reference's ops: block 1 x1 differs in 1 element "
        "(seed 7, padding 0.0)")


INTERPRETER_SCRIPT = textwrap.dedent(
    """
    import json
    import torch
    from engines import layer_graph
    from kkdeploy.config import TransformerConfig
    from kkdeploy.errors import KKError
    from kkdeploy.models.weights import build_models

    config = TransformerConfig(batch_size=2, seq_len=24, d_model=32, num_heads=2, ffn_dim=64, num_layers=2,
                               causal=True)
    model = build_models(config, torch.float16, "cpu")[0]
    out = {}
    for candidate in ("layer-graph", "layer-graph-split"):
        try:
            layer_graph.make_runner(model, config, torch.float16, torch.device("cpu"), candidate, 1234)
            out[candidate] = "built"
        except KKError as exc:
            out[candidate] = str(exc)
    print("RESULTS " + json.dumps(out))
    """
)


def test_launches_that_differ_from_this_machine_s_ops_are_refused_with_the_part():
    """The interpreter's launches against the CPU's float16 ATen ops: not bit-identical, so no runner is made,
    and the reason names the first part that differs (no CUDA graph is ever captured on the CPU)."""
    results = run_interpreter_script(INTERPRETER_SCRIPT)
    for candidate, launch in (("layer-graph", "persistent_cached_mdiv_w8_p1_regs"),
                              ("layer-graph-split", "cached_mdiv_split_w8_regs")):
        assert results[candidate].startswith(f"{launch} is not bit-identical to the reference's ops: "), results
        assert "differs in" in results[candidate] and "(seed 1234, padding 0.0)" in results[candidate], results


def test_the_bench_takes_them_by_name_and_says_why_not_here():
    from kkdeploy.pipeline import bench

    assert bench.parse_candidates("layer-graph,layer-graph-split") == ["layer-graph", "layer-graph-split"]
    assert "layer-graph" not in bench.default_candidates(torch.device("cuda"), torch.float16, "strict")
    model = build_models(CONFIG, torch.float16, "cpu")[0]
    with pytest.raises(KKError, match="^skipped: unavailable: the layer launches are Triton kernels for CUDA"):
        bench.make_candidate("layer-graph", model, CONFIG, torch.float16, torch.device("cpu"),
                             bench.BenchOptions(device="cpu", dtype=torch.float16), {})


def test_loading_proves_again_and_refuses_what_does_not_reproduce(monkeypatch, tmp_path):
    """``load`` checks the artifact was built for this model, runs the proof again (``make_runner``), and refuses a
    runner whose output fingerprint is not the build's, in one line (``kkdeploy.load`` then serves the fallback)."""
    from safetensors.torch import save_file

    from kkdeploy.artifacts import WEIGHTS_FILE
    from kkdeploy.config import dtype_name

    model = build_models(CONFIG, torch.float16, "cpu")[0]
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / WEIGHTS_FILE))
    proofs = []

    class Runner:
        closed = False

        def close(self):
            self.closed = True

    made = []

    def make_runner(model, config, dtype, device, candidate, seed):
        proofs.append((candidate, seed))
        made.append(Runner())
        return made[-1], {"launch": "persistent_cached_mdiv_w8_p1", "cases": [], "differing": 0, "stalls": 0}

    monkeypatch.setattr(layer_graph, "refusal", lambda config, dtype, device: None)
    monkeypatch.setattr(layer_graph, "make_runner", make_runner)
    monkeypatch.setattr(layer_graph, "output_fingerprint", lambda *a, **k: "f" * 64)
    options = {"config": CONFIG.to_dict(), "dtype": dtype_name(torch.float16),
               "layer_proof": {"cases": [{"seed": 77}]}, "fingerprint": {"sha256": "f" * 64}}
    entry = {"name": "layer-graph", "options": options}
    runner = layer_graph.BACKEND.load(tmp_path, entry, CONFIG, torch.float16, torch.device("cpu"))
    assert proofs == [("layer-graph", 77)] and runner.layer_proof["launch"] == "persistent_cached_mdiv_w8_p1"
    other = dict(entry, options=dict(options, fingerprint={"sha256": "0" * 64}))
    with pytest.raises(KKError, match="does not reproduce the validated output"):
        layer_graph.BACKEND.load(tmp_path, other, CONFIG, torch.float16, torch.device("cpu"))
    assert made[-1].closed and not made[0].closed  # the refused runner's graph and buffers are released
    wrong = dict(entry, options=dict(options, dtype="float32"))
    with pytest.raises(KKError, match="was built for float32"):
        layer_graph.BACKEND.load(tmp_path, wrong, CONFIG, torch.float16, torch.device("cpu"))


def test_a_build_records_the_proof_and_hands_its_runner_on(monkeypatch, tmp_path):
    """``build`` skips (one line) where the launches cannot run, else proves (``make_runner``), fingerprints, and
    records the proof in the manifest entry's options; the runner goes to the pipeline to validate and time."""
    from engines.base import BUILT, BuildContext, CandidateSkipped

    model = build_models(CONFIG, torch.float16, "cpu")[0]
    ctx = BuildContext(config=CONFIG, dtype=torch.float16, device=torch.device("cpu"), model=model, out_dir=tmp_path,
                       validation_plan={"seed": 99}, built_runners={})
    with pytest.raises(CandidateSkipped, match="Triton kernels for CUDA|CUDA-only"):
        layer_graph.BACKEND.build(ctx, "layer-graph")
    record = {"launch": "cached_mdiv_split_w8", "cases": [{"seed": 99}], "differing": 0, "stalls": 0}
    seeds = []
    monkeypatch.setattr(layer_graph, "refusal", lambda config, dtype, device: None)
    monkeypatch.setattr(layer_graph, "make_runner",
                        lambda m, c, dt, dev, name, seed, proven: (seeds.append(seed) or object(), record))
    monkeypatch.setattr(layer_graph, "output_fingerprint", lambda *a, **k: "a" * 64)
    result = layer_graph.BACKEND.build(ctx, "layer-graph-split")
    assert result.status == BUILT and result.backend == "layer_graph" and seeds == [99]
    assert result.options["layer_proof"] is record and result.options["launch"] == "cached_mdiv_split_w8"
    assert result.options["fingerprint"]["sha256"] == "a" * 64
    assert result.options["mask_modes"] == ["all-valid", "padded"]
    assert "layer-graph-split" in ctx.built_runners and result.to_dict()["recipe"]["split_launches"]


def test_on_a_gpu_the_build_proves_in_a_fresh_process_first_and_a_dead_child_is_one_line(monkeypatch, tmp_path):
    """A launch that faults ends the proving child, not the build (whose later candidates need a working device):
    the candidate fails with the reason and its launches never run in the build's process. The engine is loaded in
    a fresh process first wherever it loads (its launches are proven again there)."""
    from engines.base import BuildContext
    from kkdeploy.kernels import proof_process as pp

    model = build_models(CONFIG, torch.float16, "cpu")[0]
    ctx = BuildContext(config=CONFIG, dtype=torch.float16, device=torch.device("cpu"), model=model, out_dir=tmp_path,
                       validation_plan={"seed": 99}, built_runners={})
    monkeypatch.setattr(layer_graph, "refusal", lambda config, dtype, device: None)
    monkeypatch.setattr(pp, "isolation_wanted", lambda device: True)
    monkeypatch.setattr(layer_graph, "make_runner", lambda *a: pytest.fail("ran the launches in the build's process"))
    asked = []

    def dead(task, model_, config, dtype, device, args, **kw):
        asked.append((task, args))
        return pp.ChildOutcome(pp.CRASHED, None, "crashed: SIGSEGV (signal 11)", args["candidate"], 1.0)

    monkeypatch.setattr(pp, "run_proof_child", dead)
    with pytest.raises(KKError, match=r"^layer-graph: its proof crashed: SIGSEGV \(signal 11\) in a fresh process$"):
        layer_graph.BACKEND.build(ctx, "layer-graph")
    assert asked == [("engines.layer_graph:layer_proof_task", {"candidate": "layer-graph", "seed": 99})]
    spoiled = {"launch": "x", "stalls": 0, "cases": [{"seed": 99, "padding_ratio": 0.0, "differing": 2, "first": "qkv0",
                                                      "parts": {"hn0": 0, "qkv0": 2, "blocks": []}}]}
    monkeypatch.setattr(pp, "run_proof_child", lambda *a, **kw: pp.ChildOutcome(pp.OK, spoiled, "", None, 1.0))
    with pytest.raises(KKError, match="x is not bit-identical to the reference's ops: qkv0 differs in 2 elements"):
        layer_graph.BACKEND.build(ctx, "layer-graph")
    # a record with no differing element: the build's process takes it and does not prove the launches again
    clean = {"launch": "x", "stalls": 0, "differing": 0, "cases": [{"seed": 99, "padding_ratio": 0.0, "differing": 0,
                                                                     "first": None}]}
    monkeypatch.setattr(pp, "run_proof_child", lambda *a, **kw: pp.ChildOutcome(pp.OK, clean, "", None, 1.0))
    handed = []
    monkeypatch.setattr(layer_graph, "make_runner", lambda *a: handed.append(a[-1]) or (object(), a[-1]))
    monkeypatch.setattr(layer_graph, "output_fingerprint", lambda *a, **k: "b" * 64)
    assert layer_graph.BACKEND.build(ctx, "layer-graph").options["layer_proof"] is clean and handed == [clean]
    assert layer_graph.BACKEND.loads_native_code({"name": "layer-graph"})

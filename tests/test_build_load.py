"""End to end on the CPU: build -> validate -> choose -> write; load verifies and serves or falls back."""

import json
import logging
import shutil

import pytest
import torch

import kkdeploy
from engines.base import FAILED, PASSED
from kkdeploy import artifacts, generate_case, official_config
from kkdeploy.pipeline.build import BuildRequest, run_build
from kkdeploy.pipeline.chooser import FALLBACK
from kkdeploy.cli import main
from kkdeploy.errors import KKError
from kkdeploy.models.weights import build_models
from validation import CONTRACTS, compare_outputs

from .conftest import SMALL

FAST_TIMING = dict(warmups=2, repeats=5, rounds=1)


@pytest.fixture(scope="module")
def shape3(tmp_path_factory):
    """`kkdeploy build --shape 3` (float32 on the CPU), with a short timing protocol."""
    out = tmp_path_factory.mktemp("art") / "shape-03"
    request = BuildRequest(config=official_config(3), dtype=torch.float32, device=torch.device("cpu"), out=out,
                           shape_id=3, backends=["ort-cpu", "trt", "torch-graph"], **FAST_TIMING)
    manifest = run_build(request)
    return out, manifest


def test_build_writes_a_complete_verified_directory(shape3):
    out, manifest = shape3
    names = {c["name"]: c for c in manifest["candidates"]}
    assert names["ort-cpu"]["status"] == PASSED
    assert names["ort-cpu"]["validation"]["failed_elements"] == 0
    assert set(names["ort-cpu"]["validation"]["failed_by_mode"]) == {"all-valid", "padded"}
    assert names["trt"]["status"] == "unavailable" and "tensorrt" in names["trt"]["reason"]
    assert names["torch-graph"]["status"] == "unavailable" and "CUDA" in names["torch-graph"]["reason"]
    for required in ("model.onnx", "export.json", "ort-cpu.optimized.onnx", "weights.safetensors",
                     "validation.json", "bench.json", "latency.png", "manifest.json"):
        assert (out / required).is_file(), required
    assert manifest["files"] == artifacts.hash_tree(out)
    assert manifest["choice"]["candidate"] in ("ort-cpu", FALLBACK) and manifest["choice"]["reason"]
    assert manifest["validation"]["mask_modes"] == ["all-valid", "padded"]
    env = manifest["environment"]
    assert env["device"]["type"] == "cpu" and env["versions"]["onnxruntime"] and env["versions"]["torch"]
    validation = json.loads((out / "validation.json").read_text())
    trials = validation["candidates"]["ort-cpu"]["trials"]
    assert len(trials) == 10 and {t["seed"] for t in trials} == set(range(1234, 1239))
    assert manifest["fallback"]["sdpa_layers"] in (0, 1)
    assert manifest["fallback"]["validation"]["status"] in (PASSED, FAILED)


def test_the_manifest_says_where_the_build_spent_its_time(shape3):
    from kkdeploy.pipeline.build import stages_line

    _, manifest = shape3
    stages = manifest["build_stages"]
    assert list(stages) == ["weights", "export", "candidates", "fresh processes", "load", "validate", "time", "write"]
    assert all(seconds >= 0 for seconds in stages.values())
    assert sum(stages.values()) <= manifest["build_seconds"] + 0.1  # stages inside the build's own clock
    assert stages["validate"] > 0 and stages["time"] > 0
    line = stages_line(manifest)
    assert line.startswith(f"build {manifest['build_seconds']:.1f} s: weights ") and "candidates" in line
    assert stages_line({"build_seconds": 3.0}) is None  # an artifact built before stage times existed
    made_up = {"build_seconds": 61.0, "build_stages": {"weights": 1.0, "candidates": 50.0, "validate": 10.0},
               "candidates": [{"name": n, "build_seconds": t} for n, t in
                              (("a", 1.0), ("b", 30.0), ("c", 0.01), ("d", 19.0), ("e", 0.5))]}
    assert stages_line(made_up) == ("build 61.0 s: weights 1.0, candidates 50.0 (the slowest: b 30.0, d 19.0, a 1.0), "
                                    "validate 10.0")
    made_up["candidates"][1]["options"] = {"proof_seconds": 14.3, "proof_phases": {"cases": 1.04, "compile": 7.1,
                                                                                  "prove": 6.16}}
    assert stages_line(made_up) == ("build 61.0 s: weights 1.0, candidates 50.0 (the slowest: b 30.0, d 19.0, a 1.0), "
                                    "of which the kernel proof 14.3 (cases 1.0, compile 7.1, prove 6.2), validate 10.0")


def test_load_serves_and_matches_reference(shape3):
    out, manifest = shape3
    runner = kkdeploy.load(out)
    assert runner.backend == manifest["choice"]["candidate"]
    config = official_config(3)
    ref, _ = build_models(config, torch.float32, "cpu")
    for padding in (0.0, 0.25):
        x, mask = generate_case(config, "cpu", torch.float32, 99, padding_ratio=padding)
        with torch.inference_mode():
            assert compare_outputs(ref(x, mask), runner(x, mask), *CONTRACTS["strict"]).passed


def test_outputs_are_owned_by_the_caller(shape3):
    out, _ = shape3
    runner = kkdeploy.load(out)
    x1, m = generate_case(official_config(3), "cpu", torch.float32, 1)
    x2, _ = generate_case(official_config(3), "cpu", torch.float32, 2)
    y1 = runner(x1, m)
    kept = y1.clone()
    runner(x2, m)
    assert torch.equal(y1, kept)


@pytest.fixture
def copy_of(shape3, tmp_path):
    out, _ = shape3
    dst = tmp_path / "copy"
    shutil.copytree(out, dst)
    return dst


def _engine_choice(path):
    manifest = json.loads((path / "manifest.json").read_text())
    if manifest["choice"]["candidate"] == FALLBACK:  # force the engine so the checks have something to refuse
        manifest["choice"] = {"candidate": "ort-cpu", "backend": "ort", "all_valid_only": False, "reason": "test"}
        (path / "manifest.json").write_text(json.dumps(manifest))
    return manifest


@pytest.mark.parametrize("victim", ["model.onnx", "ort-cpu.optimized.onnx", "validation.json", "export.json"])
def test_flipped_byte_makes_load_fall_back_naming_the_file(copy_of, victim, caplog):
    _engine_choice(copy_of)
    data = bytearray((copy_of / victim).read_bytes())
    data[len(data) // 2] ^= 0x01
    (copy_of / victim).write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="kkdeploy"):
        runner = kkdeploy.load(copy_of)
    assert runner.backend == FALLBACK
    assert victim in runner.reason and "modified" in runner.reason
    assert any(victim in r.message for r in caplog.records)


def test_tampered_weights_are_refused(copy_of):
    data = bytearray((copy_of / "weights.safetensors").read_bytes())
    data[-3] ^= 0x01
    (copy_of / "weights.safetensors").write_bytes(bytes(data))
    with pytest.raises(KKError, match="weights.safetensors does not match"):
        kkdeploy.load(copy_of)


@pytest.mark.parametrize("key, value, expect", [
    (("environment", "device", "name"), "NVIDIA Imaginary GPU", "device name"),
    (("environment", "versions", "onnxruntime"), "0.0.1", "onnxruntime 0.0.1"),
])
def test_foreign_environment_refuses_the_engine(copy_of, key, value, expect):
    manifest = _engine_choice(copy_of)
    node = manifest
    for k in key[:-1]:
        node = node[k]
    node[key[-1]] = value
    (copy_of / "manifest.json").write_text(json.dumps(manifest))
    runner = kkdeploy.load(copy_of)
    assert runner.backend == FALLBACK and expect in runner.reason


def test_foreign_or_missing_manifest(tmp_path):
    with pytest.raises(KKError, match="does not exist"):
        kkdeploy.load(tmp_path)
    (tmp_path / "manifest.json").write_text('{"schema": "other"}')
    with pytest.raises(KKError, match="not a kkdeploy artifact directory"):
        kkdeploy.load(tmp_path)
    with pytest.raises(KKError, match="not a directory"):
        kkdeploy.load(tmp_path / "nope")
    (tmp_path / "manifest.json").write_text('{"schema": "kkdeploy.manifest/1", "config": {}}')
    with pytest.raises(KKError, match="lacks dtype, environment"):
        kkdeploy.load(tmp_path)
    (tmp_path / "manifest.json").write_text('{"schema": "kkdeploy.manifest/1"')
    with pytest.raises(KKError, match="not valid JSON"):
        kkdeploy.load(tmp_path)


def test_wrong_inputs_to_a_loaded_runner(shape3):
    out, _ = shape3
    runner = kkdeploy.load(out)
    x, mask = generate_case(official_config(3), "cpu", torch.float32, 1)
    with pytest.raises(KKError, match="dtype"):
        runner(x.half(), mask)
    with pytest.raises(KKError, match="valid_token_mask must have shape"):
        runner(x, mask[:, :5])


def test_cli_run_and_inspect(shape3, capsys):
    out, _ = shape3
    assert main(["run", "--artifacts", str(out), "--repeats", "2", "--padding-ratio", "0.25"]) == 0
    text = capsys.readouterr().out
    assert "PASS failed 0/65536" in text and "served by" in text
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "ort-cpu" in text and "all match" in text


def test_cli_build_refuses_non_empty_out(shape3, capsys):
    out, _ = shape3
    assert main(["build", "--shape", "3", "--out", str(out)]) == 2
    assert "not empty; pass --force" in capsys.readouterr().err


def test_injected_failure_is_rejected_with_its_count(tmp_path):
    """A graph that lost the causal mask fails validation, is reported with its count, and never ships.

    (A tanh-GELU graph is no use here: in FP32 on the official inputs it stays within the strict rule
    (max abs 3.6e-4 on shape 3), which is why the exporter's graph check rejects it by construction.)
    """
    from dataclasses import replace

    from engines import BuildContext, get_backend
    from exporters import ExportOptions, export_onnx
    from kkdeploy.pipeline.chooser import choose
    from validation.validator import validate_candidates

    ref, _ = build_models(SMALL, torch.float32, "cpu")
    onnx_path = tmp_path / "model.onnx"
    lost_mask = replace(SMALL, causal=False)
    faulty, _ = build_models(lost_mask, torch.float32, "cpu")
    export_onnx(faulty, lost_mask, torch.float32, onnx_path, ExportOptions())
    backend = get_backend("ort")
    ctx = BuildContext(SMALL, torch.float32, torch.device("cpu"), ref, tmp_path, onnx_path=onnx_path)
    built = backend.build(ctx, "ort-cpu")
    runner = backend.load(tmp_path, built.to_dict(), SMALL, torch.float32, torch.device("cpu"))
    with torch.inference_mode():
        report = validate_candidates(ref, {"ort-cpu": runner}, SMALL, torch.float32, "cpu", trials=2)
    cand = report.candidates["ort-cpu"]
    # every position but the last attends to the future: all rows but the last token's change
    assert cand.status == FAILED and cand.failed_elements("all-valid") > 0
    total_failed = sum(r.report.failed for r in cand.records)
    assert cand.failed_elements("all-valid") + cand.failed_elements("padded") == total_failed
    assert all(r.report.failed > 0 for r in cand.records)
    assert json.loads(json.dumps(report.to_dict()))["statuses"]["ort-cpu"] == FAILED
    entry = dict(built.to_dict(), status=cand.status)
    choice = choose([entry], {}, 1.0)
    assert choice["candidate"] == FALLBACK and "ort-cpu (failed)" in choice["reason"]


def test_padded_calls_on_all_valid_only_engine_take_the_fallback(monkeypatch):
    """Routing: the engine sees only all-valid calls; padded ones are answered by the fallback."""
    import engines.base
    import kkdeploy.pipeline.runtime
    from kkdeploy.pipeline.runtime import ServedRunner

    from engines.base import Runner

    checks = []  # every input check, wherever it runs: a routed call should be checked once
    for module in (engines.base, kkdeploy.pipeline.runtime):
        def counted(*args, _original=module.check_inputs, **kwargs):
            checks.append(1)
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, "check_inputs", counted)

    ref, opt = build_models(SMALL, torch.float32, "cpu")

    class Recording(Runner):
        """Answers with the reference and remembers every mask it was given."""

        def __init__(self):
            super().__init__(SMALL, torch.float32, "cpu")
            self.masks = []

        def infer(self, x, mask):
            self.masks.append(mask)
            return ref(x, mask)

    engine = Recording()
    seen = engine.masks
    served = ServedRunner(opt, engine=engine, backend="engine", all_valid_only=True)
    x, mask = generate_case(SMALL, "cpu", torch.float32, 0, padding_ratio=0.4)
    assert not bool(mask.all())
    with torch.inference_mode():
        y = served(x, mask)
        assert seen == [] and compare_outputs(ref(x, mask), y, *CONTRACTS["strict"]).passed
        checks.clear()
        served(x, torch.ones_like(mask))
        served(x)
        # the mask was checked once by the router; the engine is told "all valid" (its own full mask)
        assert len(seen) == 2 and all(m is engine.full_mask() for m in seen)
        assert len(checks) == 2  # one input check per call, not one more inside the engine
        assert not engine.full_mask().is_inference()  # cacheable: no mask.all() sync per call
        with pytest.raises(KKError, match="valid_token_mask must have shape"):
            served(x, torch.ones(SMALL.batch_size, SMALL.seq_len + 1, dtype=torch.bool))
    # with a fully validated engine for padded calls, those go there instead of the PyTorch fallback
    padded_engine = Recording()
    padded_seen = padded_engine.masks

    served = ServedRunner(opt, engine=engine, backend="engine", all_valid_only=True, padded_engine=padded_engine)
    checks.clear()
    with torch.inference_mode():
        assert compare_outputs(ref(x, mask), served(x, mask), *CONTRACTS["strict"]).passed
    assert len(padded_seen) == 1 and len(seen) == 2 and len(checks) == 1


def test_build_shape_14_ships_the_long_context_path(tmp_path, capsys):
    """Dense candidates refused with their bytes; the validated long-context model is what load serves."""
    out = tmp_path / "shape-14"
    assert main(["build", "--shape", "14", "--seq-len-validate", "128", "--trials", "1", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "18.6 TiB" in text and "torch-long-context" in text
    manifest = json.loads((out / "manifest.json").read_text())
    assert {c["name"]: c["status"] for c in manifest["candidates"]} == {
        "trt": "skipped", "ort-cpu": "skipped", "ort-cuda": "skipped", "torch-graph": "skipped",
        "torch-long-context": "passed"}
    assert manifest["validation"]["validated_shape"]["seq_len"] == 128
    for name in ("manifest.json", "long-context-validation.json"):  # strict JSON: no Infinity/NaN literals
        json.loads((out / name).read_text(), parse_constant=lambda c: pytest.fail(f"{name} holds {c}"))
    assert manifest["files"] == artifacts.hash_tree(out)
    runner = kkdeploy.load(out)
    assert runner.backend == "torch-long-context"
    assert type(runner.fallback).__name__ == "LongContextTransformer"
    assert runner.fallback.sdpa_layers == manifest["fallback"]["sdpa_layers"]
    assert runner.config == official_config(14)


def test_interrupted_build_leaves_nothing_that_claims_success(tmp_path, monkeypatch):
    """An exception injected after the engines were built (mid-validation) leaves no artifact directory."""
    import validation.validator as validator

    def explode(*args, **kwargs):
        raise RuntimeError("injected failure mid-build")

    monkeypatch.setattr(validator, "validate_candidates", explode)
    out = tmp_path / "shape"
    request = BuildRequest(config=SMALL, dtype=torch.float32, device=torch.device("cpu"), out=out,
                           backends=["ort-cpu"], **FAST_TIMING)
    with pytest.raises(RuntimeError, match="injected failure"):
        run_build(request)
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []  # no staging directory, no lock left behind


def test_ort_runner_returns_exactly_what_the_session_computes(tmp_path):
    import numpy as np

    from engines import BuildContext, get_backend
    from exporters import export_onnx

    ref, _ = build_models(SMALL, torch.float32, "cpu")
    export_onnx(ref, SMALL, torch.float32, tmp_path / "model.onnx")
    backend = get_backend("ort")
    ctx = BuildContext(SMALL, torch.float32, torch.device("cpu"), ref, tmp_path, onnx_path=tmp_path / "model.onnx")
    entry = backend.build(ctx, "ort-cpu").to_dict()
    runner = backend.load(tmp_path, entry, SMALL, torch.float32, torch.device("cpu"))
    x, mask = generate_case(SMALL, "cpu", torch.float32, 5, padding_ratio=0.3)
    (expected,) = runner.session.run(["y"], {"x": x.numpy(), "valid_token_mask": mask.numpy()})
    got = runner(x, mask)
    assert np.array_equal(got.numpy(), expected)
    assert entry["options"]["graph_optimization_level"] == "extended"
    assert (tmp_path / entry["options"]["model"]).is_file()  # the optimized graph is saved: no re-optimization


@pytest.fixture(scope="module")
def judge_build(tmp_path_factory):
    """float32 under the judge contract: the ORT build adds a calibrated mixed-precision candidate."""
    out = tmp_path_factory.mktemp("judge") / "artifacts"
    manifest = run_build(BuildRequest(SMALL, torch.float32, torch.device("cpu"), out, backends=["ort-cpu"],
                                      contract="judge", trials=2, warmups=1, repeats=3, rounds=1))
    return out, manifest


def test_judge_build_calibrates_and_keeps_only_the_chosen_graph(judge_build):
    out, manifest = judge_build
    entry = next(c for c in manifest["candidates"] if c["name"] == "ort-cpu-mixed")
    assert entry["status"] == PASSED, entry
    options = entry["options"]
    calibration = options["calibration"]
    assert calibration["passed"] and options["fp16_layers"] == calibration["fp16_layers"]
    assert calibration["tried"][0]["fp16_layers"] == list(range(SMALL.num_layers))  # all float16 first
    passing = [t["fp16_layers"] for t in calibration["tried"] if t["passed"]]
    assert options["fp16_layers"] in passing
    assert sorted(entry["files"]) == ["ort-cpu-mixed.onnx", "ort-cpu-mixed.optimized.onnx"]
    assert not list(out.glob(".calibrate-*")) and set(entry["files"]) <= set(manifest["files"])
    import onnx

    graph = onnx.load(str(out / "ort-cpu-mixed.onnx"))
    casts = [n.name for n in graph.graph.node if n.op_type == "Cast" and n.name.endswith("/fp16_in/Cast")]
    assert sorted(casts) == [f"layers.{i}/fp16_in/Cast" for i in options["fp16_layers"]]
    assert graph.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT  # float32 I/O


def autocast_import_error() -> str | None:
    try:
        import modelopt.onnx.autocast  # noqa: F401
    except Exception as exc:  # noqa: BLE001  absent, or present without what it imports
        return f"{type(exc).__name__}: {exc}"
    return None


@pytest.mark.skipif(autocast_import_error() is None, reason="ModelOpt is installed here: the anchor is built")
def test_judge_build_records_the_autocast_anchor_as_unavailable_without_modelopt(judge_build):
    out, manifest = judge_build
    names = [c["name"] for c in manifest["candidates"]]
    assert names[:3] == ["ort-cpu", "ort-cpu-mixed", "ort-cpu-autocast"]
    entry = manifest["candidates"][2]
    assert entry["status"] == "unavailable"
    assert "cannot import modelopt.onnx.autocast" in entry["reason"] and "pip install --no-deps" in entry["reason"]
    assert not list(out.glob("*autocast*")) and not list(out.glob(".*calibration*"))  # nothing half-written


@pytest.mark.skipif(autocast_import_error() is not None,
                    reason=f"ModelOpt AutoCast is optional and not importable here ({autocast_import_error()}); "
                           "engines/ort.py AUTOCAST_INSTALL installs it")
def test_judge_build_validates_and_serves_the_autocast_anchor(judge_build):
    import onnx

    out, manifest = judge_build
    entry = next(c for c in manifest["candidates"] if c["name"] == "ort-cpu-autocast")
    assert entry["status"] in (PASSED, FAILED) and entry["validation"]["failed_by_mode"].keys() == {"all-valid",
                                                                                                      "padded"}
    options = entry["options"]
    graph = onnx.load(str(out / options["source"]))
    assert graph.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT  # float32 I/O kept
    assert graph.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    fp16, total = options["fp16_nodes"]
    assert 0 < fp16 < total and options["autocast"]["data_max"] == 512
    assert set(entry["files"]) <= set(manifest["files"]) and not list(out.glob(".*calibration*"))
    if entry["status"] == PASSED:
        assert_judge_build_serves(out, manifest, "ort-cpu-autocast")


def assert_judge_build_serves(out, manifest: dict, name: str) -> None:
    """Pin ``name`` as the choice, load it, check a padded call under the judge rule, restore the manifest."""
    pinned = json.loads(json.dumps(manifest))
    pinned["choice"] = {**pinned["choice"], "candidate": name, "backend": "ort", "all_valid_only": False}
    (out / "manifest.json").write_text(json.dumps(pinned))
    try:
        runner = kkdeploy.load(out, device="cpu")
        assert runner.backend == name, runner.reason
        reference, _ = build_models(SMALL, torch.float32, "cpu")
        x, mask = generate_case(SMALL, "cpu", torch.float32, 4321, padding_ratio=0.5)
        with torch.no_grad():
            assert compare_outputs(reference(x, mask), runner(x, mask), *CONTRACTS["judge"]).passed
    finally:
        (out / "manifest.json").write_text(json.dumps(manifest))


def test_judge_build_serves_the_mixed_engine(judge_build):
    assert_judge_build_serves(*judge_build, "ort-cpu-mixed")


def test_cli_run_compares_under_the_contract_the_artifacts_were_validated_under(judge_build, capsys):
    out, _ = judge_build
    assert main(["run", "--artifacts", str(out), "--repeats", "1", "--padding-ratio", "0.25"]) == 0
    text = capsys.readouterr().out
    assert "\njudge: PASS" in text and "strict:" not in text and "tf32" not in text  # no TF32 on the CPU
    main(["run", "--artifacts", str(out), "--repeats", "1", "--contract", "strict"])  # an explicit rule wins
    assert "\nstrict: " in capsys.readouterr().out


def test_mixed_precision_flag_rules(tmp_path, capsys):
    strict = run_build(BuildRequest(SMALL, torch.float32, torch.device("cpu"), tmp_path / "strict",
                                    backends=["ort-cpu"], trials=1, warmups=1, repeats=2, rounds=1))
    assert [c["name"] for c in strict["candidates"]] == ["ort-cpu"]  # strict: no mixed candidate by default
    assert strict["options"]["mixed_precision"] is False  # the resolved default is recorded
    code = main(["build", "--batch-size", "2", "--seq-len", "8", "--d-model", "16", "--heads", "2", "--ffn-dim",
                 "16", "--layers", "2", "--device", "cpu", "--dtype", "float16", "--mixed-precision",
                 "--out", str(tmp_path / "half")])
    assert code == 2
    assert "--mixed-precision applies to float32 builds" in capsys.readouterr().err
    assert not (tmp_path / "half").exists()

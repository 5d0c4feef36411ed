"""The custom-op library's CUDA kernels proven op by op in the build, as our torch kernels are (kernels/proof.py).

Why: an ORT candidate whose graph holds ``kkdeploy::Linear``, ``LayerNorm`` or ``Gelu`` nodes is bitwise to the
reference only where each kernel is bit-identical to the ATen op it stands for, at this model's op shapes, on this
GPU, with this ONNX Runtime and this build of the library. The H200 measured that once, for the official shapes
(docs/custom-ops.md); a build on another GPU, shape or library must not take it on trust.

So a float16 CUDA build that exports custom ops first proves them: every distinct op shape of the exported graph
(``Linear`` per projection: packed Q/K/V where the export packs them, ``out_proj``, ``ffn_in``, ``ffn_out``;
``LayerNorm``; ``Gelu``), on the inputs each op gets in the first and last layer for the build's all-valid and
padded inputs (``capture_layers``, as the kernel proofs take them), and on random inputs at the same shapes. Each case runs the op alone in a one-node ORT CUDA session
with the artifact's library and compares every bit with the ATen op on the same inputs (``prove_launches``, one
launch: the session). A proof is kept per environment (the library's bytes included) and op shape, as the kernel
proofs are. A candidate whose graph uses an op that is not bit-identical is skipped with the reason; the
records go into the candidate's ``custom_op_proofs``. End-to-end strict validation still decides what ships.

Elsewhere (the CPU, float32 exports) nothing is proven: the CPU kernels are plain loops, not ATen's order, and there
is no float32 CUDA kernel; those candidates are judged by validation alone (``proof_refusal`` says why).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from kkdeploy.inputs import padded_case
from kkdeploy.kernels.model_proofs import capture_layers
from kkdeploy.kernels.proof import (RANDOM_INPUTS, RANDOM_INPUTS_DIGEST, ProofCase, ProofRecord, environment_key,
                                    lookup_proof, prove_launches, random_like, remember_proof)

LAUNCH = "ort-cuda"  # the one way each op runs: its node in an ORT CUDA session with the library
OPS = ("Linear", "LayerNorm", "Gelu")
BUDGET_S = 20.0  # per op shape, after its first case (prove_launches)


@dataclass
class OpCase:
    """One input set of one custom op: ``inputs`` as the node takes them (x, then weight and bias), ``reference``
    the ATen op's output on them, ``attrs`` the node's attributes."""
    op: str
    label: str
    inputs: list
    reference: torch.Tensor
    attrs: dict


def proof_refusal(device: torch.device | str, dtype: torch.dtype) -> Optional[str]:
    """None where the library's kernels are proven before use (CUDA, float16), else why nothing is proven."""
    device = torch.device(device)
    if device.type != "cuda":
        return "the library's CPU kernels are not ATen's order: ORT candidates with custom ops are judged by validation"
    if dtype != torch.float16:
        return f"{dtype}: the library's CUDA kernels are float16 only"
    return None


def ops_in_graph(export_options) -> list[str]:
    """The kkdeploy ops an export with ``export_options`` writes."""
    wanted = {"Linear": export_options.linear == "custom", "LayerNorm": export_options.layer_norm == "custom",
              "Gelu": export_options.gelu == "custom"}
    return [op for op in OPS if wanted[op]]


def shape_of(case: OpCase) -> dict:
    """The op shape a proof holds for (the node's input shapes and dtype)."""
    x = case.inputs[0]
    if case.op == "Linear":
        return {"op": "Linear", "m": x.shape[0], "n": case.inputs[1].shape[0], "k": x.shape[1], "dtype": str(x.dtype)}
    if case.op == "LayerNorm":
        return {"op": "LayerNorm", "rows": x.shape[0], "width": x.shape[1], "dtype": str(x.dtype)}
    return {"op": "Gelu", "rows": x.shape[0], "width": x.shape[1], "dtype": str(x.dtype)}


def model_cases(model, config, dtype, device, seed: int, padding_ratio: float, packed_qkv: bool = False,
                ops=OPS) -> list[OpCase]:
    """The custom ops' cases: the inputs each op gets in the first and last layer (and the final LayerNorm) on the
    build's all-valid and padded inputs (``capture_layers``, as the kernel proofs take them), then random inputs at
    each op shape (``RANDOM_INPUTS``). Every reference is the ATen op on the case's own inputs. ``packed_qkv``: the
    graph runs Q/K/V as one Linear on [Wq; Wk; Wv]."""
    last = config.num_layers - 1
    cases: list[OpCase] = []
    for mode, ratio in (("all-valid", 0.0), ("padded", padding_ratio)):
        x, mask = padded_case(config, device, dtype, seed, ratio)
        with torch.inference_mode():
            layers = capture_layers(model, x, mask, {0, last})
            for i, layer in layers.items():
                cases += _layer_cases(model.layers[i], layer, f"layers.{i}", mode, packed_qkv, ops)
            if "LayerNorm" in ops:
                cases.append(_case("LayerNorm", f"final_norm {mode}", layers[last].out, model.final_norm))
    generator = torch.Generator(device=device).manual_seed(seed + 1)
    seen, randoms = set(), []
    for case in cases:
        key = tuple(sorted(shape_of(case).items()))
        if key in seen:
            continue
        seen.add(key)
        for spec in RANDOM_INPUTS:
            x = random_like(case.inputs[0], spec, generator)
            randoms.append(OpCase(case.op, f"random {spec.label} {'x'.join(map(str, x.shape))}", [x, *case.inputs[1:]],
                                  reference_output(case.op, [x, *case.inputs[1:]], case.attrs), case.attrs))
    return cases + randoms


def _case(op: str, label: str, x: torch.Tensor, module=None) -> OpCase:
    """The node's inputs (token-major x, then the module's weight and bias) and the ATen op's output on them."""
    tokens = x.reshape(-1, x.shape[-1])
    inputs = [tokens] if module is None else [tokens, module.weight, module.bias]
    attrs = {"epsilon": float(module.eps)} if op == "LayerNorm" else {}
    return OpCase(op, label, inputs, reference_output(op, inputs, attrs), attrs)


def _layer_cases(block, layer, name: str, mode: str, packed_qkv: bool, ops) -> list[OpCase]:
    attention = block.attention
    out = []
    if "LayerNorm" in ops:
        out += [_case("LayerNorm", f"{name}.norm1 {mode}", layer.x, block.norm1),
                _case("LayerNorm", f"{name}.norm2 {mode}", layer.mid, block.norm2)]
    if "Linear" in ops:
        projections = (attention.q_proj, attention.k_proj, attention.v_proj)
        if packed_qkv:
            tokens = layer.h.reshape(-1, layer.h.shape[-1])
            inputs = [tokens, torch.cat([m.weight for m in projections]), torch.cat([m.bias for m in projections])]
            out.append(OpCase("Linear", f"{name}.qkv {mode}", inputs, reference_output("Linear", inputs, {}), {}))
        else:
            out += [_case("Linear", f"{name}.{p} {mode}", layer.h, m)
                    for p, m in zip(("q_proj", "k_proj", "v_proj"), projections)]
        out += [_case("Linear", f"{name}.out_proj {mode}", layer.context, attention.out_proj),
                _case("Linear", f"{name}.ffn_in {mode}", layer.h2, block.ffn_in),
                _case("Linear", f"{name}.ffn_out {mode}", layer.g, block.ffn_out)]
    if "Gelu" in ops:
        out.append(_case("Gelu", f"{name}.gelu {mode}", block.ffn_in(layer.h2)))
    return out


def reference_output(op: str, inputs: list, attrs: dict) -> torch.Tensor:
    """The ATen op the node stands for, on ``inputs``."""
    with torch.inference_mode():
        if op == "Linear":
            return F.linear(*inputs)
        if op == "LayerNorm":
            x, weight, bias = inputs
            return F.layer_norm(x, (x.shape[-1],), weight, bias, attrs["epsilon"])
        return F.gelu(inputs[0], approximate="none")


def library_environment(device, library: Path) -> dict:
    """What a proof of the library's ops holds for: the device, torch and CUDA, ONNX Runtime, the library's bytes."""
    import onnxruntime as ort

    digest = hashlib.sha256(Path(library).read_bytes()).hexdigest()[:16]
    return environment_key(device, {"kernel": "kkdeploy-custom-ops", "library": digest, "onnxruntime": ort.__version__,
                                    "cases": RANDOM_INPUTS_DIGEST})


def prove_custom_ops(cases: list[OpCase], run_node: Callable[[OpCase], torch.Tensor], device, environment: dict,
                     budget_s: float = BUDGET_S, on_op: Optional[Callable[[str], None]] = None) -> list[ProofRecord]:
    """One record per op shape: ``run_node(case)`` (the node alone, in a session) against the ATen op, bit for bit.
    A proof already made in this environment at an op shape (this process, or the disk cache) is reused, as the
    kernel proofs are. ``run_node`` is a parameter so that the proof's logic is tested without a GPU. ``on_op`` gets
    each op shape's key (``shape_key``) before its node runs (the proving child's progress)."""
    groups: dict[tuple, list[OpCase]] = {}
    for case in cases:
        groups.setdefault(tuple(sorted(shape_of(case).items())), []).append(case)
    records = []
    for key, group in groups.items():
        shape = dict(key)
        op = f"custom-op {shape['op']}"
        record = lookup_proof(environment, op, shape)
        if record is None and on_op:
            on_op(shape_key(shape))
        if record is None:
            proof_cases = [ProofCase(c.label, reference=lambda c=c: c.reference, run=lambda launch, c=c: run_node(c))
                           for c in group]
            record = prove_launches(op, shape, [LAUNCH], proof_cases, device, environment=environment,
                                    budget_s=budget_s, timed=False)
            remember_proof(record)
        records.append(record)
    return records


def shape_key(shape: dict) -> str:
    """An op shape of the library's as a string (the proving child names it before its node runs)."""
    return json.dumps(shape, sort_keys=True)


def refusal_of(records: list[ProofRecord]) -> Optional[str]:
    """Why a candidate with these ops may not be built (the first op shape that is not bit-identical, or whose proof
    ended its process), or None."""
    for record in records:
        if not record.proven:
            shape = ", ".join(f"{k}={v}" for k, v in record.shape.items() if k not in ("op", "dtype"))
            verdict = "could not be proven here" if record.reason.startswith("its proof ") else \
                "is not bit-identical to ATen here"
            return f"kkdeploy::{record.shape.get('op', 'op')} ({shape}) {verdict}: {record.reason}"
    return None


def library_proof_task(model, config, dtype, device, args: dict, report) -> dict:
    """The proof of the library's ops at ``model``'s op shapes, run in a child (``kkdeploy.kernels.proof_process``):
    a CUDA kernel of ours that faults ends that child, not the build."""
    records = prove_library_ops(model, config, dtype, device, args, lambda key: report(key, f"proving {key}"))
    return {"records": [r.to_dict() for r in records]}


def prove_library_ops(model, config, dtype, device, args: dict, on_op=None, run_node=None) -> list[ProofRecord]:
    """``args``: the library's path, the validation seed and padding ratio, the packed Q|K|V flag and the ops in the
    graph; ``run_node`` replaces the one-node sessions (tests)."""
    library = Path(args["library"])
    cases = model_cases(model, config, dtype, device, args["seed"], args["padding_ratio"],
                        packed_qkv=args["packed_qkv"], ops=args["ops"])
    sessions = NodeSessions(library, device) if run_node is None else None
    try:
        return prove_custom_ops(cases, run_node or sessions.run, device, library_environment(device, library),
                                on_op=on_op)
    finally:
        if sessions is not None:
            sessions.close()


class NodeSessions:
    """``run(case)``: the case's op as a one-node ONNX Runtime session (CUDA EP, the library registered), made once
    per op shape, inputs and output bound to torch tensors on the device (IO binding: no host copies)."""

    def __init__(self, library: Path, device: torch.device):
        from .ort import import_ort, session_options

        self.ort = import_ort()
        self.library, self.device = Path(library), torch.device(device)
        self.options = lambda: session_options(self.ort, "disabled", custom_ops_library=self.library)
        self.sessions: dict[tuple, object] = {}

    def _session(self, case: OpCase):
        from onnx import TensorProto, helper

        key = tuple(sorted(shape_of(case).items())) + tuple(sorted(case.attrs.items()))
        found = self.sessions.get(key)
        if found is None:
            elem = {torch.float16: TensorProto.FLOAT16, torch.float32: TensorProto.FLOAT}[case.inputs[0].dtype]
            names = ["x", "w", "b"][:len(case.inputs)]
            node = helper.make_node(case.op, names, ["y"], domain="kkdeploy", **case.attrs)
            graph = helper.make_graph(
                [node], f"kkdeploy-{case.op}",
                [helper.make_tensor_value_info(n, elem, list(t.shape)) for n, t in zip(names, case.inputs)],
                [helper.make_tensor_value_info("y", elem, list(case.reference.shape))])
            model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                            helper.make_opsetid("kkdeploy", 1)])
            model.ir_version = 10
            providers = (["CPUExecutionProvider"] if self.device.type == "cpu" else
                         [("CUDAExecutionProvider", {"device_id": self.device.index or 0})])
            found = self.ort.InferenceSession(model.SerializeToString(), sess_options=self.options(),
                                              providers=providers)
            self.sessions[key] = found
        return found

    def run(self, case: OpCase) -> torch.Tensor:
        import numpy as np

        session = self._session(case)
        if self.device.type == "cpu":
            feeds = {n: t.detach().contiguous().numpy() for n, t in zip(["x", "w", "b"], case.inputs)}
            return torch.from_numpy(session.run(["y"], feeds)[0])
        out = torch.empty_like(case.reference)
        binding = session.io_binding()
        index = self.device.index or 0
        np_dtype = {torch.float16: np.float16, torch.float32: np.float32}[out.dtype]
        inputs = [t.detach().contiguous() for t in case.inputs]
        for name, t in zip(["x", "w", "b"], inputs):
            binding.bind_input(name, "cuda", index, np_dtype, list(t.shape), t.data_ptr())
        binding.bind_output("y", "cuda", index, np_dtype, list(out.shape), out.data_ptr())
        torch.cuda.current_stream(self.device).synchronize()  # ORT runs on its own stream
        session.run_with_iobinding(binding)
        return out

    def close(self) -> None:
        self.sessions.clear()

"""The faithful ONNX graph of the reference Transformer, written node by node with ``onnx.helper``.

Why not ``torch.onnx.export``: the tracer writes the graph PyTorch *traced*, not where PyTorch
*rounds*: a fp16 ``tensor * python_float`` becomes a Mul by a constant stored in fp16, and the
Linear's bias placement is the exporter's choice, not ours (design.md §6). Writing the graph here
puts every Cast where the reference rounds, keeps every dim static, costs milliseconds and is
byte-for-byte deterministic for given weights and options.

Layout: activations are token-major ``[B*S, D]`` between attention blocks (one 2-D GEMM per Linear,
as ``F.linear`` flattens), heads are ``[B, H, S, D/H]`` inside attention.
"""

from __future__ import annotations

import math
from collections import Counter
from contextlib import contextmanager

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from kkdeploy.config import TransformerConfig
from kkdeploy.errors import KKError

from .options import CUSTOM_DOMAIN, CUSTOM_DOMAIN_VERSION, ExportOptions

ONNX_TYPES = {torch.float32: TensorProto.FLOAT, torch.float16: TensorProto.FLOAT16}
NUMPY_TYPES = {torch.float32: np.float32, torch.float16: np.float16}
INPUT_NAMES = ("x", "valid_token_mask")
OUTPUT_NAMES = ("y",)
PRODUCER = "kkdeploy.exporters.onnx_graph"


def onnx_elem_type(dtype: torch.dtype) -> int:
    try:
        return ONNX_TYPES[dtype]
    except KeyError:
        raise KKError(f"the ONNX exporter supports float32 and float16, not {str(dtype).replace('torch.', '')}; pass --dtype float16 or float32") from None


class GraphBuilder:
    """Collects nodes and initializers with unique, readable names."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.elem = onnx_elem_type(dtype)
        self.np_dtype = NUMPY_TYPES[dtype]
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._used: Counter = Counter()
        self._consts: dict[tuple, str] = {}
        self.value_infos: list[onnx.ValueInfoProto] = []

    def unique(self, base: str) -> str:
        self._used[base] += 1
        n = self._used[base]
        return base if n == 1 else f"{base}_{n}"

    def initializer(self, name: str, array: np.ndarray) -> str:
        name = self.unique(name)
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def constant(self, value, np_dtype, shape=()) -> str:
        """A shared small constant (scalars, shapes), deduplicated by value and type."""
        array = np.full(shape, value, dtype=np_dtype) if np.isscalar(value) else np.asarray(value, dtype=np_dtype)
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self._consts:
            label = "x".join(map(str, array.shape)) or "scalar"
            self._consts[key] = self.initializer(f"const/{array.dtype.name}_{label}", array)
        return self._consts[key]

    def node(self, op: str, inputs: list[str], name: str, n_out: int = 1, domain: str = "", **attrs) -> list[str]:
        name = self.unique(name)
        outputs = [f"{name}:{i}" if n_out > 1 else name for i in range(n_out)]
        self.nodes.append(helper.make_node(op, inputs, outputs, name=name, domain=domain or None, **attrs))
        return outputs

    def op(self, op: str, inputs: list[str], name: str, **attrs) -> str:
        return self.node(op, inputs, name, **attrs)[0]

    def custom_op(self, op: str, inputs: list[str], name: str, shape: list[int], **attrs) -> str:
        """A kkdeploy-domain node in the current dtype. ONNX cannot infer its output, so the exporter states
        it (value_info): every later shape stays static and checkable."""
        out = self.node(op, inputs, name, domain=CUSTOM_DOMAIN, **attrs)[0]
        self.value_infos.append(helper.make_tensor_value_info(out, self.elem, shape))
        return out

    def cast(self, value: str, to: int, name: str, current: int) -> str:
        """Cast only when the type changes (a same-type Cast is noise in the graph)."""
        return value if to == current else self.op("Cast", [value], f"{name}/Cast", to=to)


def _np(tensor: torch.Tensor, np_dtype) -> np.ndarray:
    return tensor.detach().to("cpu").numpy().astype(np_dtype, copy=False)


class TransformerGraph:
    """Emits the reference's operations in the reference's order for one static shape."""

    def __init__(self, model: torch.nn.Module, config: TransformerConfig, dtype: torch.dtype, options: ExportOptions):
        self.model, self.config, self.options = model, config, options
        self.g = GraphBuilder(dtype)
        self.tokens = config.batch_size * config.seq_len
        self.model_np = NUMPY_TYPES[dtype]
        self.fp16_layers = frozenset(options.fp16_layers)
        if options.fp16_layers and dtype != torch.float32:
            raise KKError(f"fp16_layers={options.fp16_layers} applies to float32 exports only (a float16 export "
                          f"runs every layer in float16); drop fp16_layers or export float32")
        out_of_range = [i for i in options.fp16_layers if i >= config.num_layers]
        if out_of_range:
            raise KKError(f"fp16_layers {tuple(out_of_range)} out of range for a {config.num_layers}-layer model; "
                          f"use layer indices 0..{config.num_layers - 1}")

    @contextmanager
    def computing_in(self, dtype: torch.dtype):
        """Emit nodes as the ``dtype`` export would (weights, constants, Casts), then restore the model dtype."""
        g = self.g
        saved = (g.dtype, g.elem, g.np_dtype, self.model_np)
        g.dtype, g.elem, g.np_dtype, self.model_np = dtype, ONNX_TYPES[dtype], NUMPY_TYPES[dtype], NUMPY_TYPES[dtype]
        try:
            yield
        finally:
            g.dtype, g.elem, g.np_dtype, self.model_np = saved

    # -- Linear --------------------------------------------------------------------------
    def linear(self, x: str, weight: torch.Tensor, bias: torch.Tensor, name: str) -> str:
        """``F.linear`` on token-major ``[N, in]``; where the bias enters the sum is the option."""
        g, mode = self.g, self.options.linear
        w = _np(weight, self.model_np)  # [out, in], values exactly the model's
        b = _np(bias, self.model_np)
        if mode == "gemm":
            return g.op("Gemm", [x, g.initializer(f"{name}.weight", w), g.initializer(f"{name}.bias", b)],
                        f"{name}/Gemm", transB=1)
        if mode == "matmul_add":
            y = g.op("MatMul", [x, g.initializer(f"{name}.weight_t", w.T)], f"{name}/MatMul")
            return g.op("Add", [y, g.initializer(f"{name}.bias", b)], f"{name}/Add")
        if mode == "fp32":
            xf = g.cast(x, TensorProto.FLOAT, f"{name}/in", g.elem)
            y = g.op("MatMul", [xf, g.initializer(f"{name}.weight_t", w.T.astype(np.float32))], f"{name}/MatMul")
            y = g.op("Add", [y, g.initializer(f"{name}.bias", b.astype(np.float32))], f"{name}/Add")
            return g.cast(y, g.elem, f"{name}/out", TensorProto.FLOAT)
        if mode == "bias_in_k":
            ones = g.constant(1.0, self.model_np, (self.tokens, 1))
            xk = g.op("Concat", [x, ones], f"{name}/ConcatOne", axis=1)
            wk = np.concatenate([w.T, b[None, :]], axis=0)  # [in + 1, out]
            return g.op("MatMul", [xk, g.initializer(f"{name}.weight_t_bias", wk)], f"{name}/MatMul")
        if mode == "custom":  # F.linear as one op: FP32 accumulator + FP32 bias, rounded once (engines/custom_ops)
            return g.custom_op("Linear", [x, g.initializer(f"{name}.weight", w), g.initializer(f"{name}.bias", b)],
                               f"{name}/Linear", [self.tokens, w.shape[0]])
        raise AssertionError(mode)

    # -- pointwise -----------------------------------------------------------------------
    def pointwise_type(self) -> int:
        return TensorProto.FLOAT if self.options.fp32_pointwise else self.g.elem

    def layer_norm(self, x: str, module: torch.nn.LayerNorm, name: str) -> str:
        """FP32 statistics always (stash_type=1); with fp32_pointwise the whole op runs in FP32."""
        g, t = self.g, self.pointwise_type()
        if self.options.layer_norm == "custom":  # the op computes in FP32 and rounds once: no Casts around it
            return g.custom_op("LayerNorm", [x, g.initializer(f"{name}.weight", _np(module.weight, self.model_np)),
                                             g.initializer(f"{name}.bias", _np(module.bias, self.model_np))],
                               f"{name}/LayerNorm", [self.tokens, self.config.d_model], epsilon=float(module.eps))
        np_t = np.float32 if t == TensorProto.FLOAT else self.model_np
        xt = g.cast(x, t, f"{name}/in", g.elem)
        # Through the model dtype first: in an fp16 block of a float32 export the weights are the FP16 ones.
        weight = _np(module.weight, self.model_np).astype(np_t)
        bias = _np(module.bias, self.model_np).astype(np_t)
        y = g.op("LayerNormalization", [xt, g.initializer(f"{name}.weight", weight),
                                        g.initializer(f"{name}.bias", bias)],
                 f"{name}/LayerNormalization", axis=-1, epsilon=float(module.eps), stash_type=1)
        return g.cast(y, g.elem, f"{name}/out", t)

    def gelu(self, x: str, name: str) -> str:
        g, t = self.g, self.pointwise_type()
        if self.options.gelu == "custom":  # the op computes in FP32 and rounds once: no Casts around it
            return g.custom_op("Gelu", [x], f"{name}/Gelu", [self.tokens, self.config.ffn_dim])
        np_t = np.float32 if t == TensorProto.FLOAT else self.model_np
        xt = g.cast(x, t, f"{name}/in", g.elem)
        mode = self.options.gelu
        if mode == "exact":  # PyTorch: x * 0.5 * (1 + erf(x * M_SQRT1_2)), in opmath
            half = g.op("Mul", [xt, g.constant(0.5, np_t)], f"{name}/MulHalf")
            inner = g.op("Mul", [xt, g.constant(1 / math.sqrt(2), np_t)], f"{name}/MulSqrtHalf")
            erf = g.op("Erf", [inner], f"{name}/Erf")
            y = g.op("Mul", [half, g.op("Add", [erf, g.constant(1.0, np_t)], f"{name}/AddOne")], f"{name}/Mul")
        elif mode == "exact_op":
            y = g.op("Gelu", [xt], f"{name}/Gelu", approximate="none")
        else:  # "tanh": deliberately unfaithful, for tests of the graph check
            cube = g.op("Mul", [g.op("Mul", [xt, xt], f"{name}/Sq"), xt], f"{name}/Cube")
            inner = g.op("Add", [xt, g.op("Mul", [cube, g.constant(0.044715, np_t)], f"{name}/MulC")], f"{name}/AddC")
            th = g.op("Tanh", [g.op("Mul", [inner, g.constant(math.sqrt(2 / math.pi), np_t)], f"{name}/MulK")],
                      f"{name}/Tanh")
            half = g.op("Mul", [xt, g.constant(0.5, np_t)], f"{name}/MulHalf")
            y = g.op("Mul", [half, g.op("Add", [th, g.constant(1.0, np_t)], f"{name}/AddOne")], f"{name}/Mul")
        return g.cast(y, g.elem, f"{name}/out", t)

    def zero_invalid_rows(self, x: str, row_valid: str, name: str) -> str:
        """Where, not Mul: a NaN row (fully masked softmax) must become exactly 0."""
        return self.g.op("Where", [row_valid, x, self.g.constant(0.0, self.model_np)], f"{name}/ZeroInvalidRows")

    # -- attention -----------------------------------------------------------------------
    def attention_mask(self, valid_token_mask: str) -> str:
        """True where a score becomes -inf: future keys (causal) or invalid keys; built once."""
        c, g = self.config, self.g
        key_invalid = g.op("Not", [valid_token_mask], "mask/KeyInvalid")
        key_invalid = g.op("Reshape", [key_invalid, g.constant([c.batch_size, 1, 1, c.seq_len], np.int64)],
                           "mask/KeyInvalid4d")
        if not c.causal:
            return key_invalid
        future = np.triu(np.ones((c.seq_len, c.seq_len), dtype=bool), 1)[None, None]
        return g.op("Or", [g.initializer("mask.future", future), key_invalid], "mask/FutureOrInvalid")

    def heads(self, t: str, perm: list[int], name: str) -> str:
        c, g = self.config, self.g
        shape = g.constant([c.batch_size, c.seq_len, c.num_heads, c.head_dim], np.int64)
        return g.op("Transpose", [g.op("Reshape", [t, shape], f"{name}/SplitHeads")], f"{name}/Transpose", perm=perm)

    def qkv(self, h: str, attn, name: str) -> tuple[str, str, str]:
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        if self.options.qkv == "separate":
            return tuple(self.linear(h, p.weight, p.bias, f"{name}.{n}")
                         for p, n in zip(projections, ("q_proj", "k_proj", "v_proj")))
        weight = torch.cat([p.weight for p in projections], dim=0)
        bias = torch.cat([p.bias for p in projections], dim=0)
        packed = self.linear(h, weight, bias, f"{name}.qkv_proj")
        d = self.config.d_model
        return tuple(self.g.node("Split", [packed, self.g.constant([d, d, d], np.int64)], f"{name}/SplitQKV",
                                 n_out=3, axis=1))

    def scale_scores(self, scores: str, name: str) -> str:
        g = self.g
        scale = self.config.head_dim ** -0.5
        if self.options.scale_in_fp32:  # PyTorch: fp16 * python float computes in FP32, rounds once
            s = g.cast(scores, TensorProto.FLOAT, f"{name}/scale_in", g.elem)
            s = g.op("Mul", [s, g.constant(scale, np.float32)], f"{name}/Scale")
            return g.cast(s, g.elem, f"{name}/scale_out", TensorProto.FLOAT)
        return g.op("Mul", [scores, g.constant(scale, self.model_np)], f"{name}/Scale")

    def attention(self, h: str, attn, masked: str, row_valid: str, name: str) -> str:
        c, g = self.config, self.g
        q, k, v = self.qkv(h, attn, name)
        q = self.heads(q, [0, 2, 1, 3], f"{name}/q")
        k_t = self.heads(k, [0, 2, 3, 1], f"{name}/k")  # [B,H,Dh,S]: K^T directly
        v = self.heads(v, [0, 2, 1, 3], f"{name}/v")
        scores = self.scale_scores(g.op("MatMul", [q, k_t], f"{name}/QK"), name)
        scores = g.op("Where", [masked, g.constant(-np.inf, self.model_np), scores], f"{name}/MaskScores")
        probs = g.op("Softmax", [g.cast(scores, TensorProto.FLOAT, f"{name}/softmax_in", g.elem)],
                     f"{name}/Softmax", axis=-1)
        probs = g.cast(probs, g.elem, f"{name}/softmax_out", TensorProto.FLOAT)
        context = g.op("MatMul", [probs, v], f"{name}/PV")
        context = g.op("Transpose", [context], f"{name}/MergeHeadsTranspose", perm=[0, 2, 1, 3])
        context = g.op("Reshape", [context, g.constant([self.tokens, c.d_model], np.int64)], f"{name}/MergeHeads")
        out = self.linear(context, attn.out_proj.weight, attn.out_proj.bias, f"{name}.out_proj")
        return self.zero_invalid_rows(out, row_valid, name)

    # -- whole model ---------------------------------------------------------------------
    def block(self, x: str, layer, masked: str, row_valid: str, name: str, fp16: bool = False) -> str:
        """One transformer block; with ``fp16`` (float32 export only) the residual stream is cast to FP16 on
        entry, the block is written exactly as the float16 export writes it, and the result is cast back."""
        if not fp16:
            return self.block_body(x, layer, masked, row_valid, name)
        g = self.g
        xh = g.cast(x, TensorProto.FLOAT16, f"{name}/fp16_in", g.elem)
        with self.computing_in(torch.float16):
            y = self.block_body(xh, layer, masked, row_valid, name)
        return g.cast(y, g.elem, f"{name}/fp16_out", TensorProto.FLOAT16)

    def block_body(self, x: str, layer, masked: str, row_valid: str, name: str) -> str:
        g = self.g
        a = self.attention(self.layer_norm(x, layer.norm1, f"{name}.norm1"), layer.attention, masked, row_valid,
                           f"{name}.attention")
        x = g.op("Add", [x, a], f"{name}/AddAttention")
        f = self.linear(self.layer_norm(x, layer.norm2, f"{name}.norm2"), layer.ffn_in.weight, layer.ffn_in.bias,
                        f"{name}.ffn_in")
        f = self.linear(self.gelu(f, f"{name}.gelu"), layer.ffn_out.weight, layer.ffn_out.bias, f"{name}.ffn_out")
        x = g.op("Add", [x, f], f"{name}/AddFeedForward")
        return self.zero_invalid_rows(x, row_valid, name)

    def build(self) -> onnx.ModelProto:
        c, g = self.config, self.g
        x_in = helper.make_tensor_value_info("x", g.elem, [c.batch_size, c.seq_len, c.d_model])
        m_in = helper.make_tensor_value_info("valid_token_mask", TensorProto.BOOL, [c.batch_size, c.seq_len])
        y_out = helper.make_tensor_value_info("y", g.elem, [c.batch_size, c.seq_len, c.d_model])
        x = g.op("Reshape", ["x", g.constant([self.tokens, c.d_model], np.int64)], "input/TokenMajor")
        row_valid = g.op("Reshape", ["valid_token_mask", g.constant([self.tokens, 1], np.int64)], "mask/RowValid")
        masked = self.attention_mask("valid_token_mask")
        for i, layer in enumerate(self.model.layers):
            x = self.block(x, layer, masked, row_valid, f"layers.{i}", fp16=i in self.fp16_layers)
        x = self.zero_invalid_rows(self.layer_norm(x, self.model.final_norm, "final_norm"), row_valid, "final_norm")
        g.nodes.append(helper.make_node("Reshape", [x, g.constant([c.batch_size, c.seq_len, c.d_model], np.int64)],
                                        ["y"], name="output/Reshape"))
        graph = helper.make_graph(g.nodes, "kernelkraft_transformer", [x_in, m_in], [y_out], g.initializers,
                                  value_info=g.value_infos)
        opsets = [helper.make_opsetid("", self.options.opset)]
        if any(n.domain == CUSTOM_DOMAIN for n in g.nodes):
            opsets.append(helper.make_opsetid(CUSTOM_DOMAIN, CUSTOM_DOMAIN_VERSION))
        model = helper.make_model(graph, opset_imports=opsets,
                                  producer_name=PRODUCER, producer_version=onnx.__version__)
        model.ir_version = min(model.ir_version, 10)  # readable by every ONNX Runtime the GPU machines carry
        helper.set_model_props(model, {"kkdeploy.config": str(c.to_dict()), "kkdeploy.options": str(self.options.to_dict())})
        return model


def build_graph(model: torch.nn.Module, config: TransformerConfig, dtype: torch.dtype,
                options: ExportOptions = ExportOptions()) -> onnx.ModelProto:
    """The in-memory graph; ``export_onnx`` adds the budget check, the graph check and the atomic write."""
    with torch.no_grad():
        return TransformerGraph(model, config, dtype, options).build()


def op_histogram(model: onnx.ModelProto) -> dict[str, int]:
    counts = Counter(f"{n.domain}:{n.op_type}" if n.domain else n.op_type for n in model.graph.node)
    return dict(sorted(counts.items()))


def float16_node_count(model: onnx.ModelProto) -> tuple[int, int]:
    """``(nodes whose first output is float16, all nodes)``, Cast and Constant nodes not counted: how much
    of a mixed-precision graph computes in float16, comparable across graphs from different converters."""
    inferred = onnx.shape_inference.infer_shapes(model)
    graph = inferred.graph
    types = {v.name: v.type.tensor_type.elem_type for v in (*graph.input, *graph.value_info, *graph.output)}
    nodes = [n for n in graph.node if n.op_type not in ("Cast", "Constant")]
    return sum(types.get(n.output[0]) == onnx.TensorProto.FLOAT16 for n in nodes), len(nodes)

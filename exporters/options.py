"""Export options: every numerically relevant choice of the ONNX graph, named so validation can compare them."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kkdeploy.errors import KKError

# Opset 17 is the lowest with LayerNormalization (stash_type=1 keeps FP32 statistics); every
# TensorRT since 8.6 and ONNX Runtime since 1.14 reads it. Gelu as one op needs opset 20.
DEFAULT_OPSET = 17
MIN_OPSET = 17
GELU_OP_MIN_OPSET = 20

LINEAR_MODES = {
    "gemm": "bias folded into one Gemm on token-major [B*S, D], in the model dtype",
    "matmul_add": "MatMul then Add, both in the model dtype (the bias is added after the GEMM rounds)",
    "fp32": "Cast -> MatMul(FP32) -> Add(FP32 bias) -> Cast: one rounding, like cuBLASLt's FP32 bias epilogue",
    "bias_in_k": "[x, 1] @ [W^T; b] in the model dtype: the bias is summed inside the GEMM's accumulator",
    "custom": "one kkdeploy::Linear node (our custom-op library): FP32 accumulation, FP32 bias, one rounding",
}
LAYER_NORM_MODES = {
    "onnx": "LayerNormalization (stash_type=1: FP32 statistics)",
    "custom": "one kkdeploy::LayerNorm node in the model dtype (our custom-op library): FP32 statistics, one rounding",
}
# The custom-op domain our library (engines/custom_ops) registers; the graph check accepts exactly this one.
CUSTOM_DOMAIN = "kkdeploy"
CUSTOM_DOMAIN_VERSION = 1
QKV_MODES = {
    "separate": "three projections, as the reference computes them",
    "packed": "one projection with [Wq; Wk; Wv], split after",
}
GELU_MODES = {
    "exact": "x*0.5*(1+erf(x*M_SQRT1_2)) written out with Erf, PyTorch's own formula and order",
    "exact_op": "one Gelu(approximate='none') node (opset >= 20)",
    "custom": "one kkdeploy::Gelu node in the model dtype (our custom-op library): ATen's FP32 formula, one rounding",
    "tanh": "tanh approximation: UNFAITHFUL, exists only so tests can prove the graph check rejects it",
}
FAITHFUL_GELU_MODES = tuple(m for m in GELU_MODES if m != "tanh")  # what a user may ask for


def gelu_modes_at(opset: int) -> list[str]:
    """The faithful GELU modes an export at ``opset`` can write (one Gelu node needs opset 20)."""
    return [m for m in FAITHFUL_GELU_MODES if m != "exact_op" or opset >= GELU_OP_MIN_OPSET]


def _choice(name: str, value: str, modes: dict) -> None:
    if value not in modes:
        raise KKError(f"unknown {name} {value!r}; use one of {', '.join(modes)}")


@dataclass(frozen=True)
class ExportOptions:
    """How the exporter writes the graph; the defaults are the faithful ones checked on the CPU EP."""

    linear: str = "gemm"
    fp32_pointwise: bool = True  # LayerNorm and GELU evaluated in FP32, cast to the model dtype once
    qkv: str = "separate"
    scale_in_fp32: bool = True  # scores * (D/H)^-0.5 in FP32, as PyTorch multiplies by a Python float
    gelu: str = "exact"
    opset: int = DEFAULT_OPSET
    # float32 exports only: these transformer blocks compute in float16 (Cast in, the float16 export's block,
    # Cast out); the range is checked in build_graph, where the number of layers is known.
    fp16_layers: tuple[int, ...] = ()
    layer_norm: str = "onnx"

    def __post_init__(self) -> None:
        layers = self.fp16_layers
        if isinstance(layers, (str, bytes)) or not isinstance(layers, (tuple, list)) or any(
                isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in layers):
            raise KKError(f"fp16_layers must be a tuple of non-negative layer indices, got {layers!r}; "
                          f"e.g. fp16_layers=(2, 3)")
        if len(set(layers)) != len(layers):
            raise KKError(f"fp16_layers lists a layer twice: {tuple(layers)!r}; list each layer once")
        object.__setattr__(self, "fp16_layers", tuple(sorted(layers)))
        _choice("linear mode", self.linear, LINEAR_MODES)
        _choice("qkv mode", self.qkv, QKV_MODES)
        _choice("layer_norm mode", self.layer_norm, LAYER_NORM_MODES)
        _choice("gelu mode", self.gelu, GELU_MODES)
        if isinstance(self.opset, bool) or not isinstance(self.opset, int) or self.opset < MIN_OPSET:
            raise KKError(f"opset must be an integer >= {MIN_OPSET} (LayerNormalization), got {self.opset!r}")
        if self.gelu == "exact_op" and self.opset < GELU_OP_MIN_OPSET:
            raise KKError(f"gelu='exact_op' needs opset >= {GELU_OP_MIN_OPSET} (the Gelu op), got {self.opset}; "
                          f"raise the opset or use gelu='exact'")

    def to_dict(self) -> dict:
        data = asdict(self)
        # Absent when empty, so an all-FP32/FP16 export's options (and its graph metadata) stay what they were.
        if data["fp16_layers"]:
            data["fp16_layers"] = list(data["fp16_layers"])
        else:
            del data["fp16_layers"]
        if data["layer_norm"] == "onnx":  # likewise: the stock LayerNorm's exports keep their bytes
            del data["layer_norm"]
        return data

    @property
    def uses_custom_ops(self) -> bool:
        """Whether the graph holds kkdeploy-domain nodes, so a session needs our custom-op library."""
        return self.linear == "custom" or self.layer_norm == "custom" or self.gelu == "custom"

    @classmethod
    def from_dict(cls, data: dict) -> "ExportOptions":
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})

    def label(self) -> str:
        """Short stable name for tables: e.g. ``gemm-separate-fp32pw``."""
        parts = [self.linear, self.qkv, "fp32pw" if self.fp32_pointwise else "nativepw"]
        if not self.scale_in_fp32:
            parts.append("scale-native")
        if self.layer_norm != "onnx":
            parts.append(f"ln-{self.layer_norm}")
        if self.gelu != "exact":
            parts.append(f"gelu-{self.gelu}")
        if self.opset != DEFAULT_OPSET:
            parts.append(f"op{self.opset}")
        if self.fp16_layers:
            parts.append("fp16l" + "_".join(map(str, self.fp16_layers)))
        return "-".join(parts)


# The variants that validation and the fidelity study compare, by the names used in tables.
NAMED_VARIANTS: dict[str, ExportOptions] = {
    "default": ExportOptions(),
    "matmul_add": ExportOptions(linear="matmul_add"),
    "fp32_linear": ExportOptions(linear="fp32"),
    "bias_in_k": ExportOptions(linear="bias_in_k"),
    "packed_qkv": ExportOptions(qkv="packed"),
    "native_pointwise": ExportOptions(fp32_pointwise=False),
    "scale_native": ExportOptions(scale_in_fp32=False),
    "gelu_op_opset20": ExportOptions(gelu="exact_op", opset=20),
    "fp32_linear_gelu_op": ExportOptions(linear="fp32", gelu="exact_op", opset=20),
}

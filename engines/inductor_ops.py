"""Opaque ATen calls for the numerically sensitive ops, so Inductor cannot re-fuse them.

Inductor decomposes ``layer_norm``, ``gelu`` and ``softmax`` into its own pointwise/reduction
code, whose reduction order and ``erf`` differ from the ATen kernels the reference runs (1 ulp
in ~1e-4 of elements, amplified by the residual stream past the strict rule). Each op here is a
``torch.library.custom_op`` whose body is *the same ATen overload with the same arguments* the
exported graph held; Inductor treats a custom op as an opaque fallback kernel (it never looks
inside), so at run time the reference's own kernel computes these values, bit for bit.

``make_sensitive_ops_opaque`` rewrites an ``ExportedProgram`` in place: it swaps every
``aten.layer_norm`` / ``aten.gelu`` / ``aten.softmax`` node for its wrapper and nothing else.

AOTInductor calls these ops from its generated C++ through the dispatcher (the proxy executor),
so a process that loads a package must have imported this module first (the runner does). A
Python-free C++ deployment would need the same three ops registered with ``TORCH_LIBRARY``.
"""

from __future__ import annotations

from typing import Optional

import torch

from kkdeploy.errors import KKError

NAMESPACE = "kkdeploy_faithful"
# Bumped whenever an op's schema or body changes: it is part of the build-cache key.
OPS_VERSION = "1"

aten = torch.ops.aten


def _custom_op(name: str):
    """custom_op with exact-stride inputs: the ATen kernel sees the layout eager gave it."""
    try:
        return torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=(),
                                       tags=(torch.Tag.needs_exact_strides,))
    except (TypeError, AttributeError):  # older torch without tags= or the tag
        return torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=())


@_custom_op("layer_norm")
def layer_norm(x: torch.Tensor, normalized_shape: list[int], weight: Optional[torch.Tensor],
               bias: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    return aten.layer_norm.default(x, normalized_shape, weight, bias, eps)


@layer_norm.register_fake
def _layer_norm_fake(x, normalized_shape, weight, bias, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@_custom_op("gelu")
def gelu(x: torch.Tensor, approximate: str) -> torch.Tensor:
    return aten.gelu.default(x, approximate=approximate)


@gelu.register_fake
def _gelu_fake(x, approximate):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@_custom_op("softmax")
def softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    return aten.softmax.int(x, dim)


@softmax.register_fake
def _softmax_fake(x, dim):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _defaults(args: tuple, kwargs: dict, names: list[str], defaults: list) -> list:
    values = list(args) + [None] * (len(names) - len(args))
    for i, name in enumerate(names):
        if i >= len(args):
            values[i] = kwargs.get(name, defaults[i])
    return values


def make_sensitive_ops_opaque(exported, keep=("layer_norm", "gelu", "softmax"),
                              layer_norm_kernel: bool = False) -> dict[str, int]:
    """Swap the LayerNorm / GELU / softmax nodes named in ``keep`` for opaque wrappers; count them.
    ``layer_norm_kernel``: LayerNorms become ``kkdeploy_faithful::layer_norm_rows`` (``kkdeploy.kernels.layer_norm``:
    the same schema and bits, one warp per row where it is proven; ATen's own kernel everywhere else).

    An unexpected form (a softmax with a dtype argument, a ``_softmax`` with half_to_float)
    raises: silently leaving it to Inductor would lose faithfulness without anyone noticing.
    """
    graph = exported.graph
    counts = {"layer_norm": 0, "gelu": 0, "softmax": 0}
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten.layer_norm.default:
            x, shape, w, b, eps, _ = _defaults(node.args, node.kwargs,
                                               ["input", "normalized_shape", "weight", "bias", "eps", "cudnn_enable"],
                                               [None, None, None, None, 1e-5, True])
            if layer_norm_kernel:
                import kkdeploy.kernels.layer_norm  # noqa: F401  registers kkdeploy_faithful::layer_norm_rows
            op = torch.ops.kkdeploy_faithful.layer_norm_rows if layer_norm_kernel else torch.ops.kkdeploy_faithful.layer_norm
            target, args, key = op.default, (x, list(shape), w, b, float(eps)), "layer_norm"
        elif node.target is aten.gelu.default:
            x, approximate = _defaults(node.args, node.kwargs, ["self", "approximate"], [None, "none"])
            target, args, key = torch.ops.kkdeploy_faithful.gelu.default, (x, approximate), "gelu"
        elif node.target in (aten.softmax.int, aten._softmax.default):
            if node.target is aten.softmax.int:
                x, dim, dtype = _defaults(node.args, node.kwargs, ["self", "dim", "dtype"], [None, None, None])
                if dtype is not None:
                    raise KKError(f"cannot keep softmax opaque: node {node.name} casts to {dtype} inside softmax")
            else:
                x, dim, half_to_float = node.args
                if half_to_float:
                    raise KKError(f"cannot keep softmax opaque: node {node.name} uses half_to_float")
            target, args, key = torch.ops.kkdeploy_faithful.softmax.default, (x, int(dim)), "softmax"
        else:
            continue
        if key not in keep:
            continue
        with graph.inserting_before(node):
            replacement = graph.call_function(target, args)
        replacement.meta = dict(node.meta)
        node.replace_all_uses_with(replacement)
        graph.erase_node(node)
        counts[key] += 1
    graph.lint()
    exported.graph_module.recompile()
    return counts

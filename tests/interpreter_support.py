"""What Triton's interpreter computes differently from the GPU, put right for the kernels' logic tests.

Triton 3.6's interpreter computes ``tl.fma(x, y, z)`` as ``x * y + z`` in numpy: two roundings, where the GPU's
``fma.rn.f32`` rounds once. The kernels' LayerNorm (ATen's Welford steps as nvcc's fmas) and the probabilities'
Markstein division depend on that single rounding, so the logic tests install ``exact_fma`` first: the float32
fma rounded once (``kkdeploy.kernels.layer_norm.fma32``), the function the CPU emulations use.

``exact_dot`` makes ``tl.dot`` independent of the machine's BLAS. The interpreter computes a tile's dot with numpy's
float32 ``matmul``, whose summation order follows the BLAS kernel chosen for the tile's shape and this CPU: two
launches of the same GEMM with other tile sizes then differed in a few float32 sums on one machine and not on
another (a layer kernel's ffn_in against the same GEMM launched alone: 2 elements after float16 rounding). Each
tile's dot is now summed in float64 (float16 and float32 products are exact there) and rounded once to float32,
then added to the accumulator as before: the same bits on every machine and for every tile shape with the same
k-steps.

``scalar_index`` lets the interpreter run with numpy 2.4: it turns a scalar tensor into a Python int with
``int(array)``, which numpy 2.4 refuses for a 1-element array of one dimension (fixed upstream by squeezing).
"""

from __future__ import annotations


def exact_fma() -> None:
    """Make this process's Triton interpreter round float32 fmas once."""
    import numpy as np
    import torch
    from triton.runtime import interpreter

    from kkdeploy.kernels.layer_norm import fma32

    def create_fma(self, x, y, z):
        if z.data.dtype != np.float32:
            return interpreter.TensorHandle(x.data * y.data + z.data, z.dtype.scalar)
        a, b, c = (np.ascontiguousarray(t, dtype=np.float32) for t in np.broadcast_arrays(x.data, y.data, z.data))
        out = fma32(torch.from_numpy(a), torch.from_numpy(b), torch.from_numpy(c)).numpy()
        return interpreter.TensorHandle(out, z.dtype.scalar)

    interpreter.InterpreterBuilder.create_fma = create_fma


def scalar_index() -> None:
    """Make this process's Triton interpreter take a 1-element array as an index (``range(0, K, BLOCK_K)``)."""
    from triton.runtime import interpreter

    patch = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


def exact_dot() -> None:
    """Make this process's Triton interpreter sum each tile's float dot products in float64, rounded once."""
    import numpy as np
    from triton.runtime import interpreter

    create_dot = interpreter.InterpreterBuilder.create_dot

    def exact(self, a, b, d, input_precision, max_num_imprecise_acc):
        floats = (np.float16, np.float32)
        if a.data.dtype not in floats or b.data.dtype not in floats or d.data.dtype != np.float32:
            return create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        product = np.matmul(a.data.astype(np.float64), b.data.astype(np.float64)).astype(np.float32)
        return interpreter.TensorHandle(product + d.data, d.dtype.scalar)

    interpreter.InterpreterBuilder.create_dot = exact

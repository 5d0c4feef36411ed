// ATen's Welford steps for LayerNorm statistics (aten/src/ATen/native/cuda/layer_norm_kernel.cu, the vectorized
// kernel), written in ATen's operand order so that nvcc, with its default FMA contraction, contracts them alike.
// Shared by the ONNX Runtime custom op (engines/custom_ops/kkdeploy_ops_cuda.cu) and the torch op
// (kkdeploy/kernels/csrc/layer_norm.cu); both are proven bit-identical to ATen op by op on the GPU.
#pragma once

namespace kk_welford {

struct Moments {
  float mean;
  float m2;
  float count;
};

// One element into a running Welford state (ATen: cuWelfordOnlineSum, reciprocal times delta).
__device__ __forceinline__ Moments push(const float value, const Moments s) {
  const float delta = value - s.mean;
  const float count = s.count + 1.f;
  const float mean = s.mean + delta * (1.f / count);
  return {mean, s.m2 + delta * (value - mean), count};
}

// Merge `other` into `own` (ATen: cuWelfordCombine(dataB = own, dataA = other)); operand order kept.
__device__ __forceinline__ Moments merge(const Moments own, const Moments other) {
  const float delta = own.mean - other.mean;
  const float count = other.count + own.count;
  float mean, m2;
  if (count > 0.f) {
    const float coef = 1.f / count;
    const float n_other = other.count * coef;
    const float n_own = own.count * coef;
    mean = n_other * other.mean + n_own * own.mean;
    m2 = other.m2 + own.m2 + delta * delta * other.count * n_own;
  } else {
    mean = 0.f;
    m2 = 0.f;
  }
  return {mean, m2, count};
}

// ATen's warp step: a shuffle-down tree, offsets 16..1; lane 0 ends with the warp's state.
__device__ __forceinline__ Moments warp_merge_down(Moments s) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    const Moments other{__shfl_down_sync(0xffffffffu, s.mean, offset, 32),
                        __shfl_down_sync(0xffffffffu, s.m2, offset, 32),
                        __shfl_down_sync(0xffffffffu, s.count, offset, 32)};
    s = merge(s, other);
  }
  return s;
}

}  // namespace kk_welford

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

// `merge` where both counts are known when the kernel is compiled (every lane of a full row holds the same number of
// elements; kOther may be 0: ATen's merges with its idle warps' empty states). The same operations in the order nvcc
// emits for `merge` (its PTX, nvcc 13.0, sm_90: count = own + other, coef = rcp.rn(count), n_other = coef *
// other.count, n_own = own.count * coef, mean = fma(n_other, other.mean, own.mean * n_own), m2 = fma(delta * delta *
// other.count, n_own, own.m2 + other.m2)), with the count arithmetic done by the compiler: 1.f / count is correctly
// rounded as rcp.rn is, and the counts are exact small integers. Written with intrinsics so that nvcc neither contracts
// nor reorders them otherwise. Saves the reciprocal (a multi-instruction sequence with a slow path) and the count's
// shuffle in every step of the tree.
template <int kOwn, int kOther>
__device__ __forceinline__ Moments merge_counted(const Moments own, const Moments other) {
  static_assert(kOwn >= 0 && kOther >= 0 && (kOwn > 0 || kOther == 0), "merge_counted: an empty side is `other`");
  if constexpr (kOwn == 0) {  // `merge`'s branch for a count of 0: zeros
    return {0.f, 0.f, 0.f};
  } else {
    constexpr float count = float(kOther) + float(kOwn);
    constexpr float coef = 1.f / count;
    constexpr float n_other = coef * float(kOther);
    constexpr float n_own = float(kOwn) * coef;
    const float delta = __fsub_rn(own.mean, other.mean);
    const float mean = __fmaf_rn(n_other, other.mean, __fmul_rn(own.mean, n_own));
    const float m2 =
        __fmaf_rn(__fmul_rn(__fmul_rn(delta, delta), float(kOther)), n_own, __fadd_rn(own.m2, other.m2));
    return {mean, m2, count};
  }
}

// The mean and m2 of lane + offset, for a step of the shuffle-down tree whose counts are known (merge_counted): the
// count is not shuffled.
__device__ __forceinline__ Moments shuffled_down(const Moments s, int offset, int width) {
  return {__shfl_down_sync(0xffffffffu, s.mean, offset, width), __shfl_down_sync(0xffffffffu, s.m2, offset, width),
          0.f};
}

// warp_merge_down where every lane holds kCount elements: the counts of each step known (kCount, 2 kCount, ...).
template <int kCount>
__device__ __forceinline__ Moments warp_merge_down_counted(Moments s) {
  s = merge_counted<kCount, kCount>(s, shuffled_down(s, 16, 32));
  s = merge_counted<2 * kCount, 2 * kCount>(s, shuffled_down(s, 8, 32));
  s = merge_counted<4 * kCount, 4 * kCount>(s, shuffled_down(s, 4, 32));
  s = merge_counted<8 * kCount, 8 * kCount>(s, shuffled_down(s, 2, 32));
  return merge_counted<16 * kCount, 16 * kCount>(s, shuffled_down(s, 1, 32));
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

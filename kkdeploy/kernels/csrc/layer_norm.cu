// ATen's float16 LayerNorm, one warp per row instead of one block per row: rows of at most 128 elements
// (layer_norm_rows_f16_kernel, layer_norm_rows2_f16_kernel) and rows of any width (layer_norm_block4_f16_kernel).
//
// Why: ATen's vectorized_layer_norm_kernel (aten/src/ATen/native/cuda/layer_norm_kernel.cu) launches one block
// of 4 warps per row and gives thread t the 4-wide vectors t, t + 128, ...; a row of N <= 128 elements has at
// most 32 vectors, so only warp 0 holds data and three warps idle. On shape 6 (1.28M rows of 128) ATen's kernel
// took 1.41 ms per call, 40% of the compiled faithful graph (H200, scripts/profile_candidate.py).
//
// The arithmetic is ATen's, step for step (kk_welford: the same Welford push per element in vector order, the
// same shuffle-down tree in the warp). ATen then merges the 4 warps' states through shared memory: warp 0 takes
// warp 2's state, then warp 1's (which took warp 3's). Those warps hold no elements, so their states are
// {0, 0, 0}; this kernel performs exactly those two merges with {0, 0, 0} instead of skipping them, so nothing
// depends on an argument that the merges are identities. Then var = m2 / N, rstd = rsqrtf(var + eps), and
// y = g * (rstd * (x - mean)) + b rounded once, written as in ATen (and in the ONNX Runtime custom op, proven
// bit-identical to ATen on the H200). Compiled by nvcc with its floating-point defaults, as PyTorch's kernels are.
// Proven op by op by the build before the op uses it (kkdeploy/kernels/layer_norm.py, docs/kernel-proofs.md).

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <string>

#include "welford.cuh"

namespace {

constexpr int kWarp = 32;
constexpr int kRowsPerBlock = 8;  // 256 threads: 8 rows

thread_local std::string g_error;

// Programmatic dependent launch (kkdeploy/kernels/dependent_launch.py): wait until every earlier kernel's writes are
// visible, then let the next kernel start. Only the kPdl instantiations have it; the plain ones are the proven code.
template <bool kPdl>
__device__ __forceinline__ void dependent_launch_entry() {
  if constexpr (kPdl) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  }
}

struct alignas(8) Half4 {
  __half v[4];
};

template <bool kPdl>
__global__ void layer_norm_rows_f16_kernel(const __half* __restrict__ X, const __half* __restrict__ gamma,
                                           const __half* __restrict__ beta, __half* __restrict__ Y, int64_t M,
                                           int N, float eps) {
  dependent_launch_entry<kPdl>();
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp;
  if (row >= M) return;  // the whole warp leaves together: the shuffles below see full warps
  const int lane = threadIdx.x % kWarp;
  const int vectors = N / 4;  // <= 32: lane t owns vector t, as ATen's thread t does
  const Half4* row4 = reinterpret_cast<const Half4*>(X + row * N);

  kk_welford::Moments s{0.f, 0.f, 0.f};
  Half4 data;
  if (lane < vectors) {
    data = row4[lane];
#pragma unroll
    for (int k = 0; k < 4; ++k) s = kk_welford::push(__half2float(data.v[k]), s);
  }
  s = kk_welford::warp_merge_down(s);
  // ATen's block step with warps 1..3 empty: warp 0 merges warp 2, then warp 1 (after warp 1 merged warp 3).
  // (Written out, not through finish_stats/write_vector: this is the code measured bit-identical on the H200,
  // and nvcc allocates the helpers' registers differently; its PTX stays as proven.)
  const kk_welford::Moments empty{0.f, 0.f, 0.f};
  const kk_welford::Moments empty_pair = kk_welford::merge(empty, empty);
  s = kk_welford::merge(s, empty);
  s = kk_welford::merge(s, empty_pair);
  const float mean = __shfl_sync(0xffffffffu, s.mean, 0, kWarp);
  const float var = __shfl_sync(0xffffffffu, s.m2 / float(N), 0, kWarp);
  const float rstd = rsqrtf(var + eps);

  if (lane < vectors) {
    const Half4 g = reinterpret_cast<const Half4*>(gamma)[lane];
    const Half4 b = reinterpret_cast<const Half4*>(beta)[lane];
    Half4 out;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      out.v[k] = __float2half_rn(__half2float(g.v[k]) * (rstd * (__half2float(data.v[k]) - mean)) +
                                 __half2float(b.v[k]));
    }
    reinterpret_cast<Half4*>(Y + row * N)[lane] = out;
  }
}

// ATen's block step with warps 1..3 empty (warp 0 merges warp 2, then warp 1 after warp 1 merged warp 3), then
// mean and rstd broadcast from the row's first lane (`width`: the lanes that share the row).
__device__ __forceinline__ void finish_stats(kk_welford::Moments s, int N, float eps, int width, float& mean,
                                             float& rstd) {
  const kk_welford::Moments empty{0.f, 0.f, 0.f};
  const kk_welford::Moments empty_pair = kk_welford::merge(empty, empty);
  s = kk_welford::merge(s, empty);
  s = kk_welford::merge(s, empty_pair);
  mean = __shfl_sync(0xffffffffu, s.mean, 0, width);
  const float var = __shfl_sync(0xffffffffu, s.m2 / float(N), 0, width);
  rstd = rsqrtf(var + eps);
}

// One output vector: y = g * (rstd * (x - mean)) + b, rounded once (ATen's expression and operand order).
__device__ __forceinline__ void write_loaded(const Half4 data, const Half4 g, const Half4 b, Half4* out4, int v,
                                            float mean, float rstd) {
  Half4 out;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    out.v[k] = __float2half_rn(__half2float(g.v[k]) * (rstd * (__half2float(data.v[k]) - mean)) +
                               __half2float(b.v[k]));
  }
  out4[v] = out;
}

// write_loaded with vector v of gamma and beta loaded here.
__device__ __forceinline__ void write_vector(const Half4 data, const __half* gamma, const __half* beta, Half4* out4,
                                             int v, float mean, float rstd) {
  write_loaded(data, reinterpret_cast<const Half4*>(gamma)[v], reinterpret_cast<const Half4*>(beta)[v], out4, v, mean,
               rstd);
}

// rows2_full's tree, for rows of kV = N / 4 vectors (a power of two up to 32; ATen's lane t holds vector t): at the
// step of offset kOffset (16: inside the lane), lanes i < kOffset, the ones ATen's lane 0 depends on, each merge
// lane i + kOffset. Lane i holds the vectors t < kV with t = i mod 2 kOffset: kV / (2 kOffset) of them when kV >=
// 2 kOffset, else one (i < kV; the lanes past kV hold nothing, and any merge of their empty states is empty), and its
// partner as many, or none when kV < 2 kOffset.
template <int kV, int kOffset>
constexpr int kTreeOwn = 4 * (kV >= 2 * kOffset ? kV / (2 * kOffset) : 1);
template <int kV, int kOffset>
constexpr int kTreeOther = kV >= 2 * kOffset ? kTreeOwn<kV, kOffset> : 0;

// The same rows, two per warp: lane t of a 16-lane half holds vectors t and t + 16 of its row, so ATen's first
// shuffle step (offset 16: lane t merges lane t + 16) is a merge inside the lane, and the offsets 8..1 are
// shuffles within the half. Every merge ATen's lane 0 depends on happens with the same operands in the same order;
// half the instructions per row. Each launch runs where the build proved it bit-identical (layer_norm.prove_layer_norm).
// kN > 0 (the rows2_full launch, rows of exactly kN: 16, 32, 64 or 128): every count in the tree that ATen's lane 0
// depends on is known when the kernel is compiled (rows2_full_counts), and kk_welford::merge_counted takes the same
// steps with the reciprocals and the counts' shuffles done by the compiler. kN == 0: N at run time (rows2, as proven).
// kEarly (with kN > 0: the rows2_full_early launch): the lane's vectors of gamma and beta are loaded first, beside
// the row's own loads, instead of in write_vector. Without it nvcc issues those loads after the tree's last shuffle:
// one more round trip to L2 on the critical path of a launch of a few microseconds. (Loaded before the dependent
// launch's wait in the source, ptxas of CUDA 13.0 still issued them after it, so they follow it here, and the PDL
// form stays the plain one plus the two griddepcontrol instructions.) The same arithmetic on the same values.
//
// kMasked (the masked kernels: the model's final LayerNorm with the reference's zero_invalid_rows after it): a row
// whose valid[row] is false is written as +0 in every element, as masked_fill(~mask, 0) writes it. Its statistics
// are still computed (the other half of the warp shuffles with it); only its store changes. The flag is read beside
// the row's loads. Without kMasked the code is the plain kernels' (their PTX is unchanged).
template <bool kPdl, int kN, bool kEarly = false, bool kMasked = false>
__device__ __forceinline__ void layer_norm_rows2_f16(const __half* __restrict__ X, const __half* __restrict__ gamma,
                                                     const __half* __restrict__ beta, __half* __restrict__ Y,
                                                     int64_t M, int N, float eps,
                                                     const bool* __restrict__ valid = nullptr) {
  static_assert(!kEarly || kN > 0, "rows2_full_early: rows of a width known when the kernel is compiled");
  dependent_launch_entry<kPdl>();
  constexpr int kHalf = kWarp / 2;
  Half4 g_low, b_low, g_high, b_high;
  if constexpr (kEarly) {
    const int lane = threadIdx.x % kHalf;
    if (lane < kN / 4) {
      g_low = reinterpret_cast<const Half4*>(gamma)[lane];
      b_low = reinterpret_cast<const Half4*>(beta)[lane];
    }
    if (lane + kHalf < kN / 4) {
      g_high = reinterpret_cast<const Half4*>(gamma)[lane + kHalf];
      b_high = reinterpret_cast<const Half4*>(beta)[lane + kHalf];
    }
  }
  if constexpr (kN > 0) N = kN;
  const int64_t warp_row = (static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp) * 2;
  if (warp_row >= M) return;  // both rows of this warp are past the end: the whole warp leaves together
  const int lane = threadIdx.x % kHalf;
  const int64_t row = warp_row + (threadIdx.x % kWarp) / kHalf;
  const bool live = row < M;  // a half past the end still takes part in the shuffles
  const int vectors = N / 4;
  const Half4* row4 = reinterpret_cast<const Half4*>(X + (live ? row : 0) * N);
  bool keep = true;  // kMasked: whether this row is written (valid), else zeroed
  if constexpr (kMasked) keep = live && valid[row];

  kk_welford::Moments low{0.f, 0.f, 0.f}, high{0.f, 0.f, 0.f};
  Half4 data_low, data_high;
  if (live && lane < vectors) {
    data_low = row4[lane];
#pragma unroll
    for (int k = 0; k < 4; ++k) low = kk_welford::push(__half2float(data_low.v[k]), low);
  }
  if (live && lane + kHalf < vectors) {
    data_high = row4[lane + kHalf];
#pragma unroll
    for (int k = 0; k < 4; ++k) high = kk_welford::push(__half2float(data_high.v[k]), high);
  }
  float mean, rstd;
  if constexpr (kN > 0) {  // a dead half (past M) computes garbage in its own lanes, which its shuffles never leave
    constexpr int kV = kN / 4;
    kk_welford::Moments s =
        kk_welford::merge_counted<kTreeOwn<kV, 16>, kTreeOther<kV, 16>>(low, high);  // ATen's offset-16 step
    s = kk_welford::merge_counted<kTreeOwn<kV, 8>, kTreeOther<kV, 8>>(s, kk_welford::shuffled_down(s, 8, kHalf));
    s = kk_welford::merge_counted<kTreeOwn<kV, 4>, kTreeOther<kV, 4>>(s, kk_welford::shuffled_down(s, 4, kHalf));
    s = kk_welford::merge_counted<kTreeOwn<kV, 2>, kTreeOther<kV, 2>>(s, kk_welford::shuffled_down(s, 2, kHalf));
    s = kk_welford::merge_counted<kTreeOwn<kV, 1>, kTreeOther<kV, 1>>(s, kk_welford::shuffled_down(s, 1, kHalf));
    const kk_welford::Moments empty{0.f, 0.f, 0.f};  // ATen's idle warps, and the merge of two of them
    s = kk_welford::merge_counted<kN, 0>(s, empty);
    s = kk_welford::merge_counted<kN, 0>(s, empty);
    mean = __shfl_sync(0xffffffffu, s.mean, 0, kHalf);
    const float var = __shfl_sync(0xffffffffu, s.m2 / float(kN), 0, kHalf);
    rstd = rsqrtf(var + eps);
  } else {
    kk_welford::Moments s = kk_welford::merge(low, high);  // ATen's offset-16 step
    for (int offset = kHalf / 2; offset > 0; offset >>= 1) {
      const kk_welford::Moments other{__shfl_down_sync(0xffffffffu, s.mean, offset, kHalf),
                                      __shfl_down_sync(0xffffffffu, s.m2, offset, kHalf),
                                      __shfl_down_sync(0xffffffffu, s.count, offset, kHalf)};
      s = kk_welford::merge(s, other);
    }
    finish_stats(s, N, eps, kHalf, mean, rstd);
  }
  if (!live) return;
  Half4* out4 = reinterpret_cast<Half4*>(Y + row * N);
  if constexpr (kMasked) {
    if (!keep) {  // an invalid token's row: +0, as the reference's masked_fill writes it
      const Half4 zero{{__ushort_as_half(0), __ushort_as_half(0), __ushort_as_half(0), __ushort_as_half(0)}};
      if (lane < vectors) out4[lane] = zero;
      if (lane + kHalf < vectors) out4[lane + kHalf] = zero;
      return;
    }
  }
  if constexpr (kEarly) {
    if (lane < vectors) write_loaded(data_low, g_low, b_low, out4, lane, mean, rstd);
    if (lane + kHalf < vectors) write_loaded(data_high, g_high, b_high, out4, lane + kHalf, mean, rstd);
  } else {
    if (lane < vectors) write_vector(data_low, gamma, beta, out4, lane, mean, rstd);
    if (lane + kHalf < vectors) write_vector(data_high, gamma, beta, out4, lane + kHalf, mean, rstd);
  }
}

// rows2 (kN == 0), rows2_full (kN: 16, 32, 64 or 128) and rows2_full_early (kEarly).
template <bool kPdl, int kN, bool kEarly = false>
__global__ void layer_norm_rows2_f16_kernel(const __half* __restrict__ X, const __half* __restrict__ gamma,
                                            const __half* __restrict__ beta, __half* __restrict__ Y, int64_t M,
                                            int N, float eps) {
  static_assert(kN == 0 || kN == 16 || kN == 32 || kN == 64 || kN == 128, "rows2_full: rows of 16, 32, 64 or 128");
  layer_norm_rows2_f16<kPdl, kN, kEarly>(X, gamma, beta, Y, M, N, eps);
}

// The masked kernels: rows2 (kN == 0) or rows2_full (kN) with valid[row] false rows written as +0 (kMasked above).
template <bool kPdl, int kN, bool kEarly = false>
__global__ void layer_norm_rows2_masked_f16_kernel(const __half* __restrict__ X, const __half* __restrict__ gamma,
                                                   const __half* __restrict__ beta, const bool* __restrict__ valid,
                                                   __half* __restrict__ Y, int64_t M, int N, float eps) {
  layer_norm_rows2_f16<kPdl, kN, kEarly, true>(X, gamma, beta, Y, M, N, eps, valid);
}

// Rows of any width ATen's vector path takes, one warp per row: the warp plays ATen's whole block of 4 warps.
// Lane l holds the Welford states of ATen's threads l, l + 32, l + 64 and l + 96 (its warps 0..3); each state folds
// the vectors t, t + 128, ... of its thread t element by element, in ATen's order. Each of the four is reduced by
// ATen's shuffle-down tree (in the warp, as ATen's warp w reduces its own), then ATen's tree over the block's warps,
// which ATen runs through shared memory, runs in registers: warps 0 and 1 merge warps 2 and 3, then warp 0 merges
// warp 1. For rows of at most 128 elements warps 1..3 hold nothing, as in layer_norm_rows_f16_kernel.
// Why: ATen launches 4 warps per row and synchronizes them twice; one warp per row needs neither.
constexpr int kBlockWarps = 4;  // ATen: block (32, 4)

// This thread's row: one per warp, kRowsPerBlock warps per block.
__device__ __forceinline__ int64_t warp_row() {
  return static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp;
}

// The elements each lane of ATen's warp w folds in a row of kN: 4 per vector t + 128 j < kN / 4 (t = lane + 32 w).
template <int kN, int kWarpIndex>
constexpr int kLaneElements =
    kN / 4 > kWarp * kWarpIndex ? 4 * ((kN / 4 - kWarp * kWarpIndex + kBlockWarps * kWarp - 1) / (kBlockWarps * kWarp))
                                : 0;

// ATen's warp w of a row of kN, its fold and its shuffle-down tree, every count known (block4_full).
template <int kN, int kWarpIndex>
__device__ __forceinline__ kk_welford::Moments warp_state_counted(const Half4* row4, int lane) {
  constexpr int kElements = kLaneElements<kN, kWarpIndex>;
  kk_welford::Moments s{0.f, 0.f, 0.f};
#pragma unroll
  for (int j = 0; j < kElements / 4; ++j) {
    const Half4 data = row4[lane + kWarpIndex * kWarp + j * kBlockWarps * kWarp];
#pragma unroll
    for (int k = 0; k < 4; ++k) s = kk_welford::push(__half2float(data.v[k]), s);
  }
  return kk_welford::warp_merge_down_counted<kElements>(s);
}

// kN == 0 (the block4 launch, as proven): N at run time. kN > 0 (block4_full): rows of exactly kN elements, a multiple
// of 128 from 256 (compiled for the widths full_kernel lists): every lane of one of ATen's warps holds as many
// vectors as the others, so every count of the folds and the trees is known when the kernel is compiled
// (kk_welford::merge_counted). The counts' shares are computed by the compiler, correctly rounded as rcp.rn and mul.rn
// round them at run time (tests/test_layer_norm_kernel.py reads them in the PTX: 1/3 and 2/3 at 384 and 768).
template <bool kPdl, int kN>
__device__ __forceinline__ void layer_norm_block4_f16(const __half* __restrict__ X, const __half* __restrict__ gamma,
                                                      const __half* __restrict__ beta, __half* __restrict__ Y,
                                                      int64_t M, int N, float eps) {
  static_assert(kN == 0 || (kN >= 256 && kN % 128 == 0), "block4_full: rows of a multiple of 128 from 256");
  dependent_launch_entry<kPdl>();
  if constexpr (kN > 0) N = kN;
  const int64_t row = warp_row();
  if (row >= M) return;  // the whole warp leaves together: its shuffles see full warps
  const int vectors = N / 4, lane = threadIdx.x % kWarp;
  const Half4* row4 = reinterpret_cast<const Half4*>(X + row * N);

  kk_welford::Moments warps[kBlockWarps];
  if constexpr (kN > 0) {
    warps[0] = warp_state_counted<kN, 0>(row4, lane);
    warps[1] = warp_state_counted<kN, 1>(row4, lane);
    warps[2] = warp_state_counted<kN, 2>(row4, lane);
    warps[3] = warp_state_counted<kN, 3>(row4, lane);
    // ATen's block step (offset 2, then 1): warp y < offset merges warp y + offset; warp w's state holds its 32
    // lanes' elements
    constexpr int c0 = kWarp * kLaneElements<kN, 0>, c1 = kWarp * kLaneElements<kN, 1>;
    constexpr int c2 = kWarp * kLaneElements<kN, 2>, c3 = kWarp * kLaneElements<kN, 3>;
    warps[0] = kk_welford::merge_counted<c0, c2>(warps[0], warps[2]);
    warps[1] = kk_welford::merge_counted<c1, c3>(warps[1], warps[3]);
    warps[0] = kk_welford::merge_counted<c0 + c2, c1 + c3>(warps[0], warps[1]);
  } else {
#pragma unroll
    for (int w = 0; w < kBlockWarps; ++w) {
      kk_welford::Moments s{0.f, 0.f, 0.f};
      for (int i = lane + w * kWarp; i < vectors; i += kBlockWarps * kWarp) {  // ATen's thread t = lane + 32 w
        const Half4 data = row4[i];
#pragma unroll
        for (int k = 0; k < 4; ++k) s = kk_welford::push(__half2float(data.v[k]), s);
      }
      warps[w] = kk_welford::warp_merge_down(s);
    }
    // ATen's block step (offset 2, then 1): warp y < offset merges warp y + offset.
    warps[0] = kk_welford::merge(warps[0], warps[2]);
    warps[1] = kk_welford::merge(warps[1], warps[3]);
    warps[0] = kk_welford::merge(warps[0], warps[1]);
  }
  const float mean = __shfl_sync(0xffffffffu, warps[0].mean, 0, kWarp);
  const float var = __shfl_sync(0xffffffffu, warps[0].m2 / float(N), 0, kWarp);
  const float rstd = rsqrtf(var + eps);

  Half4* out4 = reinterpret_cast<Half4*>(Y + row * N);
  for (int i = lane; i < vectors; i += kWarp) write_vector(row4[i], gamma, beta, out4, i, mean, rstd);
}

// block4 (kN == 0) and block4_full (kN: a multiple of 128 from 256).
template <bool kPdl, int kN>
__global__ void layer_norm_block4_f16_kernel(const __half* __restrict__ X, const __half* __restrict__ gamma,
                                             const __half* __restrict__ beta, __half* __restrict__ Y, int64_t M,
                                             int N, float eps) {
  layer_norm_block4_f16<kPdl, kN>(X, gamma, beta, Y, M, N, eps);
}

using Kernel = void (*)(const __half*, const __half*, const __half*, __half*, int64_t, int, float);

// The full forms' kernel for rows of N: rows2_full at 16-128 (FULL_ROW_WIDTHS in layer_norm.py), block4_full at
// 256-1024 (FULL_BLOCK_WIDTHS); with kEarly, rows2_full_early (rows2_full's widths only); nullptr for another width.
template <bool kPdl, bool kEarly = false>
Kernel full_kernel(int64_t N) {
  switch (N) {
    case 16: return layer_norm_rows2_f16_kernel<kPdl, 16, kEarly>;
    case 32: return layer_norm_rows2_f16_kernel<kPdl, 32, kEarly>;
    case 64: return layer_norm_rows2_f16_kernel<kPdl, 64, kEarly>;
    case 128: return layer_norm_rows2_f16_kernel<kPdl, 128, kEarly>;
    case 256: return kEarly ? nullptr : layer_norm_block4_f16_kernel<kPdl, 256>;
    case 384: return kEarly ? nullptr : layer_norm_block4_f16_kernel<kPdl, 384>;
    case 512: return kEarly ? nullptr : layer_norm_block4_f16_kernel<kPdl, 512>;
    case 768: return kEarly ? nullptr : layer_norm_block4_f16_kernel<kPdl, 768>;
    case 1024: return kEarly ? nullptr : layer_norm_block4_f16_kernel<kPdl, 1024>;
    default: return nullptr;
  }
}

using MaskedKernel = void (*)(const __half*, const __half*, const __half*, const bool*, __half*, int64_t, int, float);
template <bool kPdl, int kN, bool kEarly = false>
constexpr MaskedKernel masked = layer_norm_rows2_masked_f16_kernel<kPdl, kN, kEarly>;

// The masked kernel of a launch: rows2 (rows_per_warp 2, any N up to 128), rows2_full (3) or rows2_full_early (6) at
// 16, 32, 64 or 128; nullptr where the launch has no masked form or does not take rows of N.
template <bool kPdl>
MaskedKernel masked_kernel(int rows_per_warp, int64_t N) {
  if (rows_per_warp == 2) return masked<kPdl, 0>;
  if (rows_per_warp != 3 && rows_per_warp != 6) return nullptr;
  const bool early = rows_per_warp == 6;
  switch (N) {
    case 16: return early ? masked<kPdl, 16, true> : masked<kPdl, 16>;
    case 32: return early ? masked<kPdl, 32, true> : masked<kPdl, 32>;
    case 64: return early ? masked<kPdl, 64, true> : masked<kPdl, 64>;
    case 128: return early ? masked<kPdl, 128, true> : masked<kPdl, 128>;
    default: return nullptr;
  }
}

// Whether every buffer is 8-byte aligned: the kernels read and write 4 halves at once, as ATen's vector path does.
bool aligned8(std::initializer_list<const void*> buffers) {
  for (const void* p : buffers)
    if (reinterpret_cast<uintptr_t>(p) % 8 != 0) return false;
  return true;
}

// One launch of 8-warp blocks on `stream`; with pdl, as a programmatic dependent launch.
template <typename K, typename... Args>
cudaError_t launch_rows(K kernel, int64_t blocks, int pdl, void* stream, Args... args) {
  if (pdl) {
    cudaLaunchAttribute attribute[1];
    attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(static_cast<unsigned>(blocks));
    config.blockDim = dim3(kRowsPerBlock * kWarp);
    config.dynamicSmemBytes = 0;
    config.stream = static_cast<cudaStream_t>(stream);
    config.attrs = attribute;
    config.numAttrs = 1;
    return cudaLaunchKernelEx(&config, kernel, args...);
  }
  kernel<<<static_cast<unsigned>(blocks), kRowsPerBlock * kWarp, 0, static_cast<cudaStream_t>(stream)>>>(args...);
  return cudaGetLastError();
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) const char* kk_layer_norm_last_error(void) { return g_error.c_str(); }

// y[M, N] = LayerNorm(x[M, N]) * weight + bias (float16, contiguous rows, 8-byte aligned, N % 4 == 0).
// Returns 0, or 1 with kk_layer_norm_last_error().
// rows_per_warp 1: layer_norm_rows_f16_kernel; 2: layer_norm_rows2_f16_kernel (N <= 128 for both);
// 3: layer_norm_rows2_f16_kernel<kN> (rows2_full: two rows per warp, N of 16, 32, 64 or 128, the tree's counts known);
// 4: layer_norm_block4_f16_kernel (one row per warp playing ATen's 4 warps; N <= 2^24, ATen's vector-path limit);
// 5: layer_norm_block4_f16_kernel<kN> (block4_full: every count known, N of 256, 384, 512, 768 or 1024);
// 6: rows2_full with gamma and beta loaded first (rows2_full_early: N of 16, 32, 64 or 128).
// Each launch runs only where the build proved it bit-identical. pdl 1: a programmatic dependent launch (the same
// arithmetic, plus griddepcontrol.wait and launch_dependents at the kernel's start).
__attribute__((visibility("default"))) int kk_layer_norm_rows_f16(const void* x, const void* weight,
                                                                  const void* bias, void* y, int64_t M, int64_t N,
                                                                  float eps, int rows_per_warp, int pdl,
                                                                  void* stream) {
  if (M <= 0) return 0;
  if (rows_per_warp == 3 && (N > 128 || full_kernel<false>(N) == nullptr)) {
    g_error = "kk_layer_norm_rows_f16: the rows2_full launch takes rows of 16, 32, 64 or 128 elements";
    return 1;
  }
  if (rows_per_warp == 6 && full_kernel<false, true>(N) == nullptr) {
    g_error = "kk_layer_norm_rows_f16: the rows2_full_early launch takes rows of 16, 32, 64 or 128 elements";
    return 1;
  }
  if (rows_per_warp == 5 && (N <= 128 || full_kernel<false>(N) == nullptr)) {
    g_error = "kk_layer_norm_rows_f16: the block4_full launch takes rows of 256, 384, 512, 768 or 1024 elements";
    return 1;
  }
  if (rows_per_warp == 4 || rows_per_warp == 5) {
    if (N <= 0 || N > (1LL << 24) || N % 4 != 0) {
      g_error = "kk_layer_norm_rows_f16: rows of 4..2^24 elements, a multiple of 4 (ATen's vector path)";
      return 1;
    }
  } else if (N <= 0 || N > 128 || N % 4 != 0) {
    g_error = "kk_layer_norm_rows_f16: rows of 4..128 elements, a multiple of 4 (ATen's vector path, one warp)";
    return 1;
  }
  if (!aligned8({x, weight, bias, y})) {
    g_error = "kk_layer_norm_rows_f16: buffers must be 8-byte aligned (ATen's vector path)";
    return 1;
  }
  if (rows_per_warp < 1 || rows_per_warp > 6) {
    g_error = "kk_layer_norm_rows_f16: rows_per_warp is 1 or 2 (3: two rows of 128 with known counts; 4: ATen's "
              "block in one warp; 5: that with known counts; 6: 3 with gamma and beta loaded first)";
    return 1;
  }
  const bool two_rows = rows_per_warp == 2 || rows_per_warp == 3 || rows_per_warp == 6;  // the rows2 kernels
  const int64_t rows_per_block = kRowsPerBlock * (two_rows ? 2 : 1);
  const int64_t blocks = (M + rows_per_block - 1) / rows_per_block;
  if (blocks > 2147483647LL) {
    g_error = "kk_layer_norm_rows_f16: too many rows";
    return 1;
  }
  const Kernel kernel =
      rows_per_warp == 1   ? (pdl ? layer_norm_rows_f16_kernel<true> : layer_norm_rows_f16_kernel<false>)
      : rows_per_warp == 2 ? (pdl ? layer_norm_rows2_f16_kernel<true, 0> : layer_norm_rows2_f16_kernel<false, 0>)
      : rows_per_warp == 3 ? (pdl ? full_kernel<true>(N) : full_kernel<false>(N))
      : rows_per_warp == 4 ? (pdl ? layer_norm_block4_f16_kernel<true, 0> : layer_norm_block4_f16_kernel<false, 0>)
      : rows_per_warp == 6 ? (pdl ? full_kernel<true, true>(N) : full_kernel<false, true>(N))
                           : (pdl ? full_kernel<true>(N) : full_kernel<false>(N));
  const int n = static_cast<int>(N);
  const cudaError_t err = launch_rows(kernel, blocks, pdl, stream, static_cast<const __half*>(x),
                                      static_cast<const __half*>(weight), static_cast<const __half*>(bias),
                                      static_cast<__half*>(y), M, n, eps);
  if (err != cudaSuccess) {
    g_error = std::string("layer_norm_rows_f16_kernel: ") + cudaGetErrorString(err);
    return 1;
  }
  return 0;
}

// y as kk_layer_norm_rows_f16 computes it, with the rows whose valid[row] is 0 written as +0 (the model's final
// LayerNorm followed by the reference's zero_invalid_rows, in one launch). valid: M bools. rows_per_warp 2 (rows2), 3
// (rows2_full) or 6 (rows2_full_early); the other launches have no masked form. Returns 0, or 1 with
// kk_layer_norm_last_error().
__attribute__((visibility("default"))) int kk_layer_norm_rows_masked_f16(const void* x, const void* weight,
                                                                         const void* bias, const void* valid, void* y,
                                                                         int64_t M, int64_t N, float eps,
                                                                         int rows_per_warp, int pdl, void* stream) {
  if (M <= 0) return 0;
  if (N <= 0 || N > 128 || N % 4 != 0) {
    g_error = "kk_layer_norm_rows_masked_f16: rows of 4..128 elements, a multiple of 4 (ATen's vector path, one warp)";
    return 1;
  }
  const MaskedKernel kernel = pdl ? masked_kernel<true>(rows_per_warp, N) : masked_kernel<false>(rows_per_warp, N);
  if (kernel == nullptr) {
    g_error = "kk_layer_norm_rows_masked_f16: masked launches are rows2 (rows_per_warp 2) and, at 16, 32, 64 or 128 "
              "elements, rows2_full (3) and rows2_full_early (6)";
    return 1;
  }
  if (!aligned8({x, weight, bias, y})) {
    g_error = "kk_layer_norm_rows_masked_f16: buffers must be 8-byte aligned (ATen's vector path)";
    return 1;
  }
  if (valid == nullptr) {
    g_error = "kk_layer_norm_rows_masked_f16: no valid-token mask";
    return 1;
  }
  const int64_t blocks = (M + 2 * kRowsPerBlock - 1) / (2 * kRowsPerBlock);
  if (blocks > 2147483647LL) {
    g_error = "kk_layer_norm_rows_masked_f16: too many rows";
    return 1;
  }
  const cudaError_t err = launch_rows(kernel, blocks, pdl, stream, static_cast<const __half*>(x),
                                      static_cast<const __half*>(weight), static_cast<const __half*>(bias),
                                      static_cast<const bool*>(valid), static_cast<__half*>(y), M,
                                      static_cast<int>(N), eps);
  if (err != cudaSuccess) {
    g_error = std::string("layer_norm_rows2_masked_f16_kernel: ") + cudaGetErrorString(err);
    return 1;
  }
  return 0;
}

}  // extern "C"

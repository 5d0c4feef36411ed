// The reference's attention softmax for long rows (shape 14), fused and skipping masked keys, in ATen's order.
//
// The reference computes, per query row of a causal tile, over every key of a row of length L:
//   s = fp16(fp16(q.k) * scale); s = -inf where key > query; p = fp16(softmax(float(s)))
// with ATen's block softmax for rows longer than 1024 (aten/src/ATen/native/cuda/SoftMax.cu, read at the
// source; confirmed or refuted on the GPU by scripts/block_softmax_selftest.py). For a float32 row of length
// L > 1024: one block of 1024 threads per row; thread t folds the 4-wide vectors t, t + 1024, ... (element
// 4v + j, j = 0..3 in order) into a running max and then a running `sum += expf(x - max)`; the
// `cunn_SoftMaxForward` kernel (rows that do not fit 48 KiB of shared memory, or are not a multiple of 4)
// folds the last L mod 4096 elements one at a time instead (element L - L mod 4096 + t + 1024 i to thread t);
// `cunn_SoftMaxForwardSmem` has no such tail. The 1024 partials go through cuda_utils::BlockReduce (a
// shuffle-down tree in each warp, lane 0's values to shared memory, the same tree over the 32 warp values);
// the output is `expf(x - max) / sum`, IEEE division, rounded to fp16 by the caller's cast.
//
// This kernel does the same, reading the raw fp16 GEMM output (the scale, the fp16 roundings, the causal
// mask and both casts are elementwise, hence exact in any fusion) and never touching keys past the query:
// they are -inf, so they leave each thread's max unchanged and add exactly +0 to its sum. Only the first
// `width` columns exist in memory (width >= the last row's visible keys); the output has the same columns.
// Built by nvcc with its defaults, like PyTorch's kernels (expf and the division come out the same).

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>
#include <string>

namespace {

constexpr int kThreads = 1024;  // ATen's SoftMaxForward_getBlockSize for rows of 1024 elements or more
constexpr int kWarp = 32;
constexpr int kVec = 4;  // ILP: sizeof(float4) / sizeof(float)

thread_local std::string g_error;

// The scaled, rounded, masked score of key `e` as the reference's float32 softmax input sees it.
__device__ __forceinline__ float score(const __half* row, int64_t e, int64_t visible, float scale) {
  if (e >= visible) return -INFINITY;
  const float scaled = __half2float(row[e]) * scale;  // ATen: fp16 tensor * Python float, in fp32 opmath
  return __half2float(__float2half_rn(scaled));
}

// ATen's cuda_utils::WarpReduce / BlockReduce for sums (lane 0 of warp 0 ends with the block's value).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = kWarp >> 1; offset > 0; offset >>= 1) v = v + __shfl_down_sync(0xffffffffu, v, offset, kWarp);
  return v;
}

__device__ float block_sum(float v, float* shared) {
  const int lane = threadIdx.x % kWarp, wid = threadIdx.x / kWarp;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) shared[wid] = v;
  __syncthreads();
  v = (threadIdx.x < blockDim.x / kWarp) ? shared[lane] : 0.f;
  if (wid == 0) v = warp_sum(v);
  if (threadIdx.x == 0) shared[0] = v;
  __syncthreads();
  const float total = shared[0];
  __syncthreads();
  return total;
}

// The max is exact in any order; a plain shared-memory tree.
__device__ float block_max(float v, float* shared) {
  __syncthreads();
  shared[threadIdx.x] = v;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
    if (threadIdx.x < stride) shared[threadIdx.x] = fmaxf(shared[threadIdx.x], shared[threadIdx.x + stride]);
    __syncthreads();
  }
  const float m = shared[0];
  __syncthreads();
  return m;
}

// Launch variants. None changes what is computed, only how; each is proven bitwise against the reference
// composition on the GPU before it runs (kkdeploy.kernels.block_softmax.prove_block_softmax):
//  * kRawMax: pass 1 takes the max of the raw fp16 scores and scales it once. The score map
//    raw -> fp16(fp16(raw) * scale) is monotone for scale > 0 (a product by a positive number, then
//    round-to-nearest), so the max of the scores is the score of the max raw value: max is exact in any order.
//  * kMarkstein: p = e / sum as one correctly rounded reciprocal per row and two fmas (Markstein's
//    correction: q = e * r, rem = fma(-q, sum, e) is exact, p = fma(rem, r, q)), instead of IEEE division per
//    element. It is exact for normal quotients; the probabilities it could differ on are far below the
//    smallest float16, so the cast gives the same bits. Proven, not assumed.
//  * vector IO (chosen at launch when pointers and strides allow): 4 halfs per load and store.
constexpr int kRawMax = 1;
constexpr int kMarkstein = 2;

__device__ __forceinline__ float score_of(float raw, float scale) {
  return __half2float(__float2half_rn(raw * scale));  // ATen: fp16 tensor * Python float, in fp32 opmath
}

__device__ __forceinline__ void load4(const __half* row, int64_t v, float (&x)[kVec]) {
  const uint2 packed = *reinterpret_cast<const uint2*>(row + v * kVec);
  const __half2 lo = *reinterpret_cast<const __half2*>(&packed.x);
  const __half2 hi = *reinterpret_cast<const __half2*>(&packed.y);
  x[0] = __low2float(lo);
  x[1] = __high2float(lo);
  x[2] = __low2float(hi);
  x[3] = __high2float(hi);
}

// One block per row. `row_len` is the logical row length L (what the reference's softmax sees), `tail` its
// scalar tail (L mod 4096 for cunn_SoftMaxForward, 0 for the Smem kernel), `first_query` the query index of
// row 0 and `queries` the rows per query tile (row r is query first_query + r % queries). With `lengths`
// (padded calls, one valid-prefix length per sequence; row r belongs to sequence r / rows_per_sequence), keys
// at or past the sequence's length are masked too, for every query, as the reference masks invalid keys.
template <int kVariant, bool kVecIO>
__global__ void __launch_bounds__(kThreads) causal_block_softmax_kernel(
    const __half* __restrict__ raw, __half* __restrict__ out, int64_t width, int64_t ld_in, int64_t ld_out,
    int64_t row_len, int64_t tail, int64_t first_query, int64_t queries, float scale, int causal,
    const int64_t* __restrict__ lengths, int64_t rows_per_sequence) {
  __shared__ float shared[kThreads];
  const int64_t r = blockIdx.x;
  const __half* row = raw + r * ld_in;
  __half* orow = out + r * ld_out;
  const int64_t query = first_query + r % queries;
  int64_t visible = causal ? (query + 1 < row_len ? query + 1 : row_len) : row_len;
  if (lengths != nullptr) {
    const int64_t valid = lengths[r / rows_per_sequence];
    visible = valid < visible ? valid : visible;
  }
  const int64_t main_end = row_len - tail;  // vector-owned elements [0, main_end)
  const int t = threadIdx.x;

  // pass 1: the thread's max over its elements (ATen starts from -FLT_MAX)
  float m = -FLT_MAX;
  if (kVariant & kRawMax) {
    __half hm = __float2half_rn(-INFINITY);
    bool any = false;
    for (int64_t v = t; v * kVec < main_end && v * kVec < visible; v += kThreads) {
      if (kVecIO && v * kVec + kVec <= visible) {
        const uint2 packed = *reinterpret_cast<const uint2*>(row + v * kVec);
        const __half2 pair = __hmax2(*reinterpret_cast<const __half2*>(&packed.x),
                                     *reinterpret_cast<const __half2*>(&packed.y));
        hm = __hmax(hm, __hmax(__low2half(pair), __high2half(pair)));
      } else {
        for (int j = 0; j < kVec && v * kVec + j < visible; ++j) hm = __hmax(hm, row[v * kVec + j]);
      }
      any = true;
    }
    for (int64_t e = main_end + t; e < row_len && e < visible; e += kThreads) {
      hm = __hmax(hm, row[e]);
      any = true;
    }
    if (any) m = fmaxf(m, score_of(__half2float(hm), scale));
  } else {
    for (int64_t v = t; v * kVec < main_end && v * kVec < visible; v += kThreads)
#pragma unroll
      for (int j = 0; j < kVec; ++j) m = fmaxf(m, score(row, v * kVec + j, visible, scale));
    for (int64_t e = main_end + t; e < row_len && e < visible; e += kThreads)
      m = fmaxf(m, score(row, e, visible, scale));
  }
  const float row_max = block_max(m, shared);

  // pass 2: the thread's sum, element by element in ATen's order
  float s = 0.f;
  for (int64_t v = t; v * kVec < main_end && v * kVec < visible; v += kThreads) {
    if (kVecIO) {
      float x[kVec];
      load4(row, v, x);
#pragma unroll
      for (int j = 0; j < kVec; ++j)
        s = s + expf((v * kVec + j < visible ? score_of(x[j], scale) : -INFINITY) - row_max);
    } else {
#pragma unroll
      for (int j = 0; j < kVec; ++j) s = s + expf(score(row, v * kVec + j, visible, scale) - row_max);
    }
  }
  for (int64_t e = main_end + t; e < row_len && e < visible; e += kThreads)
    s = s + expf(score(row, e, visible, scale) - row_max);
  const float row_sum = block_sum(s, shared);
  const float inverse = (kVariant & kMarkstein) ? __frcp_rn(row_sum) : 0.f;

  // pass 3: the probabilities of the stored columns (0 past the visible keys, as exp(-inf) / sum is)
  auto probability = [&](float x, int64_t e) -> float {
    if (e >= visible) return 0.f;
    const float ex = expf(score_of(x, scale) - row_max);
    if (kVariant & kMarkstein) {
      const float q = __fmul_rn(ex, inverse);
      return __fmaf_rn(__fmaf_rn(-q, row_sum, ex), inverse, q);
    }
    return ex / row_sum;
  };
  if (kVecIO) {
    for (int64_t v = t; v * kVec < width; v += kThreads) {
      const int64_t e0 = v * kVec;
      uint2 packed = make_uint2(0u, 0u);  // all zero halfs: the masked keys' probabilities
      if (e0 < visible) {
        float x[kVec];
        load4(row, v, x);
        const __half2 lo = __floats2half2_rn(probability(x[0], e0), probability(x[1], e0 + 1));
        const __half2 hi = __floats2half2_rn(probability(x[2], e0 + 2), probability(x[3], e0 + 3));
        packed.x = *reinterpret_cast<const unsigned*>(&lo);
        packed.y = *reinterpret_cast<const unsigned*>(&hi);
      }
      *reinterpret_cast<uint2*>(orow + e0) = packed;
    }
  } else {
    for (int64_t e = t; e < width; e += kThreads)
      orow[e] = __float2half_rn(e < visible ? probability(__half2float(row[e]), e) : 0.f);
  }
}

template <int kVariant>
cudaError_t launch_variant(bool vec_io, unsigned rows, cudaStream_t stream, const __half* raw, __half* out,
                           int64_t width, int64_t ld_in, int64_t ld_out, int64_t row_len, int64_t tail,
                           int64_t first_query, int64_t queries, float scale, int causal, const int64_t* lengths,
                           int64_t rows_per_sequence) {
  if (vec_io)
    causal_block_softmax_kernel<kVariant, true><<<rows, kThreads, 0, stream>>>(
        raw, out, width, ld_in, ld_out, row_len, tail, first_query, queries, scale, causal, lengths,
        rows_per_sequence);
  else
    causal_block_softmax_kernel<kVariant, false><<<rows, kThreads, 0, stream>>>(
        raw, out, width, ld_in, ld_out, row_len, tail, first_query, queries, scale, causal, lengths,
        rows_per_sequence);
  return cudaGetLastError();
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) const char* kk_block_softmax_last_error(void) { return g_error.c_str(); }

// probs[r, :width] for rows r < rows; see the kernel. `variant` is a sum of kRawMax (1) and kMarkstein (2);
// `vector_io` allows 4-half loads and stores (taken only when pointers and strides are 8-byte aligned).
// `lengths` may be null (no padding). Returns 0, or 1 with kk_block_softmax_last_error().
__attribute__((visibility("default"))) int kk_causal_block_softmax_f16(
    const void* raw, void* out, int64_t rows, int64_t width, int64_t ld_in, int64_t ld_out, int64_t row_len,
    int64_t tail, int64_t first_query, int64_t queries, float scale, int causal, const void* lengths,
    int64_t rows_per_sequence, int variant, int vector_io, void* stream) {
  if (rows <= 0 || width <= 0) return 0;
  if (row_len <= 1024 || width > row_len || queries <= 0 || tail < 0 || tail >= 4096 || rows > 2147483647LL ||
      (lengths != nullptr && rows_per_sequence <= 0) || variant < 0 || variant > 3 ||
      ((variant & kRawMax) && !(scale > 0.f))) {
    g_error = "kk_causal_block_softmax_f16: needs rows longer than 1024, width <= row_len, queries > 0, "
              "0 <= tail < 4096, rows_per_sequence > 0 with lengths, variant 0..3, and scale > 0 for the raw max";
    return 1;
  }
  const bool vec = vector_io && width % kVec == 0 && ld_in % kVec == 0 && ld_out % kVec == 0 &&
                   reinterpret_cast<uintptr_t>(raw) % 8 == 0 && reinterpret_cast<uintptr_t>(out) % 8 == 0;
  const auto* in = static_cast<const __half*>(raw);
  auto* o = static_cast<__half*>(out);
  const auto* len = static_cast<const int64_t*>(lengths);
  const auto st = static_cast<cudaStream_t>(stream);
  const auto n = static_cast<unsigned>(rows);
  cudaError_t err;
  switch (variant) {
    case 0: err = launch_variant<0>(vec, n, st, in, o, width, ld_in, ld_out, row_len, tail, first_query, queries,
                                    scale, causal, len, rows_per_sequence); break;
    case 1: err = launch_variant<1>(vec, n, st, in, o, width, ld_in, ld_out, row_len, tail, first_query, queries,
                                    scale, causal, len, rows_per_sequence); break;
    case 2: err = launch_variant<2>(vec, n, st, in, o, width, ld_in, ld_out, row_len, tail, first_query, queries,
                                    scale, causal, len, rows_per_sequence); break;
    default: err = launch_variant<3>(vec, n, st, in, o, width, ld_in, ld_out, row_len, tail, first_query,
                                     queries, scale, causal, len, rows_per_sequence); break;
  }
  if (err != cudaSuccess) {
    g_error = std::string("causal_block_softmax_kernel: ") + cudaGetErrorString(err);
    return 1;
  }
  return 0;
}

}  // extern "C"

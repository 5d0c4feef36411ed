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

// One block per row. `row_len` is the logical row length L (what the reference's softmax sees), `tail` its
// scalar tail (L mod 4096 for cunn_SoftMaxForward, 0 for the Smem kernel), `first_query` the query index of
// row 0 and `queries` the rows per query tile (row r is query first_query + r % queries).
__global__ void causal_block_softmax_kernel(const __half* __restrict__ raw, __half* __restrict__ out,
                                            int64_t width, int64_t ld_in, int64_t ld_out, int64_t row_len,
                                            int64_t tail, int64_t first_query, int64_t queries, float scale,
                                            int causal) {
  __shared__ float shared[kThreads];
  const int64_t r = blockIdx.x;
  const __half* row = raw + r * ld_in;
  __half* orow = out + r * ld_out;
  const int64_t query = first_query + r % queries;
  const int64_t visible = causal ? (query + 1 < row_len ? query + 1 : row_len) : row_len;
  const int64_t main_end = row_len - tail;  // vector-owned elements [0, main_end)
  const int t = threadIdx.x;

  // pass 1: the thread's max over its elements (ATen starts from -FLT_MAX)
  float m = -FLT_MAX;
  for (int64_t v = t; v * kVec < main_end && v * kVec < visible; v += kThreads)
#pragma unroll
    for (int j = 0; j < kVec; ++j) m = fmaxf(m, score(row, v * kVec + j, visible, scale));
  for (int64_t e = main_end + t; e < row_len && e < visible; e += kThreads) m = fmaxf(m, score(row, e, visible, scale));
  const float row_max = block_max(m, shared);

  // pass 2: the thread's sum, element by element in ATen's order
  float s = 0.f;
  for (int64_t v = t; v * kVec < main_end && v * kVec < visible; v += kThreads)
#pragma unroll
    for (int j = 0; j < kVec; ++j) s = s + expf(score(row, v * kVec + j, visible, scale) - row_max);
  for (int64_t e = main_end + t; e < row_len && e < visible; e += kThreads)
    s = s + expf(score(row, e, visible, scale) - row_max);
  const float row_sum = block_sum(s, shared);

  // pass 3: the probabilities of the stored columns (0 past the query, as exp(-inf) / sum is)
  for (int64_t e = t; e < width; e += kThreads) {
    const float p = e < visible ? expf(score(row, e, visible, scale) - row_max) / row_sum : 0.f;
    orow[e] = __float2half_rn(p);
  }
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) const char* kk_block_softmax_last_error(void) { return g_error.c_str(); }

// probs[r, :width] for rows r < rows; see the kernel. Returns 0, or 1 with kk_block_softmax_last_error().
__attribute__((visibility("default"))) int kk_causal_block_softmax_f16(
    const void* raw, void* out, int64_t rows, int64_t width, int64_t ld_in, int64_t ld_out, int64_t row_len,
    int64_t tail, int64_t first_query, int64_t queries, float scale, int causal, void* stream) {
  if (rows <= 0 || width <= 0) return 0;
  if (row_len <= 1024 || width > row_len || queries <= 0 || tail < 0 || tail >= 4096 || rows > 2147483647LL) {
    g_error = "kk_causal_block_softmax_f16: needs rows longer than 1024, width <= row_len, queries > 0, "
              "0 <= tail < 4096";
    return 1;
  }
  causal_block_softmax_kernel<<<static_cast<unsigned>(rows), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const __half*>(raw), static_cast<__half*>(out), width, ld_in, ld_out, row_len, tail, first_query,
      queries, scale, causal);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    g_error = std::string("causal_block_softmax_kernel: ") + cudaGetErrorString(err);
    return 1;
  }
  return 0;
}

}  // extern "C"

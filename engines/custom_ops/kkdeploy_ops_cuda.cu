// kkdeploy's CUDA kernels for the custom ops (issue 20, Part B): each must be bit-identical to the ATen op it
// stands for on the GPU it was proven on (scripts/custom_ops_gpu_selftest.py). Why each is written as it is:
//
// * Linear. F.linear on FP16 CUDA tensors is ATen's addmm -> at::cuda::blas::gemm_and_bias: one cuBLASLt
//   matmul with the bias epilogue (the bias joins the FP32 accumulator; one rounding to FP16). Stock ORT adds
//   the bias after rounding (28% of elements differ). Mode KK_LINEAR_LT_BIAS describes the same matmul to
//   cuBLASLt as ATen does, so cuBLASLt's heuristic, given the same description, picks the same kernel; mode
//   KK_LINEAR_FP32_OUT keeps the FP32 product and adds the bias in our kernel (measured bitwise too).
// * LayerNorm. ATen's vectorized_layer_norm_kernel order: per thread a Welford update per element over
//   4-wide vectors (thread t reads vectors t, t + 128, ...), a shuffle-down tree in the warp, a tree over the
//   block's 4 warps through shared memory, var = m2 / N, rstd = rsqrtf(var + eps), y = g * (rstd * (x - mean))
//   + b. The expressions are written in ATen's operand order and this file is compiled with nvcc's defaults
//   (FMA contraction on, IEEE division and sqrt), as PyTorch's kernels are, so they contract alike.
// * Gelu. ATen's GeluCUDAKernelImpl (approximate="none") in FP32 opmath, rounded once.

#include <cublasLt.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "kkdeploy_ops_cuda.h"
// ATen's Welford steps, shared with the torch op's LayerNorm kernel (kkdeploy/kernels/csrc/layer_norm.cu)
#include "../../kkdeploy/kernels/csrc/welford.cuh"

namespace {

thread_local std::string g_last_error;

int fail(const std::string& what) {
  g_last_error = what;
  return 1;
}

int cuda_status(cudaError_t err, const char* where) {
  if (err == cudaSuccess) return 0;
  return fail(std::string(where) + ": " + cudaGetErrorString(err));
}

int lt_status(cublasStatus_t st, const char* where) {
  if (st == CUBLAS_STATUS_SUCCESS) return 0;
  return fail(std::string(where) + ": cuBLASLt status " + std::to_string(static_cast<int>(st)));
}

// ATen's default cuBLASLt workspace: $CUBLASLT_WORKSPACE_SIZE KiB, else 1024 KiB (pytorch#73328).
size_t aten_lt_workspace_bytes() {
  const char* env = std::getenv("CUBLASLT_WORKSPACE_SIZE");
  if (env != nullptr && *env != '\0') {
    char* end = nullptr;
    const long long kib = std::strtoll(env, &end, 10);
    if (end != env && kib >= 0) return static_cast<size_t>(kib) * 1024;
  }
  return 1024 * 1024;
}

// The largest power of two up to 256 dividing the address: what ATen passes as the MIN_ALIGNMENT preferences.
uint32_t alignment_of(const void* p) {
  const uintptr_t address = reinterpret_cast<uintptr_t>(p);
  uint32_t alignment = 256;
  while (alignment > 1 && address % alignment != 0) alignment /= 2;
  return alignment;
}

struct LinearContext {
  cublasLtHandle_t lt = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  float* scratch = nullptr;  // the FP32 product of KK_LINEAR_FP32_OUT; grows, never shrinks
  size_t scratch_elems = 0;
};

// RAII for the three cuBLASLt descriptor kinds.
struct MatmulDesc {
  cublasLtMatmulDesc_t d = nullptr;
  ~MatmulDesc() { if (d) cublasLtMatmulDescDestroy(d); }
};
struct Layout {
  cublasLtMatrixLayout_t d = nullptr;
  ~Layout() { if (d) cublasLtMatrixLayoutDestroy(d); }
};
struct Preference {
  cublasLtMatmulPreference_t d = nullptr;
  ~Preference() { if (d) cublasLtMatmulPreferenceDestroy(d); }
};

__global__ void add_bias_round_kernel(const float* __restrict__ acc, const __half* __restrict__ bias,
                                      __half* __restrict__ y, int64_t M, int64_t N) {
  const int64_t total = M * N;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    y[i] = __float2half_rn(acc[i] + __half2float(bias[i % N]));
  }
}

// ------------------------------------------------------------------------------------------- LayerNorm
using kk_welford::Moments;

struct alignas(8) Half4 {
  __half v[4];
};

constexpr int kWarp = 32;
constexpr int kWarpsPerRow = 4;  // ATen: num_threads() = 4 warps, block (32, 4), one block per row

__global__ void layer_norm_f16_kernel(const __half* __restrict__ X, const __half* gamma, const __half* beta,
                                      __half* Y, const int N, const float eps) {
  __shared__ float shared[kWarpsPerRow * 3 / 2];  // means and m2s of the upper half, then their counts
  const __half* row = X + static_cast<int64_t>(blockIdx.x) * N;
  const int threads = blockDim.x * blockDim.y;
  const int tid = threadIdx.x + threadIdx.y * blockDim.x;
  const int vectors = N / 4;
  const Half4* row4 = reinterpret_cast<const Half4*>(row);

  Moments s{0.f, 0.f, 0.f};
  for (int i = tid; i < vectors; i += threads) {
    const Half4 data = row4[i];
#pragma unroll
    for (int k = 0; k < 4; ++k) s = kk_welford::push(__half2float(data.v[k]), s);
  }
  for (int offset = kWarp >> 1; offset > 0; offset >>= 1) {
    const Moments other{__shfl_down_sync(0xffffffffu, s.mean, offset, kWarp),
                        __shfl_down_sync(0xffffffffu, s.m2, offset, kWarp),
                        __shfl_down_sync(0xffffffffu, s.count, offset, kWarp)};
    s = kk_welford::merge(s, other);
  }
  float* mean_m2 = shared;
  float* counts = shared + blockDim.y;
  for (int offset = blockDim.y / 2; offset > 0; offset /= 2) {
    if (threadIdx.x == 0 && threadIdx.y >= offset && threadIdx.y < 2 * offset) {
      const int slot = threadIdx.y - offset;
      mean_m2[2 * slot] = s.mean;
      mean_m2[2 * slot + 1] = s.m2;
      counts[slot] = s.count;
    }
    __syncthreads();
    if (threadIdx.x == 0 && threadIdx.y < offset) {
      const Moments other{mean_m2[2 * threadIdx.y], mean_m2[2 * threadIdx.y + 1], counts[threadIdx.y]};
      s = kk_welford::merge(s, other);
    }
    __syncthreads();
  }
  if (threadIdx.x == 0 && threadIdx.y == 0) {
    mean_m2[0] = s.mean;
    mean_m2[1] = s.m2 / float(N);
  }
  __syncthreads();
  const float mean = mean_m2[0];
  const float rstd = rsqrtf(mean_m2[1] + eps);

  const Half4* gamma4 = reinterpret_cast<const Half4*>(gamma);
  const Half4* beta4 = reinterpret_cast<const Half4*>(beta);
  Half4* out4 = reinterpret_cast<Half4*>(Y + static_cast<int64_t>(blockIdx.x) * N);
  for (int i = tid; i < vectors; i += threads) {
    const Half4 data = row4[i];
    const Half4 g = gamma4[i];
    const Half4 b = beta4[i];
    Half4 out;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      out.v[k] = __float2half_rn(__half2float(g.v[k]) * (rstd * (__half2float(data.v[k]) - mean)) +
                                 __half2float(b.v[k]));
    }
    out4[i] = out;
  }
}

// ------------------------------------------------------------------------------------------------ Gelu
__global__ void gelu_f16_kernel(const __half* __restrict__ x, __half* __restrict__ y, int64_t n) {
  constexpr float kAlpha = static_cast<float>(M_SQRT1_2);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float v = __half2float(x[i]);
    y[i] = __float2half_rn(v * 0.5f * (1.0f + ::erff(v * kAlpha)));
  }
}

unsigned grid_for(int64_t n, int threads) {
  const int64_t blocks = (n + threads - 1) / threads;
  return static_cast<unsigned>(blocks < 65535 * 8 ? (blocks > 0 ? blocks : 1) : 65535 * 8);
}

}  // namespace

extern "C" {

const char* kk_cuda_last_error(void) { return g_last_error.c_str(); }

void* kk_cuda_linear_create(size_t workspace_bytes) {
  auto* ctx = new LinearContext();
  ctx->workspace_bytes = workspace_bytes ? workspace_bytes : aten_lt_workspace_bytes();
  if (lt_status(cublasLtCreate(&ctx->lt), "cublasLtCreate") ||
      (ctx->workspace_bytes && cuda_status(cudaMalloc(&ctx->workspace, ctx->workspace_bytes), "cudaMalloc"))) {
    kk_cuda_linear_destroy(ctx);
    return nullptr;
  }
  return ctx;
}

void kk_cuda_linear_destroy(void* context) {
  auto* ctx = static_cast<LinearContext*>(context);
  if (ctx == nullptr) return;
  if (ctx->workspace) cudaFree(ctx->workspace);
  if (ctx->scratch) cudaFree(ctx->scratch);
  if (ctx->lt) cublasLtDestroy(ctx->lt);
  delete ctx;
}

size_t kk_cuda_linear_workspace(void* context) {
  return context ? static_cast<LinearContext*>(context)->workspace_bytes : 0;
}

int kk_cuda_linear_f16(void* context, const void* x, const void* w, const void* b, void* y, int64_t M, int64_t N,
                       int64_t K, int mode, void* stream) {
  auto* ctx = static_cast<LinearContext*>(context);
  if (ctx == nullptr) return fail("kk_cuda_linear_f16: no context");
  if (M <= 0 || N <= 0 || K <= 0) return fail("kk_cuda_linear_f16: empty matrix");
  if (mode != KK_LINEAR_LT_BIAS && mode != KK_LINEAR_FP32_OUT) return fail("kk_cuda_linear_f16: unknown mode");
  auto s = static_cast<cudaStream_t>(stream);
  const bool fp32_out = mode == KK_LINEAR_FP32_OUT;
  void* d = y;
  if (fp32_out) {
    const size_t need = static_cast<size_t>(M * N);
    if (need > ctx->scratch_elems) {
      if (ctx->scratch) cudaFree(ctx->scratch);
      ctx->scratch = nullptr;
      ctx->scratch_elems = 0;
      if (cuda_status(cudaMalloc(&ctx->scratch, need * sizeof(float)), "cudaMalloc(scratch)")) return 1;
      ctx->scratch_elems = need;
    }
    d = ctx->scratch;
  }
  // Column-major view, as ATen's addmm sets it up for a row-major result: C^T[N, M] = W[N, K] . x^T[K, M],
  // i.e. transa = T on W (stored K-major, ld K), transb = N on x (ld K), ldc = N; the bias runs along N.
  const cublasOperation_t transa = CUBLAS_OP_T, transb = CUBLAS_OP_N;
  const uint64_t m = N, n = M, k = K;
  MatmulDesc op;
  Layout a, bl, c, dl;
  Preference pref;
  if (lt_status(cublasLtMatmulDescCreate(&op.d, CUBLAS_COMPUTE_32F, CUDA_R_32F), "MatmulDescCreate") ||
      lt_status(cublasLtMatmulDescSetAttribute(op.d, CUBLASLT_MATMUL_DESC_TRANSA, &transa, sizeof(transa)),
                "TRANSA") ||
      lt_status(cublasLtMatmulDescSetAttribute(op.d, CUBLASLT_MATMUL_DESC_TRANSB, &transb, sizeof(transb)),
                "TRANSB"))
    return 1;
  if (!fp32_out) {
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    if (lt_status(cublasLtMatmulDescSetAttribute(op.d, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)),
                  "EPILOGUE") ||
        lt_status(cublasLtMatmulDescSetAttribute(op.d, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &b, sizeof(b)), "BIAS"))
      return 1;
  }
  const cudaDataType_t out_type = fp32_out ? CUDA_R_32F : CUDA_R_16F;
  if (lt_status(cublasLtMatrixLayoutCreate(&a.d, CUDA_R_16F, k, m, K), "layout A") ||  // transposed: k x m
      lt_status(cublasLtMatrixLayoutCreate(&bl.d, CUDA_R_16F, k, n, K), "layout B") ||
      lt_status(cublasLtMatrixLayoutCreate(&c.d, out_type, m, n, N), "layout C") ||
      lt_status(cublasLtMatmulPreferenceCreate(&pref.d), "PreferenceCreate"))
    return 1;
  const uint64_t ws = ctx->workspace_bytes;
  const uint32_t align_a = alignment_of(w), align_b = alignment_of(x), align_c = alignment_of(d),
                 align_d = alignment_of(fp32_out ? d : b);  // ATen passes the bias's alignment as D's
  if (lt_status(cublasLtMatmulPreferenceSetAttribute(pref.d, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                                     sizeof(ws)), "PREF workspace") ||
      lt_status(cublasLtMatmulPreferenceSetAttribute(pref.d, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a,
                                                     sizeof(align_a)), "PREF align A") ||
      lt_status(cublasLtMatmulPreferenceSetAttribute(pref.d, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b,
                                                     sizeof(align_b)), "PREF align B") ||
      lt_status(cublasLtMatmulPreferenceSetAttribute(pref.d, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_c,
                                                     sizeof(align_c)), "PREF align C") ||
      lt_status(cublasLtMatmulPreferenceSetAttribute(pref.d, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_d,
                                                     sizeof(align_d)), "PREF align D"))
    return 1;
  cublasLtMatmulHeuristicResult_t heuristic;
  std::memset(&heuristic, 0, sizeof(heuristic));
  int returned = 0;
  if (lt_status(cublasLtMatmulAlgoGetHeuristic(ctx->lt, op.d, a.d, bl.d, c.d, c.d, pref.d, 1, &heuristic,
                                               &returned), "AlgoGetHeuristic"))
    return 1;
  if (returned == 0) return fail("cuBLASLt found no algorithm for this Linear");
  const float alpha = 1.f, beta = 0.f;
  if (lt_status(cublasLtMatmul(ctx->lt, op.d, &alpha, w, a.d, x, bl.d, &beta, d, c.d, d, c.d, &heuristic.algo,
                               ctx->workspace, ctx->workspace_bytes, s), "cublasLtMatmul"))
    return 1;
  if (fp32_out) {
    add_bias_round_kernel<<<grid_for(M * N, 256), 256, 0, s>>>(ctx->scratch, static_cast<const __half*>(b),
                                                                static_cast<__half*>(y), M, N);
    if (cuda_status(cudaGetLastError(), "add_bias_round_kernel")) return 1;
  }
  return 0;
}

int kk_cuda_layer_norm_f16(const void* x, const void* weight, const void* bias, void* y, int64_t M, int64_t N,
                           float epsilon, void* stream) {
  if (N % 4 != 0) return fail("kk_cuda_layer_norm_f16: the width must be a multiple of 4 (ATen's vector path)");
  for (const void* p : {x, weight, bias, static_cast<const void*>(y)})
    if (reinterpret_cast<uintptr_t>(p) % 8 != 0)
      return fail("kk_cuda_layer_norm_f16: buffers must be 8-byte aligned (ATen's vector path)");
  if (M <= 0) return 0;
  if (M > 2147483647LL) return fail("kk_cuda_layer_norm_f16: too many rows");
  const dim3 threads(kWarp, kWarpsPerRow);
  layer_norm_f16_kernel<<<static_cast<unsigned>(M), threads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const __half*>(x), static_cast<const __half*>(weight), static_cast<const __half*>(bias),
      static_cast<__half*>(y), static_cast<int>(N), epsilon);
  return cuda_status(cudaGetLastError(), "layer_norm_f16_kernel");
}

int kk_cuda_gelu_f16(const void* x, void* y, int64_t n, void* stream) {
  if (n <= 0) return 0;
  gelu_f16_kernel<<<grid_for(n, 256), 256, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const __half*>(x), static_cast<__half*>(y), n);
  return cuda_status(cudaGetLastError(), "gelu_f16_kernel");
}

}  // extern "C"

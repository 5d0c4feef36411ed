// The CUDA half of kkdeploy's custom ops: a plain C interface (void pointers, no CUDA headers), so the ORT
// wrapper (kkdeploy_ops.cc, built by the host compiler) and tools that load the library with ctypes
// (scripts/custom_ops_gpu_selftest.py) call the same kernels. Every function returns 0 on success; on failure
// kk_cuda_last_error() names what failed. Every pointer is device memory; `stream` is a cudaStream_t.
#pragma once
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// How the Linear computes; both are FP16 x FP16 tensor-core GEMMs with an FP32 accumulator and one rounding.
//   0 (KK_LINEAR_LT_BIAS): cuBLASLt with the bias epilogue, described exactly as ATen's gemm_and_bias
//     describes it (TN layout, FP32 compute and scale, 1 MiB workspace or $CUBLASLT_WORKSPACE_SIZE KiB, the
//     pointers' alignments): the same heuristic query as F.linear, so the same kernel.
//   1 (KK_LINEAR_FP32_OUT): cuBLASLt GEMM with an FP32 output, then our kernel adds the bias in FP32 and
//     rounds once (torch.mm(out_dtype=float32) + b, then .half()).
#define KK_LINEAR_LT_BIAS 0
#define KK_LINEAR_FP32_OUT 1

__attribute__((visibility("default"))) const char* kk_cuda_last_error(void);

// A cuBLASLt handle and its workspace (workspace_bytes; 0 = ATen's default, see above). NULL on failure.
__attribute__((visibility("default"))) void* kk_cuda_linear_create(size_t workspace_bytes);
__attribute__((visibility("default"))) void kk_cuda_linear_destroy(void* context);
__attribute__((visibility("default"))) size_t kk_cuda_linear_workspace(void* context);

// y[M, N] = round_f16(x[M, K] . W[N, K]^T + b[N]) in FP32.
__attribute__((visibility("default"))) int kk_cuda_linear_f16(void* context, const void* x, const void* w,
                                                              const void* b, void* y, int64_t M, int64_t N,
                                                              int64_t K, int mode, void* stream);

// ATen's vectorized layer-norm forward (FP16 in and out, FP32 statistics): Welford per thread over 4-wide
// vectors, warp shuffles, then a tree over the 4 warps of a 128-thread block, rsqrtf. N % 4 == 0.
__attribute__((visibility("default"))) int kk_cuda_layer_norm_f16(const void* x, const void* weight,
                                                                  const void* bias, void* y, int64_t M,
                                                                  int64_t N, float epsilon, void* stream);

// ATen's exact GELU in FP32 opmath: round_f16(x * 0.5f * (1.0f + erff(x * (float)M_SQRT1_2))).
__attribute__((visibility("default"))) int kk_cuda_gelu_f16(const void* x, void* y, int64_t n, void* stream);

#ifdef __cplusplus
}
#endif

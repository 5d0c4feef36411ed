// kkdeploy's ONNX Runtime custom ops (domain "kkdeploy"), CPU kernels.
//
// Why: a stock ORT graph cannot say "FP16 GEMM, FP32 accumulator, FP32 bias, round once" (Gemm and
// MatMul+Add round before the bias; an FP32 MatMul rounds the inputs' products differently on the GPU).
// These ops state that arithmetic as one node, so an engine can compute exactly what PyTorch's fused
// Linear epilogue computes (issue 20, Part B). docs/custom-ops.md describes them.
//
//   kkdeploy::Linear(x[..., K], W[N, K], b[N]) -> y[..., N]      (torch.nn.functional.linear)
//   kkdeploy::LayerNorm(x[..., D], weight[D], bias[D]) -> y[..., D], attribute epsilon (float)
//   kkdeploy::Gelu(x) -> y                                       (torch.nn.functional.gelu, exact erf)
//
// Each exists for float32 and float16 on the CPU EP (every input and the output of one node share the type).
// Built with KKDEPLOY_WITH_CUDA (engines/custom_op_library.py does that for a CUDA build), the library also
// registers float16 kernels for the CUDA EP: kkdeploy_ops_cuda.cu, which reproduce ATen's CUDA kernels bit for
// bit (cuBLASLt with the bias epilogue, the vectorized Welford layer norm, the opmath GELU).
//
// Arithmetic (the CPU kernels are plain loops: correctness and a reproducible order over speed):
// * Linear: y[m, n] = round_T( (sum_{k=0..K-1} float(x[m,k]) * float(W[n,k])) + float(b[n]) ), the sum
//   accumulated in FP32 strictly in k order starting from 0.0f, the bias added to the FP32 sum, ONE rounding
//   to T at the end (for float32 that rounding is the identity). An FP16 x FP16 product is exact in FP32.
// * LayerNorm: FP32 statistics, two passes in index order: mean = (sum x) / D; var = (sum (x - mean)^2) / D
//   (biased); rstd = 1 / sqrtf(var + eps); y = round_T((x - mean) * rstd * float(w) + float(b)).
//   This is not ATen's CPU order (ATen uses a vectorised cascade Welford), so it is close, not bitwise.
// * Gelu: y = round_T(x * 0.5f * (1.0f + erff(x * (float)M_SQRT1_2))), ATen's expression in FP32.
// The library is built with -ffp-contract=off, so no multiply-add is fused and the order above is exact.
//
// The library links nothing: RegisterCustomOps receives ORT's API and the C++ wrapper is initialised with
// it (ORT_API_MANUAL_INIT), so a library built against older headers (the C API is versioned) loads in a
// newer runtime.

#define ORT_API_MANUAL_INIT
#include "onnxruntime_cxx_api.h"
#undef ORT_API_MANUAL_INIT

#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#ifdef KKDEPLOY_WITH_CUDA
#include "kkdeploy_ops_cuda.h"
#endif

namespace {

constexpr const char* kDomain = "kkdeploy";

// float16 <-> float32 through ORT's own conversions (round to nearest even, subnormals, inf and NaN kept).
inline float load(const float v) { return v; }
inline float load(const Ort::Float16_t v) { return v.ToFloat(); }
template <typename T> inline T store(float v);
template <> inline float store<float>(float v) { return v; }
template <> inline Ort::Float16_t store<Ort::Float16_t>(float v) { return Ort::Float16_t(v); }

template <typename T> constexpr ONNXTensorElementDataType elem_type();
template <> constexpr ONNXTensorElementDataType elem_type<float>() { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
template <> constexpr ONNXTensorElementDataType elem_type<Ort::Float16_t>() {
  return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
}

int64_t product(const std::vector<int64_t>& dims, size_t begin, size_t end) {
  int64_t p = 1;
  for (size_t i = begin; i < end; ++i) p *= dims[i];
  return p;
}

// Run ``fn``, turning any C++ exception into an OrtStatus: an exception must never cross into ORT's frames.
template <typename Fn>
OrtStatus* guarded(Fn&& fn) {
  try {
    fn();
    return nullptr;
  } catch (const Ort::Exception& e) {
    return Ort::GetApi().CreateStatus(e.GetOrtErrorCode(), e.what());
  } catch (const std::exception& e) {
    return Ort::GetApi().CreateStatus(ORT_FAIL, e.what());
  }
}

// The ORT plumbing shared by every op: status-returning kernel creation and compute (WithStatus = true),
// `Inputs` inputs and one output, all of element type T, on the CPU EP.
template <typename TOp, typename TKernel, typename T, size_t Inputs = 3>
struct OpBase : Ort::CustomOpBase<TOp, TKernel, true> {
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const {
    return guarded([&] { *kernel = new TKernel(api, info); });
  }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return Inputs; }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetInputType(size_t) const { return elem_type<T>(); }
  ONNXTensorElementDataType GetOutputType(size_t) const { return elem_type<T>(); }
};

// The kernel side: ORT calls ComputeV2, which runs the kernel's Compute and turns any exception into a status.
template <typename TKernel>
struct KernelBase {
  OrtStatusPtr ComputeV2(OrtKernelContext* raw) {
    return guarded([&] { static_cast<TKernel*>(this)->Compute(raw); });
  }
};

std::string shape_text(const std::vector<int64_t>& dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

// The three inputs of either op and their shapes (x, then its two parameters).
struct ThreeInputs {
  Ort::ConstValue x, p, q;
  std::vector<int64_t> xs, ps, qs;
};

static ThreeInputs read_inputs(Ort::KernelContext& ctx) {
  ThreeInputs in{ctx.GetInput(0), ctx.GetInput(1), ctx.GetInput(2), {}, {}, {}};
  in.xs = in.x.GetTensorTypeAndShapeInfo().GetShape();
  in.ps = in.p.GetTensorTypeAndShapeInfo().GetShape();
  in.qs = in.q.GetTensorTypeAndShapeInfo().GetShape();
  return in;
}

// Linear's shapes, checked once for the CPU and CUDA kernels: x[..., K], W[N, K], b[N] -> y[..., N].
struct LinearDims {
  int64_t M, N, K;
  std::vector<int64_t> ys;
};

static LinearDims linear_dims(const ThreeInputs& in) {
  const auto &xs = in.xs, &ws = in.ps, &bs = in.qs;
  if (xs.empty() || ws.size() != 2 || bs.size() != 1 || ws[1] != xs.back() || bs[0] != ws[0])
    ORT_CXX_API_THROW("kkdeploy::Linear: expected x[..., K], W[N, K], b[N]; got x" + shape_text(xs) + ", W" +
                          shape_text(ws) + ", b" + shape_text(bs),
                      ORT_INVALID_ARGUMENT);
  LinearDims d{product(xs, 0, xs.size() - 1), ws[0], ws[1], xs};
  d.ys.back() = d.N;
  return d;
}

// LayerNorm's shapes, checked once for both kernels: x[..., D], weight[D], bias[D]; returns the row count.
static int64_t layer_norm_rows(const ThreeInputs& in) {
  const auto &xs = in.xs, &ws = in.ps, &bs = in.qs;
  if (xs.empty() || ws.size() != 1 || bs.size() != 1 || ws[0] != xs.back() || bs[0] != xs.back())
    ORT_CXX_API_THROW("kkdeploy::LayerNorm: expected x[..., D], weight[D], bias[D]; got x" + shape_text(xs) +
                          ", weight" + shape_text(ws) + ", bias" + shape_text(bs),
                      ORT_INVALID_ARGUMENT);
  return product(xs, 0, xs.size() - 1);
}

// Gelu's one input, its shape and element count, and the same-shaped output.
struct Unary {
  Ort::ConstValue x;
  std::vector<int64_t> shape;
  int64_t n;
  Ort::UnownedValue y;
};

static Unary read_unary(Ort::KernelContext& ctx) {
  auto x = ctx.GetInput(0);
  auto shape = x.GetTensorTypeAndShapeInfo().GetShape();
  const int64_t n = product(shape, 0, shape.size());
  auto y = ctx.GetOutput(0, shape);
  return {std::move(x), std::move(shape), n, std::move(y)};
}

static float epsilon_attribute(const OrtKernelInfo* info) {
  return Ort::ConstKernelInfo(info).GetAttribute<float>("epsilon");
}

// ---------------------------------------------------------------------------------------------- Linear
template <typename T>
struct LinearKernel : KernelBase<LinearKernel<T>> {
  LinearKernel(const OrtApi&, const OrtKernelInfo*) {}

  void Compute(OrtKernelContext* raw) {
    Ort::KernelContext ctx(raw);
    const ThreeInputs in = read_inputs(ctx);
    const auto &x = in.x, &w = in.p, &b = in.q;
    const LinearDims dims = linear_dims(in);
    const int64_t K = dims.K, N = dims.N, M = dims.M;
    auto y = ctx.GetOutput(0, dims.ys);
    const T* xp = x.GetTensorData<T>();
    const T* wp = w.GetTensorData<T>();
    const T* bp = b.GetTensorData<T>();
    T* yp = y.GetTensorMutableData<T>();
    std::vector<float> wf(static_cast<size_t>(N * K)), xf(static_cast<size_t>(K));
    for (int64_t i = 0; i < N * K; ++i) wf[i] = load(wp[i]);  // exact: float16 -> float32 loses nothing
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t k = 0; k < K; ++k) xf[k] = load(xp[m * K + k]);
      for (int64_t n = 0; n < N; ++n) {
        const float* wr = &wf[n * K];
        float acc = 0.0f;
        for (int64_t k = 0; k < K; ++k) acc += xf[k] * wr[k];  // FP32 accumulator, k order
        yp[m * N + n] = store<T>(acc + load(bp[n]));             // FP32 bias, one rounding
      }
    }
  }
};

template <typename T>
struct LinearOp : OpBase<LinearOp<T>, LinearKernel<T>, T> {
  const char* GetName() const { return "Linear"; }
};

// ------------------------------------------------------------------------------------------- LayerNorm
template <typename T>
struct LayerNormKernel : KernelBase<LayerNormKernel<T>> {
  float epsilon;

  LayerNormKernel(const OrtApi&, const OrtKernelInfo* info) : epsilon(epsilon_attribute(info)) {}

  void Compute(OrtKernelContext* raw) {
    Ort::KernelContext ctx(raw);
    const ThreeInputs in = read_inputs(ctx);
    const auto &x = in.x, &w = in.p, &b = in.q;
    const auto& xs = in.xs;
    const int64_t D = xs.back(), M = layer_norm_rows(in);
    auto y = ctx.GetOutput(0, xs);
    const T* xp = x.GetTensorData<T>();
    const T* wp = w.GetTensorData<T>();
    const T* bp = b.GetTensorData<T>();
    T* yp = y.GetTensorMutableData<T>();
    std::vector<float> row(static_cast<size_t>(D)), wf(static_cast<size_t>(D)), bf(static_cast<size_t>(D));
    for (int64_t d = 0; d < D; ++d) {
      wf[d] = load(wp[d]);
      bf[d] = load(bp[d]);
    }
    const float inv_d = 1.0f / static_cast<float>(D);
    for (int64_t m = 0; m < M; ++m) {
      float sum = 0.0f;
      for (int64_t d = 0; d < D; ++d) sum += (row[d] = load(xp[m * D + d]));
      const float mean = sum * inv_d;
      float sq = 0.0f;
      for (int64_t d = 0; d < D; ++d) {
        const float c = row[d] - mean;
        sq += c * c;
      }
      const float rstd = 1.0f / std::sqrt(sq * inv_d + epsilon);
      for (int64_t d = 0; d < D; ++d) yp[m * D + d] = store<T>((row[d] - mean) * rstd * wf[d] + bf[d]);
    }
  }
};

template <typename T>
struct LayerNormOp : OpBase<LayerNormOp<T>, LayerNormKernel<T>, T> {
  const char* GetName() const { return "LayerNorm"; }
};

// ------------------------------------------------------------------------------------------------ Gelu
template <typename T>
struct GeluKernel : KernelBase<GeluKernel<T>> {
  GeluKernel(const OrtApi&, const OrtKernelInfo*) {}

  void Compute(OrtKernelContext* raw) {
    Ort::KernelContext ctx(raw);
    Unary io = read_unary(ctx);
    const T* xp = io.x.GetTensorData<T>();
    T* yp = io.y.GetTensorMutableData<T>();
    const int64_t n = io.n;
    const float alpha = static_cast<float>(M_SQRT1_2);
    for (int64_t i = 0; i < n; ++i) {
      const float v = load(xp[i]);
      yp[i] = store<T>(v * 0.5f * (1.0f + std::erf(v * alpha)));
    }
  }
};

template <typename T>
struct GeluOp : OpBase<GeluOp<T>, GeluKernel<T>, T, 1> {
  const char* GetName() const { return "Gelu"; }
};

#ifdef KKDEPLOY_WITH_CUDA
// ------------------------------------------------------------------------- CUDA EP kernels (float16)
// The same three ops for ORT's CUDA EP: inputs and output in device memory, work queued on ORT's compute
// stream. The arithmetic lives in kkdeploy_ops_cuda.cu.
void cuda_check(int rc, const char* op) {
  if (rc != 0) ORT_CXX_API_THROW(std::string("kkdeploy::") + op + " (CUDA): " + kk_cuda_last_error(), ORT_FAIL);
}

// $KKDEPLOY_CUDA_LINEAR = "fp32-out" selects KK_LINEAR_FP32_OUT (a diagnostic); the default is ATen's path.
int linear_mode_from_env() {
  const char* v = std::getenv("KKDEPLOY_CUDA_LINEAR");
  return (v != nullptr && std::string(v) == "fp32-out") ? KK_LINEAR_FP32_OUT : KK_LINEAR_LT_BIAS;
}

struct CudaLinearKernel : KernelBase<CudaLinearKernel> {
  void* context = nullptr;
  int mode = KK_LINEAR_LT_BIAS;

  CudaLinearKernel(const OrtApi&, const OrtKernelInfo*) : mode(linear_mode_from_env()) {
    context = kk_cuda_linear_create(0);  // ATen's workspace size, so cuBLASLt's heuristic sees what ATen's sees
    if (context == nullptr) ORT_CXX_API_THROW(std::string("kkdeploy::Linear (CUDA): ") + kk_cuda_last_error(),
                                              ORT_FAIL);
  }
  ~CudaLinearKernel() { kk_cuda_linear_destroy(context); }
  CudaLinearKernel(const CudaLinearKernel&) = delete;
  CudaLinearKernel& operator=(const CudaLinearKernel&) = delete;

  void Compute(OrtKernelContext* raw) {
    Ort::KernelContext ctx(raw);
    const ThreeInputs in = read_inputs(ctx);
    const LinearDims d = linear_dims(in);
    auto y = ctx.GetOutput(0, d.ys);
    if (d.M == 0) return;
    cuda_check(kk_cuda_linear_f16(context, in.x.GetTensorRawData(), in.p.GetTensorRawData(),
                                  in.q.GetTensorRawData(), y.GetTensorMutableRawData(), d.M, d.N, d.K, mode,
                                  ctx.GetGPUComputeStream()),
               "Linear");
  }
};

// The same plumbing for the CUDA EP (float16 only).
template <typename TOp, typename TKernel, size_t Inputs = 3>
struct CudaOp : OpBase<TOp, TKernel, Ort::Float16_t, Inputs> {
  const char* GetExecutionProviderType() const { return "CUDAExecutionProvider"; }
};

struct CudaLinearOp : CudaOp<CudaLinearOp, CudaLinearKernel> {
  const char* GetName() const { return "Linear"; }
};

struct CudaLayerNormKernel : KernelBase<CudaLayerNormKernel> {
  float epsilon;

  CudaLayerNormKernel(const OrtApi&, const OrtKernelInfo* info) : epsilon(epsilon_attribute(info)) {}

  void Compute(OrtKernelContext* raw) {
    Ort::KernelContext ctx(raw);
    const ThreeInputs in = read_inputs(ctx);
    const int64_t rows = layer_norm_rows(in);
    auto y = ctx.GetOutput(0, in.xs);
    cuda_check(kk_cuda_layer_norm_f16(in.x.GetTensorRawData(), in.p.GetTensorRawData(), in.q.GetTensorRawData(),
                                      y.GetTensorMutableRawData(), rows, in.xs.back(), epsilon,
                                      ctx.GetGPUComputeStream()),
               "LayerNorm");
  }
};

struct CudaLayerNormOp : CudaOp<CudaLayerNormOp, CudaLayerNormKernel> {
  const char* GetName() const { return "LayerNorm"; }
};

struct CudaGeluKernel : KernelBase<CudaGeluKernel> {
  CudaGeluKernel(const OrtApi&, const OrtKernelInfo*) {}

  void Compute(OrtKernelContext* raw) {
    Ort::KernelContext ctx(raw);
    Unary io = read_unary(ctx);
    cuda_check(kk_cuda_gelu_f16(io.x.GetTensorRawData(), io.y.GetTensorMutableRawData(), io.n,
                                ctx.GetGPUComputeStream()),
               "Gelu");
  }
};

struct CudaGeluOp : CudaOp<CudaGeluOp, CudaGeluKernel, 1> {
  const char* GetName() const { return "Gelu"; }
};

const CudaLinearOp cuda_linear_f16;
const CudaLayerNormOp cuda_layer_norm_f16;
const CudaGeluOp cuda_gelu_f16;
#endif  // KKDEPLOY_WITH_CUDA

// One instance per (op, type, EP); ORT merges same-named ops of one domain into one schema with a type constraint.
const LinearOp<float> linear_f32;
const LinearOp<Ort::Float16_t> linear_f16;
const LayerNormOp<float> layer_norm_f32;
const LayerNormOp<Ort::Float16_t> layer_norm_f16;
const GeluOp<float> gelu_f32;
const GeluOp<Ort::Float16_t> gelu_f16;

}  // namespace

extern "C" {

// Exported for tools and tests that want to know what they loaded (ctypes): the C API version built against.
__attribute__((visibility("default"))) int KKDeployOpsApiVersion() { return ORT_API_VERSION; }

// Whether this build carries the CUDA EP kernels (1) or only the CPU ones (0).
__attribute__((visibility("default"))) int KKDeployOpsWithCuda() {
#ifdef KKDEPLOY_WITH_CUDA
  return 1;
#else
  return 0;
#endif
}

__attribute__((visibility("default"))) OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options,
                                                                                const OrtApiBase* api_base) {
  const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
  if (api == nullptr) {  // the runtime is older than the headers: say so through the oldest API there is
    const OrtApi* v1 = api_base->GetApi(1);
    return v1 ? v1->CreateStatus(ORT_FAIL, "kkdeploy ops: this ONNX Runtime is older than the headers they were "
                                           "built against") : nullptr;
  }
  Ort::InitApi(api);
  OrtCustomOpDomain* domain = nullptr;
  if (OrtStatus* status = api->CreateCustomOpDomain(kDomain, &domain)) return status;
  // The domain must outlive every session using it; ORT does not take ownership, so it is kept for the
  // lifetime of the process (one small object per registration).
  std::vector<const OrtCustomOp*> ops{&linear_f32, &linear_f16, &layer_norm_f32, &layer_norm_f16, &gelu_f32,
                                      &gelu_f16};
#ifdef KKDEPLOY_WITH_CUDA
  ops.insert(ops.end(), {&cuda_linear_f16, &cuda_layer_norm_f16, &cuda_gelu_f16});
#endif
  for (const OrtCustomOp* op : ops) {
    if (OrtStatus* status = api->CustomOpDomain_Add(domain, op)) return status;
  }
  return api->AddCustomOpDomain(options, domain);
}

}  // extern "C"

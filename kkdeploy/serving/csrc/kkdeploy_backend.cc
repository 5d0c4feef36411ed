// kkdeploy's in-process Triton backend: the one-hop engine inside tritonserver's own process.
//
// Why. Triton's Python backend runs a model in a separate stub process and moves every request and response
// through shared memory and a message queue: on the H200 that hop, the stub's Python and the copies cost about
// 0.35 ms per execution beside a 0.15 ms engine call, and instances in separate processes time-slice the GPU
// (docs/serving.md). This backend embeds the Python interpreter in tritonserver itself: Triton's request buffers
// are handed to `kkdeploy.serving.inprocess` as raw pointers (wrapped as torch tensors without a copy), the
// gathered batch runs through the same `BucketEngine` as the Python backend's one-hop model, and each answer is
// copied once, by this file, from the engine's host buffer into the response.
//
// Division of labour: C++ speaks Triton's C API (typed against the headers in third_party/triton/, Triton 2.51's API),
// Python does everything with tensors. The interpreter is started once per process with Python's signal handlers
// left out (SIGINT and SIGTERM stay Triton's, so its graceful stop works), and the GIL is released between
// calls. Python is never finalized: tritonserver exits with it loaded (finalizing torch and CUDA at exit hangs).
//
// Built on the serving machine by kkdeploy/serving/backend_build.py, linked against that machine's libpython.

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <tuple>
#include <vector>

#include "triton/core/tritonbackend.h"

namespace {

#if !defined(KKDEPLOY_LIBPYTHON) || !defined(KKDEPLOY_PYTHONHOME) || !defined(KKDEPLOY_PYTHON_EXECUTABLE)
#error "build with -DKKDEPLOY_LIBPYTHON, -DKKDEPLOY_PYTHONHOME and -DKKDEPLOY_PYTHON_EXECUTABLE (backend_build.py does)"
#endif

const char* kModule = "kkdeploy.serving.inprocess";
const char* kInputX = "x";
const char* kInputMask = "valid_token_mask";
const char* kOutputY = "y";

uint64_t NowNs()
{
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

TRITONSERVER_Error* Error(TRITONSERVER_Error_Code code, const std::string& message)
{
  return TRITONSERVER_ErrorNew(code, message.c_str());
}

void Log(TRITONSERVER_LogLevel level, const std::string& message)
{
  TRITONSERVER_Error* err = TRITONSERVER_LogMessage(level, __FILE__, __LINE__, message.c_str());
  if (err != nullptr) {
    TRITONSERVER_ErrorDelete(err);
  }
}

// Holds the GIL for a scope, from any Triton thread.
class Gil {
 public:
  Gil() : state_(PyGILState_Ensure()) {}
  ~Gil() { PyGILState_Release(state_); }
  Gil(const Gil&) = delete;
  Gil& operator=(const Gil&) = delete;

 private:
  PyGILState_STATE state_;
};

// "Type: message" of the pending Python exception (cleared). Needs the GIL.
std::string PythonError()
{
  PyObject* type = nullptr;
  PyObject* value = nullptr;
  PyObject* traceback = nullptr;
  PyErr_Fetch(&type, &value, &traceback);
  PyErr_NormalizeException(&type, &value, &traceback);
  std::string text = "unknown Python error";
  if (type != nullptr) {
    PyObject* name = PyObject_GetAttrString(type, "__name__");
    PyObject* str = value != nullptr ? PyObject_Str(value) : nullptr;
    const char* n = name != nullptr ? PyUnicode_AsUTF8(name) : nullptr;
    const char* s = str != nullptr ? PyUnicode_AsUTF8(str) : nullptr;
    text = std::string(n != nullptr ? n : "Exception") + ": " + (s != nullptr ? s : "");
    Py_XDECREF(name);
    Py_XDECREF(str);
  }
  PyErr_Clear();
  Py_XDECREF(type);
  Py_XDECREF(value);
  Py_XDECREF(traceback);
  return text;
}

std::mutex python_mutex;
PyObject* python_module = nullptr;  // kkdeploy.serving.inprocess, imported once

// Starts the interpreter (once per process) and imports the Python half. The site directories of the Python
// that wrote the repository (KKDEPLOY_SITE_DIRS, set by `kkdeploy serve`) are added first, with their .pth files,
// so that a virtualenv or an editable install is importable, as in the Python backend's model.py.
TRITONSERVER_Error* EnsurePython()
{
  std::lock_guard<std::mutex> lock(python_mutex);
  if (python_module != nullptr) {
    return nullptr;
  }
  if (!Py_IsInitialized()) {
    // Triton opens backends with RTLD_LOCAL, so libpython (a dependency of this library) would be invisible to
    // the extension modules that Python imports (torch, numpy: they expect its symbols in the global scope).
    // Open it again, globally, before the interpreter starts.
    if (dlopen(KKDEPLOY_LIBPYTHON, RTLD_NOW | RTLD_GLOBAL) == nullptr) {
      const char* why = dlerror();
      return Error(
          TRITONSERVER_ERROR_INTERNAL, std::string("kkdeploy backend: cannot load ") + KKDEPLOY_LIBPYTHON + ": " +
                                           (why != nullptr ? why : "unknown error"));
    }
    PyConfig config;
    PyConfig_InitPythonConfig(&config);
    config.install_signal_handlers = 0;  // SIGINT/SIGTERM stay tritonserver's
    config.parse_argv = 0;
    PyStatus status = PyStatus_Ok();
    if (getenv("PYTHONHOME") == nullptr) {
      // The interpreter would look for its standard library beside the running program (tritonserver): name the
      // home of the Python this library was built for, unless the environment names one.
      status = PyConfig_SetBytesString(&config, &config.home, KKDEPLOY_PYTHONHOME);
    }
    if (!PyStatus_Exception(status)) {
      // sys.executable: what torch starts its compile workers with (Inductor's subprocess pool). Inside
      // tritonserver it would be guessed from PATH; name the Python this library was built for.
      status = PyConfig_SetBytesString(&config, &config.executable, KKDEPLOY_PYTHON_EXECUTABLE);
    }
    if (!PyStatus_Exception(status)) {
      status = Py_InitializeFromConfig(&config);
    }
    PyConfig_Clear(&config);
    if (PyStatus_Exception(status)) {
      return Error(
          TRITONSERVER_ERROR_INTERNAL,
          std::string("kkdeploy backend: cannot start Python: ") +
              (status.err_msg != nullptr ? status.err_msg : "unknown error"));
    }
    PyEval_SaveThread();  // the GIL is taken per call from here on
  }
  Gil gil;
  const char* bootstrap =
      "import os, site\n"
      "for _d in filter(None, os.environ.get('KKDEPLOY_SITE_DIRS', '').split(os.pathsep)):\n"
      "    site.addsitedir(_d)\n";
  if (PyRun_SimpleString(bootstrap) != 0) {
    return Error(TRITONSERVER_ERROR_INTERNAL, "kkdeploy backend: the site directories could not be added");
  }
  python_module = PyImport_ImportModule(kModule);
  if (python_module == nullptr) {
    return Error(
        TRITONSERVER_ERROR_INTERNAL,
        std::string("kkdeploy backend: cannot import ") + kModule + " (is kkdeploy installed for this Python?): " +
            PythonError());
  }
  return nullptr;
}

// Custom metrics, as the Python backend's model.py exports them: kkdeploy_stage_us_total{stage},
// kkdeploy_rows_total{kind}, kkdeploy_bucket_executions_total{bucket}; and this backend's own
// kkdeploy_route_executions_total{route=native|python}, which route served each execution (a load test then shows
// whether, say, CUDA shared-memory requests took the native route). Families are per process.
struct Families {
  TRITONSERVER_MetricFamily* stage = nullptr;
  TRITONSERVER_MetricFamily* rows = nullptr;
  TRITONSERVER_MetricFamily* executions = nullptr;
  TRITONSERVER_MetricFamily* routes = nullptr;
};

Families* MetricFamilies()
{
  static std::once_flag once;
  static Families families;
  std::call_once(once, [] {
    auto make = [](TRITONSERVER_MetricFamily** family, const char* name, const char* description) {
      TRITONSERVER_Error* err =
          TRITONSERVER_MetricFamilyNew(family, TRITONSERVER_METRIC_KIND_COUNTER, name, description);
      if (err != nullptr) {  // metrics off: the model serves without them
        TRITONSERVER_ErrorDelete(err);
        *family = nullptr;
      }
    };
    make(&families.stage, "kkdeploy_stage_us_total", "microseconds inside the kkdeploy model by stage");
    make(&families.rows, "kkdeploy_rows_total", "rows run by the engine: real (requested) and padding");
    make(&families.executions, "kkdeploy_bucket_executions_total", "engine runs per batch bucket");
    make(&families.routes, "kkdeploy_route_executions_total", "executions by the route that served them");
  });
  return &families;
}

TRITONSERVER_Metric* NewMetric(
    TRITONSERVER_MetricFamily* family, const std::string& model, const char* key, const std::string& value)
{
  if (family == nullptr) {
    return nullptr;
  }
  TRITONSERVER_Parameter* labels[2] = {
      TRITONSERVER_ParameterNew("model", TRITONSERVER_PARAMETER_STRING, model.c_str()),
      TRITONSERVER_ParameterNew(key, TRITONSERVER_PARAMETER_STRING, value.c_str())};
  TRITONSERVER_Metric* metric = nullptr;
  TRITONSERVER_Error* err =
      TRITONSERVER_MetricNew(&metric, family, const_cast<const TRITONSERVER_Parameter**>(labels), 2);
  TRITONSERVER_ParameterDelete(labels[0]);
  TRITONSERVER_ParameterDelete(labels[1]);
  if (err != nullptr) {
    TRITONSERVER_ErrorDelete(err);
    return nullptr;
  }
  return metric;
}

void Increment(TRITONSERVER_Metric* metric, double value)
{
  if (metric != nullptr && value > 0) {
    TRITONSERVER_Error* err = TRITONSERVER_MetricIncrement(metric, value);
    if (err != nullptr) {
      TRITONSERVER_ErrorDelete(err);
    }
  }
}

struct ModelState {
  std::string name;
  PyObject* model = nullptr;  // inprocess.Model
  TRITONSERVER_DataType output_type = TRITONSERVER_TYPE_INVALID;
  TRITONSERVER_Metric* stage[3] = {nullptr, nullptr, nullptr};  // gather, engine, respond
  TRITONSERVER_Metric* rows[2] = {nullptr, nullptr};  // real, padding
  TRITONSERVER_Metric* routes[2] = {nullptr, nullptr};  // native, python
  std::mutex metrics_mutex;
  std::map<long, TRITONSERVER_Metric*> executions;  // bucket -> counter, made on the bucket's first run

  void Count(long gather_ns, long engine_ns, long respond_ns, long bucket, long real)
  {
    Increment(stage[0], gather_ns / 1000.0);
    Increment(stage[1], engine_ns / 1000.0);
    Increment(stage[2], respond_ns / 1000.0);
    Increment(rows[0], static_cast<double>(real));
    Increment(rows[1], static_cast<double>(bucket - real));
    TRITONSERVER_Metric* runs = nullptr;
    {
      std::lock_guard<std::mutex> lock(metrics_mutex);
      auto found = executions.find(bucket);
      if (found == executions.end()) {
        found = executions
                    .emplace(bucket, NewMetric(MetricFamilies()->executions, name, "bucket", std::to_string(bucket)))
                    .first;
      }
      runs = found->second;
    }
    Increment(runs, 1.0);
  }

  ~ModelState()
  {
    for (TRITONSERVER_Metric* m : stage) {
      if (m != nullptr) TRITONSERVER_MetricDelete(m);
    }
    for (TRITONSERVER_Metric* m : rows) {
      if (m != nullptr) TRITONSERVER_MetricDelete(m);
    }
    for (TRITONSERVER_Metric* m : routes) {
      if (m != nullptr) TRITONSERVER_MetricDelete(m);
    }
    for (auto& entry : executions) {
      if (entry.second != nullptr) TRITONSERVER_MetricDelete(entry.second);
    }
  }
};

struct Outcome {
  bool ok = false;
  TRITONSERVER_Error_Code code = TRITONSERVER_ERROR_INTERNAL;
  std::string message;
  std::vector<int64_t> shape;
  const void* source = nullptr;  // the engine's answer for this request, valid until the next execute
  uint64_t bytes = 0;
  bool source_on_host = true;
  bool native = false;  // answered by the native route: a response buffer on its GPU is filled here too
  unsigned long long device_source = 0;  // (native) the same answer in the capture's output, on the GPU
};

// The CUDA driver calls of the native route, looked up once per process in libcuda.so.1 (KKDEPLOY_CUDA_DRIVER
// names another library with the same symbols: the CPU tests' stand-in): the backend needs no CUDA toolkit to build.
struct Driver {
  using HtoD = int (*)(unsigned long long, const void*, size_t, void*);
  using DtoH = int (*)(void*, unsigned long long, size_t, void*);
  using Fill = int (*)(unsigned long long, unsigned char, size_t, void*);
  using Launch = int (*)(void*, void*);
  using Wait = int (*)(void*);
  using DtoD = int (*)(unsigned long long, unsigned long long, size_t, void*);
  HtoD to_device = nullptr;
  DtoH to_host = nullptr;
  Fill fill = nullptr;
  Launch launch = nullptr;
  Wait wait = nullptr;
  DtoD on_device = nullptr;
  std::string error;  // why the driver cannot be used ("" when it can)
};

const Driver* CudaDriver()
{
  static std::once_flag once;
  static Driver driver;
  std::call_once(once, [] {
    const char* path = std::getenv("KKDEPLOY_CUDA_DRIVER");
    path = (path != nullptr && *path != '\0') ? path : "libcuda.so.1";
    void* lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      const char* why = dlerror();
      driver.error = std::string("cannot open ") + path + ": " + (why != nullptr ? why : "unknown");
      return;
    }
    auto find = [&](const char* symbol) {
      void* found = dlsym(lib, symbol);
      if (found == nullptr && driver.error.empty()) {
        driver.error = std::string(path) + " has no " + symbol;
      }
      return found;
    };
    driver.to_device = reinterpret_cast<Driver::HtoD>(find("cuMemcpyHtoDAsync_v2"));
    driver.to_host = reinterpret_cast<Driver::DtoH>(find("cuMemcpyDtoHAsync_v2"));
    driver.fill = reinterpret_cast<Driver::Fill>(find("cuMemsetD8Async"));
    driver.launch = reinterpret_cast<Driver::Launch>(find("cuGraphLaunch"));
    driver.wait = reinterpret_cast<Driver::Wait>(find("cuStreamSynchronize"));
    driver.on_device = reinterpret_cast<Driver::DtoD>(find("cuMemcpyDtoDAsync_v2"));
  });
  return &driver;
}

// One batch bucket as the native route sees it: the capture's own device buffers (x, mask, y), the bucket's pinned
// host buffers (staging for x and the mask, the answer), and the executable graph (cudaGraphExec_t). exec == 0: this
// bucket has no capture the route can replay, so its executions go to Python.
struct NativeBucket {
  long size = 0;
  unsigned long long x = 0, mask = 0, y = 0;
  char* stage_x = nullptr;
  char* stage_mask = nullptr;
  char* host_y = nullptr;
  void* exec = nullptr;
};

// The native route: inprocess.DirectRoute's steps, taken here without the GIL, so that several instances (threads of
// this process) gather, launch and wait at the same time instead of in turn. Planned by Python
// (inprocess.Instance.native_plan); anything it does not cover returns false before anything is written, and the
// execution goes to Python as before.
struct NativeRoute {
  const Driver* driver = nullptr;
  void* stream = nullptr;
  int64_t device = 0;  // the instance's GPU: request and response buffers on it are copied on the device
  long seq = 0;
  uint64_t x_row = 0, y_row = 0;
  std::vector<int64_t> row_shape;  // x's dims after the batch
  std::vector<int64_t> answer_shape;  // y's dims after the batch
  std::vector<int64_t> mask_row;  // the mask's dims after the batch: [seq]
  std::vector<NativeBucket> buckets;  // every bucket, smallest first
};

// Host-to-host copies of one execution, made on several threads when they are large. Why: a shape-13 batch of 64
// is 16 MB each way, and one thread copied it at about 5 GB/s (3.3 ms to gather, 4.6 ms to answer, on the H100's
// host, against a 2 ms engine). The bytes are split evenly, one piece per thread, at most kCopyHelpers + 1 pieces,
// none smaller than the chunk (KKDEPLOY_NATIVE_COPY_CHUNK bytes, 2 MiB by default; the CPU tests make it small so
// that their rows take the threaded path too). Each copy is independent: destinations never overlap.
struct Copy {
  char* dst;
  const char* src;
  uint64_t bytes;
};

constexpr int kCopyHelpers = 7;

uint64_t CopyChunk()
{
  static const uint64_t chunk = [] {
    const char* text = std::getenv("KKDEPLOY_NATIVE_COPY_CHUNK");
    const unsigned long long value = text != nullptr ? std::strtoull(text, nullptr, 10) : 0;
    return value > 0 ? static_cast<uint64_t>(value) : static_cast<uint64_t>(2) << 20;
  }();
  return chunk;
}

// Copies bytes [begin, end) of the concatenation of `copies`.
void CopyRange(const std::vector<Copy>& copies, uint64_t begin, uint64_t end)
{
  uint64_t at = 0;
  for (const Copy& c : copies) {
    const uint64_t lo = std::max(begin, at), hi = std::min(end, at + c.bytes);
    if (lo < hi) {
      std::memcpy(c.dst + (lo - at), c.src + (lo - at), hi - lo);
    }
    at += c.bytes;
    if (at >= end) {
      break;
    }
  }
}

// One instance's copy helpers: threads started on its first large copy and kept until the instance is finalized
// (starting and joining 7 threads per copy took 180-290 us on a 2-core machine, twice per execution). Triton runs
// one instance's executions one at a time, so one job is in flight at most; the calling thread copies the first
// piece and waits for the others. A thread that cannot be started leaves fewer helpers (none: every copy on the
// calling thread).
class CopyPool {
 public:
  CopyPool()
  {
    for (int i = 0; i < kCopyHelpers; ++i) {
      try {
        helpers_.emplace_back(&CopyPool::Help, this, i);
      } catch (const std::system_error&) {  // a process limit: fewer helpers
        break;
      }
    }
  }

  ~CopyPool()
  {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    work_.notify_all();
    for (std::thread& t : helpers_) {
      t.join();
    }
  }

  CopyPool(const CopyPool&) = delete;
  CopyPool& operator=(const CopyPool&) = delete;

  void Run(const std::vector<Copy>& copies)
  {
    uint64_t total = 0;
    for (const Copy& c : copies) {
      total += c.bytes;
    }
    const uint64_t pieces = std::min<uint64_t>(helpers_.size() + 1, total / CopyChunk());
    if (pieces < 2) {
      CopyRange(copies, 0, total);
      return;
    }
    const uint64_t share = (total + pieces - 1) / pieces;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      copies_ = &copies;
      total_ = total;
      share_ = share;
      pieces_ = pieces;
      pending_ = pieces - 1;
      ++job_;
    }
    work_.notify_all();
    CopyRange(copies, 0, share);
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [this] { return pending_ == 0; });
    copies_ = nullptr;
  }

 private:
  // Helper `index` copies piece index + 1 of each job that has one.
  void Help(int index)
  {
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      work_.wait(lock, [&] { return stop_ || job_ != seen; });
      if (stop_) {
        return;
      }
      seen = job_;
      const uint64_t piece = static_cast<uint64_t>(index) + 1;
      if (piece >= pieces_) {
        continue;
      }
      const std::vector<Copy>* copies = copies_;
      const uint64_t begin = piece * share_, end = std::min(total_, (piece + 1) * share_);
      lock.unlock();
      CopyRange(*copies, begin, end);
      lock.lock();
      if (--pending_ == 0) {
        done_.notify_one();
      }
    }
  }

  std::mutex mutex_;
  std::condition_variable work_, done_;
  const std::vector<Copy>* copies_ = nullptr;
  uint64_t total_ = 0, share_ = 0, pieces_ = 0, pending_ = 0, job_ = 0;
  bool stop_ = false;
  std::vector<std::thread> helpers_;  // last: started once the state above exists
};

// `copies`, split over the instance's copy helpers when large enough (the pool made then, once).
void CopyAll(std::unique_ptr<CopyPool>* pool, const std::vector<Copy>& copies)
{
  uint64_t total = 0;
  for (const Copy& c : copies) {
    total += c.bytes;
  }
  if (total / CopyChunk() < 2) {
    CopyRange(copies, 0, total);
    return;
  }
  if (*pool == nullptr) {
    *pool = std::make_unique<CopyPool>();
  }
  (*pool)->Run(copies);
}

struct InstanceState {
  ModelState* model = nullptr;
  std::unique_ptr<CopyPool> copy_pool;  // made on the first copy large enough to split
  PyObject* instance = nullptr;  // inprocess.Instance
  NativeRoute* native = nullptr;
  std::thread::id entered;  // the thread on which Python set the device and stream (Instance.enter_thread)
  ~InstanceState() { delete native; }
};

// Reads inprocess.Instance.native_plan()'s tuple. Needs the GIL. nullptr (and `why`) where it cannot be used.
NativeRoute* ReadNativePlan(PyObject* plan, std::string* why)
{
  if (plan == Py_None) {
    return nullptr;
  }
  const Driver* driver = CudaDriver();
  if (!driver->error.empty()) {
    *why = driver->error;
    return nullptr;
  }
  auto route = std::make_unique<NativeRoute>();
  route->driver = driver;
  PyObject *rows = nullptr, *answers = nullptr, *buckets = nullptr;
  unsigned long long stream = 0, x_row = 0, y_row = 0;
  if (!PyArg_ParseTuple(plan, "KlKKOOO", &stream, &route->seq, &x_row, &y_row, &rows, &answers, &buckets) ||
      !PyTuple_Check(rows) || !PyTuple_Check(answers) || !PyList_Check(buckets)) {
    PyErr_Clear();
    *why = "native_plan() returned a malformed plan";
    return nullptr;
  }
  route->stream = reinterpret_cast<void*>(static_cast<uintptr_t>(stream));
  route->mask_row.assign(1, route->seq);
  route->x_row = x_row;
  route->y_row = y_row;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(rows); ++i) {
    route->row_shape.push_back(PyLong_AsLongLong(PyTuple_GET_ITEM(rows, i)));
  }
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(answers); ++i) {
    route->answer_shape.push_back(PyLong_AsLongLong(PyTuple_GET_ITEM(answers, i)));
  }
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(buckets); ++i) {
    NativeBucket b;
    unsigned long long sx = 0, smask = 0, hy = 0, exec = 0;
    if (!PyArg_ParseTuple(PyList_GET_ITEM(buckets, i), "lKKKKKKK", &b.size, &b.x, &b.mask, &b.y, &sx, &smask, &hy,
                          &exec)) {
      PyErr_Clear();
      *why = "native_plan() returned a malformed bucket";
      return nullptr;
    }
    b.stage_x = reinterpret_cast<char*>(static_cast<uintptr_t>(sx));
    b.stage_mask = reinterpret_cast<char*>(static_cast<uintptr_t>(smask));
    b.host_y = reinterpret_cast<char*>(static_cast<uintptr_t>(hy));
    b.exec = reinterpret_cast<void*>(static_cast<uintptr_t>(exec));
    route->buckets.push_back(b);
  }
  if (PyErr_Occurred()) {
    PyErr_Clear();
    *why = "native_plan() returned a malformed plan";
    return nullptr;
  }
  return route.release();
}

// The CPU tests' stand-in for GPU memory: with a stand-in driver (KKDEPLOY_CUDA_DRIVER set), whose "device
// pointers" are host addresses, KKDEPLOY_STANDIN_DEVICE_MEMORY=all takes every request's input and response buffers as
// memory of the route's GPU, and `alternate` those of every other request of an execution (the second, fourth, ...),
// so that the device-to-device copies, and their mix with host ones, run inside a real tritonserver on the CPU;
// `other` takes every input buffer as another GPU's, which the route leaves to Python.
// 0: off (always, with the real driver), 1: all, 2: alternate, 3: other.
int StandInDeviceMemory()
{
  static const int mode = [] {
    const char* driver = std::getenv("KKDEPLOY_CUDA_DRIVER");
    const char* asked = std::getenv("KKDEPLOY_STANDIN_DEVICE_MEMORY");
    if (driver == nullptr || *driver == '\0' || asked == nullptr) {
      return 0;
    }
    const std::string mode(asked);
    return mode == "all" ? 1 : mode == "alternate" ? 2 : mode == "other" ? 3 : 0;
  }();
  return mode;
}

bool StandInOnDevice(uint32_t request_index)
{
  const int mode = StandInDeviceMemory();
  return mode == 1 || (mode == 2 && request_index % 2 == 1);
}

// One input of a request as the native route takes it: in one buffer, in host memory or on the route's GPU (a
// client's CUDA shared-memory region), with rows of `row_shape`. Its rows (shape[0]), its bytes and where they lie,
// or false (another GPU, several buffers, a wrong shape: Python's route takes the execution).
bool RequestInput(
    TRITONBACKEND_Request* request, uint32_t request_index, const char* name, const std::vector<int64_t>& row_shape,
    uint64_t row_bytes, int64_t device, bool* present, int64_t* rows, const void** data, bool* on_device)
{
  TRITONBACKEND_Input* input = nullptr;
  TRITONSERVER_Error* missing = TRITONBACKEND_RequestInput(request, name, &input);
  if (missing != nullptr) {
    TRITONSERVER_ErrorDelete(missing);
    *present = false;
    return true;
  }
  *present = true;
  const char* input_name = nullptr;
  TRITONSERVER_DataType datatype;
  const int64_t* shape = nullptr;
  uint32_t dims = 0, buffers = 0;
  uint64_t byte_size = 0;
  TRITONSERVER_Error* err =
      TRITONBACKEND_InputProperties(input, &input_name, &datatype, &shape, &dims, &byte_size, &buffers);
  if (err != nullptr) {
    TRITONSERVER_ErrorDelete(err);
    return false;
  }
  if (buffers != 1 || dims != row_shape.size() + 1 || shape[0] < 1) {
    return false;
  }
  for (size_t i = 0; i < row_shape.size(); ++i) {
    if (shape[i + 1] != row_shape[i]) {
      return false;
    }
  }
  uint64_t size = 0;
  TRITONSERVER_MemoryType memory_type = TRITONSERVER_MEMORY_CPU;
  int64_t memory_type_id = 0;
  err = TRITONBACKEND_InputBuffer(input, 0, data, &size, &memory_type, &memory_type_id);
  if (err != nullptr) {
    TRITONSERVER_ErrorDelete(err);
    return false;
  }
  if ((memory_type == TRITONSERVER_MEMORY_GPU && memory_type_id != device) || StandInDeviceMemory() == 3) {
    return false;  // another GPU's memory: Python's route copies it with torch
  }
  *rows = shape[0];
  *on_device = memory_type == TRITONSERVER_MEMORY_GPU || StandInOnDevice(request_index);
  return size == static_cast<uint64_t>(shape[0]) * row_bytes && byte_size == size;
}

// A device-to-device copy of the native route (a request's rows into the capture, an answer into a client's region).
struct DeviceCopy {
  unsigned long long dst, src;
  uint64_t bytes;
};

// Adds rows [row, row + k) to `runs`, the row ranges that cross from the staging buffer: merged with the last range
// where they follow it, so that an execution of host requests alone is one copy.
void AddRun(std::vector<std::pair<uint64_t, uint64_t>>* runs, uint64_t row, uint64_t k)
{
  if (!runs->empty() && runs->back().second == row) {
    runs->back().second = row + k;
  } else {
    runs->emplace_back(row, row + k);
  }
}

// "cuX failed with CUresult N", or "" when every call succeeded.
std::string DriverFailure(const char* call, int result)
{
  return result == 0 ? std::string() : std::string(call) + " failed with CUresult " + std::to_string(result);
}

// The native route for one execution: true when it answered (every outcome set, `stats` one run), false when the
// execution is not for it (nothing written; Python takes it). No GIL. Rows in host memory are gathered into the
// bucket's pinned staging buffers and cross in one copy per run of consecutive such requests (one copy when every
// request is in host memory); rows already on the route's GPU (a client's CUDA shared-memory region) are copied
// into the capture on the device, without touching the host.
bool NativeExecute(
    const NativeRoute& route, const std::string& model, TRITONBACKEND_Request** requests, uint32_t count,
    std::unique_ptr<CopyPool>* pool, std::vector<Outcome>* outcomes, std::vector<long>* stats)
{
  const uint64_t start = NowNs();
  std::vector<int64_t> rows(count, 0);
  std::vector<const void*> xs(count, nullptr), masks(count, nullptr);
  std::vector<char> x_on_device(count, 0), mask_on_device(count, 0);
  bool all_valid = true;
  int64_t n = 0;
  for (uint32_t r = 0; r < count; ++r) {
    bool present = false, on_device = false;
    if (!RequestInput(requests[r], r, kInputX, route.row_shape, route.x_row, route.device, &present, &rows[r], &xs[r],
                      &on_device) ||
        !present) {
      return false;
    }
    x_on_device[r] = on_device;
    int64_t mask_rows = 0;
    bool has_mask = false;
    on_device = false;
    if (!RequestInput(requests[r], r, kInputMask, route.mask_row, static_cast<uint64_t>(route.seq), route.device,
                      &has_mask, &mask_rows, &masks[r], &on_device) ||
        (has_mask && mask_rows != rows[r])) {
      return false;
    }
    if (!has_mask) {
      masks[r] = nullptr;
    }
    mask_on_device[r] = has_mask && on_device;
    all_valid = all_valid && !has_mask;
    n += rows[r];
  }
  const NativeBucket* bucket = nullptr;
  for (const NativeBucket& b : route.buckets) {
    if (n <= b.size) {
      bucket = &b;  // the smallest bucket that holds the rows (BucketedRunner.bucket_for)
      break;
    }
  }
  if (n == 0 || bucket == nullptr || bucket->exec == nullptr) {
    return false;
  }
  const long size = bucket->size;
  const uint64_t seq = static_cast<uint64_t>(route.seq);
  const auto device = [](const void* p) { return static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(p)); };
  uint64_t row = 0;
  std::vector<Copy> gather;  // host rows into the staging buffers
  std::vector<DeviceCopy> on_device;  // rows on the GPU into the capture
  std::vector<std::pair<uint64_t, uint64_t>> x_runs, mask_runs;  // row ranges that cross from the staging buffers
  gather.reserve(2 * count);
  for (uint32_t r = 0; r < count; ++r) {
    const uint64_t k = static_cast<uint64_t>(rows[r]);
    if (x_on_device[r]) {
      on_device.push_back({bucket->x + row * route.x_row, device(xs[r]), k * route.x_row});
    } else {
      gather.push_back({bucket->stage_x + row * route.x_row, static_cast<const char*>(xs[r]), k * route.x_row});
      AddRun(&x_runs, row, k);
    }
    if (!all_valid) {
      if (mask_on_device[r]) {
        on_device.push_back({bucket->mask + row * seq, device(masks[r]), k * seq});
      } else {
        if (masks[r] == nullptr) {
          std::memset(bucket->stage_mask + row * seq, 1, k * seq);
        } else {
          gather.push_back({bucket->stage_mask + row * seq, static_cast<const char*>(masks[r]), k * seq});
        }
        AddRun(&mask_runs, row, k);
      }
    }
    row += k;
  }
  CopyAll(pool, gather);
  const Driver& d = *route.driver;
  const uint64_t real = static_cast<uint64_t>(n), pad = static_cast<uint64_t>(size) - real;
  std::string failure;
  for (const auto& run : x_runs) {
    if (failure.empty()) {
      const uint64_t at = run.first * route.x_row;
      failure = DriverFailure("cuMemcpyHtoDAsync", d.to_device(bucket->x + at, bucket->stage_x + at,
                                                               (run.second - run.first) * route.x_row, route.stream));
    }
  }
  if (failure.empty() && pad > 0) {  // padding rows: zeros, fully masked
    failure = DriverFailure("cuMemsetD8Async", d.fill(bucket->x + real * route.x_row, 0, pad * route.x_row,
                                                       route.stream));
  }
  // The mask is written every run: Python's route (which writes the same capture) then cannot trust what it left
  // there (BucketEngine.static_mask_shared).
  if (failure.empty() && all_valid) {
    failure = DriverFailure("cuMemsetD8Async", d.fill(bucket->mask, 1, real * seq, route.stream));
  }
  for (const auto& run : mask_runs) {
    if (failure.empty()) {
      failure = DriverFailure("cuMemcpyHtoDAsync",
                              d.to_device(bucket->mask + run.first * seq, bucket->stage_mask + run.first * seq,
                                          (run.second - run.first) * seq, route.stream));
    }
  }
  for (const DeviceCopy& c : on_device) {
    if (failure.empty()) {
      failure = DriverFailure("cuMemcpyDtoDAsync", d.on_device(c.dst, c.src, c.bytes, route.stream));
    }
  }
  if (failure.empty() && pad > 0) {
    failure = DriverFailure("cuMemsetD8Async", d.fill(bucket->mask + real * seq, 0, pad * seq, route.stream));
  }
  const uint64_t gathered = NowNs();
  if (failure.empty()) {
    failure = DriverFailure("cuGraphLaunch", d.launch(bucket->exec, route.stream));
  }
  if (failure.empty()) {
    failure = DriverFailure("cuMemcpyDtoHAsync", d.to_host(bucket->host_y, bucket->y, real * route.y_row,
                                                           route.stream));
  }
  if (failure.empty()) {
    failure = DriverFailure("cuStreamSynchronize", d.wait(route.stream));
  }
  const uint64_t ran = NowNs();
  row = 0;
  for (uint32_t r = 0; r < count; ++r) {
    Outcome& outcome = (*outcomes)[r];
    if (!failure.empty()) {
      outcome.ok = false;
      outcome.code = TRITONSERVER_ERROR_INTERNAL;
      outcome.message = model + ": native route: " + failure;
      continue;
    }
    const uint64_t k = static_cast<uint64_t>(rows[r]);
    outcome.ok = true;
    outcome.native = true;
    outcome.shape.assign(1, rows[r]);
    outcome.shape.insert(outcome.shape.end(), route.answer_shape.begin(), route.answer_shape.end());
    outcome.source = bucket->host_y + row * route.y_row;
    outcome.device_source = bucket->y + row * route.y_row;
    outcome.bytes = k * route.y_row;
    outcome.source_on_host = true;
    row += k;
  }
  const uint64_t done = NowNs();
  if (failure.empty()) {
    for (long v : {static_cast<long>(gathered - start), static_cast<long>(ran - gathered),
                   static_cast<long>(done - ran), size, static_cast<long>(n)}) {
      stats->push_back(v);
    }
  }
  return true;
}

// (shape, [(pointer, bytes, memory type, memory type id), ...]) of one input, or Py_None when the request has
// none by that name. Needs the GIL. Returns nullptr with `error` set when Triton refuses.
PyObject* DescribeInput(TRITONBACKEND_Request* request, const char* name, TRITONSERVER_Error** error)
{
  TRITONBACKEND_Input* input = nullptr;
  TRITONSERVER_Error* missing = TRITONBACKEND_RequestInput(request, name, &input);
  if (missing != nullptr) {
    TRITONSERVER_ErrorDelete(missing);
    Py_RETURN_NONE;
  }
  const char* input_name = nullptr;
  TRITONSERVER_DataType datatype;
  const int64_t* shape = nullptr;
  uint32_t dims = 0;
  uint64_t byte_size = 0;
  uint32_t buffers = 0;
  *error = TRITONBACKEND_InputProperties(input, &input_name, &datatype, &shape, &dims, &byte_size, &buffers);
  if (*error != nullptr) {
    return nullptr;
  }
  PyObject* py_shape = PyTuple_New(dims);
  for (uint32_t i = 0; i < dims; ++i) {
    PyTuple_SET_ITEM(py_shape, i, PyLong_FromLongLong(shape[i]));
  }
  PyObject* py_buffers = PyList_New(buffers);
  for (uint32_t i = 0; i < buffers; ++i) {
    const void* buffer = nullptr;
    uint64_t size = 0;
    TRITONSERVER_MemoryType memory_type = TRITONSERVER_MEMORY_CPU;
    int64_t memory_type_id = 0;
    *error = TRITONBACKEND_InputBuffer(input, i, &buffer, &size, &memory_type, &memory_type_id);
    if (*error != nullptr) {
      Py_DECREF(py_shape);
      Py_DECREF(py_buffers);
      return nullptr;
    }
    PyList_SET_ITEM(
        py_buffers, i,
        Py_BuildValue(
            "(KKiL)", static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(buffer)),
            static_cast<unsigned long long>(size), static_cast<int>(memory_type),
            static_cast<long long>(memory_type_id)));
  }
  return Py_BuildValue("(NN)", py_shape, py_buffers);
}


// Reads what inprocess.Instance.execute returned for one request: (shape, pointer, bytes, on_host) or
// (code, message). Needs the GIL.
Outcome ReadOutcome(PyObject* item)
{
  Outcome outcome;
  if (!PyTuple_Check(item)) {
    outcome.message = "kkdeploy backend: execute() returned a malformed answer";
    return outcome;
  }
  if (PyTuple_GET_SIZE(item) == 2) {
    outcome.code = static_cast<TRITONSERVER_Error_Code>(PyLong_AsLong(PyTuple_GET_ITEM(item, 0)));
    const char* text = PyUnicode_AsUTF8(PyTuple_GET_ITEM(item, 1));
    outcome.message = text != nullptr ? text : "error";
    PyErr_Clear();
    return outcome;
  }
  if (PyTuple_GET_SIZE(item) != 4) {
    outcome.message = "kkdeploy backend: execute() returned a malformed answer";
    return outcome;
  }
  PyObject* shape = PyTuple_GET_ITEM(item, 0);
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(shape); ++i) {
    outcome.shape.push_back(PyLong_AsLongLong(PyTuple_GET_ITEM(shape, i)));
  }
  outcome.source = reinterpret_cast<const void*>(
      static_cast<uintptr_t>(PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(item, 1))));
  outcome.bytes = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(item, 2));
  outcome.source_on_host = PyObject_IsTrue(PyTuple_GET_ITEM(item, 3)) == 1;
  outcome.ok = !PyErr_Occurred();
  if (!outcome.ok) {
    outcome.message = "kkdeploy backend: " + PythonError();
  }
  return outcome;
}

}  // namespace

extern "C" {

// The entry points Triton looks up (the library is built with hidden visibility for everything else).
#define KKDEPLOY_EXPORT __attribute__((visibility("default")))

KKDEPLOY_EXPORT TRITONSERVER_Error* TRITONBACKEND_Initialize(TRITONBACKEND_Backend* /* backend */)
{
  uint32_t major = 0;
  uint32_t minor = 0;
  TRITONSERVER_Error* err = TRITONBACKEND_ApiVersion(&major, &minor);
  if (err != nullptr) {
    return err;
  }
  if (major != TRITONBACKEND_API_VERSION_MAJOR || minor < TRITONBACKEND_API_VERSION_MINOR) {
    return Error(
        TRITONSERVER_ERROR_UNSUPPORTED,
        "kkdeploy backend: built for Triton's backend API " + std::to_string(TRITONBACKEND_API_VERSION_MAJOR) +
            "." + std::to_string(TRITONBACKEND_API_VERSION_MINOR) + ", this server has " + std::to_string(major) +
            "." + std::to_string(minor));
  }
  return nullptr;
}

KKDEPLOY_EXPORT TRITONSERVER_Error* TRITONBACKEND_ModelInitialize(TRITONBACKEND_Model* model)
{
  const char* name = nullptr;
  uint64_t version = 0;
  TRITONBACKEND_ArtifactType artifact_type;
  const char* location = nullptr;
  TRITONSERVER_Message* config = nullptr;
  TRITONSERVER_Error* err = TRITONBACKEND_ModelName(model, &name);
  if (err == nullptr) err = TRITONBACKEND_ModelVersion(model, &version);
  if (err == nullptr) err = TRITONBACKEND_ModelRepository(model, &artifact_type, &location);
  if (err == nullptr) err = TRITONBACKEND_ModelConfig(model, 1, &config);
  if (err != nullptr) {
    return err;
  }
  const char* json = nullptr;
  size_t json_size = 0;
  err = TRITONSERVER_MessageSerializeToJson(config, &json, &json_size);
  std::string config_json = err == nullptr ? std::string(json, json_size) : std::string();
  TRITONSERVER_MessageDelete(config);
  if (err != nullptr) {
    return err;
  }
  err = EnsurePython();
  if (err != nullptr) {
    return err;
  }
  auto* state = new ModelState();
  state->name = name;
  {
    Gil gil;
    state->model = PyObject_CallMethod(
        python_module, "Model", "ssK", config_json.c_str(), location, static_cast<unsigned long long>(version));
    if (state->model == nullptr) {
      std::string why = PythonError();
      delete state;
      return Error(TRITONSERVER_ERROR_INVALID_ARG, std::string("kkdeploy model ") + name + ": " + why);
    }
    PyObject* type = PyObject_GetAttrString(state->model, "output_datatype");
    const char* type_name = type != nullptr ? PyUnicode_AsUTF8(type) : nullptr;
    state->output_type = type_name != nullptr ? TRITONSERVER_StringToDataType(type_name) : TRITONSERVER_TYPE_INVALID;
    Py_XDECREF(type);
    PyErr_Clear();
  }
  if (state->output_type == TRITONSERVER_TYPE_INVALID) {
    {
      Gil gil;
      Py_CLEAR(state->model);
    }
    delete state;
    return Error(TRITONSERVER_ERROR_INVALID_ARG, std::string("kkdeploy model ") + name + ": no output datatype");
  }
  Families* families = MetricFamilies();
  const char* stages[3] = {"gather", "engine", "respond"};
  for (int i = 0; i < 3; ++i) {
    state->stage[i] = NewMetric(families->stage, state->name, "stage", stages[i]);
  }
  state->rows[0] = NewMetric(families->rows, state->name, "kind", "real");
  state->rows[1] = NewMetric(families->rows, state->name, "kind", "padding");
  state->routes[0] = NewMetric(families->routes, state->name, "route", "native");
  state->routes[1] = NewMetric(families->routes, state->name, "route", "python");
  return TRITONBACKEND_ModelSetState(model, state);
}

KKDEPLOY_EXPORT TRITONSERVER_Error* TRITONBACKEND_ModelFinalize(TRITONBACKEND_Model* model)
{
  void* vstate = nullptr;
  TRITONSERVER_Error* err = TRITONBACKEND_ModelState(model, &vstate);
  if (err != nullptr) {
    return err;
  }
  auto* state = reinterpret_cast<ModelState*>(vstate);
  if (state != nullptr) {
    {
      Gil gil;
      Py_CLEAR(state->model);
    }
    delete state;
  }
  return nullptr;
}

KKDEPLOY_EXPORT TRITONSERVER_Error* TRITONBACKEND_ModelInstanceInitialize(TRITONBACKEND_ModelInstance* instance)
{
  const char* name = nullptr;
  TRITONSERVER_InstanceGroupKind kind;
  int32_t device_id = 0;
  TRITONBACKEND_Model* model = nullptr;
  void* vmodel = nullptr;
  TRITONSERVER_Error* err = TRITONBACKEND_ModelInstanceName(instance, &name);
  if (err == nullptr) err = TRITONBACKEND_ModelInstanceKind(instance, &kind);
  if (err == nullptr) err = TRITONBACKEND_ModelInstanceDeviceId(instance, &device_id);
  if (err == nullptr) err = TRITONBACKEND_ModelInstanceModel(instance, &model);
  if (err == nullptr) err = TRITONBACKEND_ModelState(model, &vmodel);
  if (err != nullptr) {
    return err;
  }
  auto* state = new InstanceState();
  state->model = reinterpret_cast<ModelState*>(vmodel);
  {
    Gil gil;
    state->instance = PyObject_CallMethod(
        state->model->model, "instance", "ssi", name, TRITONSERVER_InstanceGroupKindString(kind), device_id);
    if (state->instance == nullptr) {
      std::string why = PythonError();
      delete state;
      return Error(TRITONSERVER_ERROR_INTERNAL, std::string("kkdeploy instance ") + name + ": " + why);
    }
    PyObject* plan = PyObject_CallMethod(state->instance, "native_plan", nullptr);
    std::string why;
    if (plan == nullptr) {
      why = PythonError();
    } else {
      state->native = ReadNativePlan(plan, &why);
      if (state->native != nullptr) {
        state->native->device = device_id;
      }
      Py_DECREF(plan);
    }
    if (!why.empty()) {  // the instance serves through Python, as it would without the native route
      PyObject* said = PyObject_CallMethod(state->instance, "native_refused", "s", why.c_str());
      if (said == nullptr) {
        PyErr_Clear();
      }
      Py_XDECREF(said);
      Log(TRITONSERVER_LOG_WARN, std::string("kkdeploy instance ") + name + ": no native route: " + why);
    }
  }
  return TRITONBACKEND_ModelInstanceSetState(instance, state);
}

KKDEPLOY_EXPORT TRITONSERVER_Error* TRITONBACKEND_ModelInstanceFinalize(TRITONBACKEND_ModelInstance* instance)
{
  void* vstate = nullptr;
  TRITONSERVER_Error* err = TRITONBACKEND_ModelInstanceState(instance, &vstate);
  if (err != nullptr) {
    return err;
  }
  auto* state = reinterpret_cast<InstanceState*>(vstate);
  if (state != nullptr) {
    {
      Gil gil;
      PyObject* done = PyObject_CallMethod(state->instance, "finalize", nullptr);
      if (done == nullptr) {
        Log(TRITONSERVER_LOG_WARN, "kkdeploy instance finalize: " + PythonError());
      }
      Py_XDECREF(done);
      Py_CLEAR(state->instance);
    }
    delete state;
  }
  return nullptr;
}

// One execution: the requests' inputs described to Python (pointers, no copy), one Python call that gathers,
// runs the bucket and returns where each answer lies, then each answer copied into its response here (host to
// host: memcpy without the GIL; the native route's answers into buffers on its GPU: on the device; anything else
// involving GPU memory: back to Python, which copies with torch).
KKDEPLOY_EXPORT TRITONSERVER_Error* TRITONBACKEND_ModelInstanceExecute(
    TRITONBACKEND_ModelInstance* instance, TRITONBACKEND_Request** requests, const uint32_t request_count)
{
  const uint64_t exec_start = NowNs();
  void* vstate = nullptr;
  TRITONSERVER_Error* err = TRITONBACKEND_ModelInstanceState(instance, &vstate);
  if (err != nullptr) {
    return err;  // Triton fails and releases the requests
  }
  auto* state = reinterpret_cast<InstanceState*>(vstate);
  ModelState* model = state->model;

  std::vector<Outcome> outcomes(request_count);
  std::vector<long> stats;  // gather_ns, engine_ns, respond_ns, bucket, real per run
  uint64_t compute_start = 0;
  uint64_t compute_end = 0;
  bool answered = false;
  if (state->native != nullptr) {
    if (state->entered != std::this_thread::get_id()) {  // Python sets this thread's device and stream, once
      Gil gil;
      PyObject* done = PyObject_CallMethod(state->instance, "enter_thread", nullptr);
      if (done == nullptr) {
        Log(TRITONSERVER_LOG_ERROR, "kkdeploy instance enter_thread: " + PythonError());
      } else {
        state->entered = std::this_thread::get_id();
      }
      Py_XDECREF(done);
    }
    if (state->entered == std::this_thread::get_id()) {
      compute_start = NowNs();
      answered = NativeExecute(*state->native, model->name, requests, request_count, &state->copy_pool,
                               &outcomes, &stats);
      compute_end = NowNs();
    }
  }
  if (!answered) {
    Gil gil;
    PyObject* described = PyList_New(request_count);
    std::vector<bool> refused(request_count, false);
    for (uint32_t r = 0; r < request_count; ++r) {
      TRITONSERVER_Error* problem = nullptr;
      PyObject* x = DescribeInput(requests[r], kInputX, &problem);
      PyObject* mask = problem == nullptr ? DescribeInput(requests[r], kInputMask, &problem) : nullptr;
      if (problem != nullptr) {
        outcomes[r].code = TRITONSERVER_ErrorCode(problem);
        outcomes[r].message = TRITONSERVER_ErrorMessage(problem);
        TRITONSERVER_ErrorDelete(problem);
        refused[r] = true;
        Py_XDECREF(x);
        Py_XDECREF(mask);
        Py_INCREF(Py_None);
        PyList_SET_ITEM(described, r, Py_None);
        continue;
      }
      PyList_SET_ITEM(described, r, Py_BuildValue("(NN)", x, mask));
    }
    compute_start = NowNs();
    PyObject* answer = PyObject_CallMethod(state->instance, "execute", "O", described);
    compute_end = NowNs();
    Py_DECREF(described);
    std::string failure;
    if (answer == nullptr) {
      failure = "kkdeploy backend: " + PythonError();
    } else if (!PyTuple_Check(answer) || PyTuple_GET_SIZE(answer) != 2 ||
               !PyList_Check(PyTuple_GET_ITEM(answer, 0)) ||
               PyList_GET_SIZE(PyTuple_GET_ITEM(answer, 0)) != static_cast<Py_ssize_t>(request_count)) {
      failure = "kkdeploy backend: execute() returned a malformed answer";
    } else {
      PyObject* items = PyTuple_GET_ITEM(answer, 0);
      for (uint32_t r = 0; r < request_count; ++r) {
        if (!refused[r]) {
          outcomes[r] = ReadOutcome(PyList_GET_ITEM(items, r));
        }
      }
      PyObject* runs = PyTuple_GET_ITEM(answer, 1);
      for (Py_ssize_t i = 0; PyList_Check(runs) && i < PyList_GET_SIZE(runs); ++i) {
        PyObject* run = PyList_GET_ITEM(runs, i);
        for (Py_ssize_t k = 0; PyTuple_Check(run) && k < 5 && k < PyTuple_GET_SIZE(run); ++k) {
          stats.push_back(PyLong_AsLong(PyTuple_GET_ITEM(run, k)));
        }
      }
      PyErr_Clear();
    }
    Py_XDECREF(answer);
    if (!failure.empty()) {
      for (uint32_t r = 0; r < request_count; ++r) {
        if (!refused[r]) {
          outcomes[r].ok = false;
          outcomes[r].code = TRITONSERVER_ERROR_INTERNAL;
          outcomes[r].message = failure;
        }
      }
    }
  }

  // The responses. Each output buffer is asked for in host memory (host answers are copied into them together, on
  // several threads when large). A buffer Triton places on the native route's GPU (a client's CUDA shared-memory
  // region) gets the answer from the capture's output, copied on the device; any other buffer elsewhere, or an
  // answer Python's route left on the GPU, is copied by Python.
  std::vector<TRITONBACKEND_Response*> responses(request_count, nullptr);
  std::vector<TRITONSERVER_Error*> send_errors(request_count, nullptr);
  std::vector<std::tuple<uint32_t, void*, uint64_t, int, int64_t>> deferred;
  std::vector<Copy> answers;  // host answers into host response buffers, copied together below
  std::vector<std::pair<uint32_t, DeviceCopy>> device_answers;  // native answers into response buffers on its GPU
  uint64_t rows = 0;
  for (uint32_t r = 0; r < request_count; ++r) {
    Outcome& outcome = outcomes[r];
    TRITONSERVER_Error* problem = TRITONBACKEND_ResponseNew(&responses[r], requests[r]);
    if (problem != nullptr) {  // no response object: nothing can be sent for this request
      Log(TRITONSERVER_LOG_ERROR, std::string("kkdeploy backend: ") + TRITONSERVER_ErrorMessage(problem));
      TRITONSERVER_ErrorDelete(problem);
      responses[r] = nullptr;
      continue;
    }
    if (!outcome.ok) {
      send_errors[r] = Error(outcome.code, outcome.message);
      continue;
    }
    if (!outcome.shape.empty()) {
      rows += static_cast<uint64_t>(outcome.shape[0]);
    }
    TRITONBACKEND_Output* output = nullptr;
    problem = TRITONBACKEND_ResponseOutput(
        responses[r], &output, kOutputY, model->output_type, outcome.shape.data(),
        static_cast<uint32_t>(outcome.shape.size()));
    void* buffer = nullptr;
    TRITONSERVER_MemoryType memory_type = TRITONSERVER_MEMORY_CPU;
    int64_t memory_type_id = 0;
    if (problem == nullptr) {
      problem = TRITONBACKEND_OutputBuffer(output, &buffer, outcome.bytes, &memory_type, &memory_type_id);
    }
    if (problem != nullptr) {
      send_errors[r] = problem;
      continue;
    }
    const bool on_route_device =
        outcome.native && ((memory_type == TRITONSERVER_MEMORY_GPU && memory_type_id == state->native->device) ||
                           StandInOnDevice(r));
    if (on_route_device) {
      device_answers.push_back(
          {r, {static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(buffer)), outcome.device_source,
               outcome.bytes}});
    } else if (outcome.source_on_host && memory_type != TRITONSERVER_MEMORY_GPU) {
      answers.push_back({static_cast<char*>(buffer), static_cast<const char*>(outcome.source), outcome.bytes});
    } else {
      deferred.emplace_back(r, buffer, outcome.bytes, static_cast<int>(memory_type), memory_type_id);
    }
  }
  CopyAll(&state->copy_pool, answers);
  if (!device_answers.empty()) {  // on the route's stream, then one wait: the capture's output is rewritten next run
    const NativeRoute& route = *state->native;
    std::string failure;
    for (const auto& answer : device_answers) {
      if (failure.empty()) {
        const DeviceCopy& c = answer.second;
        failure = DriverFailure("cuMemcpyDtoDAsync", route.driver->on_device(c.dst, c.src, c.bytes, route.stream));
      }
    }
    if (failure.empty()) {
      failure = DriverFailure("cuStreamSynchronize", route.driver->wait(route.stream));
    }
    for (const auto& answer : device_answers) {
      if (!failure.empty()) {
        send_errors[answer.first] = Error(TRITONSERVER_ERROR_INTERNAL, model->name + ": native route: " + failure);
      }
    }
  }
  if (!deferred.empty()) {
    Gil gil;
    PyObject* targets = PyList_New(deferred.size());
    for (size_t i = 0; i < deferred.size(); ++i) {
      PyList_SET_ITEM(
          targets, i,
          Py_BuildValue(
              "(IKKiL)", std::get<0>(deferred[i]),
              static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(std::get<1>(deferred[i]))),
              static_cast<unsigned long long>(std::get<2>(deferred[i])), std::get<3>(deferred[i]),
              static_cast<long long>(std::get<4>(deferred[i]))));
    }
    PyObject* done = PyObject_CallMethod(state->instance, "copy_out", "O", targets);
    Py_DECREF(targets);
    if (done == nullptr) {
      std::string why = "kkdeploy backend: " + PythonError();
      for (auto& target : deferred) {
        send_errors[std::get<0>(target)] = Error(TRITONSERVER_ERROR_INTERNAL, why);
      }
    }
    Py_XDECREF(done);
  }
  const uint64_t exec_end = NowNs();
  for (uint32_t r = 0; r < request_count; ++r) {
    bool success = responses[r] != nullptr && send_errors[r] == nullptr;
    if (responses[r] != nullptr) {
      TRITONSERVER_Error* problem =
          TRITONBACKEND_ResponseSend(responses[r], TRITONSERVER_RESPONSE_COMPLETE_FINAL, send_errors[r]);
      if (send_errors[r] != nullptr) {
        TRITONSERVER_ErrorDelete(send_errors[r]);
      }
      if (problem != nullptr) {
        Log(TRITONSERVER_LOG_ERROR, std::string("kkdeploy backend: ") + TRITONSERVER_ErrorMessage(problem));
        TRITONSERVER_ErrorDelete(problem);
        success = false;
      }
    }
    TRITONSERVER_Error* problem = TRITONBACKEND_ModelInstanceReportStatistics(
        instance, requests[r], success, exec_start, compute_start, compute_end, exec_end);
    if (problem != nullptr) {
      TRITONSERVER_ErrorDelete(problem);
    }
    problem = TRITONBACKEND_RequestRelease(requests[r], TRITONSERVER_REQUEST_RELEASE_ALL);
    if (problem != nullptr) {
      TRITONSERVER_ErrorDelete(problem);
    }
  }
  if (rows > 0) {
    TRITONSERVER_Error* problem = TRITONBACKEND_ModelInstanceReportBatchStatistics(
        instance, rows, exec_start, compute_start, compute_end, exec_end);
    if (problem != nullptr) {
      TRITONSERVER_ErrorDelete(problem);
    }
  }
  for (size_t i = 0; i + 4 < stats.size(); i += 5) {
    model->Count(stats[i], stats[i + 1], stats[i + 2], stats[i + 3], stats[i + 4]);
  }
  Increment(model->routes[answered ? 0 : 1], 1.0);
  return nullptr;
}

}  // extern "C"

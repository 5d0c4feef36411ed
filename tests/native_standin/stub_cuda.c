/* The CUDA driver calls of kkdeploy's native route, on host memory: the CPU tests' stand-in for libcuda.so.1
 * (KKDEPLOY_CUDA_DRIVER names it). A "device pointer" is a host address; a "graph" is a function the test made
 * (a ctypes callback), launched by calling it. KKDEPLOY_STUB_LAUNCH_RESULT makes every launch fail with that code. */
#include <stdlib.h>
#include <string.h>

typedef int (*graph_fn)(void);

int cuMemcpyHtoDAsync_v2(unsigned long long dst, const void* src, size_t n, void* stream)
{
  (void)stream;
  memcpy((void*)(size_t)dst, src, n);
  return 0;
}

int cuMemcpyDtoHAsync_v2(void* dst, unsigned long long src, size_t n, void* stream)
{
  (void)stream;
  memcpy(dst, (const void*)(size_t)src, n);
  return 0;
}

int cuMemsetD8Async(unsigned long long dst, unsigned char value, size_t n, void* stream)
{
  (void)stream;
  memset((void*)(size_t)dst, value, n);
  return 0;
}

int cuGraphLaunch(void* exec, void* stream)
{
  (void)stream;
  const char* fail = getenv("KKDEPLOY_STUB_LAUNCH_RESULT");
  if (fail != NULL && *fail != '\0') {
    return atoi(fail);
  }
  return ((graph_fn)exec)();
}

int cuStreamSynchronize(void* stream)
{
  (void)stream;
  return 0;
}

int cuMemcpyHtoD_v2(unsigned long long dst, const void* src, size_t n)
{
  memcpy((void*)(size_t)dst, src, n);
  return 0;
}

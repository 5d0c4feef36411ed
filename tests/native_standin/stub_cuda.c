/* The CUDA driver calls of kkdeploy's native route, on host memory: the CPU tests' stand-in for libcuda.so.1
 * (KKDEPLOY_CUDA_DRIVER names it). A "device pointer" is a host address; a "graph" is a function the test made
 * (a ctypes callback), launched by calling it. KKDEPLOY_STUB_LAUNCH_RESULT makes every launch fail with that code;
 * KKDEPLOY_STUB_CALL_LOG names a file that gets a line per copy ("HtoD 512", "DtoD 64", "DtoH 512"). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void logged(const char* what, size_t n)
{
  const char* path = getenv("KKDEPLOY_STUB_CALL_LOG");
  if (path != NULL && *path != '\0') {
    FILE* f = fopen(path, "a");
    if (f != NULL) {
      fprintf(f, "%s %zu\n", what, n);
      fclose(f);
    }
  }
}

typedef int (*graph_fn)(void);

int cuMemcpyHtoDAsync_v2(unsigned long long dst, const void* src, size_t n, void* stream)
{
  (void)stream;
  logged("HtoD", n);
  memcpy((void*)(size_t)dst, src, n);
  return 0;
}

int cuMemcpyDtoHAsync_v2(void* dst, unsigned long long src, size_t n, void* stream)
{
  (void)stream;
  logged("DtoH", n);
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

int cuMemcpyDtoDAsync_v2(unsigned long long dst, unsigned long long src, size_t n, void* stream)
{
  (void)stream;
  logged("DtoD", n);
  memcpy((void*)(size_t)dst, (const void*)(size_t)src, n);
  return 0;
}

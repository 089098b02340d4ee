/* The fake runtime: reaches the driver as the real libcudart does, through dlopen of
 * libcuda.so.1, dlsym of cuGetProcAddress_v2, and cuGetProcAddress of each entry point. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdlib.h>

#include "fake.h"

static pfn_alloc drv_alloc;
static pfn_free drv_free;
static pthread_once_t once = PTHREAD_ONCE_INIT;

static void load_driver(void) {
  void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!h) return;
  pfn_gpa_v2 gpa = (pfn_gpa_v2)dlsym(h, "cuGetProcAddress_v2");
  if (!gpa) return;
  int status = -1;
  void *p = NULL;
  if (gpa("cuMemAlloc", &p, 12080, CU_GET_PROC_ADDRESS_DEFAULT, &status) == CUDA_SUCCESS)
    drv_alloc = (pfn_alloc)p;
  if (gpa("cuMemFree", &p, 12080, CU_GET_PROC_ADDRESS_DEFAULT, &status) == CUDA_SUCCESS)
    drv_free = (pfn_free)p;
}

cudaError_t cudaMalloc(void **dev_ptr, size_t size) {
  pthread_once(&once, load_driver);
  if (!drv_alloc) return 3;
  if (size == 0) {
    *dev_ptr = NULL;
    return 0;
  }
  CUdeviceptr p = 0;
  CUresult rc = drv_alloc(&p, size);
  if (rc != CUDA_SUCCESS) return rc == CUDA_ERROR_OUT_OF_MEMORY ? 2 : 1;
  *dev_ptr = (void *)(uintptr_t)p;
  return 0;
}

cudaError_t cudaFree(void *ptr) {
  pthread_once(&once, load_driver);
  if (!drv_free) return 3;
  if (!ptr) return 0;
  return drv_free((CUdeviceptr)(uintptr_t)ptr) == CUDA_SUCCESS ? 0 : 1;
}

cudaError_t cudaGetDevice(int *device) {
  if (!device) return 1;
  *device = 0;
  return 0;
}

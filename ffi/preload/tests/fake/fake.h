/* A fake CUDA driver (libcuda.so.1) and runtime (libcudart.so) for testing
 * libstrata_preload.so without a GPU. Only the entry points the shim touches exist. */
#ifndef STRATA_FAKE_CUDA_H
#define STRATA_FAKE_CUDA_H

#include <stddef.h>
#include <stdint.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef unsigned int CUdeviceptr_v1;
typedef void *CUstream;
typedef int CUdevice;
typedef unsigned long long cuuint64_t;
typedef int cudaError_t;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define CUDA_ERROR_NOT_FOUND 500
#define CUDA_ERROR_NOT_SUPPORTED 801

#define CU_GET_PROC_ADDRESS_DEFAULT 0
#define CU_GET_PROC_ADDRESS_LEGACY_STREAM 1
#define CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM 2
#define CU_GET_PROC_ADDRESS_SUCCESS 0
#define CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND 1
#define CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT 2

/* Size of the fake device's arena (its "HBM"). */
#define FAKE_ARENA_BYTES (512u << 20)

/* What the fake driver saw; fake-only symbol `fake_cuda_counters`. */
struct fake_counters {
  long allocs;        /* successful allocations, every route */
  long frees;         /* successful frees */
  long bad_frees;     /* frees of pointers it never handed out */
  long async_allocs;  /* cuMemAllocAsync + _ptsz */
  long async_frees;   /* cuMemFreeAsync + _ptsz */
  long ptsz_calls;    /* _ptsz variants */
  long get_info_calls;
  long ctx_syncs;
  long stream_syncs;
  long live;
};

void fake_cuda_counters(struct fake_counters *out);
int fake_cuda_owns(CUdeviceptr p);
/* Allocation under a name the shim does not hook (a pointer "from before the hook"). */
CUresult fake_cuda_alloc_raw(CUdeviceptr *dptr, size_t bytes);

CUresult cuInit(unsigned int flags);
CUresult cuMemAlloc(CUdeviceptr_v1 *dptr, size_t bytes);
CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytes);
CUresult cuMemFree_v2(CUdeviceptr dptr);
CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytes, CUstream s);
CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytes, CUstream s);
CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream s);
CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream s);
CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes);
CUresult cuCtxGetDevice(CUdevice *dev);
CUresult cuCtxSynchronize(void);
CUresult cuStreamSynchronize(CUstream s);
CUresult cuGetExportTable(const void **table, const void *id);
CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, cuuint64_t flags);
CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, cuuint64_t flags,
                             int *status);

cudaError_t cudaMalloc(void **dev_ptr, size_t size);
cudaError_t cudaFree(void *ptr);
cudaError_t cudaGetDevice(int *device);

typedef CUresult (*pfn_alloc)(CUdeviceptr *, size_t);
typedef CUresult (*pfn_free)(CUdeviceptr);
typedef CUresult (*pfn_alloc_async)(CUdeviceptr *, size_t, CUstream);
typedef CUresult (*pfn_free_async)(CUdeviceptr, CUstream);
typedef CUresult (*pfn_get_info)(size_t *, size_t *);
typedef CUresult (*pfn_gpa_v1)(const char *, void **, int, cuuint64_t);
typedef CUresult (*pfn_gpa_v2)(const char *, void **, int, cuuint64_t, int *);

#endif

/* The fake driver: allocations come from a static arena with a recognizable address range;
 * counters record every call. Internal calls never go through the public names. */
#include <pthread.h>
#include <string.h>

#include "fake.h"

#define MAX_LIVE 8192
#define FAKE_ALIGN 256

static unsigned char arena[FAKE_ARENA_BYTES] __attribute__((aligned(4096)));
static size_t bump;        /* arena bytes ever carved into slots */
static size_t live_bytes;  /* bytes of live slots */
static CUdeviceptr start[MAX_LIVE];
static size_t slot_len[MAX_LIVE];
static char live[MAX_LIVE];
static struct fake_counters counters;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

void fake_cuda_counters(struct fake_counters *out) {
  pthread_mutex_lock(&mu);
  *out = counters;
  pthread_mutex_unlock(&mu);
}

int fake_cuda_owns(CUdeviceptr p) {
  uintptr_t base = (uintptr_t)arena;
  return p >= base && p < base + FAKE_ARENA_BYTES;
}

/* Power-of-two size classes; a dead slot of the same class is reused, so the arena stays
 * bounded under alloc/free churn. */
static size_t class_of(size_t bytes) {
  size_t len = FAKE_ALIGN;
  while (len < bytes) len <<= 1;
  return len;
}

static CUresult do_alloc(CUdeviceptr *dptr, size_t bytes) {
  if (!dptr || bytes == 0 || bytes > FAKE_ARENA_BYTES) return bytes ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_ERROR_INVALID_VALUE;
  size_t len = class_of(bytes);
  pthread_mutex_lock(&mu);
  int slot = -1;
  for (int i = 0; i < MAX_LIVE && slot < 0; i++)
    if (!live[i] && start[i] && slot_len[i] == len) slot = i;
  for (int i = 0; i < MAX_LIVE && slot < 0; i++)
    if (!start[i] && len <= FAKE_ARENA_BYTES - bump) {
      slot = i;
      start[i] = (CUdeviceptr)(uintptr_t)(arena + bump);
      slot_len[i] = len;
      bump += len;
    }
  CUresult rc = CUDA_ERROR_OUT_OF_MEMORY;
  if (slot >= 0) {
    live[slot] = 1;
    live_bytes += len;
    *dptr = start[slot];
    counters.allocs++;
    counters.live++;
    rc = CUDA_SUCCESS;
  }
  pthread_mutex_unlock(&mu);
  return rc;
}

static CUresult do_free(CUdeviceptr p) {
  pthread_mutex_lock(&mu);
  CUresult rc = CUDA_ERROR_INVALID_VALUE;
  for (int i = 0; i < MAX_LIVE && p != 0; i++) {
    if (live[i] && start[i] == p) {
      live[i] = 0;
      live_bytes -= slot_len[i];
      counters.frees++;
      counters.live--;
      rc = CUDA_SUCCESS;
      break;
    }
  }
  if (rc != CUDA_SUCCESS) counters.bad_frees++;
  pthread_mutex_unlock(&mu);
  return rc;
}

static void count(long *c) {
  pthread_mutex_lock(&mu);
  (*c)++;
  pthread_mutex_unlock(&mu);
}

CUresult fake_cuda_alloc_raw(CUdeviceptr *dptr, size_t bytes) { return do_alloc(dptr, bytes); }
CUresult cuInit(unsigned int flags) { return flags == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE; }
/* The 32-bit ABI of CUDA < 3.2: arena addresses do not fit, as on a real 64-bit driver. */
CUresult cuMemAlloc(CUdeviceptr_v1 *dptr, size_t bytes) {
  (void)dptr;
  (void)bytes;
  return CUDA_ERROR_NOT_SUPPORTED;
}
CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytes) { return do_alloc(dptr, bytes); }
CUresult cuMemFree_v2(CUdeviceptr dptr) { return do_free(dptr); }
CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytes, CUstream s) {
  (void)s;
  count(&counters.async_allocs);
  return do_alloc(dptr, bytes);
}
CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytes, CUstream s) {
  (void)s;
  count(&counters.ptsz_calls);
  count(&counters.async_allocs);
  return do_alloc(dptr, bytes);
}
CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream s) {
  (void)s;
  count(&counters.async_frees);
  return do_free(dptr);
}
CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream s) {
  (void)s;
  count(&counters.ptsz_calls);
  count(&counters.async_frees);
  return do_free(dptr);
}
CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes) {
  if (!free_bytes || !total_bytes) return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&mu);
  counters.get_info_calls++;
  *free_bytes = FAKE_ARENA_BYTES - live_bytes;
  *total_bytes = FAKE_ARENA_BYTES;
  pthread_mutex_unlock(&mu);
  return CUDA_SUCCESS;
}
CUresult cuCtxGetDevice(CUdevice *dev) {
  if (!dev) return CUDA_ERROR_INVALID_VALUE;
  *dev = 0;
  return CUDA_SUCCESS;
}
CUresult cuCtxSynchronize(void) {
  count(&counters.ctx_syncs);
  return CUDA_SUCCESS;
}
CUresult cuStreamSynchronize(CUstream s) {
  (void)s;
  count(&counters.stream_syncs);
  return CUDA_SUCCESS;
}
CUresult cuGetExportTable(const void **table, const void *id) {
  (void)id;
  if (table) *table = NULL;
  return CUDA_ERROR_NOT_FOUND;
}

/* The driver's proc-address table: base name, first version, stream flavour, function. */
struct proc {
  const char *name;
  int since;
  int per_thread; /* -1: no flavours */
  void *fn;
};

static const struct proc procs[] = {
    {"cuInit", 2000, -1, (void *)cuInit},
    {"cuMemAlloc", 2000, -1, (void *)cuMemAlloc},
    {"cuMemAlloc", 3020, -1, (void *)cuMemAlloc_v2},
    {"cuMemFree", 3020, -1, (void *)cuMemFree_v2},
    {"cuMemGetInfo", 3020, -1, (void *)cuMemGetInfo_v2},
    {"cuMemAllocAsync", 11020, 0, (void *)cuMemAllocAsync},
    {"cuMemAllocAsync", 11020, 1, (void *)cuMemAllocAsync_ptsz},
    {"cuMemFreeAsync", 11020, 0, (void *)cuMemFreeAsync},
    {"cuMemFreeAsync", 11020, 1, (void *)cuMemFreeAsync_ptsz},
    {"cuCtxGetDevice", 2000, -1, (void *)cuCtxGetDevice},
    {"cuCtxSynchronize", 2000, -1, (void *)cuCtxSynchronize},
    {"cuStreamSynchronize", 2000, 0, (void *)cuStreamSynchronize},
    {"cuGetExportTable", 3000, -1, (void *)cuGetExportTable},
    {"cuGetProcAddress", 11030, -1, (void *)cuGetProcAddress},
    {"cuGetProcAddress", 12000, -1, (void *)cuGetProcAddress_v2},
};

static CUresult lookup(const char *symbol, void **pfn, int version, cuuint64_t flags, int *status) {
  if (!symbol || !pfn) return CUDA_ERROR_INVALID_VALUE;
  int per_thread = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0;
  const struct proc *best = NULL;
  int known = 0;
  for (size_t i = 0; i < sizeof procs / sizeof procs[0]; i++) {
    const struct proc *p = &procs[i];
    if (strcmp(p->name, symbol) != 0) continue;
    known = 1;
    if (p->since > version) continue;
    if (p->per_thread >= 0 && p->per_thread != per_thread) continue;
    if (!best || p->since > best->since) best = p;
  }
  *pfn = best ? best->fn : NULL;
  if (status)
    *status = best ? CU_GET_PROC_ADDRESS_SUCCESS
                   : (known ? CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT
                            : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND);
  return best ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}

CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, cuuint64_t flags) {
  return lookup(symbol, pfn, version, flags, NULL);
}

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, cuuint64_t flags,
                             int *status) {
  return lookup(symbol, pfn, version, flags, status);
}

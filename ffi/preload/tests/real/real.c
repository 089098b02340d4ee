/* Drives NVIDIA's real libcuda.so.1 and libcudart.so.12 (no GPU needed), with or without
 * libstrata_preload.so preloaded; tests/real_cuda.rs compares the two runs.
 *
 *   real table    reads "name version flags" lines from stdin; for each prints
 *                 "name version flags | v1 rc where | v2 rc status where", where `where` is
 *                 the returned pointer as library+offset (and its exported name when it is
 *                 exactly one), or "null".
 *   real runtime  the runtime's cudaGetDeviceCount, cudaMalloc and cudaFree (looked up with
 *                 dlsym on the runtime's own handle, as frameworks do), one "key value" line each,
 *                 and whether strata owns the pointer.
 *   real driver   the driver's allocation calls as an engine makes them (primary context current,
 *                 cuMemAlloc/cuMemFree, the stream-ordered pair, cuMemGetInfo), then cuMemAlloc on
 *                 a thread with no current context; one "key value" line each. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int (*gpa_v1)(const char *, void **, int, unsigned long long);
typedef int (*gpa_v2)(const char *, void **, int, unsigned long long, int *);

static void where(void *p, char *out, size_t n) {
  Dl_info info;
  if (!p) {
    snprintf(out, n, "null");
    return;
  }
  if (!dladdr(p, &info) || !info.dli_fname) {
    snprintf(out, n, "unknown");
    return;
  }
  const char *base = strrchr(info.dli_fname, '/');
  base = base ? base + 1 : info.dli_fname;
  unsigned long off = (unsigned long)((char *)p - (char *)info.dli_fbase);
  if (info.dli_sname && info.dli_saddr == p)
    snprintf(out, n, "%s+%#lx(%s)", base, off, info.dli_sname);
  else
    snprintf(out, n, "%s+%#lx", base, off);
}

static int table(void) {
  void *cuda = dlopen("libcuda.so.1", RTLD_NOW);
  if (!cuda) {
    fprintf(stderr, "dlopen libcuda.so.1: %s\n", dlerror());
    return 1;
  }
  int (*init)(unsigned) = (int (*)(unsigned))dlsym(cuda, "cuInit");
  gpa_v1 v1 = (gpa_v1)dlsym(cuda, "cuGetProcAddress");
  gpa_v2 v2 = (gpa_v2)dlsym(cuda, "cuGetProcAddress_v2");
  if (!init || !v1 || !v2) {
    fprintf(stderr, "libcuda.so.1 lacks cuInit or cuGetProcAddress(_v2)\n");
    return 1;
  }
  printf("cuInit %d\n", init(0));
  char name[128];
  int version;
  unsigned long long flags;
  while (scanf("%127s %d %llu", name, &version, &flags) == 3) {
    void *p1 = NULL, *p2 = NULL;
    int status = -1;
    int rc1 = v1(name, &p1, version, flags);
    int rc2 = v2(name, &p2, version, flags, &status);
    char w1[512], w2[512];
    where(rc1 == 0 ? p1 : NULL, w1, sizeof w1);
    where(rc2 == 0 ? p2 : NULL, w2, sizeof w2);
    printf("%s %d %llu | v1 %d %s | v2 %d %d %s\n", name, version, flags, rc1, w1, rc2, status, w2);
  }
  return 0;
}

static int runtime(void) {
  void *rt = dlopen("libcudart.so.12", RTLD_NOW);
  if (!rt) {
    fprintf(stderr, "dlopen libcudart.so.12: %s\n", dlerror());
    return 1;
  }
  int (*count)(int *) = (int (*)(int *))dlsym(rt, "cudaGetDeviceCount");
  int (*alloc)(void **, size_t) = (int (*)(void **, size_t))dlsym(rt, "cudaMalloc");
  int (*release)(void *) = (int (*)(void *))dlsym(rt, "cudaFree");
  int (*owns)(unsigned long long) =
      (int (*)(unsigned long long))dlsym(RTLD_DEFAULT, "strata_preload_owns");
  if (!count || !alloc || !release) {
    fprintf(stderr, "libcudart.so.12 lacks cudaGetDeviceCount, cudaMalloc or cudaFree\n");
    return 1;
  }
  int n = -1;
  int rc = count(&n);
  printf("cudaGetDeviceCount %d\n", rc);
  void *p = NULL;
  rc = alloc(&p, 3 << 20);
  printf("cudaMalloc %d\n", rc);
  printf("owned %d\n", p && owns ? owns((unsigned long long)(size_t)p) : 0);
  rc = release(p);
  printf("cudaFree %d\n", rc);
  printf("owned_after_free %d\n", p && owns ? owns((unsigned long long)(size_t)p) : 0);
  return 0;
}

typedef int (*alloc_fn)(unsigned long long *, size_t);
typedef int (*free_fn)(unsigned long long);
typedef int (*alloc_async_fn)(unsigned long long *, size_t, void *);
typedef int (*free_async_fn)(unsigned long long, void *);

static alloc_fn drv_alloc;

static void *no_context_thread(void *arg) {
  unsigned long long p = 0;
  *(int *)arg = drv_alloc(&p, 1 << 20);
  return NULL;
}

static int driver(void) {
  void *cuda = dlopen("libcuda.so.1", RTLD_NOW);
  if (!cuda) {
    fprintf(stderr, "dlopen libcuda.so.1: %s\n", dlerror());
    return 1;
  }
  int (*init)(unsigned) = (int (*)(unsigned))dlsym(cuda, "cuInit");
  int (*retain)(void **, int) = (int (*)(void **, int))dlsym(cuda, "cuDevicePrimaryCtxRetain");
  int (*set_current)(void *) = (int (*)(void *))dlsym(cuda, "cuCtxSetCurrent");
  int (*info)(size_t *, size_t *) = (int (*)(size_t *, size_t *))dlsym(cuda, "cuMemGetInfo_v2");
  drv_alloc = (alloc_fn)dlsym(cuda, "cuMemAlloc_v2");
  free_fn drv_free = (free_fn)dlsym(cuda, "cuMemFree_v2");
  alloc_async_fn alloc_async = (alloc_async_fn)dlsym(cuda, "cuMemAllocAsync");
  free_async_fn free_async = (free_async_fn)dlsym(cuda, "cuMemFreeAsync");
  int (*owns)(unsigned long long) =
      (int (*)(unsigned long long))dlsym(RTLD_DEFAULT, "strata_preload_owns");
  if (!init || !retain || !set_current || !info || !drv_alloc || !drv_free || !alloc_async ||
      !free_async) {
    fprintf(stderr, "libcuda.so.1 lacks an entry point\n");
    return 1;
  }
  void *ctx = NULL;
  printf("cuInit %d\n", init(0));
  printf("cuDevicePrimaryCtxRetain %d\n", retain(&ctx, 0));
  printf("cuCtxSetCurrent %d\n", set_current(ctx));
  unsigned long long p = 0;
  printf("cuMemAlloc %d\n", drv_alloc(&p, 3 << 20));
  printf("owned %d\n", p && owns ? owns(p) : 0);
  printf("cuMemFree %d\n", drv_free(p));
  printf("owned_after_free %d\n", p && owns ? owns(p) : 0);
  unsigned long long q = 0;
  printf("cuMemAllocAsync %d\n", alloc_async(&q, 1 << 20, NULL));
  printf("async_owned %d\n", q && owns ? owns(q) : 0);
  printf("cuMemFreeAsync %d\n", free_async(q, NULL));
  size_t free_bytes = 0, total = 0;
  printf("cuMemGetInfo %d\n", info(&free_bytes, &total));
  printf("total %zu\n", total);
  printf("free_below_total %d\n", free_bytes < total);
  int rc = -1;
  pthread_t t;
  pthread_create(&t, NULL, no_context_thread, &rc);
  pthread_join(t, NULL);
  printf("cuMemAlloc_without_context %d\n", rc);
  return 0;
}

int main(int argc, char **argv) {
  if (argc == 2 && strcmp(argv[1], "table") == 0) return table();
  if (argc == 2 && strcmp(argv[1], "runtime") == 0) return runtime();
  if (argc == 2 && strcmp(argv[1], "driver") == 0) return driver();
  fprintf(stderr, "usage: real table|runtime|driver\n");
  return 2;
}

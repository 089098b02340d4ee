/* Reaches allocation by every route an engine uses and checks who served it and who took each
 * free back. `routes SCENARIO`; EXPECT=strata (default) or EXPECT=fake says who should serve.
 * Never dereferences a device pointer (strict mode: strata memory is not CPU-accessible). */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "fake.h"

struct strata_stats {
  uint64_t live_allocations, allocs, frees, allocated_bytes, reserved_bytes, peak_reserved_bytes;
};

static int (*strata_owns)(uint64_t);
static int (*strata_stats)(int, struct strata_stats *);
static int (*strata_initialized)(void);
static int expect_strata = 1;
static int failures;

#define CHECK(cond, ...)                                                   \
  do {                                                                     \
    if (!(cond)) {                                                         \
      fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);      \
      fprintf(stderr, __VA_ARGS__);                                        \
      fprintf(stderr, "\n");                                               \
      failures++;                                                          \
    }                                                                      \
  } while (0)

static struct strata_stats sstats(void) {
  struct strata_stats s;
  memset(&s, 0, sizeof s);
  if (strata_stats) strata_stats(0, &s);
  return s;
}

static struct fake_counters fstats(void) {
  struct fake_counters c;
  fake_cuda_counters(&c);
  return c;
}

static int by_strata(CUdeviceptr p) { return strata_owns && strata_owns(p) && !fake_cuda_owns(p); }

/* Checks who served `p` (from `route`). */
static void check_owner(const char *route, CUdeviceptr p) {
  if (expect_strata)
    CHECK(by_strata(p), "%s: %#llx should come from strata", route, p);
  else
    CHECK(fake_cuda_owns(p) && !(strata_owns && strata_owns(p)),
          "%s: %#llx should come from the fake driver", route, p);
}

/* Frees `p` with `do_free` and checks the free reached its owner (and only it). */
#define CHECK_FREE(route, p, call)                                                          \
  do {                                                                                      \
    struct strata_stats s0 = sstats();                                                      \
    struct fake_counters f0 = fstats();                                                     \
    int was_strata = by_strata(p);                                                          \
    CUresult frc = (CUresult)(call);                                                        \
    CHECK(frc == 0, "%s: free returned %d", route, frc);                                    \
    struct strata_stats s1 = sstats();                                                      \
    struct fake_counters f1 = fstats();                                                     \
    if (was_strata) {                                                                       \
      CHECK(s1.frees == s0.frees + 1, "%s: strata frees %llu -> %llu", route,               \
            (unsigned long long)s0.frees, (unsigned long long)s1.frees);                    \
      CHECK(f1.frees == f0.frees && f1.bad_frees == f0.bad_frees,                           \
            "%s: a strata free reached the fake driver", route);                            \
      CHECK(!strata_owns(p), "%s: still live after free", route);                           \
    } else {                                                                                \
      CHECK(f1.frees == f0.frees + 1, "%s: fake frees %ld -> %ld", route, f0.frees, f1.frees); \
      CHECK(s1.frees == s0.frees, "%s: a foreign free reached strata", route);              \
    }                                                                                       \
  } while (0)

static void *libcuda(void) {
  void *h = dlopen("libcuda.so.1", RTLD_NOW);
  CHECK(h != NULL, "dlopen libcuda.so.1: %s", dlerror());
  return h;
}

static void route_direct(void) {
  CUdeviceptr p = 0;
  CHECK(cuMemAlloc_v2(&p, 3 << 20) == 0, "direct alloc");
  check_owner("direct large", p);
  CUdeviceptr q = 0;
  CHECK(cuMemAlloc_v2(&q, 4096) == 0, "direct small alloc");
  check_owner("direct small", q);
  CHECK(p != q, "distinct");
  CHECK_FREE("direct", p, cuMemFree_v2(p));
  CHECK_FREE("direct small", q, cuMemFree_v2(q));
  CHECK(cuMemAlloc_v2(&p, 0) == CUDA_ERROR_INVALID_VALUE, "zero bytes is invalid, as in CUDA");
}

static void route_dlsym(void) {
  void *h = libcuda();
  pfn_alloc a = (pfn_alloc)dlsym(h, "cuMemAlloc_v2");
  pfn_free f = (pfn_free)dlsym(h, "cuMemFree_v2");
  CHECK(a && f, "dlsym on the libcuda handle");
  CUdeviceptr p = 0;
  CHECK(a(&p, 1 << 20) == 0, "dlsym alloc");
  check_owner("dlsym(libcuda)", p);
  CHECK_FREE("dlsym(libcuda)", p, f(p));
  /* RTLD_NEXT and RTLD_DEFAULT too. */
  a = (pfn_alloc)dlsym(RTLD_NEXT, "cuMemAlloc_v2");
  CHECK(a != NULL, "dlsym(RTLD_NEXT)");
  if (a) {
    CHECK(a(&p, 5000) == 0, "RTLD_NEXT alloc");
    check_owner("dlsym(RTLD_NEXT)", p);
    CHECK_FREE("dlsym(RTLD_NEXT)", p, cuMemFree_v2(p));
  }
  a = (pfn_alloc)dlsym(RTLD_DEFAULT, "cuMemAlloc_v2");
  CHECK(a != NULL, "dlsym(RTLD_DEFAULT)");
  if (a) {
    CHECK(a(&p, 5000) == 0, "RTLD_DEFAULT alloc");
    check_owner("dlsym(RTLD_DEFAULT)", p);
    CHECK_FREE("dlsym(RTLD_DEFAULT)", p, cuMemFree_v2(p));
  }
  /* A hooked name on a handle that lacks it stays absent. */
  void *libc = dlopen("libc.so.6", RTLD_NOW | RTLD_NOLOAD);
  CHECK(libc && dlsym(libc, "cuMemAlloc_v2") == NULL, "libc has no cuMemAlloc_v2");
}

static void route_proc(void) {
  void *fn = NULL;
  int status = -1;
  /* The 5-argument form, default flags, current version. */
  CHECK(cuGetProcAddress_v2("cuMemAlloc", &fn, 12080, CU_GET_PROC_ADDRESS_DEFAULT, &status) == 0,
        "gpa_v2(cuMemAlloc)");
  CHECK(status == CU_GET_PROC_ADDRESS_SUCCESS, "status %d", status);
  CUdeviceptr p = 0;
  CHECK(((pfn_alloc)fn)(&p, 2 << 20) == 0, "gpa_v2 alloc");
  check_owner("cuGetProcAddress_v2(cuMemAlloc, 12080)", p);
  void *ffn = NULL;
  CHECK(cuGetProcAddress_v2("cuMemFree", &ffn, 12000, CU_GET_PROC_ADDRESS_LEGACY_STREAM, &status) == 0,
        "gpa_v2(cuMemFree)");
  CHECK_FREE("cuGetProcAddress_v2(cuMemFree)", p, ((pfn_free)ffn)(p));
  /* The 4-argument form of CUDA 11.3, an 11.x version. */
  CHECK(cuGetProcAddress("cuMemAlloc", &fn, 11080, CU_GET_PROC_ADDRESS_LEGACY_STREAM) == 0,
        "gpa_v1(cuMemAlloc)");
  CHECK(((pfn_alloc)fn)(&p, 700) == 0, "gpa_v1 alloc");
  check_owner("cuGetProcAddress(cuMemAlloc, 11080)", p);
  CHECK(cuGetProcAddress("cuMemFree", &ffn, 3020, 0) == 0, "gpa_v1(cuMemFree)");
  CHECK_FREE("cuGetProcAddress(cuMemFree)", p, ((pfn_free)ffn)(p));
  /* Through a dlsym'd cuGetProcAddress_v2 from a libcuda handle (what the runtime does). */
  pfn_gpa_v2 gpa = (pfn_gpa_v2)dlsym(libcuda(), "cuGetProcAddress_v2");
  CHECK(gpa && gpa("cuMemAlloc", &fn, 12000, 0, &status) == 0, "dlsym'd gpa_v2");
  CHECK(((pfn_alloc)fn)(&p, 9 << 20) == 0, "dlsym'd gpa alloc");
  check_owner("dlsym(cuGetProcAddress_v2) -> cuMemAlloc", p);
  CHECK_FREE("dlsym(cuGetProcAddress_v2) -> cuMemFree", p, cuMemFree_v2(p));
}

static void route_proc_self(void) {
  void *fn = NULL;
  int status = -1;
  /* cuGetProcAddress of cuGetProcAddress, CUDA 12 ABI (5 arguments) ... */
  CHECK(cuGetProcAddress_v2("cuGetProcAddress", &fn, 12000, 0, &status) == 0, "gpa(gpa) 12000");
  pfn_gpa_v2 gpa2 = (pfn_gpa_v2)fn;
  void *a = NULL;
  CHECK(gpa2("cuMemAlloc", &a, 12080, 0, &status) == 0, "gpa2(cuMemAlloc)");
  CUdeviceptr p = 0;
  CHECK(((pfn_alloc)a)(&p, 1 << 20) == 0, "alloc");
  check_owner("gpa(gpa, 12000) -> cuMemAlloc", p);
  CHECK_FREE("gpa(gpa, 12000)", p, cuMemFree_v2(p));
  /* ... and the 11.3 ABI (4 arguments). */
  CHECK(cuGetProcAddress("cuGetProcAddress", &fn, 11030, 0) == 0, "gpa(gpa) 11030");
  pfn_gpa_v1 gpa1 = (pfn_gpa_v1)fn;
  CHECK(gpa1("cuMemAlloc", &a, 11030, 0) == 0, "gpa1(cuMemAlloc)");
  CHECK(((pfn_alloc)a)(&p, 300) == 0, "alloc");
  check_owner("gpa(gpa, 11030) -> cuMemAlloc", p);
  CHECK_FREE("gpa(gpa, 11030)", p, cuMemFree_v2(p));
}

static void route_async(void) {
  CUstream s = (CUstream)(uintptr_t)0x5000;
  void *fn = NULL;
  int status = -1;
  struct { const char *what; cuuint64_t flags; } cases[] = {
      {"legacy", CU_GET_PROC_ADDRESS_LEGACY_STREAM},
      {"ptsz", CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM},
      {"default", CU_GET_PROC_ADDRESS_DEFAULT},
  };
  for (int i = 0; i < 3; i++) {
    CHECK(cuGetProcAddress_v2("cuMemAllocAsync", &fn, 12000, cases[i].flags, &status) == 0,
          "gpa(cuMemAllocAsync, %s)", cases[i].what);
    void *ffn = NULL;
    CHECK(cuGetProcAddress_v2("cuMemFreeAsync", &ffn, 12000, cases[i].flags, &status) == 0,
          "gpa(cuMemFreeAsync, %s)", cases[i].what);
    CUdeviceptr p = 0;
    CHECK(((pfn_alloc_async)fn)(&p, 4 << 20, s) == 0, "async alloc %s", cases[i].what);
    check_owner(cases[i].what, p);
    struct fake_counters f0 = fstats();
    CHECK_FREE(cases[i].what, p, ((pfn_free_async)ffn)(p, s));
    if (expect_strata)
      CHECK(fstats().stream_syncs == f0.stream_syncs + 1,
            "a stream-ordered strata free waits for its stream first");
  }
  CUdeviceptr p = 0;
  CHECK(cuMemAllocAsync(&p, 1000, s) == 0, "direct async");
  check_owner("cuMemAllocAsync", p);
  CHECK_FREE("cuMemFreeAsync", p, cuMemFreeAsync(p, s));
  CHECK(cuMemAllocAsync_ptsz(&p, 1000, NULL) == 0, "direct async ptsz");
  check_owner("cuMemAllocAsync_ptsz", p);
  CHECK_FREE("cuMemFreeAsync_ptsz", p, cuMemFreeAsync_ptsz(p, NULL));
  if (expect_strata) CHECK(fstats().async_allocs == 0, "no async allocation reached the fake");
}

static void route_runtime(void) {
  void *p = NULL;
  CHECK(cudaMalloc(&p, 6 << 20) == 0, "cudaMalloc");
  check_owner("cudaMalloc", (CUdeviceptr)(uintptr_t)p);
  CHECK_FREE("cudaFree", (CUdeviceptr)(uintptr_t)p, cudaFree(p));
  CHECK(cudaFree(NULL) == 0, "cudaFree(NULL) reaches the runtime");
  /* cudaMalloc looked up with dlsym on the runtime's handle. */
  void *rt = dlopen("libcudart.so", RTLD_NOW);
  CHECK(rt != NULL, "dlopen libcudart.so");
  cudaError_t (*m)(void **, size_t) = (cudaError_t(*)(void **, size_t))dlsym(rt, "cudaMalloc");
  cudaError_t (*f)(void *) = (cudaError_t(*)(void *))dlsym(rt, "cudaFree");
  CHECK(m && f, "dlsym cudaMalloc/cudaFree");
  CHECK(m(&p, 512) == 0, "dlsym'd cudaMalloc");
  check_owner("dlsym(cudaMalloc)", (CUdeviceptr)(uintptr_t)p);
  CHECK_FREE("dlsym(cudaFree)", (CUdeviceptr)(uintptr_t)p, f(p));
}

/* Pointers the fake driver handed out under an un-hooked name go to the real free on every
 * route. */
static void route_foreign(void) {
  CUdeviceptr p[6];
  for (int i = 0; i < 6; i++) {
    CHECK(fake_cuda_alloc_raw(&p[i], 1 << 16) == 0, "raw alloc");
    CHECK(fake_cuda_owns(p[i]), "raw alloc is the fake's");
  }
  CHECK_FREE("foreign cuMemFree_v2", p[0], cuMemFree_v2(p[0]));
  CHECK_FREE("foreign cuMemFreeAsync", p[1], cuMemFreeAsync(p[1], NULL));
  CHECK_FREE("foreign cuMemFreeAsync_ptsz", p[2], cuMemFreeAsync_ptsz(p[2], NULL));
  CHECK_FREE("foreign cudaFree", p[3], cudaFree((void *)(uintptr_t)p[3]));
  pfn_free f = (pfn_free)dlsym(libcuda(), "cuMemFree_v2");
  CHECK_FREE("foreign dlsym(cuMemFree_v2)", p[4], f(p[4]));
  void *fn = NULL;
  int status;
  CHECK(cuGetProcAddress_v2("cuMemFree", &fn, 12080, 0, &status) == 0, "gpa cuMemFree");
  CHECK_FREE("foreign gpa(cuMemFree)", p[5], ((pfn_free)fn)(p[5]));
  CHECK(fstats().bad_frees == 0, "no bad frees reached the fake driver");
  CHECK(fstats().live == 0, "the fake driver's pointers were all freed");
}

/* Lookups alone pass through untouched and initialize nothing. */
static void route_lookups(void) {
  void *h = libcuda();
  void *fn = NULL;
  int status = -1;
  CHECK(cuGetProcAddress_v2("cuGetExportTable", &fn, 12080, 0, &status) == 0, "export table");
  CHECK(fn == dlsym(h, "cuGetExportTable") && fn == (void *)cuGetExportTable,
        "cuGetExportTable passes through");
  CHECK(cuGetProcAddress_v2("cuMemAlloc", &fn, 3000, 0, &status) == 0, "v1 cuMemAlloc");
  CHECK(fn == dlsym(h, "cuMemAlloc"), "the 32-bit cuMemAlloc of CUDA < 3.2 passes through");
  CHECK(cuGetProcAddress_v2("cuNoSuchThing", &fn, 12080, 0, &status) == CUDA_ERROR_NOT_FOUND &&
            status == CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND,
        "unknown names keep the driver's answer");
  CHECK(cuGetProcAddress_v2("cuMemAllocAsync", &fn, 11000, 0, &status) == CUDA_ERROR_NOT_FOUND &&
            status == CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT,
        "too old a version keeps the driver's answer");
  CHECK(dlsym(h, "cuInit") == (void *)cuInit, "cuInit passes through");
  CHECK(dlsym(h, "cuCtxGetDevice") == (void *)cuCtxGetDevice, "cuCtxGetDevice passes through");
  void *alloc = dlsym(h, "cuMemAlloc_v2");
  CHECK(alloc != NULL, "hooked name resolves");
  if (expect_strata)
    CHECK(alloc != dlsym(h, "fake_cuda_alloc_raw"), "sanity");
  if (strata_initialized)
    CHECK(strata_initialized() == 0, "lookups must not initialize the shim");
  CHECK(fstats().allocs == 0, "no allocation happened");
}

static void route_meminfo(void) {
  size_t free0 = 0, total0 = 0, free1 = 0, total1 = 0, free2 = 0, total2 = 0, free3, total3;
  unsigned long long want_total = strtoull(getenv("EXPECT_TOTAL") ? getenv("EXPECT_TOTAL") : "0", 0, 10);
  CHECK(cuMemGetInfo_v2(&free0, &total0) == 0, "meminfo");
  CHECK(free0 <= total0, "free %zu <= total %zu", free0, total0);
  if (want_total) CHECK(total0 == want_total, "total %zu, expected %llu", total0, want_total);
  CUdeviceptr a = 0, b = 0;
  CHECK(cuMemAlloc_v2(&a, 16 << 20) == 0, "alloc a");
  CHECK(cuMemGetInfo_v2(&free1, &total1) == 0 && total1 == total0, "total is constant");
  CHECK(free1 + (16 << 20) <= free0, "free fell by the allocation: %zu -> %zu", free0, free1);
  CHECK(cuMemAlloc_v2(&b, 8 << 20) == 0, "alloc b");
  CHECK(cuMemGetInfo_v2(&free2, &total2) == 0 && total2 == total0, "total is constant");
  CHECK(free2 + (8 << 20) <= free1, "free fell again: %zu -> %zu", free1, free2);
  for (int i = 0; i < 10; i++) {
    size_t f, t;
    CHECK(cuMemGetInfo_v2(&f, &t) == 0 && f == free2, "free stable while allocations live");
  }
  check_owner("meminfo a", a);
  CHECK_FREE("meminfo b", b, cuMemFree_v2(b));
  CHECK_FREE("meminfo a", a, cuMemFree_v2(a));
  CHECK(cuMemGetInfo_v2(&free3, &total3) == 0, "meminfo");
  if (expect_strata) {
    CHECK(free3 == free0, "freed memory is servable again: %zu vs %zu", free3, free0);
    CHECK(fstats().get_info_calls == 0, "strata answered every capacity query");
  }
}

static void route_limit(void) {
  unsigned long long limit = strtoull(getenv("STRATA_PRELOAD_LIMIT_BYTES"), 0, 10);
  CUdeviceptr a = 0, b = 0;
  CHECK(cuMemAlloc_v2(&a, limit / 2) == 0, "half the limit");
  check_owner("limit a", a);
  CHECK(cuMemAlloc_v2(&b, limit) == CUDA_ERROR_OUT_OF_MEMORY, "over the limit is OOM");
  void *p = NULL;
  CHECK(cudaMalloc(&p, limit) == 2, "cudaMalloc over the limit is cudaErrorMemoryAllocation");
  size_t f = 0, t = 0;
  CHECK(cuMemGetInfo_v2(&f, &t) == 0 && f <= limit / 2, "free %zu within the limit", f);
  CHECK(fstats().allocs == 0, "OOM never falls back to the driver");
  CHECK_FREE("limit a", a, cuMemFree_v2(a));
  CHECK(cuMemAlloc_v2(&b, limit) == 0, "the whole limit once freed");
  CHECK_FREE("limit b", b, cuMemFree_v2(b));
}

static void *worker(void *arg) {
  uintptr_t seed = (uintptr_t)arg;
  CUdeviceptr held[8] = {0};
  for (int i = 0; i < 400; i++) {
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    int slot = (int)((seed >> 33) % 8);
    if (held[slot]) {
      CHECK(cuMemFree_v2(held[slot]) == 0, "thread free");
      held[slot] = 0;
    } else {
      size_t size = 256 + (size_t)((seed >> 40) % (3 << 20));
      CHECK(cuMemAlloc_v2(&held[slot], size) == 0, "thread alloc");
      check_owner("thread", held[slot]);
    }
  }
  for (int i = 0; i < 8; i++)
    if (held[i]) CHECK(cuMemFree_v2(held[i]) == 0, "thread final free");
  return NULL;
}

static void route_threads(void) {
  pthread_t t[4];
  for (uintptr_t i = 0; i < 4; i++) pthread_create(&t[i], NULL, worker, (void *)(i + 1));
  for (int i = 0; i < 4; i++) pthread_join(t[i], NULL);
  if (expect_strata) {
    struct strata_stats s = sstats();
    CHECK(s.live_allocations == 0 && s.allocs == s.frees && s.allocs > 0,
          "every strata allocation freed: %llu allocs, %llu frees, %llu live",
          (unsigned long long)s.allocs, (unsigned long long)s.frees,
          (unsigned long long)s.live_allocations);
    CHECK(fstats().allocs == 0, "nothing reached the fake driver");
  }
}

/* A child forked after the shim served the parent: its hooks pass through to the driver (which
 * answers as after any fork), so it is never handed the parent's memory, and the parent's
 * pointers are not strata's to free in the child. */
static void route_fork(void) {
  CUdeviceptr p = 0;
  CHECK(cuMemAlloc_v2(&p, 1 << 20) == 0, "parent alloc");
  check_owner("fork parent", p);
  fflush(stdout);
  fflush(stderr);
  pid_t pid = fork();
  CHECK(pid >= 0, "fork");
  if (pid == 0) {
    CUdeviceptr q = 0;
    CHECK(cuMemAlloc_v2(&q, 4096) == 0, "child alloc");
    CHECK(fake_cuda_owns(q) && !(strata_owns && strata_owns(q)),
          "child: %#llx should come from the driver", q);
    CHECK(cuMemFree_v2(q) == 0, "child free");
    if (expect_strata)
      CHECK(cuMemFree_v2(p) == CUDA_ERROR_INVALID_VALUE,
            "child: the parent's pointer goes to the driver, which does not know it");
    _exit(failures ? 1 : 0);
  }
  int status = 0;
  CHECK(waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0,
        "child failed (status %d)", status);
  CHECK_FREE("fork parent", p, cuMemFree_v2(p));
}

/* cuMemGetInfo_v2 under a limit reports what a large allocation can get: small-block pages
 * that are half used are not free for a large allocation (issue 15, item 7: it reported
 * 32 MiB free under a 64 MiB limit while a 4 MiB allocation failed). */
static void route_meminfo_small(void) {
  enum { N = 512, SMALL = 512 << 10, PAGE = 2 << 20 };
  unsigned long long limit = strtoull(getenv("STRATA_PRELOAD_LIMIT_BYTES"), 0, 10);
  static CUdeviceptr small[N];
  int n = 0;
  while (n < N && cuMemAlloc_v2(&small[n], SMALL) == 0) n++;
  CHECK(n > 0 && n < N, "small blocks up to the limit (%d)", n);
  for (int i = 0; i < n; i += 2) CHECK(cuMemFree_v2(small[i]) == 0, "free every other");
  size_t f = 0, t = 0;
  CHECK(cuMemGetInfo_v2(&f, &t) == 0, "meminfo");
  CHECK(f <= limit, "free %zu within the limit", f);
  size_t large = f / PAGE * PAGE;
  if (large > 0) {
    CUdeviceptr big = 0;
    CHECK(cuMemAlloc_v2(&big, large) == 0, "the %zu bytes reported free can be allocated", f);
    if (big) CHECK(cuMemFree_v2(big) == 0, "free big");
  }
  for (int i = 1; i < n; i += 2) CHECK(cuMemFree_v2(small[i]) == 0, "free the rest");
  CHECK(cuMemGetInfo_v2(&f, &t) == 0 && f + PAGE > limit, "all free again: %zu", f);
}

/* `strata ps` sees the shim (preload.rs): 6 MiB held until stdin says "alloc N" (answering
 * "ok" or "fail") or closes. */
static void route_hold(void) {
  CUdeviceptr p = 0;
  CHECK(cuMemAlloc_v2(&p, 6u << 20) == 0, "hold 6 MiB");
  printf("held\n");
  fflush(stdout);
  char line[64];
  unsigned long long n;
  while (fgets(line, sizeof line, stdin)) {
    CUdeviceptr q = 0;
    if (sscanf(line, "alloc %llu", &n) == 1) printf("%s\n", cuMemAlloc_v2(&q, n) == 0 ? "ok" : "fail");
    fflush(stdout);
  }
}

int main(int argc, char **argv) {
  if (argc < 2) return 2;
  const char *expect = getenv("EXPECT");
  expect_strata = !(expect && strcmp(expect, "fake") == 0);
  strata_owns = (int (*)(uint64_t))dlsym(RTLD_DEFAULT, "strata_preload_owns");
  strata_stats = (int (*)(int, struct strata_stats *))dlsym(RTLD_DEFAULT, "strata_preload_stats");
  strata_initialized = (int (*)(void))dlsym(RTLD_DEFAULT, "strata_preload_initialized");
  if (expect_strata) CHECK(strata_owns && strata_stats, "libstrata_preload.so is not preloaded");
  CHECK(cuInit(0) == 0, "cuInit");
  const char *r = argv[1];
  if (!strcmp(r, "direct")) route_direct();
  else if (!strcmp(r, "dlsym")) route_dlsym();
  else if (!strcmp(r, "proc")) route_proc();
  else if (!strcmp(r, "proc_self")) route_proc_self();
  else if (!strcmp(r, "async")) route_async();
  else if (!strcmp(r, "runtime")) route_runtime();
  else if (!strcmp(r, "foreign")) route_foreign();
  else if (!strcmp(r, "lookups")) route_lookups();
  else if (!strcmp(r, "meminfo")) route_meminfo();
  else if (!strcmp(r, "limit")) route_limit();
  else if (!strcmp(r, "threads")) route_threads();
  else if (!strcmp(r, "fork")) route_fork();
  else if (!strcmp(r, "meminfo_small")) route_meminfo_small();
  else if (!strcmp(r, "hold")) route_hold();
  else {
    fprintf(stderr, "unknown route %s\n", r);
    return 2;
  }
  if (expect_strata && strcmp(r, "foreign") && strcmp(r, "lookups")) {
    struct fake_counters f = fstats();
    CHECK(f.allocs == 0 && f.frees == 0, "%s: the fake driver served %ld allocs, %ld frees", r,
          f.allocs, f.frees);
  }
  printf("%s: %s\n", r, failures ? "FAILED" : "ok");
  return failures ? 1 : 0;
}

/* Loads libstrata.so with dlopen and looks the entry points up with dlsym, with the function
 * pointer types PyTorch's CUDAPluggableAllocator uses (torch/csrc/cuda/CUDAPluggableAllocator.h)
 * and its hook setters expect. argv[1] is the library's path. */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef void *cudaStream_t_;
typedef void *(*alloc_fn_t)(size_t size, int device, cudaStream_t_ stream);
typedef void (*free_fn_t)(void *ptr, size_t size, int device, cudaStream_t_ stream);
typedef void (*init_fn_t)(int device_count);
typedef void (*reset_fn_t)(void);
typedef void (*memory_fraction_fn_t)(double fraction, int device);
typedef void (*record_stream_fn_t)(void *ptr, cudaStream_t_ stream);
typedef const char *(*str_fn_t)(void);
typedef int (*stats_fn_t)(int device, void *out);
typedef int (*count_fn_t)(void);

#define CHECK(cond)                                                                 \
    do {                                                                            \
        if (!(cond)) {                                                              \
            fprintf(stderr, "%s:%d: CHECK(%s) failed\n", __FILE__, __LINE__, #cond); \
            exit(1);                                                                \
        }                                                                           \
    } while (0)

static void *sym(void *lib, const char *name) {
    void *p = dlsym(lib, name);
    if (!p) {
        fprintf(stderr, "dlsym(%s): %s\n", name, dlerror());
        exit(1);
    }
    return p;
}

int main(int argc, char **argv) {
    CHECK(argc == 2);
    void *lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        fprintf(stderr, "dlopen(%s): %s\n", argv[1], dlerror());
        return 1;
    }
    alloc_fn_t alloc = (alloc_fn_t)sym(lib, "strata_malloc");
    free_fn_t release = (free_fn_t)sym(lib, "strata_free");
    init_fn_t init = (init_fn_t)sym(lib, "strata_init");
    reset_fn_t reset = (reset_fn_t)sym(lib, "strata_empty_cache");
    memory_fraction_fn_t fraction = (memory_fraction_fn_t)sym(lib, "strata_set_memory_fraction");
    record_stream_fn_t record = (record_stream_fn_t)sym(lib, "strata_record_stream");
    str_fn_t last_error = (str_fn_t)sym(lib, "strata_last_error");
    str_fn_t version = (str_fn_t)sym(lib, "strata_version");
    stats_fn_t stats = (stats_fn_t)sym(lib, "strata_stats");
    count_fn_t device_count = (count_fn_t)sym(lib, "strata_device_count");

    CHECK(strcmp(version(), "0.1.0") == 0);
    /* The order PyTorch uses: init, then allocations; hooks as the caching allocator calls them. */
    /* Every device the machine has (PyTorch passes its device count); two on the host backend. */
    int devices = device_count();
    CHECK(devices >= 1);
    init(devices);
    CHECK(strcmp(last_error(), "") == 0);
    void *ptrs[64];
    for (int i = 0; i < 64; i++) {
        size_t size = (size_t)(i + 1) * 40000;
        ptrs[i] = alloc(size, i % devices, NULL);
        CHECK(ptrs[i] != NULL);
        CHECK(((uintptr_t)ptrs[i] % 256) == 0);
    }
    record(ptrs[0], NULL);
    for (int i = 0; i < 64; i++) release(ptrs[i], (size_t)(i + 1) * 40000, i % devices, NULL);
    CHECK(strcmp(last_error(), "") == 0);
    fraction(0.5, 0);
    fraction(1.0, 0);
    reset();
    CHECK(strcmp(last_error(), "") == 0);
    unsigned char raw[232];
    CHECK(stats(0, raw) == 0);
    uint64_t total; /* total_bytes: after device and initialized */
    memcpy(&total, raw + 8, sizeof total);
    CHECK(total > 0);
    /* NULL is how PyTorch learns of out-of-memory: a GiB more than the device has. */
    CHECK(alloc((size_t)total + ((size_t)1 << 30), 0, NULL) == NULL);
    CHECK(strstr(last_error(), "STRATA_OUT_OF_MEMORY") != NULL);
    release(NULL, 0, 0, NULL);

    CHECK(stats(0, raw) == 0);
    uint64_t allocated; /* allocated_bytes: after device, initialized, total_bytes, page_size */
    memcpy(&allocated, raw + 24, sizeof allocated);
    CHECK(allocated == 0);
    /* No dlclose: PyTorch never unloads the allocator library (its pool threads keep running). */
    printf("dlopen: ok\n");
    return 0;
}

/* Run-once driver of the strata_malloc + strata_free pair through the C ABI, for counting
 * instructions per pair with callgrind (the criterion bench `c_abi` times the same pair).
 * Loads LIB with dlopen and looks the two symbols up with dlsym, as PyTorch's
 * CUDAPluggableAllocator does; one warm-up pair (which maps), then PAIRS pairs of SIZE bytes on
 * device 0, the default stream, all served from the cache. Instructions per pair = the
 * difference of two runs' totals divided by the difference of their PAIRS
 * (benches/callgrind_pairs.sh does this). Also prints the wall-clock time per pair of the loop
 * (benches/pair_rounds.sh alternates builds and keeps each one's best).
 *
 *   cc -O2 -o malloc_free_pair ffi/benches/c/malloc_free_pair.c -ldl
 *   ./malloc_free_pair target/release/libstrata.so 256 100000
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

typedef void *(*malloc_fn)(size_t, int, void *);
typedef void (*free_fn)(void *, size_t, int, void *);

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s LIB SIZE PAIRS\n", argv[0]);
        return 2;
    }
    void *lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        fprintf(stderr, "dlopen: %s\n", dlerror());
        return 1;
    }
    malloc_fn sm = (malloc_fn)dlsym(lib, "strata_malloc");
    free_fn sf = (free_fn)dlsym(lib, "strata_free");
    if (!sm || !sf) {
        fprintf(stderr, "dlsym: %s\n", dlerror());
        return 1;
    }
    size_t size = strtoull(argv[2], NULL, 10);
    unsigned long long pairs = strtoull(argv[3], NULL, 10);
    void *p = sm(size, 0, NULL);
    if (!p) {
        fprintf(stderr, "warm-up allocation of %zu bytes failed\n", size);
        return 1;
    }
    sf(p, size, 0, NULL);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (unsigned long long i = 0; i < pairs; i++) {
        /* volatile: the loop's size and pointer are not folded away. */
        volatile size_t n = size;
        void *volatile q = sm(n, 0, NULL);
        sf(q, n, 0, NULL);
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double ns = (double)(t1.tv_sec - t0.tv_sec) * 1e9 + (double)(t1.tv_nsec - t0.tv_nsec);
    printf("%zu B: %.2f ns per pair\n", size, pairs ? ns / (double)pairs : 0.0);
    return 0;
}

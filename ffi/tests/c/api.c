/* The whole C API once through include/strata.h: version, devices, malloc/free with alignment
 * and contents, stats against what was allocated, hooks, streams, and bad input. */
#include <math.h>
#include <stdint.h>

#include "common.h"

_Static_assert(sizeof(strata_stats_t) == 232, "strata_stats_t layout");
_Static_assert(sizeof(strata_tag_stats_t) == 96, "strata_tag_stats_t layout");
_Static_assert(STRATA_OK == 0 && STRATA_INTERNAL == 16, "status values");

static void basics(void) {
    CHECK(strcmp(strata_version(), "0.1.0") == 0);
    CHECK(strcmp(strata_last_error(), "") == 0);
    int n = strata_device_count();
    CHECK(n == test_devices()); /* the host backend's test configuration has two */
    int two = second_device("api: device 1");

    /* Lazy: device 1 is untouched until its first allocation. */
    if (two) {
        strata_stats_t s1 = stats_of(1);
        CHECK(s1.device == 1 && s1.initialized == 0 && s1.total_bytes > 0 &&
              s1.allocated_bytes == 0);
    }

    strata_stats_t before = stats_of(0);
    size_t sizes[] = {1, 100, 256, 257, 4096, 70000, 1 << 20, (5 << 20) + 3};
    enum { N = sizeof sizes / sizeof sizes[0] };
    void *ptrs[N];
    uint64_t sum = 0;
    for (int i = 0; i < N; i++) {
        ptrs[i] = strata_malloc(sizes[i], 0, NULL);
        CHECK(ptrs[i] != NULL);
        CHECK(((uintptr_t)ptrs[i] % 256) == 0);
        for (int j = 0; j < i; j++) CHECK(ptrs[j] != ptrs[i]);
        size_t len = sizes[i] < 65536 ? sizes[i] : 65536;
        put_pattern(ptrs[i], len, 100 + i);
        sum += sizes[i];
    }
    strata_stats_t during = stats_of(0);
    CHECK(during.initialized == 1);
    CHECK(during.allocated_bytes == before.allocated_bytes + sum);
    CHECK(during.live_allocations == before.live_allocations + N);
    CHECK(during.allocs == before.allocs + N);
    CHECK(during.allocated_block_bytes >= during.allocated_bytes);
    CHECK(during.reserved_bytes >= during.allocated_block_bytes);
    CHECK(during.reserved_bytes == during.mapped_pages * during.page_size);
    CHECK(during.peak_allocated_bytes >= during.allocated_bytes);
    for (size_t i = 0; i < sizeof during.spare / sizeof during.spare[0]; i++) CHECK(during.spare[i] == 0);
    CHECK(during.limit_set == 0);
    for (int i = 0; i < N; i++) {
        size_t len = sizes[i] < 65536 ? sizes[i] : 65536;
        CHECK(has_pattern(ptrs[i], len, 100 + i));
        strata_free(ptrs[i], sizes[i], 0, NULL);
    }
    strata_stats_t after = stats_of(0);
    CHECK(after.allocated_bytes == before.allocated_bytes);
    CHECK(after.frees == before.frees + N);
    CHECK(after.peak_allocated_bytes >= before.allocated_bytes + sum);

    /* Reuse: the same small size comes back from the cache. */
    void *a = strata_malloc(512, 0, NULL);
    strata_free(a, 512, 0, NULL);
    strata_stats_t c0 = stats_of(0);
    void *b = strata_malloc(512, 0, NULL);
    CHECK(b == a);
    CHECK(stats_of(0).cache_hits == c0.cache_hits + 1);
    strata_free(b, 512, 0, NULL);

    /* Size 0: NULL and not an error. */
    strata_clear_error();
    CHECK(strata_malloc(0, 0, NULL) == NULL);
    CHECK(strcmp(strata_last_error(), "") == 0);

    /* Device 1 works independently. */
    if (!two) return;
    void *d1 = strata_malloc(3 << 20, 1, NULL);
    CHECK(d1 != NULL);
    CHECK(stats_of(1).initialized == 1 && stats_of(1).allocated_bytes == (3u << 20));
    /* Freed as device 0: refused, nothing changes. */
    CHECK(strata_free_checked(d1, 3 << 20, 0, NULL) == STRATA_INVALID_ARGUMENT);
    CHECK_ERR("belongs to device 1");
    CHECK(stats_of(1).live_allocations == 1);
    CHECK_OK(strata_free_checked(d1, 3 << 20, 1, NULL));
}

static void hooks(void) {
    int n = strata_device_count();
    strata_clear_error();
    strata_init(n);
    CHECK(strcmp(strata_last_error(), "") == 0);
    CHECK(stats_of(n - 1).initialized == 1);
    strata_init(n + 1);
    CHECK_ERR("STRATA_NO_DEVICE");

    /* empty_cache returns cached large blocks. */
    void *big = strata_malloc(16 << 20, 0, NULL);
    CHECK(big != NULL);
    strata_free(big, 16 << 20, 0, NULL);
    CHECK(stats_of(0).cached_large_bytes >= (16u << 20));
    strata_clear_error();
    strata_empty_cache();
    CHECK(strcmp(strata_last_error(), "") == 0);
    CHECK(stats_of(0).cached_large_bytes == 0);

    /* Memory fraction: a cap below one more large block makes malloc return NULL. */
    strata_stats_t s = stats_of(0);
    double fraction = (double)(s.reserved_bytes + (4 << 20)) / (double)s.total_bytes;
    strata_set_memory_fraction(fraction, 0);
    CHECK(stats_of(0).limit_bytes > 0);
    uint64_t ooms = stats_of(0).ooms;
    CHECK(strata_malloc(64 << 20, 0, NULL) == NULL);
    CHECK_ERR("STRATA_LIMIT_EXCEEDED");
    CHECK(stats_of(0).ooms == ooms + 1);
    strata_set_memory_fraction(1.0, 0);
    CHECK(stats_of(0).limit_bytes == 0);
    void *ok = strata_malloc(64 << 20, 0, NULL);
    CHECK(ok != NULL);
    strata_free(ok, 64 << 20, 0, NULL);
    strata_clear_error();
    strata_set_memory_fraction(1.5, 0);
    CHECK_ERR("outside [0, 1]");
    strata_clear_error();
    strata_set_memory_fraction(NAN, 0);
    CHECK_ERR("memory fraction");
    strata_clear_error();
    strata_set_memory_fraction(0.5, 7);
    CHECK_ERR("STRATA_NO_DEVICE");

    /* Out of memory (not a limit): more than the device has. */
    CHECK(strata_malloc((size_t)s.total_bytes + (1u << 30), 0, NULL) == NULL);
    CHECK_ERR("STRATA_OUT_OF_MEMORY");
    void *after_oom = strata_malloc(1 << 20, 0, NULL);
    CHECK(after_oom != NULL); /* still usable */
    strata_free(after_oom, 1 << 20, 0, NULL);
}

static void streams(void) {
    cudaStream_t s1 = NULL, s2 = NULL;
    CHECK_OK(strata_stream_create(0, &s1));
    CHECK_OK(strata_stream_create(0, &s2));
    CHECK(s1 != NULL && s2 != NULL && s1 != s2);

    /* Freed on s1: reused at once on s1. */
    void *p = strata_malloc(4096, 0, s1);
    CHECK(p != NULL);
    put_pattern(p, 4096, 5);
    strata_free(p, 4096, 0, s1);
    void *q = strata_malloc(4096, 0, s1);
    CHECK(q == p);

    /* Used on s2 too (record_stream), then freed: held until s2's work completes. */
    strata_clear_error();
    strata_record_stream(q, s2);
    CHECK(strcmp(strata_last_error(), "") == 0);
    strata_free(q, 4096, 0, s1);
    CHECK(strcmp(strata_last_error(), "") == 0);
    CHECK_OK(strata_stream_synchronize(s2));
    CHECK_OK(strata_stream_synchronize(s1));

    /* Allocated on s1, freed on s2: fine, stats balanced. */
    strata_stats_t before = stats_of(0);
    void *r = strata_malloc(10000, 0, s1);
    CHECK(r != NULL);
    CHECK_OK(strata_free_checked(r, 10000, 0, s2));
    CHECK(stats_of(0).allocated_bytes == before.allocated_bytes);

    strata_record_stream((void *)0x42, s1);
    CHECK_ERR("unknown pointer");
    CHECK_OK(strata_stream_destroy(s1));
    CHECK_OK(strata_stream_destroy(s2));
    CHECK(strata_stream_destroy(NULL) == STRATA_INVALID_ARGUMENT);
    CHECK(strata_stream_create(0, NULL) == STRATA_INVALID_ARGUMENT);
    CHECK(strata_stream_create(-1, &s1) == STRATA_NO_DEVICE);
}

static void bad_input(void) {
    /* free(NULL) is a no-op and no error. */
    strata_clear_error();
    strata_free(NULL, 0, 0, NULL);
    strata_free(NULL, 123, 99, NULL);
    CHECK(strcmp(strata_last_error(), "") == 0);
    CHECK_OK(strata_free_checked(NULL, 0, 0, NULL));

    /* Double free. */
    void *p = strata_malloc(777, 0, NULL);
    CHECK(p != NULL);
    strata_free(p, 777, 0, NULL);
    strata_stats_t s = stats_of(0);
    strata_clear_error();
    strata_free(p, 777, 0, NULL);
    CHECK_ERR("double free");
    CHECK(strata_free_checked(p, 777, 0, NULL) == STRATA_DOUBLE_FREE);
    CHECK(stats_of(0).frees == s.frees);

    /* Foreign and interior pointers. */
    int on_stack = 0;
    CHECK(strata_free_checked(&on_stack, sizeof on_stack, 0, NULL) == STRATA_UNKNOWN_POINTER);
    CHECK_ERR("unknown pointer");
    void *live = strata_malloc(2048, 0, NULL);
    CHECK(strata_free_checked((char *)live + 256, 0, 0, NULL) == STRATA_UNKNOWN_POINTER);
    CHECK(stats_of(0).live_allocations == s.live_allocations + 1);
    strata_free(live, 2048, 0, NULL);

    /* Absurd sizes: NULL and a message, allocator still fine. */
    size_t absurd[] = {SIZE_MAX, SIZE_MAX - 255, (size_t)1 << 62};
    for (int i = 0; i < 3; i++) {
        strata_clear_error();
        CHECK(strata_malloc(absurd[i], 0, NULL) == NULL);
        CHECK(strncmp(strata_last_error(), "strata_malloc: ", 15) == 0);
    }

    /* Negative and out-of-range devices. */
    CHECK(strata_malloc(64, -1, NULL) == NULL);
    CHECK_ERR("STRATA_NO_DEVICE");
    char no_such[32];
    snprintf(no_such, sizeof no_such, "no such device %d", strata_device_count());
    CHECK(strata_malloc(64, strata_device_count(), NULL) == NULL);
    CHECK_ERR(no_such);
    CHECK(strata_free_checked((void *)0x1000, 1, -5, NULL) == STRATA_NO_DEVICE);
    strata_stats_t out;
    CHECK(strata_stats(-1, &out) == STRATA_NO_DEVICE);
    CHECK(strata_stats(0, NULL) == STRATA_INVALID_ARGUMENT);

    /* C strings: NULL, invalid UTF-8, empty, too long. */
    CHECK(strata_tag_push(NULL) == STRATA_INVALID_ARGUMENT);
    CHECK_ERR("NULL");
    CHECK(strata_tag_push("\xff\xfe") == STRATA_INVALID_ARGUMENT);
    CHECK_ERR("UTF-8");
    CHECK(strata_tag_push("") == STRATA_INVALID_ARGUMENT);
    char longname[400];
    memset(longname, 'x', sizeof longname - 1);
    longname[sizeof longname - 1] = 0;
    CHECK(strata_tag_push(longname) == STRATA_INVALID_ARGUMENT);
    CHECK(strata_tag_depth() == 0);
    CHECK(strata_tag_pop() == STRATA_INVALID_STATE);
    CHECK(strata_sleep(NULL, 1) == STRATA_INVALID_ARGUMENT);
    CHECK(strata_sleep("no-such-tag", 1) == STRATA_INVALID_ARGUMENT);
    CHECK_ERR("unknown tag");
    CHECK(strata_wake("\xc3\x28") == STRATA_INVALID_ARGUMENT);
    strata_tag_stats_t ts;
    CHECK(strata_tag_stats("no-such-tag", 0, &ts) == STRATA_INVALID_ARGUMENT);

    /* Copies: NULL host side, non-device pointers, zero length. */
    unsigned char buf[16] = {0};
    void *d = strata_malloc(16, 0, NULL);
    CHECK(strata_memcpy_htod(d, NULL, 16) == STRATA_INVALID_ARGUMENT);
    CHECK(strata_memcpy_dtoh(NULL, d, 16) == STRATA_INVALID_ARGUMENT);
    CHECK(strata_memcpy_htod(buf, buf, 16) == STRATA_INVALID_ARGUMENT);
    CHECK_ERR("not device memory");
    CHECK_OK(strata_memcpy_htod(d, NULL, 0));
    strata_free(d, 16, 0, NULL);
}

int main(void) {
    basics();
    hooks();
    streams();
    bad_input();
    printf("api: ok\n");
    return 0;
}

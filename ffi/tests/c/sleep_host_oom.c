/* Issue 15, item 1: strata_sleep(tag, 1) when the host copy cannot be allocated returns
 * STRATA_OUT_OF_MEMORY with a readable message, and the tag stays awake with its contents; it
 * used to abort the process (an infallible allocation). Host memory runs out through
 * RLIMIT_AS, lowered just above what the process maps, so no real exhaustion is needed. */
#include <sys/resource.h>
#include <unistd.h>

#include "common.h"

#define BIG ((size_t)256 << 20)
#define HEAD 65536

/* Bytes of address space the process maps now (/proc/self/statm, first field). */
static unsigned long long mapped_now(void) {
    FILE *f = fopen("/proc/self/statm", "r");
    CHECK(f != NULL);
    unsigned long long pages = 0;
    CHECK(fscanf(f, "%llu", &pages) == 1);
    fclose(f);
    return pages * (unsigned long long)sysconf(_SC_PAGESIZE);
}

int main(void) {
    CHECK_OK(strata_tag_push("weights"));
    void *big = strata_malloc(BIG, 0, NULL);
    CHECK(big != NULL);
    void *small = strata_malloc(1000, 0, NULL);
    CHECK(small != NULL);
    CHECK_OK(strata_tag_pop());
    unsigned char *tail = (unsigned char *)big + BIG - HEAD;
    put_pattern(big, HEAD, 1);
    put_pattern(tail, HEAD, 2);
    put_pattern(small, 1000, 3);

    struct rlimit old;
    CHECK(getrlimit(RLIMIT_AS, &old) == 0);
    struct rlimit low = old;
    low.rlim_cur = (rlim_t)(mapped_now() + ((unsigned long long)64 << 20));
    CHECK(setrlimit(RLIMIT_AS, &low) == 0);
    int status = strata_sleep("weights", 1);
    CHECK(setrlimit(RLIMIT_AS, &old) == 0);
    CHECK(status == STRATA_OUT_OF_MEMORY);
    CHECK_ERR("STRATA_OUT_OF_MEMORY");
    CHECK_ERR("host");

    /* Still awake and intact: stats say so, copies work, allocation under the tag works. */
    strata_tag_stats_t ts;
    CHECK_OK(strata_tag_stats("weights", 0, &ts));
    CHECK(ts.asleep == 0 && ts.host_copy_bytes == 0 && ts.live_allocations == 2);
    CHECK(has_pattern(big, HEAD, 1));
    CHECK(has_pattern(tail, HEAD, 2));
    CHECK(has_pattern(small, 1000, 3));
    CHECK_OK(strata_tag_push("weights"));
    void *more = strata_malloc(4096, 0, NULL);
    CHECK(more != NULL);
    CHECK_OK(strata_tag_pop());

    /* With the limit lifted the same sleep works and wake restores the bytes. */
    CHECK_OK(strata_sleep("weights", 1));
    CHECK_OK(strata_wake("weights"));
    CHECK(has_pattern(big, HEAD, 1));
    CHECK(has_pattern(tail, HEAD, 2));
    CHECK(has_pattern(small, 1000, 3));
    strata_free(big, BIG, 0, NULL);
    strata_free(small, 1000, 0, NULL);
    strata_free(more, 4096, 0, NULL);
    printf("sleep_host_oom: ok\n");
    return 0;
}

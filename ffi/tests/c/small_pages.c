/* Issue 15, item 5: small host granularities (STRATA_HOST_GRANULARITY of 4-32 KiB) are
 * accepted by the backend, so the allocator must work with them: it used to refuse every
 * strata_malloc ("small threshold 1048576 above 16 pages"). Sizes on both sides of the
 * (page-derived) small threshold, contents checked, everything freed. */
#include "common.h"

int main(void) {
    const size_t sizes[] = {1, 100, 4096, 5000, 40000, 65536, 70000, 1 << 20, 3 << 20};
    enum { N = sizeof sizes / sizeof sizes[0] };
    void *p[N];
    strata_stats_t s0 = stats_of(0);
    for (int i = 0; i < N; i++) {
        p[i] = strata_malloc(sizes[i], 0, NULL);
        CHECK(p[i] != NULL);
        put_pattern(p[i], sizes[i] < 65536 ? sizes[i] : 65536, 10 + i);
    }
    strata_stats_t s = stats_of(0);
    const char *want = getenv("STRATA_HOST_GRANULARITY");
    CHECK(want != NULL);
    CHECK(s.page_size == strtoull(want, NULL, 10) * 1024); /* "4KiB" -> 4096 */
    CHECK(s.live_allocations == s0.live_allocations + N);
    for (int i = 0; i < N; i++) {
        CHECK(has_pattern(p[i], sizes[i] < 65536 ? sizes[i] : 65536, 10 + i));
        CHECK_OK(strata_free_checked(p[i], sizes[i], 0, NULL));
    }
    CHECK(stats_of(0).live_allocations == s0.live_allocations);
    printf("small_pages: ok\n");
    return 0;
}

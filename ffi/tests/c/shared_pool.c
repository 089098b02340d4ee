/* One runtime per process: strata_malloc and Harvest draw on the same per-device page pools.
 * The pool's counters show both uses, and a lent page is counted once, by its lender. */
#include "common.h"

int main(void) {
    CHECK(strata_device_count() == 2);
    const uint64_t mib = 1u << 20;
    void *p = strata_malloc(8 * mib, 1, NULL);
    CHECK(p != NULL);
    strata_stats_t before = stats_of(1);
    CHECK(before.pool_in_use_bytes == before.reserved_bytes && before.reserved_bytes >= 8 * mib);
    CHECK(before.lent_bytes == 0 && before.borrowed_bytes == 0);
    uint64_t requester_in_use = stats_of(0).pool_in_use_bytes;

    int32_t prefer[] = {1};
    strata_harvest_hints_t hints = {0, STRATA_HARVEST_BACKED, 0, 1, prefer};
    strata_harvest_handle_t h;
    CHECK_OK(strata_harvest_alloc(6 * mib, &hints, &h));
    CHECK(h.device == 1 && h.size == 6 * mib);
    strata_stats_t lending = stats_of(1);
    CHECK(lending.lent_bytes == 6 * mib);
    CHECK(lending.pool_in_use_bytes == before.pool_in_use_bytes + 6 * mib);
    CHECK(lending.reserved_bytes == before.reserved_bytes);
    strata_stats_t borrowing = stats_of(0);
    CHECK(borrowing.borrowed_bytes == 6 * mib);
    CHECK(borrowing.pool_in_use_bytes == requester_in_use); /* counted once, by the lender */

    CHECK_OK(strata_harvest_free(&h));
    strata_stats_t after = stats_of(1);
    CHECK(after.lent_bytes == 0 && after.pool_in_use_bytes == before.pool_in_use_bytes);
    CHECK(stats_of(0).borrowed_bytes == 0);
    CHECK_OK(strata_free_checked(p, 8 * mib, 1, NULL));
    printf("shared_pool: ok\n");
    return 0;
}

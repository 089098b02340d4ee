/* Harvest through the C ABI: allocations on the peer, contents by backend copies, revocation
 * callbacks (once each, lossy vs backed), stale handles after revocation and free, bad input. */
#include "common.h"

_Static_assert(sizeof(strata_harvest_handle_t) == 32, "strata_harvest_handle_t layout");
_Static_assert(sizeof(strata_harvest_hints_t) == 24, "strata_harvest_hints_t layout");

typedef struct {
    int calls;
    int lost;
    uint64_t id;
    int stale_inside; /* the handle was already stale when the callback ran */
} seen_t;

static void on_revoke(const strata_harvest_handle_t *h, int lost, void *user_data) {
    seen_t *seen = user_data;
    unsigned char byte;
    seen->calls += 1;
    seen->lost = lost;
    seen->id = h->id;
    seen->stale_inside = strata_harvest_read(h, 0, &byte, 1) == STRATA_INVALID_HANDLE;
}

int main(void) {
    CHECK(strata_device_count() == test_devices() && test_devices() >= 2); /* lends device 1 */
    strata_harvest_hints_t hints = {0, STRATA_HARVEST_LOSSY, 0, 0, NULL};
    strata_harvest_handle_t lossy, backed, plain;
    size_t len = 3u << 20;
    CHECK_OK(strata_harvest_alloc(len, &hints, &lossy));
    CHECK(lossy.device == 1 && lossy.size >= len && lossy.ptr != 0);
    hints.durability = STRATA_HARVEST_BACKED;
    int32_t prefer[] = {1};
    hints.preferred = prefer;
    hints.preferred_count = 1;
    CHECK_OK(strata_harvest_alloc(4096, &hints, &backed));
    CHECK(backed.device == 1 && backed.id != lossy.id);

    unsigned char *want = malloc(len), *got = malloc(len);
    CHECK(want && got);
    fill_pattern(want, len, 42);
    CHECK_OK(strata_harvest_write(&lossy, 0, want, len));
    memset(got, 0, len);
    CHECK_OK(strata_harvest_read(&lossy, 0, got, len));
    CHECK(memcmp(want, got, len) == 0);
    CHECK(strata_harvest_read(&lossy, lossy.size, got, 1) == STRATA_INVALID_ARGUMENT);

    seen_t seen_lossy = {0}, seen_backed = {0};
    CHECK_OK(strata_harvest_on_revoke(&lossy, on_revoke, &seen_lossy));
    CHECK_OK(strata_harvest_on_revoke(&backed, on_revoke, &seen_backed));
    CHECK(strata_harvest_on_revoke(&backed, NULL, NULL) == STRATA_INVALID_ARGUMENT);

    uint64_t revoked = 0;
    CHECK_OK(strata_harvest_reclaim(1, UINT64_MAX, &revoked));
    CHECK(revoked == lossy.size + backed.size);
    CHECK(seen_lossy.calls == 1 && seen_lossy.lost == 1 && seen_lossy.id == lossy.id);
    CHECK(seen_backed.calls == 1 && seen_backed.lost == 0 && seen_backed.id == backed.id);
    CHECK(seen_lossy.stale_inside && seen_backed.stale_inside);
    CHECK(strata_harvest_read(&lossy, 0, got, 16) == STRATA_INVALID_HANDLE);
    CHECK(strata_harvest_free(&lossy) == STRATA_INVALID_HANDLE);
    CHECK_OK(strata_harvest_reclaim(1, UINT64_MAX, &revoked));
    CHECK(revoked == 0);
    CHECK(seen_lossy.calls == 1 && seen_backed.calls == 1); /* exactly once */

    /* Free: no callback, then stale. */
    seen_t seen_plain = {0};
    CHECK_OK(strata_harvest_alloc(len, &hints, &plain));
    CHECK_OK(strata_harvest_on_revoke(&plain, on_revoke, &seen_plain));
    CHECK_OK(strata_harvest_free(&plain));
    CHECK(strata_harvest_free(&plain) == STRATA_INVALID_HANDLE);
    CHECK(seen_plain.calls == 0);

    /* Bad input. */
    CHECK(strata_harvest_alloc(len, NULL, &plain) == STRATA_INVALID_ARGUMENT);
    CHECK(strata_harvest_alloc(len, &hints, NULL) == STRATA_INVALID_ARGUMENT);
    CHECK(strata_harvest_alloc(0, &hints, &plain) == STRATA_INVALID_ARGUMENT);
    hints.durability = 7;
    CHECK(strata_harvest_alloc(len, &hints, &plain) == STRATA_INVALID_ARGUMENT);
    hints.durability = STRATA_HARVEST_BACKED;
    hints.requester = 9;
    CHECK(strata_harvest_alloc(len, &hints, &plain) == STRATA_NO_DEVICE);
    hints.requester = 0;
    CHECK(strata_harvest_alloc((size_t)1 << 50, &hints, &plain) == STRATA_OUT_OF_MEMORY);
    CHECK(strata_harvest_free(NULL) == STRATA_INVALID_ARGUMENT);
    strata_harvest_handle_t forged = backed;
    forged.id ^= 1;
    CHECK(strata_harvest_free(&forged) == STRATA_INVALID_HANDLE);

    free(want);
    free(got);
    printf("harvest: ok\n");
    return 0;
}

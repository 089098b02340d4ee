/* Issue 15, item 12: statuses and messages a caller can act on.
 * - A copy into freed, out-of-range or sleeping memory is the caller's mistake:
 *   STRATA_INVALID_ARGUMENT, not STRATA_MAPPING (documented as internal).
 * - Out of memory names the size asked for (it said "requested 2097152 bytes", one page, for a
 *   200 MiB request).
 * - Harvest read/write check the range before allocating staging; a handle whose `reserved`
 *   field is not zero is refused. */
#include <stdint.h>

#include "common.h"

#define MB ((size_t)1 << 20)

int main(void) {
    unsigned char buf[4096] = {0};

    /* Copies into memory the caller may not touch. */
    void *p = strata_malloc(8 * MB, 0, NULL);
    CHECK(p != NULL);
    CHECK(strata_memcpy_htod((char *)p + 8 * MB - 100, buf, 4096) == STRATA_INVALID_ARGUMENT);
    CHECK_ERR("not inside live, awake memory");
    CHECK_OK(strata_tag_push("msg-sleepy"));
    void *q = strata_malloc(4 * MB, 0, NULL);
    CHECK_OK(strata_tag_pop());
    CHECK(q != NULL);
    CHECK_OK(strata_sleep("msg-sleepy", 0));
    CHECK(strata_memcpy_dtoh(buf, q, sizeof buf) == STRATA_INVALID_ARGUMENT);
    CHECK(strata_sleep("msg-sleepy", 0) == STRATA_INVALID_STATE);
    CHECK_ERR("tag \"msg-sleepy\" is already asleep");
    CHECK_OK(strata_wake("msg-sleepy"));
    CHECK_OK(strata_free_checked(q, 4 * MB, 0, NULL));
    strata_empty_cache();
    CHECK(strata_memcpy_htod(q, buf, sizeof buf) == STRATA_INVALID_ARGUMENT);

    /* Out of memory names the request: 400 MiB fits the 512 MiB device, 200 MiB more does not. */
    void *big = strata_malloc(400 * MB, 1, NULL);
    CHECK(big != NULL);
    CHECK(strata_malloc(200 * MB, 1, NULL) == NULL);
    CHECK_ERR("STRATA_OUT_OF_MEMORY");
    CHECK_ERR("requested 209715200 bytes");
    strata_free(big, 400 * MB, 1, NULL);

    /* Harvest: range checked first; the reserved field must be zero. */
    strata_harvest_hints_t hints = {0, STRATA_HARVEST_BACKED, 0, 0, NULL};
    strata_harvest_handle_t h;
    CHECK_OK(strata_harvest_alloc(2 * MB, &hints, &h));
    CHECK(strata_harvest_write(&h, 0, buf, SIZE_MAX / 2) == STRATA_INVALID_ARGUMENT);
    CHECK_ERR("beyond the allocation");
    CHECK(strata_harvest_read(&h, 2 * MB - 10, buf, 100) == STRATA_INVALID_ARGUMENT);
    CHECK_ERR("beyond the allocation");
    CHECK_OK(strata_harvest_write(&h, 2 * MB - 100, buf, 100));
    strata_harvest_handle_t forged = h;
    forged.reserved = 7;
    CHECK(strata_harvest_read(&forged, 0, buf, 100) == STRATA_INVALID_ARGUMENT);
    CHECK_ERR("reserved");
    CHECK(strata_harvest_free(&forged) == STRATA_INVALID_ARGUMENT);
    CHECK_OK(strata_harvest_free(&h));
    strata_free(p, 8 * MB, 0, NULL);
    printf("messages: ok\n");
    return 0;
}

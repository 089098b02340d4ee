/* Issue 15, items 8 and 9.
 * - After strata_empty_cache an idle process holds only its live allocations: the pool's
 *   background refill used to recreate 32 MiB per device within ~50 ms.
 * - The memory-fraction cap covers everything strata holds on the device, the pool's free
 *   pages included (they used to come on top of it).
 * - A cap of zero bytes is reported as a cap (limit_set), not as "none".
 * - The hooks (void) clear the last error on success: it used to keep the previous failure. */
#define _POSIX_C_SOURCE 200809L
#include <time.h>

#include "common.h"

#define MB ((size_t)1 << 20)

static void pause_ms(long ms) {
    struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&t, NULL);
}

static uint64_t held(const strata_stats_t *s) { return s->reserved_bytes + s->pool_free_bytes; }

int main(void) {
    /* empty_cache sticks while idle. */
    void *keep = strata_malloc(4 * MB, 0, NULL);
    void *drop = strata_malloc(16 * MB, 0, NULL);
    CHECK(keep != NULL && drop != NULL);
    strata_free(drop, 16 * MB, 0, NULL);
    strata_empty_cache();
    strata_stats_t after = stats_of(0);
    for (int i = 0; i < 6; i++) {
        pause_ms(50);
        strata_stats_t s = stats_of(0);
        CHECK(s.pool_free_bytes == 0);
        CHECK(held(&s) <= held(&after));
    }

    /* The cap covers the pool's pages: 64 MiB of the device, whatever its size (half a byte
     * more: the library truncates total x fraction to whole bytes). */
    strata_set_memory_fraction((64.0 * MB + 0.5) / (double)stats_of(0).total_bytes, 0);
    strata_stats_t s = stats_of(0);
    CHECK(s.limit_set == 1 && s.limit_bytes == 64 * MB);
    void *blocks[64];
    int n = 0;
    while (n < 64 && (blocks[n] = strata_malloc(2 * MB, 0, NULL)) != NULL) {
        n++;
        s = stats_of(0);
        CHECK(held(&s) <= s.limit_bytes);
    }
    CHECK(n > 0 && n < 64);
    CHECK_ERR("STRATA_LIMIT_EXCEEDED");
    strata_free(blocks[--n], 2 * MB, 0, NULL); /* cached, then the pool refills in the back */
    for (int i = 0; i < 6; i++) {
        pause_ms(50);
        s = stats_of(0);
        CHECK(held(&s) <= s.limit_bytes);
    }
    while (n > 0) strata_free(blocks[--n], 2 * MB, 0, NULL);

    /* Zero is a cap, not "none". */
    strata_clear_error();
    strata_set_memory_fraction(0.0, 0);
    CHECK(strcmp(strata_last_error(), "") == 0);
    s = stats_of(0);
    CHECK(s.limit_set == 1 && s.limit_bytes == 0);
    CHECK(strata_malloc(4096, 0, NULL) == NULL);
    CHECK_ERR("STRATA_LIMIT_EXCEEDED");
    /* The hooks report only through the last error: a success clears the one left before. */
    strata_set_memory_fraction(1e-300, 0);
    CHECK(strcmp(strata_last_error(), "") == 0);
    strata_set_memory_fraction(2.0, 0);
    CHECK_ERR("outside [0, 1]");
    strata_empty_cache();
    CHECK(strcmp(strata_last_error(), "") == 0);
    s = stats_of(0);
    CHECK(s.limit_set == 1 && s.limit_bytes == 0);
    strata_set_memory_fraction(1.0, 0);
    s = stats_of(0);
    CHECK(s.limit_set == 0 && s.limit_bytes == 0);
    void *again = strata_malloc(4096, 0, NULL);
    CHECK(again != NULL);
    strata_free(again, 4096, 0, NULL);
    strata_free(keep, 4 * MB, 0, NULL);
    printf("limits: ok\n");
    return 0;
}

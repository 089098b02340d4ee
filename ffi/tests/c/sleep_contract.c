/* Issue 15, items 4 and 10: strata_sleep is all or nothing across devices, and a sleep before
 * any device is in use holds.
 * - A tag awake on device 0 and asleep on device 1 (a wake that failed part-way), with a cap
 *   on device 0 below what it holds: strata_sleep is STRATA_INVALID_STATE and device 0 stays
 *   awake and mapped (it used to be left asleep: the rollback wake's error was dropped).
 * - strata_sleep before any allocation: allocations under the tag are refused until
 *   strata_wake, which succeeds (it used to return OK, sleep nothing, then refuse the wake). */
#include "common.h"

#define MB (1u << 20)

static strata_tag_stats_t tag_on(const char *tag, int device) {
    strata_tag_stats_t t;
    CHECK_OK(strata_tag_stats(tag, device, &t));
    return t;
}

static void sleep_before_any_use(void) {
    CHECK_OK(strata_tag_push("early"));
    CHECK_OK(strata_tag_pop());
    CHECK(stats_of(0).initialized == 0 && stats_of(1).initialized == 0);
    CHECK_OK(strata_sleep("early", 1));
    CHECK(strata_sleep("early", 1) == STRATA_INVALID_STATE);
    CHECK_OK(strata_tag_push("early"));
    CHECK(strata_malloc(4096, 0, NULL) == NULL);
    CHECK_ERR("STRATA_INVALID_STATE");
    CHECK_ERR("\"early\""); /* the message names the tag, not its id */
    CHECK(strata_malloc(4096, 1, NULL) == NULL);
    CHECK_OK(strata_tag_pop());
    CHECK(tag_on("early", 0).asleep == 1);
    CHECK_OK(strata_wake("early"));
    CHECK(strata_wake("early") == STRATA_INVALID_STATE);
    CHECK_OK(strata_tag_push("early"));
    void *p = strata_malloc(4096, 0, NULL);
    CHECK(p != NULL);
    CHECK_OK(strata_tag_pop());
    CHECK_OK(strata_free_checked(p, 4096, 0, NULL));
}

static void all_or_nothing(void) {
    CHECK_OK(strata_tag_push("split"));
    void *a = strata_malloc(8 * MB, 0, NULL);
    void *b = strata_malloc(8 * MB, 1, NULL);
    CHECK_OK(strata_tag_pop());
    CHECK(a != NULL && b != NULL);
    put_pattern(a, 4096, 1);
    put_pattern(b, 4096, 2);
    CHECK_OK(strata_sleep("split", 1));
    /* Device 1 cannot map anything: the wake stops there, device 0 awake. */
    strata_set_memory_fraction(0.0, 1);
    CHECK(strata_wake("split") == STRATA_LIMIT_EXCEEDED);
    CHECK(tag_on("split", 0).asleep == 0 && tag_on("split", 1).asleep == 1);
    CHECK(has_pattern(a, 4096, 1));
    /* Device 0 capped below what it holds: a sleep that reached it could not be undone. */
    strata_set_memory_fraction(0.0, 0);
    CHECK(strata_sleep("split", 1) == STRATA_INVALID_STATE);
    CHECK_ERR("asleep on device 1");
    strata_tag_stats_t t0 = tag_on("split", 0);
    CHECK(t0.asleep == 0 && t0.reserved_bytes >= 8 * MB);
    CHECK(has_pattern(a, 4096, 1));
    /* Lift the caps: the wake finishes and both devices hold their bytes. */
    strata_set_memory_fraction(1.0, 0);
    strata_set_memory_fraction(1.0, 1);
    CHECK_OK(strata_wake("split"));
    CHECK(tag_on("split", 1).asleep == 0);
    CHECK(has_pattern(a, 4096, 1) && has_pattern(b, 4096, 2));
    CHECK_OK(strata_free_checked(a, 8 * MB, 0, NULL));
    CHECK_OK(strata_free_checked(b, 8 * MB, 1, NULL));
}

int main(void) {
    sleep_before_any_use();
    all_or_nothing();
    printf("sleep_contract: ok\n");
    return 0;
}

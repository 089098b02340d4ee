/* Issue 15, item 6: tag names are released when no longer in use, so a server using a tag per
 * request does not fail for good after 65,536 of them (it used to: names were never
 * released). Names in use (pushed, with live allocations, or asleep) survive every release
 * with their ids and figures. */
#include "common.h"

#define ROUNDS 140000 /* more than twice the 65,536 names registered at once */

int main(void) {
    /* In use throughout: a live allocation, a sleeping tag, a pushed tag. */
    CHECK_OK(strata_tag_push("keep-live"));
    void *live = strata_malloc(5000, 0, NULL);
    CHECK_OK(strata_tag_pop());
    CHECK(live != NULL);
    put_pattern(live, 5000, 11);
    CHECK_OK(strata_tag_push("keep-asleep"));
    void *nap = strata_malloc(3000, 1, NULL);
    CHECK_OK(strata_tag_pop());
    CHECK(nap != NULL);
    put_pattern(nap, 3000, 12);
    CHECK_OK(strata_sleep("keep-asleep", 1));
    CHECK_OK(strata_tag_push("keep-pushed"));
    strata_tag_stats_t live0, nap0, pushed0;
    CHECK_OK(strata_tag_stats("keep-live", 0, &live0));
    CHECK_OK(strata_tag_stats("keep-asleep", 1, &nap0));
    CHECK_OK(strata_tag_stats("keep-pushed", 0, &pushed0));

    /* Per-request tags: push, allocate, free, pop. */
    char name[64];
    for (int i = 0; i < ROUNDS; i++) {
        snprintf(name, sizeof name, "request-%d", i);
        CHECK_OK(strata_tag_push(name));
        if (i % 1000 == 0) {
            void *p = strata_malloc(256, 0, NULL);
            CHECK(p != NULL);
            CHECK_OK(strata_free_checked(p, 256, 0, NULL));
        }
        CHECK_OK(strata_tag_pop());
    }
    CHECK(strata_tag_depth() == 1);

    strata_tag_stats_t t;
    CHECK_OK(strata_tag_stats("keep-live", 0, &t));
    CHECK(t.tag_id == live0.tag_id && t.live_allocations == 1 && t.allocs == live0.allocs);
    CHECK_OK(strata_tag_stats("keep-asleep", 1, &t));
    CHECK(t.tag_id == nap0.tag_id && t.asleep == 1);
    CHECK_OK(strata_tag_stats("keep-pushed", 0, &t));
    CHECK(t.tag_id == pushed0.tag_id);
    /* The first request names were released; the latest is still registered. */
    CHECK(strata_tag_stats("request-0", 0, &t) == STRATA_INVALID_ARGUMENT);
    snprintf(name, sizeof name, "request-%d", ROUNDS - 1);
    CHECK_OK(strata_tag_stats(name, 0, &t));
    CHECK(t.tag_id != live0.tag_id && t.tag_id != nap0.tag_id && t.tag_id != pushed0.tag_id);

    /* Allocations under the pushed tag still carry it; the sleeping tag wakes intact. */
    void *mine = strata_malloc(100, 0, NULL);
    CHECK(mine != NULL);
    CHECK_OK(strata_tag_stats("keep-pushed", 0, &t));
    CHECK(t.live_allocations == 1);
    CHECK_OK(strata_free_checked(mine, 100, 0, NULL));
    CHECK_OK(strata_tag_pop());
    CHECK_OK(strata_wake("keep-asleep"));
    CHECK(has_pattern(nap, 3000, 12));
    CHECK(has_pattern(live, 5000, 11));
    strata_free(live, 5000, 0, NULL);
    strata_free(nap, 3000, 1, NULL);
    printf("tag_names: ok\n");
    return 0;
}

/* A tag set to overflow (onto host memory or a peer) is in use: releasing idle names keeps it
 * and its setting. Its id used to be released like any idle name's and handed to the next new
 * name, which then overflowed without asking (the setting stayed with the id, in the
 * allocators and in the set applied to devices first used later). */
#include "common.h"

#define ROUNDS 70000 /* more than the 65,536 names registered at once */

/* Allocates 4 MiB under `tag` on device 0; frees it; returns whether it succeeded. */
static int allocates(const char *tag) {
    CHECK_OK(strata_tag_push(tag));
    void *p = strata_malloc(4 << 20, 0, NULL);
    CHECK_OK(strata_tag_pop());
    if (p != NULL)
        CHECK_OK(strata_free_checked(p, 0, 0, NULL));
    return p != NULL;
}

int main(void) {
    /* Both tags used once, then idle: nothing live, nothing pushed, only the setting. */
    CHECK(allocates("to-host") && allocates("to-peer"));
    CHECK_OK(strata_set_overflow("to-host", STRATA_TIER_HOST));
    CHECK_OK(strata_set_overflow_peer("to-peer", 1));
    strata_tag_stats_t host0, peer0, t;
    CHECK_OK(strata_tag_stats("to-host", 0, &host0));
    CHECK_OK(strata_tag_stats("to-peer", 0, &peer0));

    char name[64];
    for (int i = 0; i < ROUNDS; i++) {
        snprintf(name, sizeof name, "request-%d", i);
        CHECK_OK(strata_tag_push(name));
        CHECK_OK(strata_tag_pop());
    }
    CHECK(strata_tag_stats("request-0", 0, &t) == STRATA_INVALID_ARGUMENT); /* released */
    CHECK_OK(strata_tag_stats("to-host", 0, &t));
    CHECK(t.tag_id == host0.tag_id);
    CHECK_OK(strata_tag_stats("to-peer", 0, &t));
    CHECK(t.tag_id == peer0.tag_id);

    /* On a full device the two still overflow; the newest names do not. */
    static void *hog[1024];
    int n = fill_device(0, hog, 1024);
    CHECK(allocates("to-host") && allocates("to-peer"));
    for (int i = ROUNDS - 8; i < ROUNDS; i++) {
        snprintf(name, sizeof name, "request-%d", i);
        CHECK(!allocates(name));
    }

    /* Turned off (host) and revoked (peer), the settings no longer hold the names. */
    CHECK_OK(strata_set_overflow("to-host", 0));
    CHECK_OK(strata_revoke_peer(1, NULL));
    CHECK(!allocates("to-host") && !allocates("to-peer"));
    free_all(0, hog, n);
    for (int i = 0; i < ROUNDS; i++) {
        snprintf(name, sizeof name, "again-%d", i);
        CHECK_OK(strata_tag_push(name));
        CHECK_OK(strata_tag_pop());
    }
    CHECK(strata_tag_stats("to-host", 0, &t) == STRATA_INVALID_ARGUMENT);
    CHECK(strata_tag_stats("to-peer", 0, &t) == STRATA_INVALID_ARGUMENT);
    printf("tag_overflow: ok\n");
    return 0;
}

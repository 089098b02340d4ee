/* Tags and sleep/wake: contents kept across sleep with host copies (small and large blocks, on
 * both devices), zeros without them, memory really released while asleep, other tags untouched,
 * allocating under a sleeping tag refused, freeing while asleep allowed. */
#include "common.h"

#define N 12

int main(void) {
    void *w[N], *kv[N], *other;
    size_t wsize[N], kvsize[N];
    CHECK_OK(strata_tag_push("weights"));
    for (int i = 0; i < N; i++) {
        wsize[i] = i % 3 == 0 ? (size_t)(2 << 20) + 4096 * i : (size_t)(1000 + 3000 * i);
        w[i] = strata_malloc(wsize[i], i % 2, NULL);
        CHECK(w[i] != NULL);
        put_pattern(w[i], wsize[i] < 65536 ? wsize[i] : 65536, 1000 + i);
    }
    CHECK_OK(strata_tag_push("kv")); /* nested: kv inside weights */
    for (int i = 0; i < N; i++) {
        kvsize[i] = i % 4 == 0 ? (size_t)(3 << 20) : (size_t)(512 * (i + 1));
        kv[i] = strata_malloc(kvsize[i], 0, NULL);
        CHECK(kv[i] != NULL);
        put_pattern(kv[i], kvsize[i] < 65536 ? kvsize[i] : 65536, 2000 + i);
    }
    CHECK_OK(strata_tag_pop());
    CHECK_OK(strata_tag_pop());
    CHECK(strata_tag_depth() == 0);
    other = strata_malloc(5000, 0, NULL); /* untagged */
    CHECK(other != NULL);
    put_pattern(other, 5000, 3000);

    strata_tag_stats_t ws, ks;
    CHECK_OK(strata_tag_stats("weights", 0, &ws));
    CHECK_OK(strata_tag_stats("kv", 0, &ks));
    CHECK(ws.tag_id != ks.tag_id);
    CHECK(ws.live_allocations == N / 2 && ks.live_allocations == N);
    CHECK(ws.reserved_bytes > 0 && ks.reserved_bytes > 0);

    /* Sleep weights with copies, kv without. */
    strata_stats_t before = stats_of(0);
    CHECK_OK(strata_sleep("weights", 1));
    CHECK_OK(strata_sleep("kv", 0));
    strata_stats_t asleep = stats_of(0);
    CHECK(asleep.reserved_bytes + ws.reserved_bytes + ks.reserved_bytes == before.reserved_bytes);
    CHECK(asleep.sleeps == before.sleeps + 2);
    CHECK_OK(strata_tag_stats("weights", 0, &ws));
    CHECK(ws.asleep == 1 && ws.reserved_bytes == 0 && ws.host_copy_bytes > 0);
    CHECK_OK(strata_tag_stats("weights", 1, &ws));
    CHECK(ws.asleep == 1);
    CHECK_OK(strata_tag_stats("kv", 0, &ks));
    CHECK(ks.asleep == 1 && ks.host_copy_bytes == 0);

    /* Asleep: no allocation under the tag, no copies from its memory, but frees work. */
    CHECK(strata_sleep("weights", 1) == STRATA_INVALID_STATE);
    CHECK_OK(strata_tag_push("weights"));
    CHECK(strata_malloc(64, 0, NULL) == NULL);
    CHECK_ERR("STRATA_INVALID_STATE");
    CHECK_OK(strata_tag_pop());
    unsigned char probe[16];
    CHECK(strata_memcpy_dtoh(probe, w[1], sizeof probe) != STRATA_OK);
    CHECK_OK(strata_free_checked(w[N - 1], wsize[N - 1], (N - 1) % 2, NULL));
    CHECK_OK(strata_free_checked(kv[N - 1], kvsize[N - 1], 0, NULL));
    /* The untagged block is untouched. */
    CHECK(has_pattern(other, 5000, 3000));

    CHECK_OK(strata_wake("weights"));
    CHECK_OK(strata_wake("kv"));
    CHECK(strata_wake("kv") == STRATA_INVALID_STATE);
    CHECK(stats_of(0).wakes == before.wakes + 2);
    for (int i = 0; i < N - 1; i++) {
        CHECK(has_pattern(w[i], wsize[i] < 65536 ? wsize[i] : 65536, 1000 + i));
        CHECK(is_zero(kv[i], kvsize[i] < 65536 ? kvsize[i] : 65536));
    }
    CHECK_OK(strata_tag_stats("weights", 0, &ws));
    CHECK(ws.asleep == 0 && ws.host_copy_bytes == 0 && ws.reserved_bytes > 0);

    /* Allocating under the tag works again; a second cycle keeps the new contents. */
    CHECK_OK(strata_tag_push("weights"));
    void *fresh = strata_malloc(7777, 0, NULL);
    CHECK(fresh != NULL);
    CHECK_OK(strata_tag_pop());
    put_pattern(fresh, 7777, 4000);
    CHECK_OK(strata_sleep("weights", 1));
    CHECK_OK(strata_wake("weights"));
    CHECK(has_pattern(fresh, 7777, 4000));
    CHECK(has_pattern(w[0], 65536, 1000));

    strata_free(fresh, 7777, 0, NULL);
    for (int i = 0; i < N - 1; i++) {
        CHECK_OK(strata_free_checked(w[i], wsize[i], i % 2, NULL));
        CHECK_OK(strata_free_checked(kv[i], kvsize[i], 0, NULL));
    }
    strata_free(other, 5000, 0, NULL);
    CHECK(stats_of(0).live_allocations == 0 && stats_of(1).live_allocations == 0);
    printf("sleep_wake: ok\n");
    return 0;
}

/* Offload and onload: a tag's allocations (small and large) move to host memory and back at
 * the same addresses with their contents, stay readable and writable while offloaded, and
 * the device memory they held is free meanwhile; overflow serves a full device from host
 * memory (or a peer's) for the tags that allow it, and a peer's revocation moves them back;
 * disk offload is a sleep to TMPDIR; bad tiers
 * and unknown tags are errors that change nothing. */
#include "common.h"

#define N 8

int main(void) {
    void *p[N];
    size_t size[N];
    CHECK_OK(strata_tag_push("model"));
    for (int i = 0; i < N; i++) {
        size[i] = i % 2 == 0 ? (size_t)(3 << 20) + 512 * i : (size_t)(700 + 4000 * i);
        p[i] = strata_malloc(size[i], 0, NULL);
        CHECK(p[i] != NULL);
        put_pattern(p[i], size[i] < 65536 ? size[i] : 65536, 100 + i);
    }
    CHECK_OK(strata_tag_pop());
    void *other = strata_malloc(5000, 0, NULL);
    CHECK(other != NULL);
    put_pattern(other, 5000, 7);

    strata_spill_stats_t s0, s1, dev;
    CHECK_OK(strata_spill_stats("model", 0, &s0));
    CHECK(s0.local_bytes > 0 && s0.host_bytes == 0 && s0.migrations_to_host == 0);
    CHECK_OK(strata_offload("model", STRATA_TIER_HOST, NULL));
    CHECK_OK(strata_spill_stats("model", 0, &s1));
    CHECK(s1.local_bytes == 0 && s1.host_bytes > 0);
    CHECK(s1.migrations_to_host > 0 && s1.bytes_to_host == s1.host_bytes);
    CHECK_OK(strata_spill_stats(NULL, 0, &dev));
    CHECK(dev.host_bytes == s1.host_bytes && dev.local_bytes > 0); /* the untagged block */
    CHECK(strata_spill_stats("model", 0, NULL) == STRATA_INVALID_ARGUMENT);
    for (int i = 0; i < N; i++)
        CHECK(has_pattern(p[i], size[i] < 65536 ? size[i] : 65536, 100 + i));
    /* Usable while offloaded. */
    put_pattern(p[1], size[1], 555);
    CHECK(has_pattern(p[1], size[1], 555));
    CHECK(has_pattern(other, 5000, 7));

    CHECK_OK(strata_onload("model", NULL));
    CHECK_OK(strata_spill_stats("model", 0, &s1));
    CHECK(s1.host_bytes == 0 && s1.local_bytes > 0 && s1.migrations_to_device > 0);
    for (int i = 0; i < N; i++) {
        if (i == 1)
            CHECK(has_pattern(p[i], size[i], 555));
        else
            CHECK(has_pattern(p[i], size[i] < 65536 ? size[i] : 65536, 100 + i));
    }

    /* Disk: not accessible until onload, then intact. */
    CHECK_OK(strata_offload("model", STRATA_TIER_DISK, NULL));
    unsigned char probe[16];
    CHECK(strata_memcpy_dtoh(probe, p[0], sizeof probe) != STRATA_OK);
    CHECK(strata_offload("model", STRATA_TIER_HOST, NULL) == STRATA_INVALID_STATE);
    CHECK_OK(strata_onload("model", NULL));
    CHECK(has_pattern(p[0], 65536, 100));
    CHECK(has_pattern(p[1], size[1], 555));

    /* Bad input. */
    CHECK(strata_offload("model", 9, NULL) == STRATA_INVALID_ARGUMENT);
    CHECK_ERR("tier");
    CHECK(strata_offload(NULL, STRATA_TIER_HOST, NULL) == STRATA_INVALID_ARGUMENT);
    CHECK(strata_onload(NULL, NULL) == STRATA_INVALID_ARGUMENT);

    /* Overflow: once the device is full, the overflowing tag is served from host memory and
     * other tags still get NULL; onload moves its pages to the device once there is room. */
    static void *hog[1024];
    int nh = fill_device(0, hog, 1024);
    CHECK(nh >= 4);
    CHECK(strata_set_overflow("model", 5) == STRATA_INVALID_ARGUMENT);
    CHECK_OK(strata_set_overflow("model", STRATA_TIER_HOST));
    CHECK_OK(strata_tag_push("model"));
    void *spill = strata_malloc(16 << 20, 0, NULL);
    CHECK_OK(strata_tag_pop());
    CHECK(spill != NULL);
    put_pattern(spill, 65536, 77);
    strata_spill_stats_t ov;
    CHECK_OK(strata_spill_stats("model", 0, &ov));
    CHECK(ov.host_bytes >= (16 << 20));
    CHECK_OK(strata_tag_push("other"));
    CHECK(strata_malloc(16 << 20, 0, NULL) == NULL);
    CHECK_OK(strata_tag_pop());
    free_all(0, hog, nh);
    CHECK_OK(strata_onload("model", NULL));
    CHECK_OK(strata_spill_stats("model", 0, &ov));
    CHECK(ov.host_bytes == 0);
    CHECK(has_pattern(spill, 65536, 77));
    CHECK_OK(strata_set_overflow("model", 0));
    CHECK_OK(strata_free_checked(spill, 16 << 20, 0, NULL));

    /* Overflow onto device 1's pages, then device 1 takes them back: the allocation moves
     * to device 0 (room made first) at the same address, each move noticed once. */
    nh = fill_device(0, hog, 1024);
    CHECK_OK(strata_set_overflow_peer("model", 1));
    CHECK_OK(strata_tag_push("model"));
    void *lent = strata_malloc(8 << 20, 0, NULL);
    CHECK_OK(strata_tag_pop());
    CHECK(lent != NULL);
    put_pattern(lent, 65536, 88);
    CHECK_OK(strata_spill_stats("model", 0, &ov));
    CHECK(ov.peer_bytes >= (8 << 20));
    free_all(0, hog, nh);
    CHECK_OK(strata_revoke_peer(1, NULL));
    CHECK(has_pattern(lent, 65536, 88));
    CHECK_OK(strata_spill_stats("model", 0, &ov));
    CHECK(ov.peer_bytes == 0 && ov.host_bytes == 0);
    strata_revoked_t rv[16];
    size_t nrv = 0;
    CHECK_OK(strata_take_revoked(rv, 16, &nrv));
    CHECK(nrv >= 1);
    uint64_t moved = 0;
    for (size_t i = 0; i < nrv; i++) {
        CHECK(rv[i].device == 0 && rv[i].lender == 1 && rv[i].to_device == 1);
        moved += rv[i].bytes;
    }
    CHECK(moved >= (8 << 20));
    CHECK_OK(strata_take_revoked(rv, 16, &nrv));
    CHECK(nrv == 0);
    CHECK(strata_take_revoked(rv, 16, NULL) == STRATA_INVALID_ARGUMENT);
    CHECK_OK(strata_free_checked(lent, 8 << 20, 0, NULL));

    for (int i = 0; i < N; i++)
        CHECK_OK(strata_free_checked(p[i], size[i], 0, NULL));
    CHECK_OK(strata_free_checked(other, 5000, 0, NULL));
    printf("offload: ok\n");
    return 0;
}

/* KV spaces through the C API: every call with good and bad input (NULL, stale handles, wrong
 * device, a request of another space, append past max_tokens), contents compared bit for bit
 * across spills to host and disk (staged up to host ahead of need) and back, lost blocks reported exactly once (callback or
 * take_lost), Backed revocations losing nothing, stats. Strict host backend: bytes move only
 * through strata_kv_write / strata_kv_read. */
#define _DEFAULT_SOURCE
#include <stdlib.h>
#include <unistd.h>

#include "common.h"

#define LAYERS 2
#define HEADS 8
#define HEAD_DIM 128
#define ELEM 2
#define BPT (HEADS * HEAD_DIM * ELEM) /* 2048 bytes per token: 1024 tokens per 2 MiB block */

static char disk_dir[64];

static strata_kv_config_t config(int durability) {
    strata_kv_config_t c;
    memset(&c, 0, sizeof c);
    c.device = 0;
    c.durability = durability;
    c.layers = LAYERS;
    c.kv_heads = HEADS;
    c.head_dim = HEAD_DIM;
    c.elem_size = ELEM;
    c.max_requests = 8;
    c.max_tokens = 4096;
    c.zero_page = 1;
    c.host_bytes = 64u << 20;
    c.disk_bytes = 64u << 20;
    c.disk_dir = disk_dir;
    return c;
}

/* Writes pattern `seed + layer*2 + kind` over tokens [0, tokens) of every tensor. */
static void write_all(strata_kv_t kv, strata_kv_request_t r, uint32_t tokens, uint64_t seed) {
    size_t len = (size_t)tokens * BPT;
    unsigned char *buf = malloc(len);
    CHECK(buf != NULL);
    for (uint32_t l = 0; l < LAYERS; l++) {
        for (int k = 0; k < 2; k++) {
            fill_pattern(buf, len, seed + l * 2 + (uint64_t)k);
            CHECK_OK(strata_kv_write(kv, r, l, k, 0, buf, len));
        }
    }
    free(buf);
}

/* True when every tensor holds the patterns of write_all; *tier receives the slowest read. */
static int holds_all(strata_kv_t kv, strata_kv_request_t r, uint32_t tokens, uint64_t seed,
                     int *slowest) {
    size_t len = (size_t)tokens * BPT;
    unsigned char *want = malloc(len), *got = malloc(len);
    CHECK(want != NULL && got != NULL);
    int same = 1;
    *slowest = 0;
    for (uint32_t l = 0; l < LAYERS; l++) {
        for (int k = 0; k < 2; k++) {
            int tier = -1;
            fill_pattern(want, len, seed + l * 2 + (uint64_t)k);
            CHECK_OK(strata_kv_read(kv, r, l, k, 0, got, len, &tier));
            CHECK(tier >= 0 && tier <= 2);
            if (tier > *slowest) *slowest = tier;
            same &= memcmp(want, got, len) == 0;
        }
    }
    free(want);
    free(got);
    return same;
}

static strata_kv_request_info_t info_of(strata_kv_t kv, strata_kv_request_t r) {
    strata_kv_request_info_t i;
    memset(&i, 0xAB, sizeof i);
    CHECK_OK(strata_kv_request_info(kv, r, &i));
    return i;
}

static void bad_configs(void) {
    strata_kv_t kv = 0;
    strata_kv_config_t c = config(STRATA_KV_LOSSY);
    CHECK(strata_kv_create(NULL, &kv) == STRATA_INVALID_ARGUMENT);
    CHECK_ERR("config is NULL");
    CHECK(strata_kv_create(&c, NULL) == STRATA_INVALID_ARGUMENT);
    CHECK_ERR("out is NULL");
    strata_kv_config_t b = c;
    b.layers = 0;
    CHECK(strata_kv_create(&b, &kv) == STRATA_INVALID_ARGUMENT);
    CHECK_ERR("layers is 0");
    b = c;
    b.elem_size = 3;
    CHECK(strata_kv_create(&b, &kv) == STRATA_INVALID_ARGUMENT);
    CHECK_ERR("elem_size 3");
    b = c;
    b.durability = 5;
    CHECK(strata_kv_create(&b, &kv) == STRATA_INVALID_ARGUMENT);
    CHECK_ERR("durability 5");
    b = c;
    b.disk_dir = NULL;
    CHECK(strata_kv_create(&b, &kv) == STRATA_INVALID_ARGUMENT);
    CHECK_ERR("needs disk_dir");
    b = c;
    b.device = 7;
    CHECK(strata_kv_create(&b, &kv) == STRATA_NO_DEVICE);
    b.device = -1;
    CHECK(strata_kv_create(&b, &kv) == STRATA_NO_DEVICE);
    b = c;
    b.kv_heads = 3; /* 3 x 128 x 2 = 768 bytes per token: does not divide the page */
    CHECK(strata_kv_create(&b, &kv) == STRATA_INVALID_ARGUMENT);
    CHECK_ERR("must divide");
    b = c;
    b.disk_dir = "/nonexistent/strata-kv-dir";
    CHECK(strata_kv_create(&b, &kv) != STRATA_OK);
    CHECK(kv == 0);
}

static int lost_calls;
static strata_kv_t lost_kv;
static strata_kv_request_t lost_req[64];
static uint32_t lost_block[64];

static void on_lost(strata_kv_t kv, strata_kv_request_t r, uint32_t block, void *user) {
    CHECK(user == &lost_calls);
    CHECK(kv == lost_kv);
    /* No strata lock is held: calling back in works. */
    strata_kv_request_info_t i;
    CHECK_OK(strata_kv_request_info(kv, r, &i));
    CHECK(block < i.blocks && i.lost >= 1);
    CHECK(lost_calls < 64);
    lost_req[lost_calls] = r;
    lost_block[lost_calls] = block;
    lost_calls++;
}

int main(void) {
    strcpy(disk_dir, "/tmp/strata-kv-c-XXXXXX");
    CHECK(mkdtemp(disk_dir) != NULL);
    bad_configs();

    strata_kv_config_t c = config(STRATA_KV_LOSSY);
    strata_kv_t kv = 0, other = 0;
    CHECK_OK(strata_kv_create(&c, &kv));
    CHECK(kv != 0);
    c.disk_bytes = 0;
    c.disk_dir = NULL;
    CHECK_OK(strata_kv_create(&c, &other));
    CHECK(other != kv);

    /* Tensor descriptors. */
    strata_kv_tensor_t t, t2;
    CHECK_OK(strata_kv_tensor(kv, 1, STRATA_KV_V, &t));
    CHECK(t.data != 0 && t.ndim == 4 && t.elem_size == ELEM && t.device == 0);
    CHECK(t.shape[0] == 8 && t.shape[1] == 4096 && t.shape[2] == HEADS && t.shape[3] == HEAD_DIM);
    CHECK(t.strides[3] == ELEM && t.strides[2] == HEAD_DIM * ELEM && t.strides[1] == BPT);
    CHECK(t.strides[0] >= 4096 * BPT);
    /* DLPack: kDLCUDA (2) on CUDA; none (0) on the strict host backend (not CPU-accessible). */
    const char *backend = getenv("STRATA_BACKEND");
    CHECK(t.dlpack_device_type == (backend && strcmp(backend, "cuda") == 0 ? 2 : 0));
    CHECK_OK(strata_kv_tensor(kv, 0, STRATA_KV_K, &t2));
    CHECK(t2.data != t.data);
    CHECK(strata_kv_tensor(kv, 2, STRATA_KV_K, &t) == STRATA_INVALID_ARGUMENT);
    CHECK_ERR("layer 2 out of range");
    CHECK(strata_kv_tensor(kv, 0, 2, &t) == STRATA_INVALID_ARGUMENT);
    CHECK(strata_kv_tensor(kv, 0, STRATA_KV_K, NULL) == STRATA_INVALID_ARGUMENT);

    /* Admit, append, write, read. */
    strata_kv_request_t r1 = 0, r2 = 0, q = 0;
    CHECK(strata_kv_admit(kv, NULL) == STRATA_INVALID_ARGUMENT);
    CHECK_OK(strata_kv_admit(kv, &r1));
    CHECK_OK(strata_kv_admit(kv, &r2));
    CHECK_OK(strata_kv_admit(other, &q));
    CHECK(r1 != 0 && r1 != r2 && q != r1 && q != r2);
    CHECK(strata_kv_append(kv, r1, 0) == STRATA_INVALID_ARGUMENT);
    CHECK_OK(strata_kv_append(kv, r1, 1500));
    CHECK_OK(strata_kv_append(kv, r2, 1024));
    strata_kv_request_info_t i = info_of(kv, r1);
    CHECK(i.tokens == 1500 && i.blocks == 2 && i.resident == 2 && i.host == 0 && i.lost == 0);
    CHECK(i.slot < 8 && info_of(kv, r2).slot != i.slot);
    write_all(kv, r1, 1500, 100);
    write_all(kv, r2, 1024, 200);
    int tier;
    CHECK(holds_all(kv, r1, 1500, 100, &tier) && tier == 0);
    /* Partial tokens and bad lengths. */
    unsigned char tok[BPT];
    CHECK(strata_kv_write(kv, r1, 0, STRATA_KV_K, 1499, tok, 2 * BPT) != STRATA_OK);
    CHECK(strata_kv_write(kv, r1, 0, STRATA_KV_K, 0, NULL, BPT) == STRATA_INVALID_ARGUMENT);
    CHECK(strata_kv_read(kv, r1, 0, STRATA_KV_K, 0, NULL, BPT, NULL) == STRATA_INVALID_ARGUMENT);
    CHECK(holds_all(kv, r1, 1500, 100, &tier));

    /* Append past max_tokens: a clear error, nothing lost. */
    CHECK(strata_kv_append(kv, r1, 4096) == STRATA_INVALID_ARGUMENT);
    CHECK_ERR("max_tokens");
    CHECK(info_of(kv, r1).tokens == 1500);
    CHECK(holds_all(kv, r1, 1500, 100, &tier));

    /* Truncate: above the length or another space's request refused, nothing lost; below,
     * the second block's pages (one per tensor) go back to the pool. */
    CHECK(strata_kv_truncate(kv, r1, 1501) == STRATA_INVALID_ARGUMENT);
    CHECK_ERR("above its 1500");
    CHECK(strata_kv_truncate(kv, q, 0) == STRATA_INVALID_ARGUMENT);
    CHECK(info_of(kv, r1).tokens == 1500);
    CHECK(holds_all(kv, r1, 1500, 100, &tier));
    strata_kv_stats_t before, after;
    CHECK_OK(strata_kv_stats(kv, &before));
    CHECK_OK(strata_kv_truncate(kv, r1, 1000));
    CHECK_OK(strata_kv_stats(kv, &after));
    CHECK(before.pool_in_use_pages - after.pool_in_use_pages == 2 * LAYERS);
    i = info_of(kv, r1);
    CHECK(i.tokens == 1000 && i.blocks == 1 && i.resident == 1);
    CHECK(holds_all(kv, r1, 1000, 100, &tier));
    CHECK_OK(strata_kv_append(kv, r1, 500));
    write_all(kv, r1, 1500, 100);
    CHECK(holds_all(kv, r1, 1500, 100, &tier));

    /* A request of another space. */
    CHECK(strata_kv_append(kv, q, 1) == STRATA_INVALID_ARGUMENT);
    CHECK_ERR("does not belong to this KV space");
    CHECK(strata_kv_release(other, r1) == STRATA_INVALID_ARGUMENT);
    CHECK(strata_kv_spill(kv, q, STRATA_TIER_HOST) == STRATA_INVALID_ARGUMENT);
    CHECK(strata_kv_make_resident(kv, &q, 1, NULL) == STRATA_INVALID_ARGUMENT);

    /* Spill to host, read from there, restore on a stream, same bytes. */
    cudaStream_t s = NULL;
    CHECK_OK(strata_stream_create(0, &s));
    CHECK(strata_kv_spill(kv, r1, 0) == STRATA_INVALID_ARGUMENT);
    CHECK(strata_kv_spill(kv, r1, 3) == STRATA_INVALID_ARGUMENT);
    CHECK_OK(strata_kv_spill(kv, r1, STRATA_TIER_HOST));
    i = info_of(kv, r1);
    CHECK(i.host == 2 && i.resident == 0);
    CHECK(holds_all(kv, r1, 1500, 100, &tier) && tier == 1);
    CHECK(strata_kv_append(kv, r1, 1) == STRATA_INVALID_STATE);
    CHECK_ERR("not resident");
    CHECK(strata_kv_write(kv, r1, 0, STRATA_KV_K, 0, tok, BPT) == STRATA_INVALID_STATE);
    CHECK(strata_kv_make_resident(kv, NULL, 1, s) == STRATA_INVALID_ARGUMENT);
    CHECK_OK(strata_kv_make_resident(kv, &r1, 1, s));
    CHECK_OK(strata_stream_synchronize(s));
    i = info_of(kv, r1);
    CHECK(i.resident == 2 && i.host == 0);
    CHECK(holds_all(kv, r1, 1500, 100, &tier) && tier == 0);

    /* Residency array. */
    uint8_t res[8];
    size_t n = 99;
    CHECK(strata_kv_residency(kv, r1, res, 1, &n) == STRATA_INVALID_ARGUMENT && n == 2);
    CHECK(strata_kv_residency(kv, r1, res, 8, NULL) == STRATA_INVALID_ARGUMENT);

    /* Spill to disk (the host copies of full blocks move too), back again. */
    CHECK_OK(strata_kv_spill(kv, r1, STRATA_TIER_DISK));
    CHECK_OK(strata_kv_residency(kv, r1, res, 8, &n));
    CHECK(n == 2 && res[0] == STRATA_KV_ON_DISK && res[1] == STRATA_KV_ON_DISK);
    CHECK(holds_all(kv, r1, 1500, 100, &tier) && tier == 2);
    /* No disk tier: refused, whether there is anything to spill or not. */
    CHECK(strata_kv_spill(other, q, STRATA_TIER_DISK) == STRATA_INVALID_STATE);
    /* Up to host memory ahead of need (the first hop), then one hop back. */
    uint64_t staged = 0;
    CHECK(strata_kv_stage(kv, NULL, 1, &staged) == STRATA_INVALID_ARGUMENT);
    CHECK_OK(strata_kv_stage(kv, &r1, 1, &staged));
    CHECK(staged > 0);
    CHECK_OK(strata_kv_residency(kv, r1, res, 8, &n));
    CHECK(n == 2 && res[0] == STRATA_KV_IN_HOST && res[1] == STRATA_KV_IN_HOST);
    CHECK_OK(strata_kv_stage(kv, &r1, 1, NULL)); /* nothing left on disk */
    CHECK(holds_all(kv, r1, 1500, 100, &tier) && tier == 1);
    CHECK_OK(strata_kv_make_resident(kv, &r1, 1, s));
    CHECK_OK(strata_stream_synchronize(s));
    CHECK(holds_all(kv, r1, 1500, 100, &tier) && tier == 0);
    CHECK_OK(strata_kv_append(kv, r1, 600)); /* 2100 tokens: a third block */
    CHECK(info_of(kv, r1).blocks == 3);
    CHECK(holds_all(kv, r1, 1500, 100, &tier));
    CHECK_OK(strata_kv_check(kv));

    /* Scheduler hints: queue, advance, lookahead prefetch ordered on the stream. */
    CHECK_OK(strata_kv_spill(kv, r2, STRATA_TIER_HOST));
    CHECK_OK(strata_kv_advance(kv, 5));
    strata_kv_request_t wait[2] = {r1, r2};
    CHECK_OK(strata_kv_queue(kv, wait, 2));
    CHECK(strata_kv_queue(kv, NULL, 2) == STRATA_INVALID_ARGUMENT);
    uint32_t counts[2] = {1, 1};
    strata_kv_request_t plan[2] = {r2, r1};
    CHECK(strata_kv_hint(kv, plan, NULL, 2, s) == STRATA_INVALID_ARGUMENT);
    CHECK_OK(strata_kv_hint(kv, plan, counts, 2, s));
    CHECK_OK(strata_stream_synchronize(s));
    strata_kv_stats_t st;
    memset(&st, 0xAB, sizeof st);
    CHECK_OK(strata_kv_stats(kv, &st));
    CHECK(st.prefetch_hits >= 1 && info_of(kv, r2).resident == 1);
    CHECK(holds_all(kv, r2, 1024, 200, &tier) && tier == 0);
    uint64_t idle = 99;
    CHECK_OK(strata_kv_advance(kv, 10));
    CHECK_OK(strata_kv_spill_idle(kv, 2, STRATA_TIER_HOST, &idle));
    CHECK(idle == 4); /* r1's three blocks, r2's one */
    CHECK_OK(strata_kv_make_resident(kv, wait, 2, NULL));
    CHECK(holds_all(kv, r1, 1500, 100, &tier) && holds_all(kv, r2, 1024, 200, &tier));

    CHECK_OK(strata_kv_stats(kv, &st));
    CHECK(st.page_size == 2u << 20 && st.tokens_per_block == 1024);
    CHECK(st.block_bytes == 2 * LAYERS * st.page_size);
    CHECK(st.requests_admitted == 2 && st.blocks == 4 && st.blocks_resident == 4);
    CHECK(st.spills >= 3 && st.restores >= 5 && st.prefetch_misses >= 1 && st.stalls >= 1);
    CHECK(st.bytes_from_device > 0 && st.bytes_to_device > 0 && st.disk_write_bytes > 0);
    CHECK(st.host_capacity_bytes == 64u << 20 && st.disk_capacity_bytes == 64u << 20);
    /* The one stage above moved `staged` objects; the restore used them all. */
    CHECK(st.staged_objects == staged && st.staged_evicted == 0);
    for (size_t k = 0; k < sizeof st.spare / sizeof st.spare[0]; k++) CHECK(st.spare[k] == 0);
    CHECK(st.pages_ahead == 0 && st.pages_from_ahead == 0); /* no STRATA_KV_MAP_AHEAD here */
    CHECK(strata_kv_stats(kv, NULL) == STRATA_INVALID_ARGUMENT);

    /* Lossy revocation: every block without a clean copy lost, each reported exactly once
     * through the callback; take_lost then has nothing. Asking for more pages than the device
     * has fails, with the losses on the way standing. */
    CHECK_OK(strata_kv_on_lost(kv, on_lost, &lost_calls));
    lost_kv = kv;
    uint64_t lost = 99;
    CHECK(strata_kv_revoke(kv, 1u << 20, &lost) == STRATA_OUT_OF_MEMORY);
    CHECK(lost_calls >= 1);
    for (int a = 0; a < lost_calls; a++) {
        CHECK(lost_req[a] == r1 || lost_req[a] == r2);
        for (int b = a + 1; b < lost_calls; b++)
            CHECK(lost_req[a] != lost_req[b] || lost_block[a] != lost_block[b]);
    }
    strata_kv_request_info_t i1 = info_of(kv, r1), i2 = info_of(kv, r2);
    CHECK((int)(i1.lost + i2.lost) == lost_calls);
    CHECK_OK(strata_kv_stats(kv, &st));
    CHECK(st.lost_blocks == (uint64_t)lost_calls);
    uint32_t blocks[8];
    CHECK_OK(strata_kv_take_lost(kv, r1, blocks, 8, &n));
    CHECK(n == 0);
    CHECK(strata_kv_take_lost(kv, r1, blocks, 1, &n) == STRATA_INVALID_ARGUMENT && n == 3);
    /* Lost blocks come back as fresh pages; the others keep their bytes. */
    CHECK_OK(strata_kv_make_resident(kv, wait, 2, s));
    CHECK_OK(strata_stream_synchronize(s));
    CHECK(info_of(kv, r1).resident == 3 && info_of(kv, r2).resident == 1);
    CHECK_OK(strata_kv_on_lost(kv, NULL, NULL));
    CHECK_OK(strata_kv_check(kv));

    /* Without a callback, take_lost reports (once). */
    write_all(kv, r1, 2100, 300);
    CHECK(strata_kv_revoke(kv, 1u << 20, &lost) == STRATA_OUT_OF_MEMORY);
    CHECK(info_of(kv, r1).lost >= 1);
    CHECK(strata_kv_make_resident(kv, &r1, 1, NULL) == STRATA_INVALID_STATE);
    CHECK_ERR("take_lost");
    CHECK_OK(strata_kv_take_lost(kv, r1, blocks, 8, &n));
    CHECK(n >= 1 && n == info_of(kv, r1).lost);
    for (size_t k = 1; k < n; k++) CHECK(blocks[k - 1] < blocks[k]);
    CHECK_OK(strata_kv_take_lost(kv, r1, blocks, 8, &n));
    CHECK(n == 0);
    CHECK_OK(strata_kv_take_lost(kv, r2, blocks, 8, &n));
    CHECK_OK(strata_kv_make_resident(kv, wait, 2, NULL));
    CHECK_OK(strata_kv_check(kv));

    /* Release: the handle is stale afterwards, never another request. */
    CHECK_OK(strata_kv_release(kv, r2));
    CHECK(strata_kv_release(kv, r2) == STRATA_INVALID_HANDLE);
    CHECK(strata_kv_append(kv, r2, 1) == STRATA_INVALID_HANDLE);
    CHECK(strata_kv_truncate(kv, r2, 0) == STRATA_INVALID_HANDLE);
    CHECK(strata_kv_request_info(kv, r2, &i) == STRATA_INVALID_HANDLE);
    strata_kv_request_t r3;
    CHECK_OK(strata_kv_admit(kv, &r3));
    CHECK(r3 != r2);

    /* A Backed space: revocation spills instead, nothing is lost, bytes intact. */
    strata_kv_config_t bc = config(STRATA_KV_BACKED);
    strata_kv_t backed;
    CHECK_OK(strata_kv_create(&bc, &backed));
    strata_kv_request_t b1;
    CHECK_OK(strata_kv_admit(backed, &b1));
    CHECK_OK(strata_kv_append(backed, b1, 2048));
    write_all(backed, b1, 2048, 400);
    CHECK_OK(strata_kv_advance(backed, 1));
    lost = 99;
    CHECK(strata_kv_revoke(backed, 1u << 20, &lost) == STRATA_OUT_OF_MEMORY);
    CHECK(info_of(backed, b1).lost == 0 && info_of(backed, b1).host == 2);
    CHECK(holds_all(backed, b1, 2048, 400, &tier) && tier == 1);
    CHECK_OK(strata_kv_revoke(backed, 4, &lost));
    CHECK(lost == 0);
    CHECK_OK(strata_kv_make_resident(backed, &b1, 1, NULL));
    CHECK(holds_all(backed, b1, 2048, 400, &tier) && tier == 0);
    CHECK_OK(strata_kv_destroy(backed));

    /* Stale and bogus space handles. */
    CHECK_OK(strata_kv_destroy(other));
    CHECK(strata_kv_destroy(other) == STRATA_INVALID_HANDLE);
    CHECK(strata_kv_admit(other, &q) == STRATA_INVALID_HANDLE);
    CHECK(strata_kv_append(other, q, 1) == STRATA_INVALID_HANDLE);
    CHECK(strata_kv_stats(other, &st) == STRATA_INVALID_HANDLE);
    CHECK(strata_kv_admit(0, &q) == STRATA_INVALID_HANDLE);
    CHECK(strata_kv_admit(kv ^ (1ull << 40), &q) == STRATA_INVALID_HANDLE);
    strata_kv_t again;
    CHECK_OK(strata_kv_create(&c, &again)); /* may reuse `other`'s slot, never its handle */
    CHECK(again != other);
    CHECK(strata_kv_admit(other, &q) == STRATA_INVALID_HANDLE);
    CHECK_OK(strata_kv_destroy(again));

    CHECK_OK(strata_kv_destroy(kv));
    CHECK(strata_kv_append(kv, r1, 1) == STRATA_INVALID_HANDLE);
    CHECK_OK(strata_stream_destroy(s));
    rmdir(disk_dir);
    printf("kv: ok\n");
    return 0;
}

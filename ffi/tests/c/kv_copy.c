/* strata_kv_copy_tokens: an engine's KV blocks (host memory, or device memory from
 * strata_malloc) copied into a KV space's requests and back in one call per direction on a
 * stream, bit for bit; ordered after make_resident's copies; a copy in drops the clean copy
 * of the blocks it writes (the next spill copies again); every bad input a typed error that
 * queues nothing. Strict host backend: the space's bytes are checked with strata_kv_read. */
#define _DEFAULT_SOURCE
#include <stdlib.h>
#include <unistd.h>

#include "common.h"

#define LAYERS 2
#define BPT 4096        /* one token: 1 head x 4096 bytes */
#define RUN 64          /* tokens per copy (one 256 KiB engine block): 2 MiB per tensor */
#define BLOCKS 8        /* engine blocks per tensor copied in each direction */

static strata_kv_config_t config(void) {
    strata_kv_config_t c;
    memset(&c, 0, sizeof c);
    c.device = 0;
    c.durability = STRATA_KV_BACKED;
    c.layers = LAYERS;
    c.kv_heads = 1;
    c.head_dim = BPT;
    c.elem_size = 1;
    c.max_requests = 4;
    c.max_tokens = RUN * BLOCKS;
    c.zero_page = 1;
    c.host_bytes = 16u << 20;
    return c;
}

/* Engine block b of tensor t: the pattern of seed + t * BLOCKS + b. */
static uint64_t seed_of(uint64_t seed, int t, int b) { return seed + (uint64_t)t * BLOCKS + b; }

/* One copy per (tensor, engine block): block b of tensor t <-> tokens b*RUN.. of request r. */
static size_t plan(strata_kv_token_copy_t *out, strata_kv_request_t r, unsigned char *base) {
    size_t n = 0;
    for (int t = 0; t < 2 * LAYERS; t++) {
        for (int b = 0; b < BLOCKS; b++) {
            memset(&out[n], 0, sizeof out[n]);
            out[n].request = r;
            out[n].layer = (uint32_t)(t / 2);
            out[n].kind = t % 2;
            out[n].first_token = (uint32_t)b * RUN;
            out[n].address = (uint64_t)(uintptr_t)(base + ((size_t)t * BLOCKS + b) * RUN * BPT);
            n++;
        }
    }
    return n;
}

/* The request holds the patterns of `seed` (read back wherever its blocks are). */
static int request_holds(strata_kv_t kv, strata_kv_request_t r, uint64_t seed) {
    size_t len = (size_t)RUN * BPT;
    unsigned char *want = malloc(len), *got = malloc(len);
    CHECK(want != NULL && got != NULL);
    int same = 1;
    for (int t = 0; t < 2 * LAYERS; t++) {
        for (int b = 0; b < BLOCKS; b++) {
            fill_pattern(want, len, seed_of(seed, t, b));
            CHECK_OK(strata_kv_read(kv, r, (uint32_t)(t / 2), t % 2, (uint32_t)b * RUN, got, len,
                                    NULL));
            same &= memcmp(want, got, len) == 0;
        }
    }
    free(want);
    free(got);
    return same;
}

static void fill_host(unsigned char *base, uint64_t seed) {
    for (int t = 0; t < 2 * LAYERS; t++)
        for (int b = 0; b < BLOCKS; b++)
            fill_pattern(base + ((size_t)t * BLOCKS + b) * RUN * BPT, (size_t)RUN * BPT,
                         seed_of(seed, t, b));
}

static int host_holds(const unsigned char *base, uint64_t seed) {
    size_t len = (size_t)RUN * BPT;
    unsigned char *want = malloc(len);
    CHECK(want != NULL);
    int same = 1;
    for (int t = 0; t < 2 * LAYERS; t++)
        for (int b = 0; b < BLOCKS; b++) {
            fill_pattern(want, len, seed_of(seed, t, b));
            same &= memcmp(want, base + ((size_t)t * BLOCKS + b) * RUN * BPT, len) == 0;
        }
    free(want);
    return same;
}

int main(void) {
    strata_kv_config_t c = config();
    strata_kv_t kv = 0, other = 0;
    CHECK_OK(strata_kv_create(&c, &kv));
    CHECK_OK(strata_kv_create(&c, &other));
    cudaStream_t stream = NULL;
    CHECK_OK(strata_stream_create(0, &stream));
    const size_t engine_bytes = (size_t)2 * LAYERS * BLOCKS * RUN * BPT;
    const size_t n = 2 * LAYERS * BLOCKS;
    strata_kv_token_copy_t *copies = calloc(n, sizeof *copies);
    unsigned char *host = malloc(engine_bytes);
    CHECK(copies != NULL && host != NULL);

    strata_kv_request_t r = 0, foreign = 0;
    CHECK_OK(strata_kv_admit(kv, &r));
    CHECK_OK(strata_kv_append(kv, r, RUN * BLOCKS));
    CHECK_OK(strata_kv_admit(other, &foreign));
    CHECK_OK(strata_kv_append(other, foreign, RUN));

    /* In from host memory, one call for every tensor and block. */
    fill_host(host, 100);
    plan(copies, r, host);
    CHECK_OK(strata_kv_copy_tokens(kv, STRATA_KV_COPY_IN, RUN, copies, n, stream));
    CHECK_OK(strata_stream_synchronize(stream));
    CHECK(request_holds(kv, r, 100));

    /* Out into device memory (an engine's KV tensors on strata) and back out to the host. */
    unsigned char *dev = strata_malloc(engine_bytes, 0, NULL);
    CHECK(dev != NULL);
    plan(copies, r, dev);
    CHECK_OK(strata_kv_copy_tokens(kv, STRATA_KV_COPY_OUT, RUN, copies, n, stream));
    CHECK_OK(strata_stream_synchronize(stream));
    for (int t = 0; t < 2 * LAYERS; t++)
        for (int b = 0; b < BLOCKS; b++)
            CHECK(has_pattern(dev + ((size_t)t * BLOCKS + b) * RUN * BPT, (size_t)RUN * BPT,
                              seed_of(100, t, b)));

    /* Spilled, then made resident with another stream waiting: a copy out queued right after
     * on `stream` still reads the restored bytes (strata orders it after the request's copies;
     * the host link's latency keeps the restore in flight meanwhile). */
    CHECK_OK(strata_kv_spill(kv, r, STRATA_TIER_HOST));
    plan(copies, r, host);
    CHECK(strata_kv_copy_tokens(kv, STRATA_KV_COPY_OUT, RUN, copies, n, stream) ==
          STRATA_INVALID_STATE);
    CHECK_ERR("not resident");
    cudaStream_t elsewhere = NULL;
    CHECK_OK(strata_stream_create(0, &elsewhere));
    CHECK_OK(strata_kv_make_resident(kv, &r, 1, elsewhere));
    memset(host, 0, engine_bytes);
    CHECK_OK(strata_kv_copy_tokens(kv, STRATA_KV_COPY_OUT, RUN, copies, n, stream));
    CHECK_OK(strata_stream_synchronize(stream));
    CHECK(host_holds(host, 100));

    /* The restored blocks are full, so they hold clean copies: spilling again copies nothing,
     * unless a copy in rewrote them. */
    strata_kv_stats_t before = kv_stats(kv);
    CHECK(before.blocks_clean > 0);
    fill_host(host, 200);
    CHECK_OK(strata_kv_copy_tokens(kv, STRATA_KV_COPY_IN, RUN, copies, n, stream));
    CHECK(kv_stats(kv).blocks_clean == 0);
    /* The spill waits for the copy in (no synchronize here). */
    CHECK_OK(strata_kv_spill(kv, r, STRATA_TIER_HOST));
    strata_kv_stats_t after = kv_stats(kv);
    CHECK(after.spills > before.spills);
    CHECK(after.clean_spills == before.clean_spills);
    CHECK(request_holds(kv, r, 200));
    CHECK_OK(strata_kv_make_resident(kv, &r, 1, NULL));

    /* Bad input: a typed error, nothing queued. */
    memset(host, 0, engine_bytes);
    CHECK(strata_kv_copy_tokens(kv, 2, RUN, copies, n, stream) == STRATA_INVALID_ARGUMENT);
    CHECK_ERR("direction 2");
    CHECK(strata_kv_copy_tokens(kv, STRATA_KV_COPY_OUT, 0, copies, n, stream) ==
          STRATA_INVALID_ARGUMENT);
    CHECK(strata_kv_copy_tokens(kv, STRATA_KV_COPY_OUT, RUN, NULL, n, stream) ==
          STRATA_INVALID_ARGUMENT);
    CHECK_OK(strata_kv_copy_tokens(kv, STRATA_KV_COPY_OUT, RUN, NULL, 0, stream));
    strata_kv_token_copy_t bad = copies[0];
    bad.reserved = 1;
    CHECK(strata_kv_copy_tokens(kv, STRATA_KV_COPY_OUT, RUN, &bad, 1, stream) ==
          STRATA_INVALID_ARGUMENT);
    bad = copies[0];
    bad.kind = 5;
    CHECK(strata_kv_copy_tokens(kv, STRATA_KV_COPY_OUT, RUN, &bad, 1, stream) ==
          STRATA_INVALID_ARGUMENT);
    bad = copies[0];
    bad.layer = LAYERS;
    CHECK(strata_kv_copy_tokens(kv, STRATA_KV_COPY_OUT, RUN, &bad, 1, stream) != STRATA_OK);
    bad = copies[n - 1];
    bad.first_token += 1; /* past the request's tokens */
    CHECK(strata_kv_copy_tokens(kv, STRATA_KV_COPY_OUT, RUN, &bad, 1, stream) ==
          STRATA_INVALID_ARGUMENT);
    /* the last copy is bad: the ones before it are not queued either */
    strata_kv_token_copy_t mixed[2] = {copies[0], bad};
    CHECK(strata_kv_copy_tokens(kv, STRATA_KV_COPY_OUT, RUN, mixed, 2, stream) ==
          STRATA_INVALID_ARGUMENT);
    bad = copies[0];
    bad.request = foreign;
    CHECK(strata_kv_copy_tokens(kv, STRATA_KV_COPY_OUT, RUN, &bad, 1, stream) ==
          STRATA_INVALID_ARGUMENT);
    CHECK_ERR("does not belong to this KV space");
    /* two destinations on one engine block */
    strata_kv_token_copy_t twice[2] = {copies[0], copies[1]};
    twice[1].address = twice[0].address;
    CHECK(strata_kv_copy_tokens(kv, STRATA_KV_COPY_OUT, RUN, twice, 2, stream) ==
          STRATA_INVALID_ARGUMENT);
    CHECK(strata_kv_copy_tokens(0, STRATA_KV_COPY_OUT, RUN, copies, n, stream) != STRATA_OK);
    CHECK_OK(strata_stream_synchronize(stream));
    for (size_t i = 0; i < engine_bytes; i++) CHECK(host[i] == 0);

    /* Release right after a copy out: the release waits for it. */
    CHECK_OK(strata_kv_copy_tokens(kv, STRATA_KV_COPY_OUT, RUN, copies, n, stream));
    CHECK_OK(strata_kv_release(kv, r));
    CHECK(host_holds(host, 200));

    strata_free(dev, engine_bytes, 0, NULL);
    CHECK_OK(strata_stream_destroy(elsewhere));
    CHECK_OK(strata_stream_destroy(stream));
    CHECK_OK(strata_kv_destroy(other));
    CHECK_OK(strata_kv_destroy(kv));
    free(copies);
    free(host);
    printf("kv_copy: ok\n");
    return 0;
}

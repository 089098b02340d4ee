/* 8 threads each grow, write, spill (host or disk), restore on their own stream and verify
 * their own request of one Lossy KV space, while a revoker takes every page it can, losing
 * blocks. A lost block is reported exactly once (callback or take_lost) and the worker then
 * rewrites its KV; bytes that were not lost never change. */
#define _DEFAULT_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "common.h"

#define WORKERS 8
#define ITERS 12
#define BPT 2048 /* 8 heads x 128 x 2 bytes: 1024 tokens per 2 MiB page */
#define MAX_TOKENS 3072

static strata_kv_t kv;
static strata_kv_request_t reqs[WORKERS];
static atomic_uint lost_seen[WORKERS];
static atomic_uint reported_by_callback, reported_by_take;
static atomic_int done;

static int worker_of(strata_kv_request_t r) {
    for (int i = 0; i < WORKERS; i++)
        if (reqs[i] == r) return i;
    return -1;
}

static void on_lost(strata_kv_t k, strata_kv_request_t r, uint32_t block, void *user) {
    (void)block;
    CHECK(k == kv && user == NULL);
    int w = worker_of(r);
    CHECK(w >= 0);
    atomic_fetch_add(&lost_seen[w], 1);
    atomic_fetch_add(&reported_by_callback, 1);
}

static void take_lost(int w) {
    uint32_t blocks[8];
    size_t n = 0;
    CHECK_OK(strata_kv_take_lost(kv, reqs[w], blocks, 8, &n));
    atomic_fetch_add(&lost_seen[w], (unsigned)n);
    atomic_fetch_add(&reported_by_take, (unsigned)n);
}

static uint64_t seed_of(int w, unsigned version) { return (uint64_t)w * 1000003u + version; }

static void *worker(void *arg) {
    int w = (int)(intptr_t)arg;
    strata_kv_request_t r = reqs[w];
    cudaStream_t s;
    CHECK_OK(strata_stream_create(0, &s));
    unsigned char *want = malloc((size_t)MAX_TOKENS * BPT), *got = malloc((size_t)MAX_TOKENS * BPT);
    CHECK(want != NULL && got != NULL);
    uint32_t tokens = 0;
    unsigned written_at = ~0u, version = 0;
    int verified = 0;
    for (int it = 0; it < ITERS;) {
        int rc = strata_kv_make_resident(kv, &r, 1, s);
        if (rc == STRATA_INVALID_STATE) { /* lost, not reported yet */
            take_lost(w);
            continue;
        }
        if (rc == STRATA_OUT_OF_MEMORY) { /* the revoker holds the pool for a moment */
            usleep(1000);
            continue;
        }
        CHECK_OK(rc);
        CHECK_OK(strata_stream_synchronize(s));
        unsigned lost = atomic_load(&lost_seen[w]);
        if (lost != written_at) {
            /* (Re)compute: a new version of every token. */
            version++;
            size_t len = (size_t)tokens * BPT;
            fill_pattern(want, len, seed_of(w, version));
            rc = len ? strata_kv_write(kv, r, 0, STRATA_KV_K, 0, want, len) : STRATA_OK;
            if (rc == STRATA_INVALID_STATE) continue; /* spilled or lost meanwhile */
            CHECK_OK(rc);
            written_at = lost;
        } else if (tokens > 0) {
            size_t len = (size_t)tokens * BPT;
            int tier = -1;
            rc = strata_kv_read(kv, r, 0, STRATA_KV_K, 0, got, len, &tier);
            if (rc == STRATA_INVALID_STATE) continue; /* lost meanwhile */
            CHECK_OK(rc);
            fill_pattern(want, len, seed_of(w, version));
            if (memcmp(want, got, len) != 0) {
                /* Only a loss reported since the write may explain different bytes. */
                CHECK(atomic_load(&lost_seen[w]) != written_at);
                continue;
            }
            verified++;
        }
        /* Grow by a few tokens (the last block must be resident; a spill may intervene). */
        if (tokens + 256 <= MAX_TOKENS) {
            rc = strata_kv_append(kv, r, 256);
            if (rc == STRATA_OK) {
                tokens += 256;
                written_at = ~0u; /* the new tokens need bytes */
            } else {
                CHECK(rc == STRATA_INVALID_STATE || rc == STRATA_OUT_OF_MEMORY);
            }
        }
        rc = strata_kv_spill(kv, r, it % 3 == 2 ? STRATA_TIER_DISK : STRATA_TIER_HOST);
        CHECK(rc == STRATA_OK || rc == STRATA_OUT_OF_MEMORY);
        it++;
    }
    CHECK(verified > 0 || atomic_load(&lost_seen[w]) > 0);
    free(want);
    free(got);
    CHECK_OK(strata_stream_destroy(s));
    return NULL;
}

static void *revoker(void *arg) {
    (void)arg;
    int rounds = 0;
    /* Bounded: each round creates and releases every free page of the device, which a loaded
     * machine makes slow; the workers keep running past the last round. */
    while (!atomic_load(&done) && rounds < 15) {
        uint64_t lost = 0;
        /* More pages than the device has: every block without a clean copy goes. */
        int rc = strata_kv_revoke(kv, 1u << 20, &lost);
        CHECK(rc == STRATA_OUT_OF_MEMORY || rc == STRATA_OK);
        CHECK_OK(strata_kv_check(kv));
        rounds++;
        usleep(20000);
    }
    CHECK(rounds > 0);
    return NULL;
}

int main(void) {
    char dir[] = "/tmp/strata-kv-threads-XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    strata_kv_config_t c = kv_config(STRATA_KV_LOSSY, 8, WORKERS, MAX_TOKENS, 128u << 20, dir);
    CHECK_OK(strata_kv_create(&c, &kv));
    for (int i = 0; i < WORKERS; i++) CHECK_OK(strata_kv_admit(kv, &reqs[i]));
    CHECK_OK(strata_kv_on_lost(kv, on_lost, NULL));

    pthread_t workers[WORKERS], rev;
    CHECK(pthread_create(&rev, NULL, revoker, NULL) == 0);
    for (int i = 0; i < WORKERS; i++)
        CHECK(pthread_create(&workers[i], NULL, worker, (void *)(intptr_t)i) == 0);
    for (int i = 0; i < WORKERS; i++) CHECK(pthread_join(workers[i], NULL) == 0);
    atomic_store(&done, 1);
    CHECK(pthread_join(rev, NULL) == 0);

    /* Every lost block was reported exactly once, by one of the two channels. */
    for (int i = 0; i < WORKERS; i++) take_lost(i);
    strata_kv_stats_t st;
    CHECK_OK(strata_kv_stats(kv, &st));
    unsigned reported = atomic_load(&reported_by_callback) + atomic_load(&reported_by_take);
    CHECK(st.lost_blocks == reported);
    CHECK(st.requests_admitted == WORKERS);
    /* The space has a zero page: with STRATA_KV_MAP_AHEAD (kv_threads-mapper) appends took pages
     * the background mapper mapped ahead; without it there is no mapper. */
    const char *ahead = getenv("STRATA_KV_MAP_AHEAD");
    if (ahead && atoi(ahead) > 0)
        CHECK(st.pages_from_ahead > 0);
    else
        CHECK(st.pages_from_ahead == 0 && st.pages_ahead == 0);
    CHECK_OK(strata_kv_check(kv));
    for (int i = 0; i < WORKERS; i++) CHECK_OK(strata_kv_release(kv, reqs[i]));
    CHECK_OK(strata_kv_destroy(kv));
    rmdir(dir);
    printf("kv_threads: ok (%u lost blocks reported: %u by callback, %u by take_lost)\n", reported,
           atomic_load(&reported_by_callback), atomic_load(&reported_by_take));
    return 0;
}

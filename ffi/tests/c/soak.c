/* A bounded soak: threads run every kind of C call at once for STRATA_SOAK_SECONDS (default
 * 15): allocations on two devices and several streams with contents checked, frees on other
 * streams, record_stream, tags (a private one per thread, a shared one, nesting), sleep/wake
 * of the private tag with and without host copies, Harvest allocations with reads and writes
 * while another thread reclaims (revocation callbacks), empty_cache and stats; and a KV
 * thread that admits, appends and writes requests of a KV space, spills them to host memory
 * and disk, makes them resident on its stream and reads every token back. At the end the
 * accounting is back to zero: no live allocation, every revocation called back exactly once,
 * and after strata_empty_cache nothing is held on either device. */
#define _DEFAULT_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "common.h"

#define THREADS 6
#define SLOTS 16
#define HANDLES 2
#define PROBE 256

static double deadline;
static atomic_long callbacks, stale_frees, ops_total, sleeps_total, revoked_reads;
static long kv_ops, kv_spills, kv_verified;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + t.tv_nsec * 1e-9;
}

static void on_revoke(const strata_harvest_handle_t *h, int lost, void *user_data) {
    (void)h;
    (void)user_data;
    CHECK(lost == 0);
    atomic_fetch_add(&callbacks, 1);
}

typedef struct {
    void *ptr;
    size_t size;
    int device;
    uint64_t seed;
    int zeroed;
    int mine; /* under the thread's private tag (the one it sleeps) */
} slot_t;

static void check_slot(const slot_t *s) {
    size_t n = s->size < PROBE ? s->size : PROBE;
    if (s->zeroed) CHECK(is_zero(s->ptr, n));
    else CHECK(has_pattern(s->ptr, n, s->seed));
}

static void *worker(void *arg) {
    int id = (int)(intptr_t)arg;
    uint64_t rng = 0x9E3779B97F4A7C15ull * (uint64_t)(id + 1);
    char mine[32];
    snprintf(mine, sizeof mine, "soak-%d", id);
    cudaStream_t streams[2];
    for (int d = 0; d < 2; d++) CHECK_OK(strata_stream_create(d, &streams[d]));
    slot_t slots[SLOTS] = {0};
    strata_harvest_handle_t handles[HANDLES];
    int handle_live[HANDLES] = {0};
    uint64_t handle_seed[HANDLES] = {0}, seq = (uint64_t)id << 40;
    unsigned char buf[PROBE], want[PROBE];
    long ops = 0;
    while (now() < deadline) {
        uint64_t r = next_rand(&rng);
        slot_t *s = &slots[(r >> 8) % SLOTS];
        switch (r % 10) {
        case 0:
        case 1:
        case 2: { /* allocate, under the private or the shared tag */
            if (s->ptr) break;
            int private_tag = (r >> 16) & 1;
            CHECK_OK(strata_tag_push(private_tag ? mine : "soak-shared"));
            size_t size = (r >> 20) % 3 == 0 ? ((r >> 24) % 3 + 1) << 20 : (r >> 24) % 20000 + 1;
            int device = (r >> 40) & 1;
            void *p = strata_malloc(size, device, (r >> 41) & 1 ? streams[device] : NULL);
            CHECK_OK(strata_tag_pop());
            if (!p) {
                CHECK_ERR("STRATA_OUT_OF_MEMORY");
                break;
            }
            slot_t fresh = {p, size, device, ++seq, 0, private_tag};
            *s = fresh;
            put_pattern(p, size < PROBE ? size : PROBE, s->seed);
            break;
        }
        case 3: /* check and free, sometimes on another stream */
            if (!s->ptr) break;
            check_slot(s);
            if ((r >> 16) & 1) strata_record_stream(s->ptr, streams[s->device]);
            CHECK_OK(strata_free_checked(s->ptr, s->size, s->device,
                                         (r >> 17) & 1 ? streams[s->device] : NULL));
            memset(s, 0, sizeof *s);
            break;
        case 4: { /* sleep and wake the private tag */
            int keep = (r >> 16) & 1;
            int st = strata_sleep(mine, keep);
            if (st == STRATA_INVALID_ARGUMENT) break; /* never pushed yet */
            CHECK(st == STRATA_OK);
            atomic_fetch_add(&sleeps_total, 1);
            for (int i = 0; i < SLOTS; i++)
                if (slots[i].ptr && slots[i].mine) {
                    CHECK(strata_memcpy_dtoh(buf, slots[i].ptr, 1) == STRATA_INVALID_ARGUMENT);
                    if (!keep) slots[i].zeroed = 1;
                }
            while ((st = strata_wake(mine)) == STRATA_OUT_OF_MEMORY) {
                struct timespec pause = {0, 1000000};
                nanosleep(&pause, NULL);
            }
            CHECK(st == STRATA_OK);
            for (int i = 0; i < SLOTS; i++)
                if (slots[i].ptr && slots[i].mine) check_slot(&slots[i]);
            break;
        }
        case 5: { /* Harvest: allocate, write, read back; a revoked handle is stale */
            int h = (int)((r >> 16) % HANDLES);
            if (!handle_live[h]) {
                strata_harvest_hints_t hints = {(int)(r >> 20) & 1, STRATA_HARVEST_BACKED, 0, 0,
                                                NULL};
                int st = strata_harvest_alloc(((r >> 24) % 4 + 1) << 20, &hints, &handles[h]);
                if (st != STRATA_OK) {
                    CHECK(st == STRATA_OUT_OF_MEMORY);
                    break;
                }
                CHECK_OK(strata_harvest_on_revoke(&handles[h], on_revoke, NULL));
                handle_live[h] = 1;
                handle_seed[h] = ++seq;
                fill_pattern(want, PROBE, handle_seed[h]);
                int w = strata_harvest_write(&handles[h], 0, want, PROBE);
                CHECK(w == STRATA_OK || w == STRATA_INVALID_HANDLE);
            } else if ((r >> 28) & 1) {
                int st = strata_harvest_read(&handles[h], 0, buf, PROBE);
                if (st == STRATA_INVALID_HANDLE) {
                    atomic_fetch_add(&revoked_reads, 1);
                    break;
                }
                CHECK(st == STRATA_OK);
                fill_pattern(want, PROBE, handle_seed[h]);
                CHECK(memcmp(buf, want, PROBE) == 0);
            } else {
                int st = strata_harvest_free(&handles[h]);
                if (st == STRATA_INVALID_HANDLE) atomic_fetch_add(&stale_frees, 1);
                else CHECK(st == STRATA_OK);
                handle_live[h] = 0;
            }
            break;
        }
        case 6: /* the owner of a device takes memory back */
            if ((r >> 16) % 8 == 0) {
                uint64_t got = 0;
                CHECK_OK(strata_harvest_reclaim((int)(r >> 20) & 1, ((r >> 24) % 8) << 20, &got));
            }
            break;
        case 7:
            if ((r >> 16) % 16 == 0) strata_empty_cache();
            else {
                strata_stats_t st;
                CHECK_OK(strata_stats((int)(r >> 20) & 1, &st));
                CHECK(st.allocated_bytes <= st.allocated_block_bytes);
            }
            break;
        case 8: /* nested tags */
            CHECK_OK(strata_tag_push("soak-shared"));
            CHECK_OK(strata_tag_push(mine));
            CHECK(strata_tag_depth() == 2);
            CHECK_OK(strata_tag_pop());
            CHECK_OK(strata_tag_pop());
            break;
        default: /* contents of a random slot */
            if (s->ptr) check_slot(s);
            break;
        }
        ops++;
    }
    for (int i = 0; i < SLOTS; i++)
        if (slots[i].ptr) {
            check_slot(&slots[i]);
            CHECK_OK(strata_free_checked(slots[i].ptr, slots[i].size, slots[i].device, NULL));
        }
    for (int h = 0; h < HANDLES; h++)
        if (handle_live[h]) {
            int st = strata_harvest_free(&handles[h]);
            if (st == STRATA_INVALID_HANDLE) atomic_fetch_add(&stale_frees, 1);
            else CHECK(st == STRATA_OK);
        }
    for (int d = 0; d < 2; d++) CHECK_OK(strata_stream_destroy(streams[d]));
    CHECK(strata_tag_depth() == 0);
    atomic_fetch_add(&ops_total, ops);
    return NULL;
}

#define KV_REQUESTS 4
#define KV_BPT 2048 /* 8 heads x 128 x 2 bytes: 1024 tokens per 2 MiB page */
#define KV_MAX_TOKENS 2048

/* One KV space on device 1 (the other threads' memory pressure included): every request holds
 * the pattern of its seed in its first `tokens` tokens of layer 0's K tensor. */
static void *kv_worker(void *arg) {
    const char *dir = arg;
    strata_kv_config_t c =
        kv_config(STRATA_KV_BACKED, 8, KV_REQUESTS, KV_MAX_TOKENS, 32u << 20, dir);
    c.device = 1;
    strata_kv_t kv;
    CHECK_OK(strata_kv_create(&c, &kv));
    cudaStream_t stream;
    CHECK_OK(strata_stream_create(1, &stream));
    strata_kv_request_t reqs[KV_REQUESTS];
    uint32_t tokens[KV_REQUESTS] = {0};
    uint64_t seeds[KV_REQUESTS] = {0}, seq = 7u << 20, rng = 0x5EED, step = 0;
    int live[KV_REQUESTS] = {0};
    size_t max_len = (size_t)KV_MAX_TOKENS * KV_BPT;
    unsigned char *want = malloc(max_len), *got = malloc(max_len);
    CHECK(want != NULL && got != NULL);
    while (now() < deadline) {
        uint64_t r = next_rand(&rng);
        int i = (int)((r >> 8) % KV_REQUESTS);
        CHECK_OK(strata_kv_advance(kv, ++step));
        if (!live[i]) {
            CHECK_OK(strata_kv_admit(kv, &reqs[i]));
            live[i] = 1;
            tokens[i] = 0;
            seeds[i] = ++seq;
        }
        size_t len = (size_t)tokens[i] * KV_BPT;
        switch (r % 4) {
        case 0: { /* append and write every token (the last block is made resident first) */
            uint32_t more = (uint32_t)((r >> 16) % 700 + 1);
            if (tokens[i] + more > KV_MAX_TOKENS) break;
            int rc = strata_kv_make_resident(kv, &reqs[i], 1, stream);
            if (rc == STRATA_OUT_OF_MEMORY) break;
            CHECK_OK(rc);
            CHECK_OK(strata_stream_synchronize(stream));
            rc = strata_kv_append(kv, reqs[i], more);
            if (rc == STRATA_OUT_OF_MEMORY) break;
            CHECK_OK(rc);
            tokens[i] += more;
            len = (size_t)tokens[i] * KV_BPT;
            fill_pattern(want, len, seeds[i]);
            rc = strata_kv_write(kv, reqs[i], 0, STRATA_KV_K, 0, want, len);
            if (rc == STRATA_INVALID_STATE) { /* spilled for another request's room: forget */
                CHECK_OK(strata_kv_release(kv, reqs[i]));
                live[i] = 0;
                break;
            }
            CHECK_OK(rc);
            break;
        }
        case 1: { /* spill to host memory or disk */
            int tier = (r >> 16) & 1 ? STRATA_TIER_DISK : STRATA_TIER_HOST;
            int rc = strata_kv_spill(kv, reqs[i], tier);
            CHECK(rc == STRATA_OK || rc == STRATA_OUT_OF_MEMORY);
            kv_spills += rc == STRATA_OK;
            break;
        }
        case 2: { /* make resident on the stream, then every token reads back */
            int rc = strata_kv_make_resident(kv, &reqs[i], 1, stream);
            if (rc == STRATA_OUT_OF_MEMORY) break;
            CHECK_OK(rc);
            CHECK_OK(strata_stream_synchronize(stream));
        } /* fall through */
        default: {
            if (len == 0) break;
            int tier = -1;
            CHECK_OK(strata_kv_read(kv, reqs[i], 0, STRATA_KV_K, 0, got, len, &tier));
            fill_pattern(want, len, seeds[i]);
            CHECK(memcmp(want, got, len) == 0);
            kv_verified++;
            if ((r >> 20) % 4 == 0) {
                CHECK_OK(strata_kv_release(kv, reqs[i]));
                live[i] = 0;
            }
            break;
        }
        }
        CHECK_OK(strata_kv_check(kv));
        kv_ops++;
    }
    for (int i = 0; i < KV_REQUESTS; i++)
        if (live[i]) CHECK_OK(strata_kv_release(kv, reqs[i]));
    CHECK_OK(strata_stream_destroy(stream));
    CHECK_OK(strata_kv_destroy(kv));
    free(want);
    free(got);
    return NULL;
}

int main(void) {
    const char *env = getenv("STRATA_SOAK_SECONDS");
    double seconds = env ? atof(env) : 15;
    CHECK(strata_device_count() == 2);
    char dir[] = "/tmp/strata-soak-XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    deadline = now() + seconds;
    pthread_t t[THREADS], kv_thread;
    for (intptr_t i = 0; i < THREADS; i++)
        CHECK(pthread_create(&t[i], NULL, worker, (void *)i) == 0);
    CHECK(pthread_create(&kv_thread, NULL, kv_worker, dir) == 0);
    for (int i = 0; i < THREADS; i++) CHECK(pthread_join(t[i], NULL) == 0);
    CHECK(pthread_join(kv_thread, NULL) == 0);
    rmdir(dir);
    CHECK(kv_verified > 0);

    /* Every revocation called back once, and each revoked handle was found stale by its owner
     * when freed. */
    CHECK(atomic_load(&callbacks) == atomic_load(&stale_frees));
    strata_empty_cache();
    for (int d = 0; d < 2; d++) {
        strata_stats_t s = stats_of(d);
        CHECK(s.live_allocations == 0 && s.allocated_bytes == 0);
        CHECK(s.reserved_bytes == 0 && s.pool_free_bytes == 0);
        CHECK(s.allocs == s.frees);
    }
    printf("soak: %ld ops by %d threads in %.0f s, %ld sleeps, %ld revocations (%ld reads saw "
           "one)\n",
           atomic_load(&ops_total), THREADS, seconds, atomic_load(&sleeps_total),
           atomic_load(&callbacks), atomic_load(&revoked_reads));
    printf("soak: %ld KV operations, %ld spills, %ld requests read back whole\n", kv_ops,
           kv_spills, kv_verified);
    printf("soak: ok\n");
    return 0;
}

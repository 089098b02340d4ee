/* A random walk over the KV calls of two spaces against a model: every request's tokens and
 * bytes (a pattern version per request), stale and foreign handles, appends past max_tokens,
 * spills, batches made resident, revocations (losses tracked through take_lost), releases.
 * After every step the spaces' invariants hold and the model agrees with strata_kv_request_info
 * (and, for the request touched and every 25 steps for all, with the bytes read back). */
#define _DEFAULT_SOURCE
#include <stdlib.h>
#include <unistd.h>

#include "common.h"

#define SPACES 2
#define SLOTS 6
#define BPT 1024 /* 4 heads x 128 x 2 bytes: 2048 tokens per page */
#define MAX_TOKENS 6144
#define STEPS 400
/* Device 0 is capped (see main): its pool refuses at the cap, before the device would. */
#define OUT_OF_ROOM(rc) ((rc) == STRATA_LIMIT_EXCEEDED || (rc) == STRATA_OUT_OF_MEMORY)

typedef struct {
    strata_kv_request_t handle; /* 0: slot of the model unused */
    uint32_t tokens;
    uint64_t version; /* the pattern every token holds; 0: unknown (lost, not rewritten) */
} model_req;

static strata_kv_t spaces[SPACES];
static model_req model[SPACES][SLOTS];
static strata_kv_request_t released[64];
static int n_released;
static unsigned char want[MAX_TOKENS * BPT], got[MAX_TOKENS * BPT];

static void rewrite(int s, model_req *m, uint64_t version) {
    size_t len = (size_t)m->tokens * BPT;
    if (len == 0) return;
    fill_pattern(want, len, version);
    for (int k = 0; k < 2; k++) {
        int rc = strata_kv_write(spaces[s], m->handle, 0, k, 0, want, len);
        if (rc == STRATA_INVALID_STATE) { /* a block is not resident */
            m->version = 0;
            return;
        }
        CHECK_OK(rc);
    }
    m->version = version;
}

static void verify(int s, const model_req *m, int bytes) {
    strata_kv_request_info_t i;
    CHECK_OK(strata_kv_request_info(spaces[s], m->handle, &i));
    CHECK(i.tokens == m->tokens);
    CHECK(i.blocks == (m->tokens + 2047) / 2048);
    CHECK(i.resident + i.host + i.disk + i.lost == i.blocks);
    if (!bytes || m->version == 0 || i.lost > 0 || m->tokens == 0) return;
    size_t len = (size_t)m->tokens * BPT;
    fill_pattern(want, len, m->version);
    for (int k = 0; k < 2; k++) {
        CHECK_OK(strata_kv_read(spaces[s], m->handle, 0, k, 0, got, len, NULL));
        CHECK(memcmp(want, got, len) == 0);
    }
}

static void note_lost(int s) {
    for (int j = 0; j < SLOTS; j++) {
        model_req *m = &model[s][j];
        if (!m->handle) continue;
        uint32_t blocks[8];
        size_t n = 0;
        CHECK_OK(strata_kv_take_lost(spaces[s], m->handle, blocks, 8, &n));
        if (n > 0) m->version = 0;
    }
}

int main(void) {
    /* A 448 MiB budget on device 0, whatever its size (the host test device has 512 MiB): a
     * revoke of 1 << 20 pages first takes all the capacity the pool can still create, one
     * cuMemCreate per page. Uncapped on a 141 GiB device that was ~180,000 pages per walk (two
     * minutes over the emulated driver, past 160 s on an H200); capped, about 2,000. */
    strata_set_memory_fraction((double)(448u << 20) / (double)stats_of(0).total_bytes, 0);
    char dir[] = "/tmp/strata-kv-walk-XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    for (int s = 0; s < SPACES; s++) {
        strata_kv_config_t c = kv_config(s == 0 ? STRATA_KV_LOSSY : STRATA_KV_BACKED, 4, SLOTS,
                                         MAX_TOKENS, 48u << 20, dir);
        c.zero_page = s == 0;
        CHECK_OK(strata_kv_create(&c, &spaces[s]));
    }
    uint64_t rng = 0x5EEDu, version = 1;
    cudaStream_t stream;
    CHECK_OK(strata_stream_create(0, &stream));
    for (int step = 0; step < STEPS; step++) {
        int s = (int)(next_rand(&rng) % SPACES);
        strata_kv_t kv = spaces[s];
        model_req *m = &model[s][next_rand(&rng) % SLOTS];
        int rc;
        switch (next_rand(&rng) % 10) {
        case 0: /* admit or release */
            if (!m->handle) {
                CHECK_OK(strata_kv_admit(kv, &m->handle));
                m->tokens = 0;
                m->version = 0;
            } else {
                CHECK_OK(strata_kv_release(kv, m->handle));
                if (n_released < 64) released[n_released++] = m->handle;
                memset(m, 0, sizeof *m);
            }
            break;
        case 1:
        case 2: { /* append (sometimes past max_tokens), then rewrite */
            if (!m->handle) break;
            uint32_t add = 1 + (uint32_t)(next_rand(&rng) % 3000);
            rc = strata_kv_append(kv, m->handle, add);
            if (m->tokens + add > MAX_TOKENS) {
                CHECK(rc == STRATA_INVALID_ARGUMENT);
            } else if (rc == STRATA_OK) {
                m->tokens += add;
                rewrite(s, m, ++version);
            } else {
                CHECK(rc == STRATA_INVALID_STATE || OUT_OF_ROOM(rc));
                if (rc == STRATA_INVALID_STATE) note_lost(s);
            }
            break;
        }
        case 3: /* spill */
            if (!m->handle) break;
            rc = strata_kv_spill(kv, m->handle, next_rand(&rng) % 2 ? STRATA_TIER_HOST
                                                                 : STRATA_TIER_DISK);
            CHECK(rc == STRATA_OK || OUT_OF_ROOM(rc));
            break;
        case 4:
        case 5: { /* make a batch resident */
            strata_kv_request_t batch[SLOTS];
            size_t n = 0;
            for (int j = 0; j < SLOTS; j++)
                if (model[s][j].handle && next_rand(&rng) % 2) batch[n++] = model[s][j].handle;
            rc = strata_kv_make_resident(kv, batch, n, stream);
            if (rc == STRATA_INVALID_STATE) {
                note_lost(s);
                rc = strata_kv_make_resident(kv, batch, n, stream);
            }
            CHECK(rc == STRATA_OK || OUT_OF_ROOM(rc));
            CHECK_OK(strata_stream_synchronize(stream));
            break;
        }
        case 6: { /* revoke */
            uint64_t lost = 0;
            rc = strata_kv_revoke(kv, next_rand(&rng) % 4 ? 8 : (1u << 20), &lost);
            CHECK(rc == STRATA_OK || OUT_OF_ROOM(rc));
            if (s == 1) CHECK(lost == 0); /* Backed */
            note_lost(s);
            break;
        }
        case 7: /* rewrite (recompute) */
            if (m->handle) rewrite(s, m, ++version);
            break;
        case 8: /* stale and foreign handles change nothing */
            if (n_released > 0) {
                strata_kv_request_t r = released[next_rand(&rng) % n_released];
                rc = strata_kv_append(kv, r, 1);
                CHECK(rc == STRATA_INVALID_HANDLE || rc == STRATA_INVALID_ARGUMENT);
            }
            if (m->handle)
                CHECK(strata_kv_append(spaces[1 - s], m->handle, 1) == STRATA_INVALID_ARGUMENT);
            break;
        default: /* scheduler clock */
            CHECK_OK(strata_kv_advance(kv, (uint64_t)step));
            break;
        }
        for (int t = 0; t < SPACES; t++) {
            CHECK_OK(strata_kv_check(spaces[t]));
            for (int j = 0; j < SLOTS; j++)
                if (model[t][j].handle)
                    verify(t, &model[t][j], &model[t][j] == m || step % 25 == 0);
        }
    }
    strata_kv_stats_t st;
    /* Space 0 has a zero page: with STRATA_KV_MAP_AHEAD (kv_walk-mapper) its appends took pages
     * the background mapper mapped ahead too; without it there is no mapper. */
    CHECK_OK(strata_kv_stats(spaces[0], &st));
    const char *ahead = getenv("STRATA_KV_MAP_AHEAD");
    if (ahead && atoi(ahead) > 0)
        CHECK(st.pages_from_ahead > 0);
    else
        CHECK(st.pages_from_ahead == 0 && st.pages_ahead == 0);
    CHECK_OK(strata_kv_stats(spaces[1], &st));
    CHECK(st.lost_blocks == 0);
    for (int s = 0; s < SPACES; s++) CHECK_OK(strata_kv_destroy(spaces[s]));
    CHECK_OK(strata_stream_destroy(stream));
    rmdir(dir);
    printf("kv_walk: ok (%llu pool pages created)\n", (unsigned long long)st.pool_created_pages);
    return 0;
}

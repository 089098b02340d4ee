/* A fuzz target for the KV C API (strata_kv_*): each input is a byte-coded sequence of calls on
 * up to three spaces of random shapes (valid ones, and counts at their types' limits that must
 * be refused with STRATA_INVALID_ARGUMENT or STRATA_OUT_OF_MEMORY), requests appended,
 * truncated, spilled, restored, revoked and released with sizes at the type limits, and random,
 * forged, stale and foreign handles. A model predicts each status and the bytes of every
 * request that lost nothing; lost blocks are reported exactly once. An input ends by releasing
 * and destroying everything, and the device's pool must be back where it started.
 *
 * LLVMFuzzerTestOneInput is libFuzzer's entry point (build as fuzz.c says, on this file); with
 * STRATA_FUZZ_DRIVER, fuzz_driver.h replays ffi/tests/fuzz/kv-corpus and mutates it for a time
 * budget. */
#define _POSIX_C_SOURCE 200809L
#include <dirent.h>
#include <time.h>
#include <unistd.h>

#define FUZZ_NAME "kv_fuzz"
#include "fuzz.h"

#define SPACES 3
#define REQS 6

typedef struct {
    strata_kv_request_t h;
    int live;
    uint32_t tokens;
    uint64_t seed;
    int exact; /* no block ever lost: the bytes are the model's */
} req_t;

typedef struct {
    strata_kv_t kv;
    strata_kv_config_t c;
    uint32_t bpt;
    req_t r[REQS];
    strata_kv_request_t released; /* a stale handle of this space, or 0 */
} space_t;

static space_t spaces[SPACES];
static strata_kv_t destroyed; /* a stale space handle */
static char disk_dir[64];
static uint64_t take64(bytes_t *b) {
    uint64_t x = 0;
    for (int i = 0; i < 8; i++) x = x << 8 | take(b);
    return x;
}

/* A count at a limit of uint32_t. */
static uint32_t limit32(bytes_t *b) {
    static const uint32_t limits[] = {0, UINT32_MAX, 1u << 31, (1u << 31) + 1};
    return limits[take(b) % 4];
}

/* A count at a limit of uint32_t, a random one, or a small one. */
static uint32_t count32(bytes_t *b, uint32_t small) {
    unsigned a = take(b);
    switch (a % 8) {
    case 0: return 0;
    case 1: return UINT32_MAX;
    case 2: return 1u << 31;
    case 3: return (uint32_t)take64(b);
    default: return 1 + (a * 37u + take(b)) % small;
    }
}

/* The bytes of tokens [from, from + n) of (layer, kind) of a request written with `seed`. */
static void token_bytes(unsigned char *buf, uint32_t bpt, uint64_t seed, uint32_t layer, int kind,
                        uint32_t from, uint32_t n) {
    for (uint32_t t = 0; t < n; t++)
        fill_pattern(buf + (size_t)t * bpt, bpt,
                     seed * 1000003 + (uint64_t)(from + t) * 4 + layer * 2 + (uint64_t)kind);
}

static void write_range(space_t *s, req_t *r, uint32_t from, uint32_t n) {
    size_t len = (size_t)n * s->bpt;
    unsigned char *buf = malloc(len ? len : 1);
    FCHECK(buf != NULL);
    for (uint32_t l = 0; l < s->c.layers; l++)
        for (int k = 0; k < 2; k++) {
            token_bytes(buf, s->bpt, r->seed, l, k, from, n);
            FCHECK(strata_kv_write(s->kv, r->h, l, k, from, buf, len) == STRATA_OK);
        }
    free(buf);
}

static strata_kv_request_info_t info_of(space_t *s, req_t *r) {
    strata_kv_request_info_t i;
    FCHECK(strata_kv_request_info(s->kv, r->h, &i) == STRATA_OK);
    FCHECK(i.tokens == r->tokens);
    return i;
}

/* Reads every token of the first and the last tensor; the model's bytes unless a block was
 * lost (then the read of a lost block is STRATA_INVALID_STATE). */
static void check_req(space_t *s, req_t *r) {
    strata_kv_request_info_t i = info_of(s, r);
    FCHECK(i.resident + i.host + i.disk + i.lost == i.blocks);
    size_t len = (size_t)r->tokens * s->bpt;
    if (len == 0 || len > (64u << 20)) return;
    unsigned char *want = malloc(len), *got = malloc(len);
    FCHECK(want && got);
    uint32_t last = s->c.layers - 1;
    for (int k = 0; k < 2; k++) {
        uint32_t layer = k ? last : 0;
        int tier = -1;
        int st = strata_kv_read(s->kv, r->h, layer, k, 0, got, len, &tier);
        if (i.lost) {
            FCHECK(st == STRATA_INVALID_STATE);
            continue;
        }
        FCHECK(st == STRATA_OK && tier >= 0 && tier <= 2);
        if (!r->exact) continue;
        token_bytes(want, s->bpt, r->seed, layer, k, 0, r->tokens);
        FCHECK(memcmp(want, got, len) == 0);
    }
    free(want);
    free(got);
}

/* Takes the lost blocks of every request (each reported once: the second take is empty). */
static void take_all_lost(space_t *s) {
    for (int j = 0; j < REQS; j++) {
        req_t *r = &s->r[j];
        if (!r->live) continue;
        uint32_t blocks[4096];
        size_t n = 0;
        strata_kv_request_info_t i = info_of(s, r);
        if (i.blocks > 4096) continue;
        FCHECK(strata_kv_take_lost(s->kv, r->h, blocks, 4096, &n) == STRATA_OK);
        if (n) r->exact = 0;
        for (size_t k = 0; k < n; k++) FCHECK(blocks[k] < i.blocks && (k == 0 || blocks[k - 1] < blocks[k]));
        FCHECK(strata_kv_take_lost(s->kv, r->h, blocks, 4096, &n) == STRATA_OK && n == 0);
    }
}

static void op_create(bytes_t *b, space_t *s) {
    if (s->kv) return;
    unsigned a = take(b), e = take(b);
    static const uint32_t heads[] = {1, 2, 4, 8}, dims[] = {32, 64, 128, 128};
    static const uint32_t elems[] = {1, 2, 4, 8};
    strata_kv_config_t c = kv_config(a & 1, heads[(a >> 1) & 3], 1 + (a >> 3) % 4,
                                     512u << ((a >> 5) & 3), 0, NULL);
    c.layers = 1 + e % 2;
    c.head_dim = dims[(e >> 1) & 3];
    c.elem_size = elems[(e >> 3) & 3];
    c.zero_page = (e >> 5) & 1;
    unsigned tiers = take(b);
    static const uint64_t host[] = {0, 4u << 20, 64u << 20, 64u << 20};
    c.host_bytes = host[tiers & 3];
    if (tiers & 4) {
        c.disk_bytes = (tiers & 8) ? 4u << 20 : 64u << 20;
        c.disk_dir = disk_dir;
    }
    int weird = (e >> 6) == 3;
    if (weird) { /* one field at a limit of its type */
        static const uint64_t huge[] = {UINT64_MAX, 1ull << 40, 1ull << 46, 1ull << 62};
        uint32_t v = limit32(b);
        switch (take(b) % 12) {
        case 0: c.layers = v; break;
        case 1: c.max_requests = v; break;
        case 2: /* the smallest tokens, without the zero page mapped behind every page */
            c.max_tokens = v;
            c.zero_page = 0;
            c.kv_heads = 1;
            c.head_dim = 32;
            c.elem_size = 1;
            break;
        case 3: c.kv_heads = v; break;
        case 4: c.head_dim = v; break;
        case 5: c.elem_size = v; break;
        case 6: c.durability = (int32_t)v; break;
        case 7: c.host_bytes = huge[take(b) % 4]; break;
        case 8: c.disk_bytes = huge[take(b) % 4]; c.disk_dir = (v & 1) ? disk_dir : NULL; break;
        case 9: c.reserved = (int32_t)v; break;
        case 10: c.spare[v % 4] = v; break;
        default: c.device = (int32_t)v; break;
        }
    }
    strata_kv_t kv = 0;
    int st = strata_kv_create(&c, &kv);
    if (!weird) FCHECK(st == STRATA_OK);
    else FCHECK(st == STRATA_OK || st == STRATA_INVALID_ARGUMENT || st == STRATA_OUT_OF_MEMORY ||
                st == STRATA_NO_DEVICE);
    if (st != STRATA_OK) {
        FCHECK(kv == 0);
        return;
    }
    FCHECK(kv != 0 && kv != destroyed);
    memset(s, 0, sizeof *s);
    s->kv = kv;
    s->c = c;
    s->bpt = c.kv_heads * c.head_dim * c.elem_size;
}

static void op_destroy(space_t *s) {
    if (!s->kv) return;
    FCHECK(strata_kv_destroy(s->kv) == STRATA_OK);
    FCHECK(strata_kv_destroy(s->kv) == STRATA_INVALID_HANDLE);
    destroyed = s->kv;
    memset(s, 0, sizeof *s);
}

static void op_admit(space_t *s, uint64_t *seq) {
    int j = 0;
    while (j < REQS && s->r[j].live) j++;
    strata_kv_request_t h = 0;
    int st = strata_kv_admit(s->kv, &h);
    int live = 0;
    for (int k = 0; k < REQS; k++) live += s->r[k].live;
    if ((uint32_t)live >= s->c.max_requests) {
        FCHECK(st == STRATA_INVALID_STATE);
        return;
    }
    FCHECK(st == STRATA_OK && h != 0);
    if (j == REQS) { /* no room in the model: release it at once */
        FCHECK(strata_kv_release(s->kv, h) == STRATA_OK);
        s->released = h;
        return;
    }
    s->r[j] = (req_t){h, 1, 0, ++*seq, 1};
}

static void op_append(bytes_t *b, space_t *s, req_t *r) {
    uint32_t n = count32(b, 600);
    static uint8_t res[8192];
    size_t blocks = 0;
    /* The block the next token goes to must be resident, if it exists; -1: not known. */
    int tail = 1;
    strata_kv_stats_t ks = kv_stats(s->kv);
    if (strata_kv_residency(s->kv, r->h, res, sizeof res, &blocks) != STRATA_OK) tail = -1;
    else if (r->tokens / ks.tokens_per_block < blocks)
        tail = res[r->tokens / ks.tokens_per_block] == STRATA_KV_RESIDENT;
    int st = strata_kv_append(s->kv, r->h, n);
    if (n == 0 || (uint64_t)r->tokens + n > s->c.max_tokens) {
        FCHECK(st == STRATA_INVALID_ARGUMENT);
        return;
    }
    if (tail == 0) {
        FCHECK(st == STRATA_INVALID_STATE);
        return;
    }
    FCHECK(st == STRATA_OK || st == STRATA_OUT_OF_MEMORY || (tail < 0 && st == STRATA_INVALID_STATE));
    if (st != STRATA_OK) return;
    uint32_t from = r->tokens;
    r->tokens += n;
    /* Other requests may have been spilled for room; this one's new tokens are resident. */
    if (n <= 4096) write_range(s, r, from, n);
    else r->exact = 0;
}

static void op_truncate(bytes_t *b, space_t *s, req_t *r) {
    uint32_t n = (take(b) & 1) ? count32(b, 600) : (r->tokens ? take(b) % (r->tokens + 1) : 0);
    int st = strata_kv_truncate(s->kv, r->h, n);
    if (n > r->tokens) {
        FCHECK(st == STRATA_INVALID_ARGUMENT);
        return;
    }
    FCHECK(st == STRATA_OK);
    r->tokens = n;
}

static void op_tiering(bytes_t *b, space_t *s, req_t *r) {
    unsigned a = take(b);
    switch (a % 6) {
    case 0:
    case 1: {
        int tier = (a >> 3) % 4; /* 0 and 3 are no tier */
        int st = strata_kv_spill(s->kv, r->h, tier);
        if (tier == 0 || tier == 3) FCHECK(st == STRATA_INVALID_ARGUMENT);
        else if (tier == STRATA_TIER_DISK && !s->c.disk_bytes) FCHECK(st == STRATA_INVALID_STATE);
        else FCHECK(st == STRATA_OK || st == STRATA_OUT_OF_MEMORY);
        break;
    }
    case 2: {
        strata_kv_request_t batch[REQS];
        size_t n = 0;
        for (int j = 0; j < REQS; j++)
            if (s->r[j].live && ((a >> 3) >> (j % 5) & 1)) batch[n++] = s->r[j].h;
        int st = strata_kv_make_resident(s->kv, batch, n, NULL);
        FCHECK(st == STRATA_OK || st == STRATA_OUT_OF_MEMORY);
        break;
    }
    case 3: {
        static const uint64_t amounts[] = {1, 4, 16, 1ull << 30, UINT64_MAX, 0, 64, 1u << 20};
        uint64_t lost = 0xdeadbeef;
        int st = strata_kv_revoke(s->kv, amounts[(a >> 3) & 7], &lost);
        FCHECK(st == STRATA_OK || st == STRATA_OUT_OF_MEMORY);
        FCHECK(lost != 0xdeadbeef);
        if (s->c.durability == STRATA_KV_BACKED) FCHECK(lost == 0);
        take_all_lost(s);
        break;
    }
    case 4: {
        uint64_t spilled = 0xdeadbeef, objects = 0xdeadbeef;
        FCHECK(strata_kv_advance(s->kv, (a & 8) ? UINT64_MAX : take(b)) == STRATA_OK);
        int tier = 1 + (a >> 5) % 2;
        int st = strata_kv_spill_idle(s->kv, (a & 16) ? UINT64_MAX : take(b) % 4, tier, &spilled);
        if (tier == STRATA_TIER_DISK && !s->c.disk_bytes) FCHECK(st == STRATA_INVALID_STATE);
        else FCHECK((st == STRATA_OK && spilled != 0xdeadbeef) || st == STRATA_OUT_OF_MEMORY);
        FCHECK(strata_kv_stage(s->kv, &r->h, 1, &objects) == STRATA_OK && objects != 0xdeadbeef);
        break;
    }
    default: {
        strata_kv_request_t plan[2] = {r->h, r->h};
        uint32_t counts[2] = {1, 1};
        FCHECK(strata_kv_queue(s->kv, plan, 1) == STRATA_OK);
        FCHECK(strata_kv_hint(s->kv, plan, counts, 2, NULL) == STRATA_OK);
        /* An array longer than any memory: refused before it is read. */
        FCHECK(strata_kv_hint(s->kv, plan, counts, (size_t)1 << 62, NULL) == STRATA_INVALID_ARGUMENT);
        FCHECK(strata_kv_queue(s->kv, plan, SIZE_MAX) == STRATA_INVALID_ARGUMENT);
        break;
    }
    }
}

/* Bad arguments and foreign, forged and stale handles: refused, nothing changed. */
static void op_bad(bytes_t *b, space_t *s, req_t *r) {
    unsigned a = take(b);
    static unsigned char buf[8192];
    switch (a % 8) {
    case 0: FCHECK(strata_kv_write(s->kv, r->h, UINT32_MAX, 0, 0, buf, s->bpt) == STRATA_INVALID_ARGUMENT); break;
    case 1: FCHECK(strata_kv_read(s->kv, r->h, 0, 7, 0, buf, 0, NULL) == STRATA_INVALID_ARGUMENT); break;
    case 2: FCHECK(strata_kv_read(s->kv, r->h, 0, 0, UINT32_MAX, buf, SIZE_MAX, NULL) == STRATA_INVALID_ARGUMENT); break;
    case 3: FCHECK(strata_kv_write(s->kv, r->h, 0, 1, r->tokens, buf, s->bpt) != STRATA_OK); break;
    case 4: {
        strata_kv_tensor_t t;
        FCHECK(strata_kv_tensor(s->kv, UINT32_MAX, 0, &t) == STRATA_INVALID_ARGUMENT);
        FCHECK(strata_kv_tensor(s->kv, s->c.layers - 1, 1, &t) == STRATA_OK);
        FCHECK(t.shape[0] == s->c.max_requests && t.shape[1] == s->c.max_tokens);
        break;
    }
    case 5: { /* a forged handle: another space's, or random */
        strata_kv_request_t forged = take64(b);
        for (int k = 0; k < SPACES; k++)
            for (int j = 0; j < REQS; j++)
                if (spaces[k].r[j].live && spaces[k].r[j].h == forged) return;
        strata_kv_request_info_t i;
        int st = strata_kv_request_info(s->kv, forged, &i);
        FCHECK(st == STRATA_INVALID_ARGUMENT || st == STRATA_INVALID_HANDLE);
        FCHECK(strata_kv_append(s->kv, forged, 1) == st);
        FCHECK(strata_kv_queue(s->kv, &forged, 1) == st);
        break;
    }
    case 6: { /* a released request of this space */
        if (!s->released) return;
        FCHECK(strata_kv_append(s->kv, s->released, 1) == STRATA_INVALID_HANDLE);
        FCHECK(strata_kv_stage(s->kv, &s->released, 1, NULL) == STRATA_INVALID_HANDLE);
        FCHECK(strata_kv_queue(s->kv, &s->released, 1) == STRATA_INVALID_HANDLE);
        FCHECK(strata_kv_make_resident(s->kv, &s->released, 1, NULL) == STRATA_INVALID_HANDLE);
        break;
    }
    default: { /* a destroyed or random space */
        strata_kv_t kv = (a & 8) ? destroyed : take64(b);
        for (int k = 0; k < SPACES; k++)
            if (spaces[k].kv && spaces[k].kv == kv) return;
        strata_kv_request_t h;
        FCHECK(strata_kv_admit(kv, &h) == STRATA_INVALID_HANDLE);
        FCHECK(strata_kv_revoke(kv, UINT64_MAX, NULL) == STRATA_INVALID_HANDLE);
        break;
    }
    }
}

static void release(space_t *s, req_t *r) {
    FCHECK(strata_kv_release(s->kv, r->h) == STRATA_OK);
    FCHECK(strata_kv_release(s->kv, r->h) == STRATA_INVALID_HANDLE);
    s->released = r->h;
    r->live = 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static uint64_t seq;
    static uint64_t pool_in_use;
    if (!disk_dir[0]) {
        strcpy(disk_dir, "/tmp/strata-kv-fuzz-XXXXXX");
        FCHECK(mkdtemp(disk_dir) != NULL);
        strata_stats_t st = stats_of(0);
        pool_in_use = st.pool_in_use_bytes;
    }
    cur_data = data;
    cur_size = size;
    bytes_t b = {data, size};
    for (int ops = 0; b.n > 0 && ops < 128; ops++) {
        unsigned a = take(&b);
        space_t *s = &spaces[(a >> 4) % SPACES];
        if ((a & 15) == 0 || !s->kv) {
            op_create(&b, s);
            continue;
        }
        if ((a & 15) == 1) {
            op_destroy(s);
            continue;
        }
        req_t *r = &s->r[take(&b) % REQS];
        if (!r->live || (a & 15) == 2) {
            if (!r->live) op_admit(s, &seq);
            else release(s, r);
            continue;
        }
        switch (a & 15) {
        case 3: case 4: case 5: op_append(&b, s, r); break;
        case 6: op_truncate(&b, s, r); break;
        case 7: case 8: case 9: op_tiering(&b, s, r); break;
        case 10: case 11: op_bad(&b, s, r); break;
        case 12: FCHECK(strata_kv_check(s->kv) == STRATA_OK); break;
        default: check_req(s, r); break;
        }
    }
    for (int k = 0; k < SPACES; k++) {
        space_t *s = &spaces[k];
        if (!s->kv) continue;
        FCHECK(strata_kv_check(s->kv) == STRATA_OK);
        for (int j = 0; j < REQS; j++)
            if (s->r[j].live) {
                check_req(s, &s->r[j]);
                release(s, &s->r[j]);
            }
        op_destroy(s);
    }
    FCHECK(stats_of(0).pool_in_use_bytes == pool_in_use);
    return 0;
}

#ifdef STRATA_FUZZ_DRIVER
#include "fuzz_driver.h"
#endif

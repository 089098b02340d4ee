/* KV spaces at the limits of their types (issue 31): counts and their products checked
 * (STRATA_INVALID_ARGUMENT or STRATA_OUT_OF_MEMORY, never an abort or STRATA_INTERNAL), address
 * space running out as STRATA_OUT_OF_MEMORY, a huge disk tier costing no memory up front, full
 * tiers as STRATA_OUT_OF_MEMORY, truncation releasing spilled copies, a failed revocation
 * still reporting its losses, reserved fields, stale handles in strata_kv_queue and what
 * pages_revoked counts. Strict host backend, two 512 MiB devices, 2 MiB pages. */
#define _DEFAULT_SOURCE
#include <stdlib.h>
#include <unistd.h>

#include "common.h"

#define BPT 2048u  /* 8 heads x 128 x 2 bytes */
#define TPB 1024u  /* tokens per 2 MiB block */

static char disk_dir[64];

static strata_kv_config_t config(int durability, uint64_t host, uint64_t disk) {
    strata_kv_config_t c = kv_config(durability, 8, 4, 4096, host, disk ? disk_dir : NULL);
    c.disk_bytes = disk;
    return c;
}

static int create_status(strata_kv_config_t c) {
    strata_kv_t kv = 0;
    int st = strata_kv_create(&c, &kv);
    if (st == STRATA_OK) CHECK_OK(strata_kv_destroy(kv));
    else CHECK(kv == 0);
    return st;
}

static long resident_kib(void) {
    FILE *f = fopen("/proc/self/statm", "r");
    CHECK(f != NULL);
    long size = 0, rss = 0;
    CHECK(fscanf(f, "%ld %ld", &size, &rss) == 2);
    fclose(f);
    return rss * (sysconf(_SC_PAGESIZE) / 1024);
}

static void write_tokens(strata_kv_t kv, strata_kv_request_t r, uint32_t tokens, uint64_t seed) {
    size_t len = (size_t)tokens * BPT;
    unsigned char *buf = malloc(len);
    CHECK(buf != NULL);
    for (int k = 0; k < 2; k++) {
        fill_pattern(buf, len, seed + (uint64_t)k);
        CHECK_OK(strata_kv_write(kv, r, 0, k, 0, buf, len));
    }
    free(buf);
}

static int holds_tokens(strata_kv_t kv, strata_kv_request_t r, uint32_t tokens, uint64_t seed) {
    size_t len = (size_t)tokens * BPT;
    unsigned char *want = malloc(len), *got = malloc(len);
    CHECK(want != NULL && got != NULL);
    int same = 1;
    for (int k = 0; k < 2; k++) {
        fill_pattern(want, len, seed + (uint64_t)k);
        CHECK_OK(strata_kv_read(kv, r, 0, k, 0, got, len, NULL));
        same &= memcmp(want, got, len) == 0;
    }
    free(want);
    free(got);
    return same;
}

/* A new request of `tokens` tokens holding the patterns of `seed`. */
static strata_kv_request_t filled(strata_kv_t kv, uint32_t tokens, uint64_t seed) {
    strata_kv_request_t r;
    CHECK_OK(strata_kv_admit(kv, &r));
    CHECK_OK(strata_kv_append(kv, r, tokens));
    write_tokens(kv, r, tokens, seed);
    return r;
}

/* Item 1 and 2: counts and their products; address space. */
static void shapes(void) {
    strata_kv_config_t c = config(STRATA_KV_LOSSY, 0, 0), b;
    b = c;
    b.layers = UINT32_MAX; /* 2^33 tensors: more address space than any process has */
    CHECK(create_status(b) == STRATA_OUT_OF_MEMORY);
    CHECK_ERR("address space");
    b = c;
    b.max_requests = UINT32_MAX;
    CHECK(create_status(b) == STRATA_OUT_OF_MEMORY);
    b = c;
    b.max_requests = 8;
    b.max_tokens = UINT32_MAX; /* 2^46 bytes per tensor: 2^47 in all */
    CHECK(create_status(b) == STRATA_OUT_OF_MEMORY);
    CHECK_ERR("address space");
    b.max_requests = 4; /* 2^46 bytes in all, 2^25 pages: more than a space's tables take */
    CHECK(create_status(b) == STRATA_INVALID_ARGUMENT);
    CHECK_ERR("pages");
    b = c;
    b.kv_heads = UINT32_MAX;
    b.head_dim = UINT32_MAX;
    b.elem_size = 8;
    CHECK(create_status(b) == STRATA_INVALID_ARGUMENT);
    b = c;
    b.layers = UINT32_MAX;
    b.max_requests = UINT32_MAX;
    b.max_tokens = UINT32_MAX;
    CHECK(create_status(b) == STRATA_INVALID_ARGUMENT); /* the product overflows 64 bits */
    CHECK_ERR("overflow");
    /* Reserved fields are zero. */
    b = c;
    b.reserved = 1;
    CHECK(create_status(b) == STRATA_INVALID_ARGUMENT);
    CHECK_ERR("reserved");
    b = c;
    b.spare[3] = 1;
    CHECK(create_status(b) == STRATA_INVALID_ARGUMENT);
    CHECK_ERR("spare");
}

/* Item 2: the zero page behind every page of a space with more pages than the process may
 * map (vm.max_map_count) runs out of address-space mappings: STRATA_OUT_OF_MEMORY. Not under
 * AddressSanitizer, whose allocator needs new mappings while the process has none left. */
static void mapping_count(void) {
#if defined(__SANITIZE_ADDRESS__)
    printf("kv_limits: mapping count case skipped under AddressSanitizer\n");
    return;
#endif
    FILE *f = fopen("/proc/sys/vm/max_map_count", "r");
    long limit = 0;
    if (f) {
        if (fscanf(f, "%ld", &limit) != 1) limit = 0;
        fclose(f);
    }
    const char *backend = getenv("STRATA_BACKEND");
    if (limit <= 0 || limit > 400000 || (backend && strcmp(backend, "cuda") == 0)) {
        printf("kv_limits: mapping count case skipped (max_map_count %ld, backend %s)\n", limit,
               backend ? backend : "default");
        return;
    }
    /* One head: 256 bytes per token, 8192 tokens per page; two tensors of `pages` pages. */
    uint64_t pages = (uint64_t)limit / 2 + 4096;
    strata_kv_config_t c = kv_config(STRATA_KV_LOSSY, 1, 1, (uint32_t)(pages * 8192), 0, NULL);
    c.disk_bytes = 0;
    CHECK(create_status(c) == STRATA_OUT_OF_MEMORY);
    CHECK_ERR("address space");
}

/* Item 3: a disk tier's size is checked against its filesystem and never wraps a block count;
 * its bookkeeping grows with what it holds. */
static void disk_sizes(void) {
    strata_kv_config_t c = config(STRATA_KV_LOSSY, 8u << 20, 8u << 20);
    c.disk_bytes = UINT64_MAX;
    CHECK(create_status(c) == STRATA_INVALID_ARGUMENT);
    CHECK_ERR("blocks");
    c.disk_bytes = 1ull << 52; /* 2^34 blocks of 256 KiB: a 32-bit count would wrap */
    CHECK(create_status(c) == STRATA_INVALID_ARGUMENT);
    c.disk_bytes = 1ull << 46;
    long before = resident_kib();
    strata_kv_t kv = 0;
    int st = strata_kv_create(&c, &kv);
    long grew = resident_kib() - before;
    if (st == STRATA_OK) CHECK_OK(strata_kv_destroy(kv));
    else CHECK(st == STRATA_OUT_OF_MEMORY && kv == 0);
    printf("kv_limits: disk_bytes 2^46: status %d, resident memory +%ld KiB\n", st, grew);
    CHECK(grew < 64 * 1024);
}

/* Item 4: a full tier is STRATA_OUT_OF_MEMORY, whichever it is, with the blocks left as they
 * were. */
static void full_tiers(void) {
    /* Host 4 MiB (one block of two tensors), disk 4 MiB. */
    strata_kv_config_t c = config(STRATA_KV_LOSSY, 4u << 20, 4u << 20);
    strata_kv_t kv;
    CHECK_OK(strata_kv_create(&c, &kv));
    strata_kv_request_t r = filled(kv, 3 * TPB, 10);
    CHECK(strata_kv_spill(kv, r, STRATA_TIER_DISK) == STRATA_OUT_OF_MEMORY);
    CHECK(holds_tokens(kv, r, 3 * TPB, 10));
    CHECK(strata_kv_spill(kv, r, STRATA_TIER_HOST) == STRATA_OUT_OF_MEMORY);
    CHECK(holds_tokens(kv, r, 3 * TPB, 10));
    CHECK_OK(strata_kv_check(kv));
    CHECK_OK(strata_kv_destroy(kv));
    /* No disk tier: the host tier alone. */
    c = config(STRATA_KV_LOSSY, 4u << 20, 0);
    CHECK_OK(strata_kv_create(&c, &kv));
    r = filled(kv, 2 * TPB, 20);
    CHECK(strata_kv_spill(kv, r, STRATA_TIER_HOST) == STRATA_OUT_OF_MEMORY);
    CHECK(strata_kv_spill(kv, r, STRATA_TIER_DISK) == STRATA_INVALID_STATE); /* no disk tier */
    CHECK_ERR("without a disk tier");
    CHECK(strata_kv_spill_idle(kv, 0, STRATA_TIER_DISK, NULL) == STRATA_INVALID_STATE);
    CHECK(holds_tokens(kv, r, 2 * TPB, 20));
    CHECK_OK(strata_kv_check(kv));
    CHECK_OK(strata_kv_destroy(kv));
}

/* Item 5: truncating a spilled request releases the spilled copies past the new end, the
 * partly kept last block's surplus chunks included. */
static void truncate_spilled(void) {
    strata_kv_config_t c = config(STRATA_KV_LOSSY, 64u << 20, 64u << 20);
    strata_kv_t kv;
    CHECK_OK(strata_kv_create(&c, &kv));
    strata_kv_request_t r = filled(kv, 3 * TPB - 100, 30);
    for (int tier = STRATA_TIER_HOST; tier <= STRATA_TIER_DISK; tier++) {
        CHECK_OK(strata_kv_spill(kv, r, tier));
        CHECK_OK(strata_kv_truncate(kv, r, TPB + 100)); /* block 1 keeps 100 tokens */
        CHECK_OK(strata_kv_check(kv));
        strata_kv_stats_t s = kv_stats(kv);
        /* Block 0 whole (8 chunks of 256 KiB per tensor), block 1 one chunk per tensor. */
        CHECK(s.host_used_bytes + s.disk_used_bytes >= 2 * 9 * (256u << 10));
        CHECK(s.host_used_bytes <= 2 * 9 * (256u << 10) && s.disk_used_bytes <= 2 * 9 * (256u << 10));
        CHECK(holds_tokens(kv, r, TPB + 100, 30));
        CHECK_OK(strata_kv_make_resident(kv, &r, 1, NULL));
        CHECK(holds_tokens(kv, r, TPB + 100, 30));
        CHECK_OK(strata_kv_append(kv, r, 2 * TPB - 200));
        write_tokens(kv, r, 3 * TPB - 100, 30);
    }
    CHECK_OK(strata_kv_spill(kv, r, STRATA_TIER_HOST));
    CHECK_OK(strata_kv_truncate(kv, r, 0));
    CHECK_OK(strata_kv_check(kv));
    strata_kv_stats_t s = kv_stats(kv);
    CHECK(s.host_used_bytes == 0 && s.disk_used_bytes == 0);
    CHECK_OK(strata_kv_destroy(kv));
}

/* Items 1 and 6 and pages_revoked: huge revocations fail cleanly; one that loses blocks, then
 * fails, still reports them; one the device has room for takes nothing and counts nothing. */
static void revocations(void) {
    strata_kv_config_t c = config(STRATA_KV_LOSSY, 0, 0);
    strata_kv_t kv;
    CHECK_OK(strata_kv_create(&c, &kv));
    strata_kv_request_t r = filled(kv, 2 * TPB, 40);
    CHECK_OK(strata_kv_advance(kv, 1));
    uint64_t lost = 99;
    /* The device has room: the pages come from it, the request keeps its blocks. */
    CHECK_OK(strata_kv_revoke(kv, 4, &lost));
    CHECK(lost == 0);
    CHECK(kv_stats(kv).pages_revoked == 0);
    CHECK(holds_tokens(kv, r, 2 * TPB, 40));
    /* More than the device holds: everything on the way is lost, reported, then the error. */
    lost = 99;
    CHECK(strata_kv_revoke(kv, 1ull << 30, &lost) == STRATA_OUT_OF_MEMORY);
    CHECK(lost == 2);
    CHECK(kv_stats(kv).pages_revoked == 4 && kv_stats(kv).lost_blocks == 2);
    uint32_t blocks[4];
    size_t n = 0;
    CHECK_OK(strata_kv_take_lost(kv, r, blocks, 4, &n));
    CHECK(n == 2 && blocks[0] == 0 && blocks[1] == 1);
    lost = 99;
    CHECK(strata_kv_revoke(kv, UINT64_MAX, &lost) == STRATA_OUT_OF_MEMORY);
    CHECK(lost == 0);
    CHECK_OK(strata_kv_make_resident(kv, &r, 1, NULL));
    CHECK_OK(strata_kv_check(kv));
    CHECK_OK(strata_kv_destroy(kv));
    /* A Backed space reports 0 lost whatever happens. */
    c = config(STRATA_KV_BACKED, 64u << 20, 0);
    CHECK_OK(strata_kv_create(&c, &kv));
    lost = 99;
    CHECK(strata_kv_revoke(kv, UINT64_MAX, &lost) == STRATA_OUT_OF_MEMORY);
    CHECK(lost == 0);
    CHECK_OK(strata_kv_destroy(kv));
}

/* strata_kv_queue refuses released requests, as strata_kv_stage does, keeping its queue. */
static void stale_queue(void) {
    strata_kv_config_t c = config(STRATA_KV_LOSSY, 0, 0);
    strata_kv_t kv;
    CHECK_OK(strata_kv_create(&c, &kv));
    strata_kv_request_t r[2];
    CHECK_OK(strata_kv_admit(kv, &r[0]));
    CHECK_OK(strata_kv_admit(kv, &r[1]));
    CHECK_OK(strata_kv_queue(kv, r, 2));
    CHECK_OK(strata_kv_release(kv, r[1]));
    CHECK(strata_kv_stage(kv, &r[1], 1, NULL) == STRATA_INVALID_HANDLE);
    CHECK(strata_kv_queue(kv, r, 2) == STRATA_INVALID_HANDLE);
    CHECK(strata_kv_queue(kv, &r[1], 1) == STRATA_INVALID_HANDLE);
    CHECK_OK(strata_kv_queue(kv, r, 1));
    CHECK_OK(strata_kv_destroy(kv));
}

int main(void) {
    strcpy(disk_dir, "/tmp/strata-kv-limits-XXXXXX");
    CHECK(mkdtemp(disk_dir) != NULL);
    shapes();
    disk_sizes();
    full_tiers();
    truncate_spilled();
    revocations();
    stale_queue();
    mapping_count();
    rmdir(disk_dir);
    printf("kv_limits: ok\n");
    return 0;
}

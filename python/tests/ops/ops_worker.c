/* A strata process for the operators' tests (test_ops.py): allocations under three tags, one
 * asleep ("cache"), one offloaded to host memory ("moved", 2 MiB), and one KV space with tokens,
 * then allocations on request.
 *
 *   ops_worker WEIGHTS_MIB CACHE_MIB KV_TOKENS
 *
 * Prints "ready ALLOCATED RESERVED POOL_IN_USE" (strata_stats of device 0), then reads lines:
 * "alloc BYTES" answers "ok" or "fail MESSAGE"; "quit" (or end of input) exits. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "strata.h"

static void die(const char *what) {
    fprintf(stderr, "ops_worker: %s: %s\n", what, strata_last_error());
    exit(1);
}

static void *tagged(const char *tag, size_t bytes) {
    if (strata_tag_push(tag) != 0) die("tag push");
    void *p = strata_malloc(bytes, 0, NULL);
    if (!p) die("malloc");
    if (strata_tag_pop() != 0) die("tag pop");
    return p;
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: ops_worker WEIGHTS_MIB CACHE_MIB KV_TOKENS\n");
        return 2;
    }
    size_t weights = strtoull(argv[1], NULL, 10) << 20, cache = strtoull(argv[2], NULL, 10) << 20;
    uint32_t tokens = (uint32_t)strtoul(argv[3], NULL, 10);
    tagged("weights", weights);
    tagged("cache", cache);
    if (strata_sleep("cache", 1) != 0) die("sleep");
    tagged("moved", 2u << 20);
    if (strata_offload("moved", STRATA_TIER_HOST, NULL) != 0) die("offload");

    strata_kv_config_t c;
    memset(&c, 0, sizeof c);
    c.durability = STRATA_KV_BACKED;
    c.layers = 1;
    c.kv_heads = 8;
    c.head_dim = 128;
    c.elem_size = 2;
    c.max_requests = 2;
    c.max_tokens = 8192;
    strata_kv_t kv;
    strata_kv_request_t r;
    if (strata_kv_create(&c, &kv) != 0) die("kv create");
    if (strata_kv_admit(kv, &r) != 0) die("kv admit");
    if (strata_kv_append(kv, r, tokens) != 0) die("kv append");

    strata_stats_t s;
    if (strata_stats(0, &s) != 0) die("stats");
    printf("ready %llu %llu %llu\n", (unsigned long long)s.allocated_bytes,
           (unsigned long long)s.reserved_bytes, (unsigned long long)s.pool_in_use_bytes);
    fflush(stdout);

    char line[128];
    while (fgets(line, sizeof line, stdin)) {
        unsigned long long bytes;
        if (sscanf(line, "alloc %llu", &bytes) == 1) {
            void *p = strata_malloc(bytes, 0, NULL);
            if (p) printf("ok\n");
            else printf("fail %s\n", strata_last_error());
            fflush(stdout);
        } else if (strncmp(line, "quit", 4) == 0) {
            break;
        }
    }
    return 0;
}

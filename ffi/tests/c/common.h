/* Helpers shared by the C tests of the strata C API. Each test is a program: exit 0 = pass.
 * Device memory is never dereferenced (the host backend's strict mode would fault, as a GPU
 * would): contents move with strata_memcpy_htod / strata_memcpy_dtoh. */
#ifndef STRATA_TEST_COMMON_H
#define STRATA_TEST_COMMON_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "strata.h"

#define CHECK(cond)                                                                        \
    do {                                                                                   \
        if (!(cond)) {                                                                     \
            fprintf(stderr, "%s:%d: CHECK(%s) failed; last error: %s\n", __FILE__, __LINE__, \
                    #cond, strata_last_error());                                           \
            exit(1);                                                                       \
        }                                                                                  \
    } while (0)

#define CHECK_OK(call) CHECK((call) == STRATA_OK)

/* The last error mentions `needle`. */
#define CHECK_ERR(needle) CHECK(strstr(strata_last_error(), (needle)) != NULL)

/* Deterministic byte pattern of `seed` (xorshift64*). */
static inline void fill_pattern(unsigned char *buf, size_t len, uint64_t seed) {
    uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
    for (size_t i = 0; i < len; i++) {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        buf[i] = (unsigned char)((x * 0x2545F4914F6CDD1Dull) >> 56);
    }
}

/* Writes the pattern of `seed` over the first `len` bytes of device memory `ptr`. */
static inline void put_pattern(void *ptr, size_t len, uint64_t seed) {
    unsigned char *buf = malloc(len ? len : 1);
    CHECK(buf != NULL);
    fill_pattern(buf, len, seed);
    CHECK_OK(strata_memcpy_htod(ptr, buf, len));
    free(buf);
}

/* True when the first `len` bytes of device memory `ptr` hold the pattern of `seed`. */
static inline int has_pattern(const void *ptr, size_t len, uint64_t seed) {
    unsigned char *want = malloc(len ? len : 1), *got = malloc(len ? len : 1);
    CHECK(want != NULL && got != NULL);
    fill_pattern(want, len, seed);
    CHECK_OK(strata_memcpy_dtoh(got, ptr, len));
    int same = memcmp(want, got, len) == 0;
    free(want);
    free(got);
    return same;
}

/* True when the first `len` bytes of device memory `ptr` are zero. */
static inline int is_zero(const void *ptr, size_t len) {
    unsigned char *got = malloc(len ? len : 1);
    CHECK(got != NULL);
    CHECK_OK(strata_memcpy_dtoh(got, ptr, len));
    for (size_t i = 0; i < len; i++) {
        if (got[i] != 0) {
            free(got);
            return 0;
        }
    }
    free(got);
    return 1;
}

static inline strata_stats_t stats_of(int device) {
    strata_stats_t s;
    memset(&s, 0xAB, sizeof s);
    CHECK_OK(strata_stats(device, &s));
    return s;
}

/* Fills device `device` under tag "hog" (64 MiB blocks, then 2 MiB ones) until it refuses,
 * whatever its size: the blocks go into hog[0..cap), their number is returned (fewer than
 * `cap`: the device is full). free_all frees them. */
static inline int fill_device(int device, void **hog, int cap) {
    int n = 0;
    CHECK_OK(strata_tag_push("hog"));
    while (n < cap && (hog[n] = strata_malloc(64 << 20, device, NULL)) != NULL)
        n++;
    while (n < cap && (hog[n] = strata_malloc(2 << 20, device, NULL)) != NULL)
        n++;
    CHECK_OK(strata_tag_pop());
    CHECK(n < cap);
    return n;
}

/* Frees blocks[0..n) of `device`, then empties the cache (the memory goes back to the device). */
static inline void free_all(int device, void **blocks, int n) {
    for (int i = 0; i < n; i++)
        CHECK_OK(strata_free_checked(blocks[i], 0, device, NULL));
    strata_empty_cache();
}

/* The number of devices the test runner expects (STRATA_TEST_DEVICES: the host backend's two,
 * or what the CUDA driver reports); 2 when unset (the host backend's test configuration). */
static inline int test_devices(void) {
    const char *n = getenv("STRATA_TEST_DEVICES");
    return n && *n ? atoi(n) : 2;
}

/* True when device 1 exists; otherwise prints the named skip of `what` (which gpu-run lists). */
static inline int second_device(const char *what) {
    if (strata_device_count() >= 2) return 1;
    printf("skipped %s: needs a second device; this machine has %d\n", what, strata_device_count());
    return 0;
}

static inline strata_kv_stats_t kv_stats(strata_kv_t kv) {
    strata_kv_stats_t s;
    CHECK_OK(strata_kv_stats(kv, &s));
    return s;
}

/* Small deterministic PRNG for the walks. */
static inline uint64_t next_rand(uint64_t *state) {
    uint64_t x = *state;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return *state = x;
}

/* A KV space of one layer of `kv_heads` heads x 128 x 2 bytes on device 0, with the zero page
 * and host and disk tiers of `tier_bytes` each (the disk tier's file in `disk_dir`). */
static inline strata_kv_config_t kv_config(int durability, uint32_t kv_heads, uint32_t max_requests,
                                           uint32_t max_tokens, uint64_t tier_bytes,
                                           const char *disk_dir) {
    strata_kv_config_t c;
    memset(&c, 0, sizeof c);
    c.durability = durability;
    c.layers = 1;
    c.kv_heads = kv_heads;
    c.head_dim = 128;
    c.elem_size = 2;
    c.max_requests = max_requests;
    c.max_tokens = max_tokens;
    c.zero_page = 1;
    c.host_bytes = tier_bytes;
    c.disk_bytes = tier_bytes;
    c.disk_dir = disk_dir;
    return c;
}

#endif

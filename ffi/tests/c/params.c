/* MIRAGE parameters through the C API: bad input, registration, the idle budget from a prefill
 * report, an idle model's layers remapped to the device pool under KV pressure (the serving
 * model untouched), every layer readable with its bytes through prepare_layer / layer_done on a
 * stream, then with the look-ahead (prepare_next) and its counters, dynamic reversion after the
 * pool let its pages go (empty_cache), reversion of everything, unregistering. */
#include <stdlib.h>

#include "common.h"

#define LAYERS 8
#define LAYER_BYTES (3u << 20) /* rounded up to 2 pages of 2 MiB */

static strata_params_model_stats_t stats_of_model(strata_model_t m) {
    strata_params_model_stats_t s;
    memset(&s, 0xAB, sizeof s);
    CHECK_OK(strata_params_model_stats(m, &s));
    return s;
}

static void check_layer(strata_model_t m, uint32_t layer, unsigned char *want, unsigned char *got) {
    fill_pattern(want, LAYER_BYTES, 900 + layer);
    CHECK_OK(strata_params_read(m, layer, 0, got, LAYER_BYTES));
    CHECK(memcmp(want, got, LAYER_BYTES) == 0);
}

int main(void) {
    unsigned char *host[LAYERS];
    const void *ptrs[LAYERS];
    for (int l = 0; l < LAYERS; l++) {
        host[l] = malloc(LAYER_BYTES);
        CHECK(host[l] != NULL);
        fill_pattern(host[l], LAYER_BYTES, 900 + (uint64_t)l);
        ptrs[l] = host[l];
    }
    unsigned char *want = malloc(LAYER_BYTES), *got = malloc(LAYER_BYTES);
    CHECK(want != NULL && got != NULL);
    strata_model_t idle = 0, serving = 0;

    CHECK(strata_params_register(0, LAYERS, LAYER_BYTES, 4, ptrs, NULL) == STRATA_INVALID_ARGUMENT);
    CHECK(strata_params_register(0, LAYERS, LAYER_BYTES, 4, NULL, &idle) == STRATA_INVALID_ARGUMENT);
    CHECK(strata_params_register(0, 0, LAYER_BYTES, 4, ptrs, &idle) == STRATA_INVALID_ARGUMENT);
    CHECK(strata_params_register(9, LAYERS, LAYER_BYTES, 4, ptrs, &idle) == STRATA_NO_DEVICE);
    const void *holes[2] = {host[0], NULL};
    CHECK(strata_params_register(0, 2, LAYER_BYTES, 1, holes, &idle) == STRATA_INVALID_ARGUMENT);
    CHECK_ERR("host_layers[1] is NULL");
    CHECK(strata_params_set_active(0, 1) == STRATA_INVALID_HANDLE);
    CHECK(strata_params_set_active(0x100000005ull, 1) == STRATA_INVALID_HANDLE);
    CHECK(strata_params_set_active(0x900000001ull, 1) == STRATA_INVALID_HANDLE); /* device 8 */

    CHECK_OK(strata_params_register(0, LAYERS, LAYER_BYTES, 4, ptrs, &idle));
    CHECK_OK(strata_params_register(0, 2, LAYER_BYTES, 2, ptrs, &serving));
    CHECK(idle != serving);
    strata_params_model_stats_t s = stats_of_model(idle);
    CHECK(s.layers == LAYERS && s.layer_bytes == 4u << 20 && s.pages_per_layer == 2);
    CHECK(s.remapped_layers == 0 && s.remap_limit == 0 && s.device == 0);
    uint64_t gpu_before = s.gpu_pages;
    for (uint32_t l = 0; l < LAYERS; l++) check_layer(idle, l, want, got);
    CHECK(strata_params_read(idle, 0, (4u << 20) - 4, got, 8) == STRATA_INVALID_ARGUMENT);
    CHECK(strata_params_read(idle, LAYERS, 0, got, 8) == STRATA_INVALID_ARGUMENT);

    /* Without compute reports nothing may be remapped. */
    uint32_t decisions = 99;
    CHECK_OK(strata_params_step(0, 4, &decisions));
    CHECK(decisions == 0 && stats_of_model(idle).remapped_layers == 0);

    /* T_T was measured at registration. An idle model's budget is its prefill time when it
     * reported one (MIRAGE 5.3), else n x T_c. */
    CHECK(stats_of_model(idle).transfer_ns > 0);
    CHECK_OK(strata_params_report_compute(idle, 1));
    CHECK(stats_of_model(idle).remap_limit == 0);
    CHECK_OK(strata_params_report_prefill(idle, 3600000000000ull));
    CHECK(stats_of_model(idle).remap_limit == 4);
    CHECK(strata_params_report_prefill(0, 1) == STRATA_INVALID_HANDLE);

    /* Nothing streams yet: the look-ahead has nothing to prepare. Bad input is refused. */
    uint32_t next = 0;
    CHECK_OK(strata_params_prepare_next(idle, 0, &next));
    CHECK(next == STRATA_PARAMS_NO_LAYER);
    CHECK(strata_params_prepare_next(idle, LAYERS, &next) == STRATA_INVALID_ARGUMENT);
    CHECK_ERR("no layer 8");
    CHECK(strata_params_prepare_next(idle, 0, NULL) == STRATA_INVALID_ARGUMENT);
    CHECK(strata_params_prepare_next(0, 0, &next) == STRATA_INVALID_HANDLE);

    CHECK_OK(strata_params_set_active(serving, 1));
    CHECK_OK(strata_params_report_compute(serving, 50000000));
    CHECK_OK(strata_params_report_compute(idle, 50000000));
    CHECK(stats_of_model(idle).remap_limit >= 2);
    uint64_t pool_before = stats_of(0).pool_free_bytes;
    CHECK_OK(strata_params_step(0, 4, &decisions));
    CHECK(decisions == 1);
    s = stats_of_model(idle);
    CHECK(s.remapped_layers >= 2 && s.streamed_layers > s.remapped_layers && s.slots >= 1);
    CHECK(s.gpu_pages + 2 * s.remapped_layers == gpu_before);
    CHECK(stats_of(0).pool_free_bytes >= pool_before + 4 * (2u << 20));
    CHECK(stats_of_model(serving).remapped_layers == 0);

    /* Every layer, streamed or not, comes with its bytes through prepare/done on a stream. */
    cudaStream_t st;
    CHECK_OK(strata_stream_create(0, &st));
    for (int pass = 0; pass < 2; pass++) {
        for (uint32_t l = 0; l < LAYERS; l++) {
            CHECK_OK(strata_params_prepare_layer(idle, l, st));
            CHECK_OK(strata_stream_synchronize(st));
            uint64_t p = 0;
            CHECK_OK(strata_params_layer_ptr(idle, l, &p));
            CHECK(p != 0);
            check_layer(idle, l, want, got);
            CHECK_OK(strata_params_layer_done(idle, l, st));
        }
    }
    CHECK(strata_params_prepare_layer(idle, LAYERS, st) == STRATA_INVALID_ARGUMENT);
    CHECK(strata_params_layer_done(idle, LAYERS, st) == STRATA_INVALID_ARGUMENT);
    CHECK_ERR("no layer");
    CHECK(strata_params_layer_done(idle, UINT32_MAX, st) == STRATA_INVALID_ARGUMENT);
    s = stats_of_model(idle);
    uint64_t m = s.streamed_layers;
    CHECK(s.streamed_runs == 2 * m && s.slot_loads == 2 * m);
    CHECK(s.loads_ahead == 0 && s.found_prepared == 0);

    /* With the look-ahead after each layer's done, every streamed layer but the first is loaded
     * (or loading) when asked for; the last one's look-ahead loads the next token's first. */
    for (uint32_t l = 0; l < LAYERS; l++) {
        CHECK_OK(strata_params_prepare_layer(idle, l, st));
        CHECK_OK(strata_stream_synchronize(st));
        check_layer(idle, l, want, got);
        CHECK_OK(strata_params_layer_done(idle, l, st));
        uint32_t after = l;
        for (uint32_t k = 0; k < s.slots; k++) {
            CHECK_OK(strata_params_prepare_next(idle, after, &next));
            if (next == STRATA_PARAMS_NO_LAYER) break;
            CHECK(next < LAYERS);
            after = next;
        }
    }
    s = stats_of_model(idle);
    CHECK(s.streamed_runs == 3 * m && s.found_prepared == m - 1 && s.loads_ahead >= m);
    CHECK(s.slot_loads == 2 * m + 1 + s.loads_ahead);
    CHECK(s.load_waits <= s.streamed_runs);

    /* Dynamic reversion: the pool gives its free pages (the reclaimed ones among them) back to
     * the driver, yet the device has room, so a step without a shortage brings every layer
     * back. It used to count the pool's free pages only, and wait for ever. */
    CHECK_OK(strata_stream_synchronize(st));
    strata_empty_cache();
    CHECK(stats_of(0).pool_free_bytes == 0);
    CHECK_OK(strata_params_step(0, 0, &decisions));
    CHECK(decisions == 1);
    s = stats_of_model(idle);
    CHECK(s.remapped_layers == 0 && s.gpu_pages == gpu_before);
    for (uint32_t l = 0; l < LAYERS; l++) check_layer(idle, l, want, got);

    /* Reversion of everything at once: pages back, layers at their own addresses again with
     * their bytes. */
    CHECK_OK(strata_params_step(0, 4, &decisions));
    CHECK(decisions == 1 && stats_of_model(idle).remapped_layers >= 2);
    CHECK_OK(strata_params_revert_all(0));
    s = stats_of_model(idle);
    CHECK(s.remapped_layers == 0 && s.gpu_pages == gpu_before);
    for (uint32_t l = 0; l < LAYERS; l++) check_layer(idle, l, want, got);
    CHECK(strata_params_revert_all(7) == STRATA_NO_DEVICE);

    /* Unregistering: refused while serving; then every page back to the pool, handle stale. */
    CHECK(strata_params_unregister(serving, NULL) == STRATA_INVALID_STATE);
    CHECK_ERR("active");
    CHECK_OK(strata_params_set_active(serving, 0));
    uint64_t in_use = stats_of(0).pool_in_use_bytes, returned = 0;
    CHECK_OK(strata_params_unregister(idle, &returned));
    CHECK(returned == gpu_before);
    CHECK(stats_of(0).pool_in_use_bytes == in_use - returned * (2u << 20));
    CHECK(strata_params_model_stats(idle, &s) == STRATA_INVALID_HANDLE);
    CHECK(strata_params_unregister(idle, NULL) == STRATA_INVALID_HANDLE);
    CHECK(strata_params_set_active(idle, 1) == STRATA_INVALID_HANDLE);
    CHECK_OK(strata_params_unregister(serving, NULL));
    CHECK(stats_of(0).pool_in_use_bytes == in_use - (returned + 4) * (2u << 20));
    CHECK_OK(strata_stream_destroy(st));
    for (int l = 0; l < LAYERS; l++) free(host[l]);
    free(want);
    free(got);
    printf("params: ok\n");
    return 0;
}

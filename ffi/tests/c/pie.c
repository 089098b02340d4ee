/* Pie's controller through the C API: bad input, the FIFO protocol keeping at most the budget's
 * layers on the device over many tokens with every layer on the device when it runs,
 * adaptive expansion above the floor, and TierKV's overlap condition from measured times. */
#include "common.h"

#define LAYERS 6

static int state(strata_pie_t p, uint32_t layer) {
    int s = -1;
    CHECK_OK(strata_pie_state(p, layer, &s));
    return s;
}

int main(void) {
    strata_pie_t p = 0;
    strata_pie_decision_t d;
    uint32_t m = 99;

    CHECK(strata_pie_create(0, 0, &p) == STRATA_INVALID_ARGUMENT);
    CHECK(strata_pie_create(LAYERS, LAYERS, &p) == STRATA_INVALID_ARGUMENT);
    CHECK_ERR("layers");
    CHECK(strata_pie_create(LAYERS, 0, NULL) == STRATA_INVALID_ARGUMENT);
    CHECK_OK(strata_pie_create(LAYERS, 0, &p));
    CHECK(p != 0);
    CHECK(strata_pie_set_floor(p, LAYERS, &m) == STRATA_INVALID_ARGUMENT);
    CHECK(strata_pie_layer_start(p, LAYERS, &d) == STRATA_INVALID_ARGUMENT);
    CHECK(strata_pie_layer_start(p, 0, NULL) == STRATA_INVALID_ARGUMENT);
    CHECK(strata_pie_swap_done(p, 0) == STRATA_INVALID_STATE);
    CHECK(strata_pie_swap_done(p, 7) == STRATA_INVALID_ARGUMENT);
    CHECK(strata_pie_state(p, 0, NULL) == STRATA_INVALID_ARGUMENT);
    CHECK(strata_pie_observe(p, 0, -1.0, &m) == STRATA_INVALID_ARGUMENT);
    CHECK(state(p, 0) == STRATA_PIE_GPU);

    /* Room for two layers: swaps finish right away (the caller's copies are instant here); a
     * layer not on the device when it starts is waited for by asking again. */
    CHECK_OK(strata_pie_set_floor(p, LAYERS - 2, &m));
    CHECK(m == LAYERS - 2);
    int swap_ins = 0;
    for (int step = 0; step < 20 * LAYERS; step++) {
        uint32_t k = (uint32_t)(step % LAYERS);
        for (int tries = 0;; tries++) {
            CHECK(tries < 8);
            CHECK_OK(strata_pie_layer_start(p, k, &d));
            if (d.swap_out >= 0) {
                CHECK((uint32_t)d.swap_out != k);
                CHECK(state(p, (uint32_t)d.swap_out) == STRATA_PIE_SWAPPING_OUT);
                CHECK_OK(strata_pie_swap_done(p, 1));
            }
            if (d.swap_in >= 0) {
                CHECK(state(p, (uint32_t)d.swap_in) == STRATA_PIE_SWAPPING_IN);
                CHECK_OK(strata_pie_swap_done(p, 0));
                swap_ins++;
            }
            if (state(p, k) == STRATA_PIE_GPU)
                break;
        }
        int held = 0;
        for (uint32_t l = 0; l < LAYERS; l++)
            held += state(p, l) != STRATA_PIE_CPU;
        CHECK(held <= 2 || step < LAYERS); /* the first pass sheds the layers over budget */
    }
    /* After the first pass every token brings in the four layers that are not kept. */
    CHECK(swap_ins >= 19 * (LAYERS - 2));
    CHECK_OK(strata_pie_destroy(p));
    CHECK(strata_pie_destroy(p) == STRATA_INVALID_HANDLE);
    CHECK(strata_pie_layer_start(p, 0, &d) == STRATA_INVALID_HANDLE);

    /* Adaptive expansion: a step without a wait adds a CPU layer, a wait takes it back. */
    CHECK_OK(strata_pie_create(LAYERS, 3, &p));
    CHECK_OK(strata_pie_observe(p, 0, 50.0, &m));
    CHECK(m == 1);
    CHECK_OK(strata_pie_observe(p, 0, 50.0, &m)); /* settling */
    CHECK_OK(strata_pie_observe(p, 1, 40.0, &m));
    CHECK(m == 0);
    CHECK_OK(strata_pie_set_floor(p, 2, NULL));
    CHECK_OK(strata_pie_observe(p, 0, 50.0, &m));
    CHECK(m == 2);
    CHECK_OK(strata_pie_destroy(p));
    /* TierKV's overlap condition from the controller's measurements: 2 ms per layer; 1 MiB
     * crosses host -> device in 3 ms and 2 MiB in 5 ms (1 ms + 2 ms per MiB). */
    CHECK_OK(strata_pie_create(4, 0, &p));
    strata_pie_overlap_t o;
    CHECK_OK(strata_pie_overlap(p, 0, 2, 1u << 20, 0, &o));
    CHECK(o.steps == -1 && o.fits == -1 && o.t_transfer < 0 && o.window < 0);
    for (uint32_t l = 0; l < 4; l++)
        CHECK_OK(strata_pie_observe_compute(p, l, 2e-3));
    CHECK_OK(strata_pie_observe_transfer(p, STRATA_PIE_HOST_TO_DEVICE, 1u << 20, 3e-3));
    CHECK_OK(strata_pie_observe_transfer(p, STRATA_PIE_HOST_TO_DEVICE, 2u << 20, 5e-3));
    CHECK_OK(strata_pie_overlap(p, 1, 2, 1u << 20, 0, &o));
    CHECK(o.fits == 0 && o.steps == 2); /* one layer (2 ms) does not hide 3 ms; two do */
    CHECK(o.t_transfer > 2.9e-3 && o.t_transfer < 3.1e-3 && o.window > 1.9e-3 && o.window < 2.1e-3);
    CHECK_OK(strata_pie_overlap(p, 0, 2, 1u << 20, 0, &o));
    CHECK(o.fits == 1);
    /* Blocks on disk need the disk link, not measured yet. */
    CHECK_OK(strata_pie_overlap(p, 0, 2, 0, 1u << 20, &o));
    CHECK(o.steps == -1 && o.fits == -1);
    CHECK_OK(strata_pie_observe_transfer(p, STRATA_PIE_DISK_TO_HOST, 1u << 20, 5e-4));
    CHECK_OK(strata_pie_overlap(p, 0, 2, 0, 1u << 20, &o));
    CHECK(o.fits == 1 && o.steps == 2); /* 3 + 0.5 ms: hidden by two layers (4 ms) */
    CHECK(strata_pie_observe_transfer(p, 2, 1, 1.0) == STRATA_INVALID_ARGUMENT);
    CHECK(strata_pie_observe_compute(p, 4, 1.0) == STRATA_INVALID_ARGUMENT);
    CHECK(strata_pie_overlap(p, 0, 1, 0, 0, NULL) == STRATA_INVALID_ARGUMENT);
    CHECK_OK(strata_pie_destroy(p));
    printf("pie: ok\n");
    return 0;
}

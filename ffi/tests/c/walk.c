/* Random malloc/free walks with fill patterns on both devices, under changing tags, with the
 * stats checked against a model after every step. */
#include "common.h"

#define SLOTS 96
#define STEPS 3000
#define CHECKED 4096

typedef struct {
    void *ptr;
    size_t size;
    int device;
    int tag; /* -1: untagged */
    uint64_t seed;
} slot_t;

static const char *TAGS[] = {"walk-a", "walk-b", "walk-c"};

static size_t pick_size(uint64_t *rng) {
    uint64_t r = next_rand(rng);
    switch (r % 8) {
    case 0: return 1 + (r >> 8) % 256;
    case 1:
    case 2: return 1 + (r >> 8) % 8192;
    case 3:
    case 4: return 1 + (r >> 8) % (1 << 20);
    case 5: return (1 << 20) + (r >> 8) % (6 << 20);
    case 6: return 256 * (1 + (r >> 8) % 64);
    default: return 2u << 20;
    }
}

int main(void) {
    uint64_t rng = 0x5EED1234ABCDull;
    slot_t slots[SLOTS];
    memset(slots, 0, sizeof slots);
    uint64_t base[2], live_base[2], model[2] = {0, 0}, live_model[2] = {0, 0};
    for (int d = 0; d < 2; d++) {
        strata_stats_t s = stats_of(d);
        base[d] = s.allocated_bytes;
        live_base[d] = s.live_allocations;
    }
    uint64_t tag_model[3] = {0, 0, 0};
    int depth = 0;
    for (int step = 0; step < STEPS; step++) {
        uint64_t r = next_rand(&rng);
        int i = (int)(r % SLOTS);
        slot_t *s = &slots[i];
        if ((r >> 20) % 16 == 0) {
            /* Change the thread's tag stack. */
            if (depth > 0 && (r >> 30) % 2 == 0) {
                CHECK_OK(strata_tag_pop());
                depth--;
            } else if (depth < 3) {
                CHECK_OK(strata_tag_push(TAGS[depth]));
                depth++;
            }
            CHECK(strata_tag_depth() == depth);
            continue;
        }
        if (s->ptr == NULL) {
            size_t size = pick_size(&rng);
            int device = (int)((r >> 40) % 2);
            void *p = strata_malloc(size, device, NULL);
            CHECK(p != NULL);
            CHECK(((uintptr_t)p % 256) == 0);
            for (int j = 0; j < SLOTS; j++) CHECK(slots[j].ptr != p);
            s->ptr = p;
            s->size = size;
            s->device = device;
            s->tag = depth - 1;
            s->seed = r;
            put_pattern(p, size < CHECKED ? size : CHECKED, r);
            model[device] += size;
            live_model[device]++;
            if (s->tag >= 0 && device == 0) tag_model[s->tag] += size;
        } else {
            size_t len = s->size < CHECKED ? s->size : CHECKED;
            CHECK(has_pattern(s->ptr, len, s->seed));
            CHECK_OK(strata_free_checked(s->ptr, s->size, s->device, NULL));
            model[s->device] -= s->size;
            live_model[s->device]--;
            if (s->tag >= 0 && s->device == 0) tag_model[s->tag] -= s->size;
            s->ptr = NULL;
        }
        if (step % 7 == 0) {
            for (int d = 0; d < 2; d++) {
                strata_stats_t st = stats_of(d);
                CHECK(st.allocated_bytes == base[d] + model[d]);
                CHECK(st.live_allocations == live_base[d] + live_model[d]);
                CHECK(st.reserved_bytes >= st.allocated_block_bytes);
            }
            for (int t = 0; t < 3; t++) {
                strata_tag_stats_t ts;
                if (strata_tag_stats(TAGS[t], 0, &ts) == STRATA_OK) {
                    CHECK(ts.allocated_bytes == tag_model[t]);
                    CHECK(ts.tag_id >= 1);
                }
            }
        }
        if (step % 500 == 499) strata_empty_cache();
    }
    for (int i = 0; i < SLOTS; i++) {
        if (slots[i].ptr) {
            size_t len = slots[i].size < CHECKED ? slots[i].size : CHECKED;
            CHECK(has_pattern(slots[i].ptr, len, slots[i].seed));
            strata_free(slots[i].ptr, slots[i].size, slots[i].device, NULL);
        }
    }
    while (depth-- > 0) CHECK_OK(strata_tag_pop());
    for (int d = 0; d < 2; d++) CHECK(stats_of(d).allocated_bytes == base[d]);
    printf("walk: ok\n");
    return 0;
}

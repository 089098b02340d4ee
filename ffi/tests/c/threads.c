/* Threads (pthreads) allocating and freeing at once, each with its own tag stack and stream:
 * pointers never handed out twice, contents intact, stats balanced at the end, and frees on a
 * stream other than the allocating one. */
#include <pthread.h>

#include "common.h"

#define THREADS 8
#define SLOTS 32
#define STEPS 1500
#define CHECKED 1024

typedef struct {
    int id;
    cudaStream_t stream;
    uint64_t allocated_at_end;
    int failed;
} worker_t;

static void *worker(void *arg) {
    worker_t *w = arg;
    char tag[32];
    snprintf(tag, sizeof tag, "thread-%d", w->id);
    CHECK_OK(strata_tag_push(tag));
    CHECK(strata_tag_depth() == 1);
    uint64_t rng = 0x1000 + (uint64_t)w->id * 7919;
    void *ptrs[SLOTS] = {0};
    size_t sizes[SLOTS] = {0};
    uint64_t seeds[SLOTS] = {0};
    for (int step = 0; step < STEPS; step++) {
        uint64_t r = next_rand(&rng);
        int i = (int)(r % SLOTS);
        if (ptrs[i] == NULL) {
            size_t size = (r >> 16) % 4 == 0 ? (1 << 20) + (r >> 24) % (3 << 20)
                                              : 1 + (r >> 24) % 16384;
            cudaStream_t s = (r >> 40) % 2 ? w->stream : NULL;
            ptrs[i] = strata_malloc(size, w->id % 2, s);
            CHECK(ptrs[i] != NULL);
            sizes[i] = size;
            seeds[i] = r;
            put_pattern(ptrs[i], size < CHECKED ? size : CHECKED, r);
        } else {
            size_t len = sizes[i] < CHECKED ? sizes[i] : CHECKED;
            if (!has_pattern(ptrs[i], len, seeds[i])) {
                fprintf(stderr, "thread %d: contents of %p changed\n", w->id, ptrs[i]);
                w->failed = 1;
            }
            cudaStream_t s = (r >> 40) % 2 ? w->stream : NULL;
            CHECK_OK(strata_free_checked(ptrs[i], sizes[i], w->id % 2, s));
            ptrs[i] = NULL;
        }
    }
    strata_tag_stats_t ts;
    CHECK_OK(strata_tag_stats(tag, w->id % 2, &ts));
    uint64_t mine = 0;
    for (int i = 0; i < SLOTS; i++) mine += ptrs[i] ? sizes[i] : 0;
    if (ts.allocated_bytes != mine) {
        fprintf(stderr, "thread %d: tag stats %llu != %llu\n", w->id,
                (unsigned long long)ts.allocated_bytes, (unsigned long long)mine);
        w->failed = 1;
    }
    for (int i = 0; i < SLOTS; i++) {
        if (ptrs[i]) strata_free(ptrs[i], sizes[i], w->id % 2, w->stream);
    }
    CHECK_OK(strata_tag_pop());
    return NULL;
}

int main(void) {
    strata_stats_t before[2] = {stats_of(0), stats_of(1)};
    pthread_t th[THREADS];
    worker_t w[THREADS];
    for (int i = 0; i < THREADS; i++) {
        memset(&w[i], 0, sizeof w[i]);
        w[i].id = i;
        CHECK_OK(strata_stream_create(i % 2, &w[i].stream));
        CHECK(pthread_create(&th[i], NULL, worker, &w[i]) == 0);
    }
    int failed = 0;
    for (int i = 0; i < THREADS; i++) {
        CHECK(pthread_join(th[i], NULL) == 0);
        failed |= w[i].failed;
        CHECK_OK(strata_stream_synchronize(w[i].stream));
        CHECK_OK(strata_stream_destroy(w[i].stream));
    }
    CHECK(!failed);
    for (int d = 0; d < 2; d++) {
        strata_stats_t after = stats_of(d);
        CHECK(after.allocated_bytes == before[d].allocated_bytes);
        CHECK(after.live_allocations == before[d].live_allocations);
        CHECK(after.allocs - before[d].allocs == after.frees - before[d].frees);
    }
    /* The main thread's tag stack is its own. */
    CHECK(strata_tag_depth() == 0);
    printf("threads: ok\n");
    return 0;
}

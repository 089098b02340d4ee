/* Issue 15, item 2: after fork(), a child of a process that uses strata is refused on every
 * call that touches devices (a clear STRATA_INVALID_STATE naming fork), never served from the
 * parent's memory (its emulated device memory would be shared with the parent) and never left
 * hanging (the parent's stream threads do not exist in the child). The parent carries on. */
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common.h"

#define LEN 4096

static void child(void *parent_ptr, cudaStream_t stream) {
    alarm(20); /* a hang is a failure, not a stuck test */
    CHECK(strata_malloc(LEN, 0, NULL) == NULL);
    CHECK_ERR("STRATA_INVALID_STATE");
    CHECK_ERR("fork");
    unsigned char buf[LEN];
    memset(buf, 0x5A, sizeof buf);
    CHECK(strata_memcpy_htod(parent_ptr, buf, LEN) == STRATA_INVALID_STATE);
    CHECK(strata_memcpy_dtoh(buf, parent_ptr, LEN) == STRATA_INVALID_STATE);
    CHECK(strata_stream_synchronize(stream) == STRATA_INVALID_STATE);
    CHECK(strata_stream_synchronize(NULL) == STRATA_INVALID_STATE);
    CHECK(strata_free_checked(parent_ptr, LEN, 0, NULL) == STRATA_INVALID_STATE);
    strata_stats_t s;
    CHECK(strata_stats(0, &s) == STRATA_INVALID_STATE);
    CHECK(strata_device_count() == -1);
    CHECK(strata_sleep("fork-tag", 1) == STRATA_INVALID_STATE);
    strata_empty_cache();
    CHECK_ERR("fork");
    strata_harvest_hints_t hints = {0, STRATA_HARVEST_BACKED, 0, 0, NULL};
    strata_harvest_handle_t h;
    CHECK(strata_harvest_alloc(1 << 20, &hints, &h) == STRATA_INVALID_STATE);
    printf("child: refused\n");
    exit(0);
}

int main(void) {
    CHECK_OK(strata_tag_push("fork-tag"));
    void *p = strata_malloc(LEN, 0, NULL);
    CHECK_OK(strata_tag_pop());
    CHECK(p != NULL);
    put_pattern(p, LEN, 7);
    cudaStream_t stream;
    CHECK_OK(strata_stream_create(0, &stream));
    /* Harvest in use in the parent too, so the child's refusal covers its fast path. */
    strata_harvest_hints_t hints = {0, STRATA_HARVEST_BACKED, 0, 0, NULL};
    strata_harvest_handle_t h;
    CHECK_OK(strata_harvest_alloc(1 << 20, &hints, &h));
    fflush(stdout);

    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) child(p, stream);
    int status = 0;
    CHECK(waitpid(pid, &status, 0) == pid);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);

    /* The parent's bytes, stream and allocator are untouched and usable. */
    CHECK(has_pattern(p, LEN, 7));
    CHECK_OK(strata_stream_synchronize(stream));
    void *q = strata_malloc(LEN, 0, stream);
    CHECK(q != NULL && q != p);
    CHECK_OK(strata_free_checked(q, LEN, 0, stream));
    CHECK_OK(strata_free_checked(p, LEN, 0, NULL));
    CHECK_OK(strata_harvest_free(&h));
    CHECK_OK(strata_stream_destroy(stream));
    printf("fork: ok\n");
    return 0;
}

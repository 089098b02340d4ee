/* strata_sleep_to_disk + strata_wake: contents of a tag's allocations (several 8 MiB chunks of
 * the pipeline, small ones, one freed while asleep) come back from the file at the same
 * addresses; bad input is an error with the tag left awake. */
#define _DEFAULT_SOURCE
#include <stdlib.h>
#include <unistd.h>

#include "common.h"

int main(void) {
    char dir[] = "/tmp/strata-sleep-disk-XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    const size_t sizes[] = {100, 70000, (3u << 20) + 5, (19u << 20) + 3};
    void *ptrs[4];
    CHECK_OK(strata_tag_push("to-disk"));
    for (int i = 0; i < 4; i++) {
        ptrs[i] = strata_malloc(sizes[i], 0, NULL);
        CHECK(ptrs[i] != NULL);
        put_pattern(ptrs[i], sizes[i], 40 + (uint64_t)i);
    }
    void *freed_asleep = strata_malloc(1u << 20, 0, NULL);
    CHECK(freed_asleep != NULL);
    CHECK_OK(strata_tag_pop());
    uint64_t reserved = stats_of(0).reserved_bytes;

    CHECK(strata_sleep_to_disk(NULL, dir) == STRATA_INVALID_ARGUMENT);
    CHECK(strata_sleep_to_disk("to-disk", NULL) == STRATA_INVALID_ARGUMENT);
    CHECK(strata_sleep_to_disk("never-pushed", dir) == STRATA_INVALID_ARGUMENT);
    CHECK(strata_sleep_to_disk("to-disk", "/nonexistent/strata") == STRATA_OS);
    strata_tag_stats_t ts;
    CHECK_OK(strata_tag_stats("to-disk", 0, &ts));
    CHECK(ts.asleep == 0);
    CHECK(has_pattern(ptrs[3], sizes[3], 43));

    CHECK_OK(strata_sleep_to_disk("to-disk", dir));
    CHECK_OK(strata_tag_stats("to-disk", 0, &ts));
    CHECK(ts.asleep == 1 && ts.host_copy_bytes == 0);
    CHECK(stats_of(0).reserved_bytes + (24u << 20) <= reserved);
    CHECK(strata_sleep_to_disk("to-disk", dir) == STRATA_INVALID_STATE);
    CHECK(rmdir(dir) == 0); /* the file was unlinked at once: the directory is empty */
    strata_free(freed_asleep, 0, 0, NULL);
    CHECK_OK(strata_wake("to-disk"));
    for (int i = 0; i < 4; i++) {
        CHECK(has_pattern(ptrs[i], sizes[i], 40 + (uint64_t)i));
        CHECK_OK(strata_free_checked(ptrs[i], sizes[i], 0, NULL));
    }
    printf("sleep_disk: ok\n");
    return 0;
}

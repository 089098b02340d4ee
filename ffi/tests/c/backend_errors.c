/* A backend that cannot open keeps its status at the C boundary. Run with a broken environment
 * (ffi/tests/c_api.rs sets one per case) and the expected status's name as argv[1]: every call
 * that needs the backend fails with that status, the first time and again later (the failure is
 * remembered), and the last error names it. */
#include "common.h"

static const struct {
    const char *name;
    int status;
} EXPECTED[] = {
    {"STRATA_CONFIG", STRATA_CONFIG},
    {"STRATA_NO_DEVICE", STRATA_NO_DEVICE},
};

int main(int argc, char **argv) {
    CHECK(argc == 2);
    int expected = -1;
    for (size_t i = 0; i < sizeof EXPECTED / sizeof EXPECTED[0]; i++) {
        if (strcmp(argv[1], EXPECTED[i].name) == 0) {
            expected = EXPECTED[i].status;
        }
    }
    CHECK(expected != -1);

    for (int round = 0; round < 2; round++) {
        CHECK(strata_device_count() == -1);
        CHECK_ERR(argv[1]);

        strata_stats_t stats;
        int status = strata_stats(0, &stats);
        if (status != expected) {
            fprintf(stderr, "strata_stats: status %d, expected %d (%s); last error: %s\n",
                    status, expected, argv[1], strata_last_error());
            return 1;
        }
        CHECK_ERR(argv[1]);

        strata_clear_error();
        CHECK(strata_malloc(4096, 0, NULL) == NULL);
        CHECK_ERR(argv[1]);
    }
    printf("backend_errors: ok\n");
    return 0;
}

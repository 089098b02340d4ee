/* What the fuzz targets (fuzz.c, kv_fuzz.c) share: the input being run, FCHECK (a failed
 * check saves that input as $STRATA_FUZZ_ARTIFACTS/<FUZZ_NAME>-failure.bin, then aborts) and
 * the byte reader. Define FUZZ_NAME before including it. */
#ifndef STRATA_FUZZ_H
#define STRATA_FUZZ_H

#include "common.h"

static const uint8_t *cur_data;
static size_t cur_size;

static void save_input(void) {
    const char *dir = getenv("STRATA_FUZZ_ARTIFACTS");
    char path[512];
    snprintf(path, sizeof path, "%s/" FUZZ_NAME "-failure.bin", dir ? dir : ".");
    FILE *f = fopen(path, "wb");
    if (f) {
        fwrite(cur_data, 1, cur_size, f);
        fclose(f);
        fprintf(stderr, "input saved to %s\n", path);
    }
}

#define FCHECK(cond)                                                                        \
    do {                                                                                    \
        if (!(cond)) {                                                                      \
            fprintf(stderr, "%s:%d: FCHECK(%s) failed; last error: %s\n", __FILE__, __LINE__, \
                    #cond, strata_last_error());                                            \
            save_input();                                                                   \
            abort();                                                                        \
        }                                                                                   \
    } while (0)

typedef struct {
    const uint8_t *p;
    size_t n;
} bytes_t;

static unsigned take(bytes_t *b) {
    if (b->n == 0) return 0;
    b->n--;
    return *b->p++;
}

#endif

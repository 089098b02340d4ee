/* The driver of the fuzz targets (fuzz.c, kv_fuzz.c) when libFuzzer is not available: it
 * replays the corpus folder (argv[1]), then runs random mutations of it for argv[2] seconds
 * from seed argv[3]. Included once, by a target compiled with STRATA_FUZZ_DRIVER, after its
 * LLVMFuzzerTestOneInput; needs <dirent.h>, <time.h> and fuzz.h (FUZZ_NAME names the target in
 * its output, "<name>: ok" at the end). */
#ifndef STRATA_FUZZ_DRIVER_H
#define STRATA_FUZZ_DRIVER_H


#define MAX_INPUT 4096
#define MAX_CORPUS 256

static uint8_t *corpus[MAX_CORPUS];
static size_t corpus_len[MAX_CORPUS];
static int corpus_n;

static void load_corpus(const char *dir) {
    DIR *d = opendir(dir);
    CHECK(d != NULL);
    struct dirent *e;
    while ((e = readdir(d)) != NULL && corpus_n < MAX_CORPUS) {
        if (e->d_name[0] == '.') continue;
        char path[1024];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        FILE *f = fopen(path, "rb");
        if (!f) continue;
        uint8_t *buf = malloc(MAX_INPUT);
        CHECK(buf != NULL);
        size_t n = fread(buf, 1, MAX_INPUT, f);
        fclose(f);
        corpus[corpus_n] = buf;
        corpus_len[corpus_n++] = n;
    }
    closedir(d);
    CHECK(corpus_n > 0);
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    CHECK(argc >= 3);
    load_corpus(argv[1]);
    double budget = atof(argv[2]);
    uint64_t rng = argc > 3 ? strtoull(argv[3], NULL, 10) : (uint64_t)time(NULL);
    printf(FUZZ_NAME ": seed %llu, %d corpus inputs, %.0f s\n", (unsigned long long)rng, corpus_n, budget);
    rng = rng * 2 + 1;
    for (int i = 0; i < corpus_n; i++) LLVMFuzzerTestOneInput(corpus[i], corpus_len[i]);
    static uint8_t input[MAX_INPUT];
    double start = now();
    long runs = 0;
    while (now() - start < budget) {
        int from = (int)(next_rand(&rng) % (uint64_t)corpus_n);
        size_t n = corpus_len[from];
        memcpy(input, corpus[from], n);
        int edits = 1 + (int)(next_rand(&rng) % 16);
        for (int e = 0; e < edits; e++) {
            uint64_t r = next_rand(&rng);
            switch (r % 4) {
            case 0: /* overwrite a byte */
                if (n) input[(r >> 8) % n] = (uint8_t)(r >> 32);
                break;
            case 1: /* append random bytes */
                for (int k = 0; k < 8 && n < MAX_INPUT; k++) input[n++] = (uint8_t)next_rand(&rng);
                break;
            case 2: /* splice in part of another input */ {
                int other = (int)((r >> 8) % (uint64_t)corpus_n);
                size_t len = corpus_len[other] / 2, at = n ? (r >> 24) % n : 0;
                if (at + len > MAX_INPUT) len = MAX_INPUT - at;
                memcpy(input + at, corpus[other], len);
                if (at + len > n) n = at + len;
                break;
            }
            default: /* truncate */
                if (n > 1) n = 1 + (r >> 8) % n;
            }
        }
        LLVMFuzzerTestOneInput(input, n);
        runs++;
    }
    printf(FUZZ_NAME ": %ld mutated inputs in %.1f s\n", runs, now() - start);
    printf(FUZZ_NAME ": ok\n");
    return 0;
}

#endif

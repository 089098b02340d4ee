/* A fuzz target for the C ABI: each input is a byte-coded sequence of calls (valid and
 * invalid: allocations on two devices (one on a one-device machine) and streams, frees,
 * double and foreign frees, tags,
 * sleep/wake with and without host copies, copies in and out of range, memory-fraction caps,
 * empty_cache, Harvest with reclaim and revocation callbacks), run against a model that
 * predicts every status and the bytes of every live allocation. An input ends by undoing what
 * it did, and the accounting must be back where it started.
 *
 * LLVMFuzzerTestOneInput is libFuzzer's entry point: with clang,
 *   clang -g -O1 -fsanitize=fuzzer,address -Iinclude ffi/tests/c/fuzz.c \
 *         -Ltarget/debug -lstrata -Wl,-rpath,$PWD/target/debug -o fuzz
 *   STRATA_BACKEND=host STRATA_HOST_DEVICES=2x512MiB ./fuzz ffi/tests/fuzz/corpus
 * Without clang (CI builds with gcc), STRATA_FUZZ_DRIVER compiles the small driver (fuzz_driver.h):
 * it replays the committed corpus, then runs random mutations of it for a time budget. */
#define _POSIX_C_SOURCE 200809L
#include <dirent.h>
#include <time.h>

#define FUZZ_NAME "fuzz"
#include "fuzz.h"

#define SLOTS 32
#define HANDLES 8
#define TAGS 3
#define PROBE 512 /* bytes of each allocation the model tracks */

static const char *const TAG_NAMES[TAGS] = {"fz-a", "fz-b", "fz-c"};

typedef struct {
    void *ptr;
    size_t size;
    int device;
    int tag; /* -1: untagged */
    uint64_t seed;
    int zeroed; /* woken after a sleep without host copies: the probe reads zeros */
} slot_t;

typedef struct {
    strata_harvest_handle_t h;
    int live;
    int revoked;
    uint64_t seed;
} handle_t;

static slot_t slots[SLOTS];
static handle_t handles[HANDLES];
static int tag_stack[64], depth;
static int pushed_ever[TAGS];
/* 0 awake, 1 asleep, 2 partly (a wake failed after waking some devices). */
static int asleep[TAGS];
static cudaStream_t streams[2];
/* Devices the calls use: 0 and 1, or 0 alone on a one-device machine (a device byte picks
 * DEV(byte)); `devices` is how many the library reports. */
static int used, devices;
#define DEV(x) ((int)((x) & 1) % used)
static int current_tag(void) { return depth ? tag_stack[depth - 1] : -1; }

static int last_error_is(const char *name) { return strstr(strata_last_error(), name) != NULL; }

static void check_slot(const slot_t *s) {
    if (s->tag >= 0 && asleep[s->tag] == 2) return; /* which devices woke is not modelled */
    size_t n = s->size < PROBE ? s->size : PROBE;
    if (s->zeroed) FCHECK(is_zero(s->ptr, n));
    else FCHECK(has_pattern(s->ptr, n, s->seed));
}

static void op_malloc(bytes_t *b, uint64_t *seq) {
    unsigned a = take(b), c = take(b);
    static const size_t scale[4] = {1, 256, 4096, 65536}; /* up to 4 MiB: large blocks too */
    size_t size = (size_t)(a % 64) * scale[c % 4] + (c >> 2);
    int device = DEV(a >> 6);
    cudaStream_t stream = (a >> 7) ? streams[device] : NULL;
    int i = 0;
    while (i < SLOTS && slots[i].ptr) i++;
    if (i == SLOTS) return;
    strata_clear_error();
    void *p = strata_malloc(size, device, stream);
    int tag = current_tag();
    if (size == 0) {
        FCHECK(p == NULL && strcmp(strata_last_error(), "") == 0);
        return;
    }
    if (tag >= 0 && asleep[tag] == 1) {
        FCHECK(p == NULL && last_error_is("STRATA_INVALID_STATE"));
        return;
    }
    if (p == NULL) {
        FCHECK(last_error_is("STRATA_OUT_OF_MEMORY") || last_error_is("STRATA_LIMIT_EXCEEDED") ||
               (tag >= 0 && asleep[tag] == 2 && last_error_is("STRATA_INVALID_STATE")));
        return;
    }
    FCHECK(((uintptr_t)p & 255) == 0);
    slot_t s = {p, size, device, tag, ++*seq, 0};
    put_pattern(p, size < PROBE ? size : PROBE, s.seed);
    slots[i] = s;
}

static void op_free(bytes_t *b) {
    slot_t *s = &slots[take(b) % SLOTS];
    if (!s->ptr) return;
    if (s->tag < 0 || !asleep[s->tag]) check_slot(s);
    int wrong_device = take(b) & 1;
    if (wrong_device) {
        FCHECK(strata_free_checked(s->ptr, s->size, !s->device, NULL) != STRATA_OK);
        if (s->tag < 0 || !asleep[s->tag]) check_slot(s);
    }
    FCHECK(strata_free_checked(s->ptr, s->size, s->device, NULL) == STRATA_OK);
    void *freed = s->ptr;
    int device = s->device;
    memset(s, 0, sizeof *s);
    /* A second free is refused unless the address was handed out again meanwhile (it was not:
     * nothing ran in between). */
    int st = strata_free_checked(freed, 1, device, NULL);
    FCHECK(st == STRATA_DOUBLE_FREE || st == STRATA_UNKNOWN_POINTER);
}

static void op_copy(bytes_t *b) {
    slot_t *s = &slots[take(b) % SLOTS];
    unsigned mode = take(b) % 3;
    unsigned char buf[64];
    if (!s->ptr) {
        int x = 0;
        FCHECK(strata_memcpy_htod(&x, buf, 1) != STRATA_OK); /* host memory is not device */
        return;
    }
    int sleeping = s->tag >= 0 && asleep[s->tag];
    if (mode == 0) { /* in range */
        if (sleeping && asleep[s->tag] == 2) return;
        if (sleeping) FCHECK(strata_memcpy_dtoh(buf, s->ptr, 1) == STRATA_INVALID_ARGUMENT);
        else check_slot(s);
    } else { /* past the end of the mapped pages */
        size_t far = (s->size + (2u << 20)) & ~(size_t)((2u << 20) - 1);
        int st = strata_memcpy_htod((char *)s->ptr + far + ((size_t)256 << 30), buf, sizeof buf);
        FCHECK(st == STRATA_INVALID_ARGUMENT);
        if (!sleeping) check_slot(s);
    }
}

static void op_tag(bytes_t *b) {
    unsigned a = take(b);
    if (a & 1) {
        int st = strata_tag_pop();
        if (depth == 0) FCHECK(st == STRATA_INVALID_STATE);
        else {
            FCHECK(st == STRATA_OK);
            depth--;
        }
        FCHECK(strata_tag_depth() == depth);
        return;
    }
    if (depth == 64) return;
    int t = (int)(a >> 1) % TAGS;
    FCHECK(strata_tag_push(TAG_NAMES[t]) == STRATA_OK);
    tag_stack[depth++] = t;
    pushed_ever[t] = 1;
}

static void op_sleep_wake(bytes_t *b) {
    unsigned a = take(b);
    int t = (int)(a % TAGS), keep = (a >> 2) & 1;
    if (a & 8) { /* wake */
        int st = strata_wake(TAG_NAMES[t]);
        if (!pushed_ever[t]) FCHECK(st == STRATA_INVALID_ARGUMENT);
        else if (!asleep[t]) FCHECK(st == STRATA_INVALID_STATE);
        else if (st == STRATA_OK) asleep[t] = 0;
        else {
            FCHECK(st == STRATA_OUT_OF_MEMORY || st == STRATA_LIMIT_EXCEEDED);
            asleep[t] = 2;
        }
        if (st == STRATA_OK)
            for (int i = 0; i < SLOTS; i++)
                if (slots[i].ptr && slots[i].tag == t) check_slot(&slots[i]);
        return;
    }
    int st = strata_sleep(TAG_NAMES[t], keep);
    if (!pushed_ever[t]) FCHECK(st == STRATA_INVALID_ARGUMENT);
    else if (asleep[t]) FCHECK(st == STRATA_INVALID_STATE);
    else if (st == STRATA_OK) {
        asleep[t] = 1;
        for (int i = 0; i < SLOTS; i++)
            if (slots[i].ptr && slots[i].tag == t && !keep) slots[i].zeroed = 1;
    } else {
        /* A failure (host memory) leaves the tag awake and intact. */
        FCHECK(st == STRATA_OUT_OF_MEMORY);
        for (int i = 0; i < SLOTS; i++)
            if (slots[i].ptr && slots[i].tag == t) check_slot(&slots[i]);
    }
}

static void op_limit(bytes_t *b) {
    unsigned a = take(b);
    int device = DEV(a);
    double fraction = (a >> 1) >= 120 ? 1.0 : (double)(a >> 1) / 120.0;
    strata_clear_error();
    strata_set_memory_fraction(fraction, device);
    FCHECK(strcmp(strata_last_error(), "") == 0);
    strata_stats_t s = stats_of(device);
    FCHECK(s.limit_set == (fraction < 1.0));
    if (a == 255) {
        strata_set_memory_fraction(2.0, device);
        FCHECK(last_error_is("STRATA_INVALID_ARGUMENT"));
    }
}

static void revoked_cb(const strata_harvest_handle_t *h, int lost, void *user) {
    handle_t *mine = user;
    FCHECK(h->id == mine->h.id && lost == 0);
    mine->revoked++;
}

static void op_harvest(bytes_t *b, uint64_t *seq) {
    unsigned a = take(b);
    handle_t *x = &handles[(a >> 3) % HANDLES];
    unsigned char buf[256], want[256];
    switch (a & 7) {
    case 0:
    case 1: {
        if (x->live) return;
        strata_harvest_hints_t hints = {DEV(a >> 6), STRATA_HARVEST_BACKED, 0, 0, NULL};
        size_t size = (size_t)(take(b) % 8 + 1) << 20;
        int st = strata_harvest_alloc(size, &hints, &x->h);
        if (st != STRATA_OK) {
            /* The lender's memory-fraction cap covers the pages it lends too. */
            FCHECK(st == STRATA_OUT_OF_MEMORY || st == STRATA_LIMIT_EXCEEDED);
            return;
        }
        x->live = 1;
        x->revoked = 0;
        x->seed = ++*seq;
        FCHECK(strata_harvest_on_revoke(&x->h, revoked_cb, x) == STRATA_OK);
        fill_pattern(want, sizeof want, x->seed);
        FCHECK(strata_harvest_write(&x->h, x->h.size - sizeof want, want, sizeof want) == STRATA_OK);
        return;
    }
    case 2:
    case 3: {
        if (!x->live) return;
        int st = strata_harvest_read(&x->h, x->h.size - sizeof buf, buf, sizeof buf);
        if (x->revoked) {
            FCHECK(st == STRATA_INVALID_HANDLE);
            return;
        }
        FCHECK(st == STRATA_OK);
        fill_pattern(want, sizeof want, x->seed);
        FCHECK(memcmp(buf, want, sizeof buf) == 0);
        FCHECK(strata_harvest_read(&x->h, x->h.size, buf, 1) == STRATA_INVALID_ARGUMENT);
        return;
    }
    case 4: {
        if (!x->live) return;
        int st = strata_harvest_free(&x->h);
        FCHECK(x->revoked ? st == STRATA_INVALID_HANDLE : st == STRATA_OK);
        FCHECK(strata_harvest_free(&x->h) == STRATA_INVALID_HANDLE);
        x->live = 0;
        return;
    }
    case 5: {
        uint64_t got = 0;
        FCHECK(strata_harvest_reclaim(DEV(a >> 6), (uint64_t)take(b) << 20, &got) == STRATA_OK);
        for (int i = 0; i < HANDLES; i++) FCHECK(handles[i].revoked <= 1);
        return;
    }
    default: {
        strata_harvest_handle_t forged = x->h;
        forged.id ^= 0x5a5a;
        forged.reserved = (int32_t)(a >> 6);
        FCHECK(strata_harvest_read(&forged, 0, buf, 1) != STRATA_OK);
        return;
    }
    }
}

static void op_misc(bytes_t *b) {
    unsigned a = take(b);
    strata_stats_t s;
    switch (a % 6) {
    case 0: strata_empty_cache(); break;
    case 1: FCHECK(strata_stream_synchronize(streams[DEV(a >> 7)]) == STRATA_OK); break;
    case 2: {
        int device = (int)(a >> 3) - 8;
        FCHECK(strata_stats(device, &s) == (device >= 0 && device < devices ? STRATA_OK : STRATA_NO_DEVICE));
        break;
    }
    case 3: FCHECK(strata_tag_push(NULL) == STRATA_INVALID_ARGUMENT && strata_tag_push("") == STRATA_INVALID_ARGUMENT); break;
    case 4: {
        int x = 0;
        FCHECK(strata_free_checked(&x, sizeof x, 0, NULL) == STRATA_UNKNOWN_POINTER);
        break;
    }
    default: {
        slot_t *sl = &slots[(a >> 3) % SLOTS];
        if (sl->ptr) strata_record_stream(sl->ptr, streams[sl->device]);
        break;
    }
    }
}

/* Undoes the input's state; the accounting must match where it started. */
static void free_slot(slot_t *s) {
    check_slot(s);
    FCHECK(strata_free_checked(s->ptr, s->size, s->device, NULL) == STRATA_OK);
    memset(s, 0, sizeof *s);
}

/* Undoes the input's state (awake memory first, so the sleeping tags' pages are available to
 * wake them); the accounting must match where it started. */
static void finish(const strata_stats_t before[2]) {
    int d;
    for (int i = 0; i < SLOTS; i++)
        if (slots[i].ptr && (slots[i].tag < 0 || !asleep[slots[i].tag])) free_slot(&slots[i]);
    for (int i = 0; i < HANDLES; i++)
        if (handles[i].live) {
            strata_harvest_free(&handles[i].h);
            handles[i].live = 0;
        }
    for (d = 0; d < used; d++) strata_set_memory_fraction(1.0, d);
    strata_empty_cache();
    for (int t = 0; t < TAGS; t++)
        if (asleep[t]) {
            FCHECK(strata_wake(TAG_NAMES[t]) == STRATA_OK);
            asleep[t] = 0;
        }
    for (int i = 0; i < SLOTS; i++)
        if (slots[i].ptr) free_slot(&slots[i]);
    for (; depth > 0; depth--) FCHECK(strata_tag_pop() == STRATA_OK);
    for (d = 0; d < used; d++) {
        strata_set_memory_fraction(1.0, d);
        FCHECK(strata_stream_synchronize(streams[d]) == STRATA_OK);
        strata_stats_t s = stats_of(d);
        FCHECK(s.live_allocations == before[d].live_allocations);
        FCHECK(s.allocated_bytes == before[d].allocated_bytes);
        FCHECK(s.limit_set == 0);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static uint64_t seq;
    if (!streams[0]) {
        devices = strata_device_count();
        FCHECK(devices == test_devices());
        used = devices < 2 ? devices : 2;
        for (int d = 0; d < used; d++) FCHECK(strata_stream_create(d, &streams[d]) == STRATA_OK);
        strata_init(devices);
    }
    cur_data = data;
    cur_size = size;
    strata_stats_t before[2];
    for (int d = 0; d < used; d++) before[d] = stats_of(d);
    bytes_t b = {data, size};
    static int trace = -1;
    if (trace < 0) trace = getenv("STRATA_FUZZ_TRACE") != NULL;
    for (int ops = 0; b.n > 0 && ops < 256; ops++) {
        if (trace) fprintf(stderr, "op %d: byte %u at %zu\n", ops, *b.p, size - b.n);
        switch (take(&b) % 8) {
        case 0:
        case 1: op_malloc(&b, &seq); break;
        case 2: op_free(&b); break;
        case 3: op_copy(&b); break;
        case 4: op_tag(&b); break;
        case 5: op_sleep_wake(&b); break;
        case 6: take(&b) & 1 ? op_limit(&b) : op_misc(&b); break;
        default: op_harvest(&b, &seq); break;
        }
    }
    finish(before);
    return 0;
}

#ifdef STRATA_FUZZ_DRIVER
#include "fuzz_driver.h"
#endif

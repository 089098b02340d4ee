/*
 * strata.h — the C API of libstrata.so (GPU memory virtualization on the CUDA VMM API).
 *
 * Entry points for PyTorch's pluggable allocator (exact signatures of
 * torch/csrc/cuda/CUDAPluggableAllocator.h), the hooks PyTorch can take, statistics, tags,
 * sleep/wake, Harvest (peer-memory allocations with revocation), errors and a version, plus small test-support calls (streams, copies).
 *
 * Conventions
 *  - Nothing has to be called first: the backend (STRATA_BACKEND=cuda|host|auto) and one caching
 *    allocator per device are created on first use.
 *  - Thread-safe. No Python, no GIL. Nothing ever unwinds into the caller: internal failures
 *    are reported as STRATA_INTERNAL.
 *  - Calls returning `int` return a strata_status_t (0 = STRATA_OK). Calls returning a pointer
 *    return NULL on failure; calls returning void (PyTorch's signatures) report failures only
 *    through strata_last_error(). Every failure sets the calling thread's last error;
 *    successes leave it unchanged (like errno): call strata_clear_error() first to tell.
 *  - cudaStream_t is an opaque pointer whose value is the stream handle (NULL = default
 *    stream). Frees are stream-ordered: memory freed on stream S is reused at once on S and on
 *    other streams only after the work queued on S before the free has completed.
 *  - Device memory is never CPU-accessible through these pointers in general: move bytes with
 *    strata_memcpy_htod / strata_memcpy_dtoh (or CUDA).
 *  - fork(): in a child forked after the process first used strata, every call that touches a
 *    device (or Harvest) returns STRATA_INVALID_STATE with a message naming fork, as CUDA
 *    refuses a context inherited over fork: the parent's memory and streams are never shared
 *    with the child. Fork before the first use, or exec, to use strata in a child.
 */
#ifndef STRATA_H
#define STRATA_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* cudaStream_t without including the CUDA headers (same type: a pointer to an opaque struct). */
#ifndef __DRIVER_TYPES_H__
typedef struct CUstream_st *cudaStream_t;
#endif

/* Status codes. Stable: values never change once published; 0 is success. The source is
 * ffi/src/status.rs; its tests check this enum and python/strata/_status.py against it. */
typedef enum strata_status_t {
    STRATA_OK = 0,
    STRATA_OUT_OF_MEMORY = 1,     /* physical memory or address space exhausted (recoverable) */
    STRATA_LIMIT_EXCEEDED = 2,    /* the memory-fraction cap would be exceeded */
    STRATA_INVALID_ARGUMENT = 3,  /* NULL, bad UTF-8, absurd size, pointer of another device... */
    STRATA_UNKNOWN_POINTER = 4,   /* not from strata_malloc (or an interior pointer) */
    STRATA_DOUBLE_FREE = 5,       /* freed twice */
    STRATA_INVALID_HANDLE = 6,    /* unknown or destroyed stream/event handle */
    STRATA_INVALID_STATE = 7,     /* e.g. allocating under a sleeping tag, popping an empty stack */
    STRATA_MAPPING = 8,           /* a virtual-memory mapping rule was broken (internal) */
    STRATA_UNSUPPORTED = 9,       /* operation or backend not available */
    STRATA_NO_DEVICE = 10,        /* no CUDA driver, or device ordinal out of range */
    STRATA_DRIVER = 11,           /* a CUDA driver call failed */
    STRATA_INJECTED_FAULT = 12,   /* host backend test fault plan */
    STRATA_OS = 13,               /* an operating-system call failed */
    STRATA_CONFIG = 14,           /* a STRATA_* environment variable could not be parsed */
    STRATA_ASYNC = 15,            /* asynchronous work failed (reported at synchronization) */
    STRATA_INTERNAL = 16,         /* a bug inside strata, caught at the boundary */
} strata_status_t;

/* Per-device statistics (strata_stats). Byte figures are exact. */
typedef struct strata_stats_t {
    int32_t device;
    int32_t initialized;            /* 1 once the device's allocator exists (first use) */
    uint64_t total_bytes;           /* physical memory of the device */
    uint64_t page_size;             /* mapping granularity */
    uint64_t allocated_bytes;       /* requested bytes of live allocations */
    uint64_t allocated_block_bytes; /* bytes of the blocks holding them (class or pages) */
    uint64_t reserved_bytes;        /* bytes of pages held mapped (live, segments, cache) */
    uint64_t mapped_pages;          /* reserved_bytes / page_size */
    uint64_t cached_large_bytes;    /* freed large blocks kept mapped for reuse */
    uint64_t pool_free_bytes;       /* free physical pages in the device's page pool */
    uint64_t peak_allocated_bytes;
    uint64_t peak_reserved_bytes;
    uint64_t live_allocations;
    uint64_t pending_blocks;        /* freed blocks waiting for other streams */
    uint64_t limit_bytes;           /* cap on reserved bytes (0 and limit_set == 0: none) */
    uint64_t allocs;                /* counts since the allocator was created */
    uint64_t frees;
    uint64_t cache_hits;
    uint64_t cache_misses;
    uint64_t ooms;                  /* out-of-memory and limit failures */
    uint64_t sleeps;
    uint64_t wakes;
    uint64_t pool_in_use_bytes;     /* pool pages in use (allocator, lent to peers, ...) */
    uint64_t lent_bytes;            /* of those, lent to peers (Harvest placements here) */
    uint64_t borrowed_bytes;        /* peers' pages this device borrowed (not in the above) */
    uint64_t limit_set;             /* 1 when a cap is set (then limit_bytes, possibly 0) */
    uint64_t spare[4];              /* zero; room to grow */
} strata_stats_t;

/* Per-tag statistics on one device (strata_tag_stats). */
typedef struct strata_tag_stats_t {
    uint32_t tag_id;                /* 1, 2, ... in order of first push (a released name's id is reused) */
    int32_t asleep;                 /* 1 while the tag sleeps on this device */
    uint64_t allocated_bytes;
    uint64_t reserved_bytes;
    uint64_t peak_allocated_bytes;
    uint64_t live_allocations;
    uint64_t allocs;
    uint64_t frees;
    uint64_t host_copy_bytes;       /* bytes held in host copies while asleep */
    uint64_t spare[4];              /* zero; room to grow */
} strata_tag_stats_t;

/* ---- Version and errors ------------------------------------------------------------------- */

/* The library version ("0.1.0"); static storage. */
const char *strata_version(void);

/* The calling thread's most recent failure as a readable message ("" if none); valid until
 * the thread's next strata call. Never NULL. */
const char *strata_last_error(void);

/* Clears the calling thread's last error. */
void strata_clear_error(void);

/* Number of devices; -1 (and the last error) when no backend can be opened. */
int strata_device_count(void);

/* ---- PyTorch's pluggable-allocator entry points ------------------------------------------- */

/* Allocates `size` bytes on `device` for use on `stream`, under the calling thread's current
 * tag. The pointer is aligned to at least 256 bytes. NULL on failure (out of memory, limit,
 * sleeping tag, bad device, absurd size: see strata_last_error) and for size 0 (no error). */
void *strata_malloc(size_t size, int device, cudaStream_t stream);

/* Frees `ptr` on `stream` (PyTorch passes the size, device and stream of the allocation; the
 * size is not needed). NULL is a no-op. Double free, foreign pointer, bad device: nothing
 * changes and the last error says why. Safe with work in flight on other streams. */
void strata_free(void *ptr, size_t size, int device, cudaStream_t stream);

/* strata_free returning its status. */
int strata_free_checked(void *ptr, size_t size, int device, cudaStream_t stream);

/* ---- Hooks (CUDAPluggableAllocator set_init_fn, set_reset_fn, set_memory_fraction_fn,
 *      set_record_stream_fn); failures go to the last error ----------------------------------- */

/* Creates the allocators of devices 0..device_count-1 now (else on first use). */
void strata_init(int device_count);

/* Unmaps every cached page on every device and returns it, and the pools' free pages, to the
 * driver. Live allocations stay. The pools refill only once allocations ask for pages again,
 * so an idle process holds no more than its live allocations afterwards. */
void strata_empty_cache(void);

/* Caps everything strata holds on `device` (pages mapped for allocations and cache, and the
 * page pool's free pages) at `fraction` (0..1) of its memory; 1 lifts the cap. Beyond it
 * strata_malloc returns NULL (STRATA_LIMIT_EXCEEDED). A cap of 0 bytes is a cap (limit_set
 * in strata_stats_t tells it from none). */
void strata_set_memory_fraction(double fraction, int device);

/* `ptr` is also used on `stream`: after its free, its memory is reused only once the work
 * queued on `stream` before the free completes. */
void strata_record_stream(void *ptr, cudaStream_t stream);

/* ---- Statistics --------------------------------------------------------------------------- */

/* Fills *out with device's figures (zeros and initialized == 0 before its first use). */
int strata_stats(int device, strata_stats_t *out);

/* Fills *out with the figures of tag `tag` on `device`. Unknown tag: STRATA_INVALID_ARGUMENT. */
int strata_tag_stats(const char *tag, int device, strata_tag_stats_t *out);

/* ---- Tags, sleep and wake ----------------------------------------------------------------- */

/* Pushes tag `name` (non-empty UTF-8, at most 256 bytes) on the calling thread's tag stack: the
 * thread's allocations carry it until the matching strata_tag_pop. Blocks of different tags
 * never share a page. At most 65,536 names are registered at once: when that many are, the
 * names no longer in use (pushed by no thread, nothing live or asleep under them) are released
 * (strata_tag_stats then calls them unknown; pushed again they start from zero). Only with
 * 65,536 names all in use does a push fail (STRATA_INVALID_STATE). */
int strata_tag_push(const char *name);

/* Pops the calling thread's tag stack (STRATA_INVALID_STATE when empty). */
int strata_tag_pop(void);

/* Depth of the calling thread's tag stack. */
int strata_tag_depth(void);

/* Puts tag `tag` to sleep on every device: waits for the streams using its memory, copies its
 * live allocations to host memory if keep_host_copy != 0 (host memory exhausted:
 * STRATA_OUT_OF_MEMORY, the tag stays awake and intact), unmaps and releases its pages.
 * Pointers keep their addresses; allocating under the tag fails until strata_wake; freeing
 * works. A device used for the first time while the tag sleeps starts with the tag asleep
 * (so a sleep before any allocation holds too). Unknown tag: STRATA_INVALID_ARGUMENT.
 * All or nothing across devices: a tag already asleep anywhere is STRATA_INVALID_STATE with
 * nothing changed; if a device fails, the devices this call put to sleep are woken again and
 * its status is returned. Only if that wake fails too is the status STRATA_INVALID_STATE
 * with a message naming the devices left asleep (strata_wake wakes them). */
int strata_sleep(const char *tag, int keep_host_copy);

/* Maps fresh pages at the same addresses and restores the host copies (or zeros). A tag asleep
 * nowhere is STRATA_INVALID_STATE. On failure (e.g. out of memory) the tag stays asleep where
 * it was not woken yet: call again. */
int strata_wake(const char *tag);

/* ---- Harvest: opportunistic memory on peer GPUs ----------------------------------------- */

/* What revoking an allocation costs (Harvest's two consistency choices). */
enum {
    STRATA_HARVEST_BACKED = 0, /* the caller keeps an authoritative host copy: nothing is lost */
    STRATA_HARVEST_LOSSY = 1   /* reconstructible: a revocation reports it lost */
};

/* A harvested allocation: the peer device lending it, the base of a VA range mapped with
 * access for the requesting device, its size (rounded up to pages), and an id with a
 * generation. A freed or revoked handle is stale: every later use is STRATA_INVALID_HANDLE,
 * never someone else's memory. */
typedef struct strata_harvest_handle_t {
    int32_t device;
    int32_t reserved; /* zero (a handle with another value is STRATA_INVALID_ARGUMENT) */
    uint64_t ptr;
    uint64_t size;
    uint64_t id;
} strata_harvest_handle_t;

typedef struct strata_harvest_hints_t {
    int32_t requester;       /* the device whose copies use the memory */
    int32_t durability;      /* STRATA_HARVEST_BACKED or STRATA_HARVEST_LOSSY */
    int32_t direct_only;     /* nonzero: only peers directly linked to the requester */
    int32_t preferred_count; /* entries of `preferred` (0: no preference) */
    const int32_t *preferred; /* peers to prefer (a hint, not a limit); may be NULL if count 0 */
} strata_harvest_hints_t;

/* Called when a harvested allocation is revoked: `lost` is 1 for STRATA_HARVEST_LOSSY (the
 * data is gone), 0 for STRATA_HARVEST_BACKED (fall back to the host copy).
 * Threading: it runs once, on the thread whose strata call revoked the allocation (e.g. the
 * one calling strata_harvest_reclaim), after every copy that touched the range has completed
 * and after the handle became stale, before the pages return to the peer; no strata lock is
 * held, so it may call strata (but should be short). `user_data` is passed through untouched
 * and must be usable from that thread. */
typedef void (*strata_revoke_fn)(const strata_harvest_handle_t *handle, int lost, void *user_data);

/* Allocates `size` bytes on the best-fit peer of hints->requester: among peers with room
 * (free memory minus the owner's reserve, within its quota), directly linked ones first, then
 * preferred ones, then the least leftover. With one device, the device lends to itself.
 * No room anywhere: STRATA_OUT_OF_MEMORY (a normal outcome: use host memory). */
int strata_harvest_alloc(size_t size, const strata_harvest_hints_t *hints,
                         strata_harvest_handle_t *out);

/* Waits for the allocation's in-flight copies and returns its pages. No callback runs.
 * Stale (freed, revoked or being revoked): STRATA_INVALID_HANDLE. */
int strata_harvest_free(const strata_harvest_handle_t *handle);

/* Registers `callback(handle, lost, user_data)` for the revocation of `handle` (see
 * strata_revoke_fn). Several may be registered; each runs once. */
int strata_harvest_on_revoke(const strata_harvest_handle_t *handle, strata_revoke_fn callback,
                             void *user_data);

/* The owner of device `peer` takes at least `bytes` back: allocations there are revoked in
 * Harvest's order (stop new copies, drain in-flight ones, invalidate, call back, return the
 * pages). *revoked_bytes (if not NULL) receives the bytes revoked. */
int strata_harvest_reclaim(int peer, uint64_t bytes, uint64_t *revoked_bytes);

/* Copies `len` host bytes at `src` into the allocation at `offset` (a backend copy) and waits.
 * A range beyond the allocation is STRATA_INVALID_ARGUMENT (checked before anything is
 * allocated); host staging is bounded (8 MiB), whatever `len` is. */
int strata_harvest_write(const strata_harvest_handle_t *handle, uint64_t offset, const void *src,
                         size_t len);

/* Copies `len` bytes of the allocation at `offset` into host memory `dst` and waits. */
int strata_harvest_read(const strata_harvest_handle_t *handle, uint64_t offset, void *dst,
                        size_t len);

/* ---- Test support: streams and copies ----------------------------------------------------- */

/* Creates a stream on `device` (a real CUstream on CUDA). */
int strata_stream_create(int device, cudaStream_t *out);

/* Destroys a stream once its work completes (not NULL). */
int strata_stream_destroy(cudaStream_t stream);

/* Waits for the work queued on `stream` (NULL: the default stream). */
int strata_stream_synchronize(cudaStream_t stream);

/* Copies `len` host bytes at `src` to device memory `dst` (from strata_malloc) and waits. A
 * range that is not inside live, awake memory (freed, out of range, tag asleep) is
 * STRATA_INVALID_ARGUMENT; so for strata_memcpy_dtoh. */
int strata_memcpy_htod(void *dst, const void *src, size_t len);

/* Copies `len` bytes of device memory `src` (from strata_malloc) to host `dst` and waits. */
int strata_memcpy_dtoh(void *dst, const void *src, size_t len);

#ifdef __cplusplus
}
#endif

#endif /* STRATA_H */

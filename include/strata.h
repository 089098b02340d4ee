/*
 * strata.h — the C API of libstrata.so (GPU memory virtualization on the CUDA VMM API).
 *
 * Entry points for PyTorch's pluggable allocator (exact signatures of
 * torch/csrc/cuda/CUDAPluggableAllocator.h), the hooks PyTorch can take, statistics, tags,
 * sleep/wake, Harvest (peer-memory allocations with revocation), KV spaces (an engine's KV cache
 * at fixed addresses, spilled to host memory and disk), errors and a version, plus small test-support calls (streams, copies).
 *
 * Conventions
 *  - Nothing has to be called first: the backend (STRATA_BACKEND=cuda|host|auto) and one caching
 *    allocator per device are created on first use.
 *  - Thread-safe. No Python, no GIL. Nothing ever unwinds into the caller: internal failures
 *    are reported as STRATA_INTERNAL.
 *  - Calls returning `int` return a strata_status_t (0 = STRATA_OK). Calls returning a pointer
 *    return NULL on failure; calls returning void (PyTorch's signatures) report failures only
 *    through strata_last_error(). Every failure sets the calling thread's last error;
 *    successes leave it unchanged (like errno): call strata_clear_error() first to tell. The
 *    hooks (strata_init, strata_empty_cache, strata_set_memory_fraction, strata_record_stream)
 *    report only through it, so their success clears it.
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
    STRATA_OUT_OF_MEMORY = 1,     /* physical memory, address space or tier space exhausted (recoverable) */
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
    uint64_t allocated_block_bytes; /* bytes of the blocks holding them (class or 512 B units) */
    uint64_t reserved_bytes;        /* bytes of pages held mapped (live, segments, cache) */
    uint64_t mapped_pages;          /* reserved_bytes / page_size */
    uint64_t cached_large_bytes;    /* freed large blocks kept mapped for reuse */
    uint64_t pool_free_bytes;       /* free physical pages in the device's page pool */
    uint64_t peak_allocated_bytes;
    uint64_t peak_reserved_bytes;
    uint64_t live_allocations;
    uint64_t pending_blocks;        /* freed blocks waiting for other streams */
    uint64_t limit_bytes;           /* cap on the device's own memory held (host and peer pages
                                       in reserved_bytes do not count; 0 and limit_set == 0:
                                       none) */
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
 *      set_record_stream_fn); failures set the last error, successes clear it ---------------- */

/* Creates the allocators of devices 0..device_count-1 now (else on first use). */
void strata_init(int device_count);

/* Unmaps every cached page on every device and returns it, and the pools' free pages (host
 * memory kept for offloaded tags included), to the driver. Live allocations stay. The pools refill only once allocations ask for pages again,
 * so an idle process holds no more than its live allocations afterwards. */
void strata_empty_cache(void);

/* Caps everything strata holds of `device`'s own memory (pages mapped for allocations and
 * cache, and the page pool's free pages) at `fraction` (0..1) of it; 1 lifts the cap. Host
 * memory and peer pages behind strata's addresses (strata_offload, overflow) do not count.
 * Beyond it strata_malloc returns NULL (STRATA_LIMIT_EXCEEDED), except for a tag set to
 * overflow, which goes on onto its overflow memory; strata_onload and revocations stay under
 * it. A cap of 0 bytes is a cap (limit_set in strata_stats_t tells it from none). An operator
 * sets the same cap from outside the process with `strata limit PID[:DEVICE] SIZE|none`
 * (README, "Operators"); the last one set wins. */
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
 * names no longer in use (pushed by no thread, nothing live or asleep under them, not set to
 * overflow) are released (strata_tag_stats then calls them unknown; pushed again they start
 * from zero). Only with 65,536 names all in use does a push fail (STRATA_INVALID_STATE). */
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

/* strata_sleep keeping the copies on disk: in an unlinked file in directory `dir` (which must
 * exist), not in host memory (at most three 8 MiB chunks of host memory per device while they
 * move; device reads overlap file writes). strata_wake reads them back, file reads overlapping
 * device writes. A failed copy (no such directory, disk full) leaves the tag awake. */
int strata_sleep_to_disk(const char *tag, const char *dir);

/* Maps fresh pages at the same addresses and restores the host or disk copies (or zeros). A tag asleep
 * nowhere is STRATA_INVALID_STATE. On failure (e.g. out of memory) the tag stays asleep where
 * it was not woken yet: call again. */
int strata_wake(const char *tag);

/* ---- Offload and onload: live allocations to another tier at the same addresses ---------- */

/* Tiers are the KV ABI's STRATA_TIER_HOST (host memory mapped for the device: still usable, at
 * link speed) and STRATA_TIER_DISK (an unlinked file in TMPDIR: not usable until onload). */

/* Moves every live allocation of tag `tag`, on every device, to `tier` at the same addresses.
 * STRATA_TIER_HOST: waits for the streams that used the tag's memory, gives its cached free
 * memory back, then per segment copies on `stream` (NULL: the default stream) into host-memory
 * pages, synchronizes `stream` and remaps them at the same addresses; kernels keep using the
 * pointers (slower). New allocations of the tag still come from the device. A failure leaves
 * the segment being moved intact on its old pages; those moved before it stay moved (call
 * again). STRATA_TIER_DISK is strata_sleep_to_disk into TMPDIR. Other tiers:
 * STRATA_INVALID_ARGUMENT; a sleeping tag: STRATA_INVALID_STATE. */
int strata_offload(const char *tag, int tier, cudaStream_t stream);

/* Brings tag `tag` back onto the devices' own memory at the same addresses: pages in host
 * memory are copied back on `stream` (out of device memory leaves the rest where it is, still
 * usable); a tag offloaded to disk is woken (strata_wake). */
int strata_onload(const char *tag, cudaStream_t stream);

/* Overflow (off by default): with `tier` STRATA_TIER_HOST, allocations of tag `tag` that find
 * a device out of memory (or at its strata_set_memory_fraction cap: what is left under it is
 * used first) succeed on host memory mapped for the device instead of returning
 * NULL (slower; strata_onload moves them to the device once it has room); `tier` 0 turns it
 * off (pages already taken stay until freed or onloaded). Applies to every device, including
 * those first used later. Replaces a strata_set_overflow_peer of the tag. A tag set to
 * overflow is in use: its name is not released (strata_tag_push). Other tiers:
 * STRATA_INVALID_ARGUMENT; a driver that cannot map host memory (CUDA before 12.2):
 * STRATA_UNSUPPORTED, also before any device was used. */
int strata_set_overflow(const char *tag, int tier);

/* Overflow onto a peer: allocations of tag `tag` on every device in use but `lender` that find their
 * device out of memory succeed on `lender`'s pages (borrowed memory, taken back by
 * strata_revoke_peer). Turned off by strata_set_overflow(tag, 0) or by a revocation; replaced
 * by strata_set_overflow(tag, STRATA_TIER_HOST). The tag is in use until then, as with
 * strata_set_overflow. */
int strata_set_overflow_peer(const char *tag, int lender);

/* One segment moved off a lender's pages by a revocation. */
typedef struct strata_revoked_t {
    int32_t device;    /* the device whose allocation moved */
    int32_t lender;    /* the device that took its pages back */
    int32_t to_device; /* 1: onto the device's own memory; 0: onto host memory */
    uint32_t tag_id;   /* as in strata_tag_stats_t */
    uint64_t ptr;      /* first byte of the segment: unchanged */
    uint64_t bytes;
} strata_revoked_t;

/* The lender takes its pages back: every segment on device `lender`'s pages behind another
 * device's allocations moves to that device's own memory, or to host memory when it is full,
 * at the same addresses with its contents (copies ordered on `stream`); tags stop overflowing
 * onto it. Each move is queued once for strata_take_revoked. */
int strata_revoke_peer(int lender, cudaStream_t stream);

/* Moves up to `capacity` revocation notices, oldest first, into out[0..*count); each notice
 * is handed out once. */
int strata_take_revoked(strata_revoked_t *out, size_t capacity, size_t *count);

/* Where a tag's (or a device's) mapped pages are, and the migrations that moved them. */
typedef struct strata_spill_stats_t {
    uint64_t local_bytes;          /* the device's own memory */
    uint64_t peer_bytes;           /* pages borrowed from a peer device */
    uint64_t host_bytes;           /* host memory mapped for the device (offloaded) */
    uint64_t migrations_to_host;   /* segments moved to host memory ... */
    uint64_t migrations_to_device; /* ... and back onto the device */
    uint64_t bytes_to_host;
    uint64_t bytes_to_device;
    uint64_t stalled_ns;           /* time callers waited on migrations */
    uint64_t spare[4];             /* zero; room to grow */
} strata_spill_stats_t;

/* Fills *out for tag `tag` on `device`, or for the whole device when `tag` is NULL. */
int strata_spill_stats(const char *tag, int device, strata_spill_stats_t *out);

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

/* ---- KV spaces: an engine's KV cache at fixed addresses, tiered ----------------------------- */

/* A KV space holds, for each of `layers` layers, a K and a V tensor of shape
 * [max_requests, max_tokens, kv_heads, head_dim] at addresses fixed for the space's life (a
 * framework wraps them without a copy; kernels and CUDA graphs may bake them in). Each request
 * is one slot of the first axis; its pages are mapped as it grows (strata_kv_append). A *block*
 * is one page index of a request across all 2 x layers tensors (tokens_per_block tokens): the
 * unit of residency. Blocks spill to host memory or disk and come back at the same addresses;
 * holes read as zeros when zero_page is set (else they are unmapped).
 * The space's pages come from the device's page pool, the one strata_malloc maps from: one
 * budget. Handles are opaque, 0 is never valid; a destroyed space's handle, a released
 * request's handle and a request of another space are errors (STRATA_INVALID_HANDLE /
 * STRATA_INVALID_ARGUMENT), never someone else's memory. Thread-safe: the calls on one space
 * serialize on its lock; calls on different spaces run in parallel. The engine synchronizes
 * its own work on a request's KV before spilling or releasing it. */
typedef uint64_t strata_kv_t;
typedef uint64_t strata_kv_request_t;

enum {
    STRATA_KV_BACKED = 0, /* revocations spill victims to host memory first: nothing is lost */
    STRATA_KV_LOSSY = 1   /* revocations drop blocks without copying; each is reported once */
};
enum { STRATA_KV_K = 0, STRATA_KV_V = 1 };
enum { STRATA_TIER_HOST = 1, STRATA_TIER_DISK = 2 };
/* Residency of a block (strata_kv_residency; strata_kv_read's tier uses the first three). */
enum { STRATA_KV_RESIDENT = 0, STRATA_KV_IN_HOST = 1, STRATA_KV_ON_DISK = 2, STRATA_KV_LOST = 3 };

typedef struct strata_kv_config_t {
    int32_t device;
    int32_t durability;     /* STRATA_KV_BACKED or STRATA_KV_LOSSY */
    uint32_t layers;
    uint32_t kv_heads;
    uint32_t head_dim;
    uint32_t elem_size;     /* 1, 2, 4 or 8; kv_heads x head_dim x elem_size must divide the page */
    uint32_t max_requests;
    uint32_t max_tokens;    /* per request */
    int32_t zero_page;      /* nonzero: holes are backed by one shared read-only zero page */
    int32_t reserved;       /* zero (else STRATA_INVALID_ARGUMENT) */
    uint64_t host_bytes;    /* host tier (pinned host memory allocated at creation); 0: none */
    uint64_t disk_bytes;    /* disk tier; 0: none (then disk_dir must be NULL); at most what
                               disk_dir's filesystem has available at creation (its file grows
                               as blocks land, its bookkeeping with the blocks held) */
    const char *disk_dir;   /* existing writable directory for the disk tier's file, or NULL */
    uint64_t step_time_ns;  /* one engine step, for the lookahead window (0: 20 ms) */
    uint64_t spare[4];      /* zero (else STRATA_INVALID_ARGUMENT) */
} strata_kv_config_t;

/* One (layer, K/V) tensor: element [r][t][h][d] is at data + r*strides[0] + t*strides[1] +
 * h*strides[2] + d*strides[3] (byte strides). dlpack_device_type is DLPack's DLDeviceType of
 * the addresses: 2 (kDLCUDA), 1 (kDLCPU: the host backend outside strict mode), 0 (not
 * CPU-accessible: the strict host backend). */
typedef struct strata_kv_tensor_t {
    uint64_t data;
    int32_t device;
    int32_t dlpack_device_type;
    int32_t ndim;           /* 4 */
    uint32_t elem_size;
    int64_t shape[4];       /* max_requests, max_tokens, kv_heads, head_dim */
    int64_t strides[4];     /* bytes */
} strata_kv_tensor_t;

typedef struct strata_kv_request_info_t {
    uint32_t slot;          /* index along the tensors' first axis */
    uint32_t tokens;
    uint32_t blocks;        /* ceil(tokens / tokens_per_block) */
    uint32_t resident;      /* blocks by residency (a snapshot) */
    uint32_t host;
    uint32_t disk;
    uint32_t lost;
    uint32_t reserved;
} strata_kv_request_info_t;

typedef struct strata_kv_stats_t {
    uint64_t page_size;
    uint64_t tokens_per_block;
    uint64_t block_bytes;        /* one block in all tensors */
    uint64_t requests_admitted;  /* ever */
    uint64_t blocks;             /* of the live requests, now: */
    uint64_t blocks_resident;
    uint64_t blocks_spilled;
    uint64_t blocks_clean;       /* resident with a clean copy below (re-spill copies nothing) */
    uint64_t blocks_lost;
    uint64_t pool_free_pages;    /* the device's page pool (shared with strata_malloc) */
    uint64_t pool_in_use_pages;
    uint64_t pool_created_pages; /* pages by source: created for the pool, ever */
    uint64_t pool_adopted_pages; /* pages by source: reclaimed (MIRAGE) or borrowed, ever */
    uint64_t host_used_bytes;    /* tier occupancy */
    uint64_t host_capacity_bytes;
    uint64_t disk_used_bytes;
    uint64_t disk_capacity_bytes;
    uint64_t bytes_to_device;    /* bytes moved each way, ever */
    uint64_t bytes_from_device;
    uint64_t disk_read_bytes;
    uint64_t disk_write_bytes;
    uint64_t spills;             /* blocks copied down, ever */
    uint64_t clean_spills;       /* blocks spilled without a copy (clean copy reused), ever */
    uint64_t clean_revocations;  /* blocks revoked without loss thanks to a clean copy, ever */
    uint64_t restores;           /* blocks copied back, ever */
    uint64_t prefetch_hits;      /* blocks brought back ahead of need by strata_kv_hint */
    uint64_t prefetch_misses;    /* blocks strata_kv_make_resident had to copy itself */
    uint64_t stalls;             /* strata_kv_make_resident calls that copied blocks */
    uint64_t evictions;          /* requests spilled to make room, ever */
    uint64_t lost_blocks;        /* ever */
    uint64_t pages_revoked;      /* pages revocations took from the space, ever (those the pool
                                    or the device had free take nothing from it) */
    uint64_t staged_objects;     /* store objects strata_kv_stage moved up, ever */
    uint64_t staged_evicted;     /* of those, dropped before a restore read them */
    uint64_t pages_ahead;        /* pages the background mapper (STRATA_KV_MAP_AHEAD) holds mapped
                                    ahead of growing requests now, not yet appended */
    uint64_t pages_from_ahead;   /* pages appends took from the mapper (no driver call), ever */
    uint64_t spare[4];           /* zero */
} strata_kv_stats_t;

/* Called once per block lost to a revocation of a STRATA_KV_LOSSY space, on the thread of the
 * strata_kv_revoke that lost it, after that call released every strata lock: it may call strata
 * (strata_kv_request_info, strata_kv_make_resident, ...). A block reported here is not reported
 * again by strata_kv_take_lost. `user_data` is passed through untouched. */
typedef void (*strata_kv_lost_fn)(strata_kv_t kv, strata_kv_request_t request, uint32_t block,
                                  void *user_data);

/* Creates a KV space (the device's pool and backend are created on first use). Every count and
 * product of counts is checked. STRATA_INVALID_ARGUMENT: bad shapes, NULL, elem_size or
 * durability out of range, disk_bytes without disk_dir, reserved or spare not zero, bytes per
 * token not dividing the page, sizes that overflow 64 bits, more than 2^24 pages in all the
 * tensors together (each page has an entry in the space's tables; with zero_page, a mapping
 * from creation on), a host or disk tier of more than 2^32 - 1 store blocks.
 * STRATA_OUT_OF_MEMORY: tensors of 2^47 bytes or more together (x86-64's whole user address
 * space), address space running out while reserving or mapping them, disk_bytes beyond what
 * disk_dir's filesystem has available, host memory for the host tier or the tables. No such
 * device: STRATA_NO_DEVICE. */
int strata_kv_create(const strata_kv_config_t *config, strata_kv_t *out);

/* Waits for the space's copies and releases everything it holds: its pages are back in the
 * device's pool when it returns. Its handle and its requests' handles are stale afterwards.
 * Calls already running on it finish first (waited for up to 200 ms; a call that destroys the
 * space from a callback of a call on it is not waited for: the outer call releases it). */
int strata_kv_destroy(strata_kv_t kv);

/* Describes the `kind` (STRATA_KV_K / STRATA_KV_V) tensor of `layer`. */
int strata_kv_tensor(strata_kv_t kv, uint32_t layer, int kind, strata_kv_tensor_t *out);

/* Admits a request with no tokens. All slots taken: STRATA_INVALID_STATE. */
int strata_kv_admit(strata_kv_t kv, strata_kv_request_t *out);

/* Appends `tokens` (> 0) tokens to a request: maps the pages they need in every tensor,
 * spilling requests that run furthest away while the pool is short. Past max_tokens:
 * STRATA_INVALID_ARGUMENT; out of memory: STRATA_OUT_OF_MEMORY; the request's last block
 * spilled or blocks lost and not yet reported: STRATA_INVALID_STATE. On error nothing changed.
 * The new tokens hold undefined bytes until the engine writes them: pages are recycled as
 * they come from the pool (a truncated or released request's, or strata_malloc's), not zeroed,
 * as cudaMalloc's are not; so are tokens past a truncation within its last page. */
int strata_kv_append(strata_kv_t kv, strata_kv_request_t request, uint32_t tokens);

/* Truncates a request to its first `tokens` tokens (a crop), after its copies: the pages past
 * them are unmapped and go back to the pool, and their spilled copies are released (a spilled
 * last block keeps the copies of the chunks its remaining tokens use); the addresses stay.
 * `tokens` above the request's length: STRATA_INVALID_ARGUMENT, nothing changed. */
int strata_kv_truncate(strata_kv_t kv, strata_kv_request_t request, uint32_t tokens);

/* Releases a request after its copies (its pages go to the next request; its handle is stale). */
int strata_kv_release(strata_kv_t kv, strata_kv_request_t request);

/* A request's slot, tokens and blocks by residency. */
int strata_kv_request_info(strata_kv_t kv, strata_kv_request_t request,
                           strata_kv_request_info_t *out);

/* Writes STRATA_KV_RESIDENT / _IN_HOST / _ON_DISK / _LOST for each block of the request into
 * out[0..*count). *count always receives the number of blocks; more than `capacity`:
 * STRATA_INVALID_ARGUMENT and nothing written to `out`. */
int strata_kv_residency(strata_kv_t kv, strata_kv_request_t request, uint8_t *out,
                        size_t capacity, size_t *count);

/* Copies `len` host bytes (whole tokens, already appended, in resident blocks) into tokens
 * first_token.. of the request in the `kind` tensor of `layer` (a backend copy; waits). */
int strata_kv_write(strata_kv_t kv, strata_kv_request_t request, uint32_t layer, int kind,
                    uint32_t first_token, const void *src, size_t len);

/* Copies `len` bytes (whole tokens) of tokens first_token.. of the request in the `kind` tensor
 * of `layer` into host memory, from wherever they are; *tier (if not NULL) receives the
 * slowest tier read. Lost blocks: STRATA_INVALID_STATE. */
int strata_kv_read(strata_kv_t kv, strata_kv_request_t request, uint32_t layer, int kind,
                   uint32_t first_token, void *dst, size_t len, int *tier);

/* Direction of strata_kv_copy_tokens. */
enum { STRATA_KV_COPY_IN = 0, STRATA_KV_COPY_OUT = 1 };

/* One run of a request's tokens in the `kind` tensor of `layer`, and the memory outside the
 * space it is copied from (STRATA_KV_COPY_IN) or to (STRATA_KV_COPY_OUT). */
typedef struct strata_kv_token_copy_t {
    strata_kv_request_t request;
    uint32_t layer;
    int32_t kind;           /* STRATA_KV_K or STRATA_KV_V */
    uint32_t first_token;
    uint32_t reserved;      /* zero */
    uint64_t address;       /* device memory, or host memory */
} strata_kv_token_copy_t;

/* Queues `count` copies of `tokens` tokens each between requests and memory outside the space
 * (an engine's own KV blocks, offloaded or loaded back) on `stream`, as one launch of the
 * block-copy kernel (one batch of copies where the backend cannot launch it), after the
 * requests' earlier copies (make_resident's: `stream` waits for them). The host does not wait:
 * synchronize `stream` before relying on the bytes or reusing the outside memory. Spills,
 * revocations, strata_kv_read/_write, truncation and release of those requests wait for these
 * copies. Every run lies within its request's tokens (STRATA_INVALID_ARGUMENT) in resident
 * blocks (STRATA_INVALID_STATE); on error nothing is queued. COPY_IN drops the clean lower-tier
 * copies of the blocks it writes. Each outside range is device memory mapped for `stream`'s
 * device or host memory, valid and untouched by others until the copies complete; destinations
 * must not overlap one another or any source. */
int strata_kv_copy_tokens(strata_kv_t kv, int direction, uint32_t tokens,
                          const strata_kv_token_copy_t *copies, size_t count,
                          cudaStream_t stream);

/* Spills the request's resident blocks to STRATA_TIER_HOST or STRATA_TIER_DISK (blocks already
 * in host memory move to disk too). Full blocks with a clean copy copy nothing. Out of tier
 * space, whichever tier (host memory full, the disk tier or its filesystem full):
 * STRATA_OUT_OF_MEMORY with the blocks left resident. STRATA_TIER_DISK in a space without a
 * disk tier: STRATA_INVALID_STATE. */
int strata_kv_spill(strata_kv_t kv, strata_kv_request_t request, int tier);

/* Spills every request not used for more than `idle_steps` steps; *blocks (if not NULL)
 * receives the blocks spilled. Statuses as strata_kv_spill's. */
int strata_kv_spill_idle(strata_kv_t kv, uint64_t idle_steps, int tier, uint64_t *blocks);

/* Moves the scheduler's step clock to `step` (never back). Requests used in the current step
 * are never spilled for room. */
int strata_kv_advance(strata_kv_t kv, uint64_t step);

/* The scheduler's waiting queue beyond the hinted window, in the order the requests will run
 * (eviction, from the pool and from a full host tier to disk, takes the last first). Replaces
 * the previous queue. A released request: STRATA_INVALID_HANDLE, the previous queue kept. */
int strata_kv_queue(strata_kv_t kv, const strata_kv_request_t *waiting, size_t count);

/* TierKV lookahead: the batches of the next `steps` steps (`step_counts[i]` handles each, one
 * after another in `requests`). Spilled blocks of those requests whose transfer fits the
 * compute window come back now, evicting only requests that run later; `stream` waits for the
 * copies (no host synchronization). Released requests are ignored (a hint is advice). */
int strata_kv_hint(strata_kv_t kv, const strata_kv_request_t *requests,
                   const uint32_t *step_counts, size_t steps, cudaStream_t stream);

/* Makes every block of the batch resident (spilling requests outside it while the pool is
 * short) and orders the copies before `stream`'s later work: the stream waits on them, the
 * host does not. All or nothing: out of memory, or a request with unreported lost blocks
 * (STRATA_INVALID_STATE), changes no block's residency. Lost blocks (once reported) come back
 * as fresh pages of undefined contents for the engine to recompute. */
int strata_kv_make_resident(strata_kv_t kv, const strata_kv_request_t *batch, size_t count,
                            cudaStream_t stream);

/* TierKV's first hop ahead of need: the batch's spilled blocks that sit on disk move up to host
 * memory, so that a later strata_kv_make_resident copies them from there (one hop, not two).
 * Only into host room nothing else needs: free host memory beyond what spilling every other
 * resident request would take. Staging never moves another request's blocks down (that would
 * trade this disk read for one of theirs); what finds no room stays on disk (advice: not an
 * error). The file reads run without the space's lock and never ahead of a restore's disk
 * reads. *objects (if not NULL) receives the number of store objects moved up (a block is one
 * per layer and K/V). A space without a disk tier moves nothing. */
int strata_kv_stage(strata_kv_t kv, const strata_kv_request_t *batch, size_t count,
                    uint64_t *objects);

/* The request's blocks lost to revocations and not yet reported, ascending, into
 * blocks[0..*count); each block is reported once (here or to the strata_kv_lost_fn). capacity
 * must be at least the request's block count (else STRATA_INVALID_ARGUMENT, *count receives
 * that count and nothing is taken). */
int strata_kv_take_lost(strata_kv_t kv, strata_kv_request_t request, uint32_t *blocks,
                        size_t capacity, size_t *count);

/* Registers the space's lost-block callback (replacing the previous one); NULL clears it. */
int strata_kv_on_lost(strata_kv_t kv, strata_kv_lost_fn callback, void *user_data);

/* Takes `pages` pool pages from the space back to the device's pool (for strata_malloc, another
 * space, a lender): free pool pages first, then blocks of the requests running furthest away.
 * STRATA_KV_LOSSY: blocks with a clean copy become spilled, others are lost (reported once:
 * the callback runs before this call returns, else strata_kv_take_lost). STRATA_KV_BACKED: the
 * victims are spilled to host memory first, nothing is lost. *lost_blocks (if not NULL)
 * receives the blocks this call lost, also when it fails. Not enough pages even then (any
 * `pages` beyond the device, UINT64_MAX included): STRATA_OUT_OF_MEMORY, the pages taken on
 * the way back in the pool, the blocks lost on the way lost and reported. */
int strata_kv_revoke(strata_kv_t kv, uint64_t pages, uint64_t *lost_blocks);

/* Fills *out with the space's figures. */
int strata_kv_stats(strata_kv_t kv, strata_kv_stats_t *out);

/* Checks the space's invariants (tests): STRATA_INVALID_STATE with the broken one. */
int strata_kv_check(strata_kv_t kv);

/* ---- Pie: per-layer FIFO swapping and adaptive expansion (decisions only) ------------------ */

/* A controller for a caller that keeps each layer's KV in its own place (one KV space per layer)
 * and moves whole layers between the device and host memory itself. It holds Pie's mapping
 * table (two-phase updates), its FIFO protocol (when layer k starts: swap in the hottest CPU
 * layer if a device slot is free and no swap-in is in flight; swap out the coldest device
 * layer, the one computed last, if no swap-out is in flight) and adaptive expansion (one more
 * CPU layer while no step waits and throughput does not fall; one fewer after a wait). It aims
 * for max(floor, expansion) layers on the CPU. Layers are 0..layers-1, run cyclically. Pure
 * bookkeeping: no memory, no copies; thread-safe (one lock per controller). */
typedef uint64_t strata_pie_t;

/* Layers to start moving (-1: none). */
typedef struct strata_pie_decision_t {
    int32_t swap_in;
    int32_t swap_out;
} strata_pie_decision_t;

/* A layer's place in the mapping table (strata_pie_state). A swapping-out layer's device copy is
 * still there, but a caller whose swap-out frees it as it goes must not compute on it. */
enum { STRATA_PIE_GPU = 0, STRATA_PIE_CPU = 1, STRATA_PIE_SWAPPING_IN = 2, STRATA_PIE_SWAPPING_OUT = 3 };

/* Creates a controller with every layer on the device; adaptive expansion may move up to
 * `max_cpu_layers` (< layers; 0: never on its own) to the CPU. layers 0 or above 65536,
 * max_cpu_layers >= layers, NULL out: STRATA_INVALID_ARGUMENT. */
int strata_pie_create(uint32_t layers, uint32_t max_cpu_layers, strata_pie_t *out);

/* Destroys a controller; its handle is stale afterwards (STRATA_INVALID_HANDLE). */
int strata_pie_destroy(strata_pie_t pie);

/* The least layers on the CPU (those the device budget cannot hold; < layers, else
 * STRATA_INVALID_ARGUMENT). *cpu_layers (if not NULL) receives the number aimed for. */
int strata_pie_set_floor(strata_pie_t pie, uint32_t floor, uint32_t *cpu_layers);

/* Layer `layer` begins: *out receives the swaps to start (phase one is recorded). The caller
 * reports each one's end with strata_pie_swap_done. Calling it again for the same layer after a
 * swap finished is how a caller waiting for its layer gets the next move. */
int strata_pie_layer_start(strata_pie_t pie, uint32_t layer, strata_pie_decision_t *out);

/* The swap-in (direction 0) or swap-out (1) in flight finished (phase two). None in flight:
 * STRATA_INVALID_STATE; another direction: STRATA_INVALID_ARGUMENT. */
int strata_pie_swap_done(strata_pie_t pie, int direction);

/* *out receives STRATA_PIE_GPU, _CPU, _SWAPPING_IN or _SWAPPING_OUT for `layer`. */
int strata_pie_state(strata_pie_t pie, uint32_t layer, int *out);

/* One measurement interval ended (a decode step): `waited` nonzero if a layer waited on a swap,
 * `throughput` (finite, >= 0; e.g. tokens/s) over it. *cpu_layers (if not NULL) receives the
 * number of CPU layers aimed for afterwards. */
int strata_pie_observe(strata_pie_t pie, int waited, double throughput, uint32_t *cpu_layers);

/* TierKV's overlap condition (seed 002, Eq. 1-2) per layer, from the controller's own
 * measurements: Eq. 2 prices a layer's transfer as latency + bytes / bandwidth per hop, with
 * each hop's latency and bandwidth fitted by least squares to the transfers reported (a plain
 * rate until two sizes were seen); blocks on disk take both hops (disk -> host -> device).
 * Eq. 1 holds when that time is at most the compute time of the layers in between (each
 * layer's running mean of the times reported). */
enum { STRATA_PIE_HOST_TO_DEVICE = 0, STRATA_PIE_DISK_TO_HOST = 1 };

/* -1 where nothing was measured yet. */
typedef struct strata_pie_overlap_t {
    int32_t steps;      /* least layers ahead the transfer must start to be hidden (-1: none do) */
    int32_t fits;       /* 1: started when `from` begins, it is hidden; 0: it is not */
    double t_transfer;  /* Eq. 2, seconds */
    double window;      /* compute of layers from, from+1, ..., layer-1 (cyclic), seconds */
} strata_pie_overlap_t;

/* Layer `layer` computed for `seconds` (from its start to the next layer's start). Seconds not
 * finite or negative, layer out of range: STRATA_INVALID_ARGUMENT. */
int strata_pie_observe_compute(strata_pie_t pie, uint32_t layer, double seconds);

/* A transfer of `bytes` over `hop` (STRATA_PIE_HOST_TO_DEVICE or STRATA_PIE_DISK_TO_HOST) took
 * `seconds`. Another hop, seconds not finite or negative: STRATA_INVALID_ARGUMENT. */
int strata_pie_observe_transfer(strata_pie_t pie, int hop, uint64_t bytes, double seconds);

/* The overlap condition for `layer`'s transfer of `host_bytes` from host memory and `disk_bytes`
 * from disk, started when layer `from` begins. */
int strata_pie_overlap(strata_pie_t pie, uint32_t from, uint32_t layer, uint64_t host_bytes,
                       uint64_t disk_bytes, strata_pie_overlap_t *out);

/* ---- Parameters (MIRAGE): idle models' layer memory lent to the KV cache ------------------ */

/* A model's layers live in strata parameter memory, each with a pinned host copy that is the
 * authority (copied from the caller's buffers at registration). When the KV cache runs short,
 * strata_params_step has the device's remapping controller pick idle models (lowest priority,
 * most recently active last, up to `cap` layers each, within the budget T_T x N <= T_compute)
 * and give alpha layers' worth of their pages to the device's pool, where KV spaces and
 * strata_malloc grow; those models then stream m = alpha + 1 or alpha + 2 evenly spaced layers
 * through beta slots, reloaded by strata_params_prepare_layer. When pressure falls the pages
 * come back (reversion) and the layers are reloaded at their own addresses. One controller per
 * device; a model handle stays valid until strata_params_unregister (handles are never reused). */
typedef uint64_t strata_model_t;

typedef struct strata_params_model_stats_t {
    int32_t device;
    uint32_t layers;
    uint64_t layer_bytes;      /* rounded up to pages */
    uint64_t pages_per_layer;
    uint32_t remapped_layers;  /* alpha: layers' worth of pages given to the pool */
    uint32_t streamed_layers;  /* m: layers loaded into slots when they run */
    uint32_t slots;            /* beta */
    uint32_t remap_limit;      /* most layers remappable now (0 until compute is reported) */
    uint64_t gpu_pages;        /* pages the model holds on the device */
    uint64_t transfer_ns;      /* T_T: measured host -> device time of one layer (the device's
                                  largest), 0 before any */
    /* Streamed layers, counted since registration: */
    uint64_t streamed_runs;    /* strata_params_prepare_layer calls for streamed layers */
    uint64_t slot_loads;       /* host -> slot loads queued (by either call) */
    uint64_t loads_ahead;      /* of those, queued ahead by strata_params_prepare_next */
    uint64_t found_prepared;   /* runs whose layer a look-ahead had loaded (or was loading) */
    uint64_t load_waits;       /* runs whose load was not complete when asked for */
    uint64_t spare[4];         /* zero */
} strata_params_model_stats_t;

/* strata_params_prepare_next's answer when it prepared nothing. */
#define STRATA_PARAMS_NO_LAYER UINT32_MAX

/* Registers a model of `layers` layers of `layer_bytes` bytes on `device`; host_layers[i] holds
 * layer i (copied now into strata's host copy, then loaded to the device; the call measures
 * the reload time T_T). At most `cap` layers are ever remapped. A new model is idle. */
int strata_params_register(int device, uint32_t layers, uint64_t layer_bytes, uint32_t cap,
                           const void *const *host_layers, strata_model_t *out);

/* Unregisters the model: its in-flight reloads drain, then every page it holds on the device
 * (resident layers and slots) goes back to the device's pool and its host copies are freed; pages
 * it gave the pool through remapping stay there. *pages_returned (if not NULL) receives the
 * number of pages given back. The caller has synchronized the compute reading its resident
 * layers. Refused with STRATA_INVALID_STATE, changing nothing, while the model is active
 * (strata_params_set_active) or a slot holds a layer not reported done
 * (strata_params_layer_done). The handle is STRATA_INVALID_HANDLE from then on. */
int strata_params_unregister(strata_model_t model, uint64_t *pages_returned);

/* Where `layer` is now: its own address when resident, its slot when streamed and prepared;
 * streamed and not prepared: STRATA_INVALID_STATE. */
int strata_params_layer_ptr(strata_model_t model, uint32_t layer, uint64_t *out);

/* Marks the model serving (never remapped while active) or idle. */
int strata_params_set_active(strata_model_t model, int active);

/* Reports the model's compute time per layer (T_c); until then none of its layers is remapped. */
int strata_params_report_compute(strata_model_t model, uint64_t per_layer_ns);

/* Reports the model's prefill time: its T_compute while idle (MIRAGE 5.3: an idle model may give
 * up to prefill / T_T layers; without a prefill report, n x T_c). */
int strata_params_report_prefill(strata_model_t model, uint64_t prefill_ns);

/* One controller step on `device`: `pages_short` pages the KV cache could not get remap layers
 * until covered; 0 reverts (dynamic reversion) what the pool could hand out covers: its free
 * pages and what the device (and strata_set_memory_fraction's cap) still has room for. *decisions (if not NULL) receives
 * the number of models changed. The caller has synchronized the compute reading the models. */
int strata_params_step(int device, uint64_t pages_short, uint32_t *decisions);

/* Reverts every remapped layer on `device` (pages taken back from the pool, layers reloaded). */
int strata_params_revert_all(int device);

/* Makes `layer` ready to run: a streamed layer is found in its slot (loaded ahead) or reloaded
 * into a slot behind the previous occupant's strata_params_layer_done; `stream` waits for that
 * one copy, the host does not. It counts as running until its strata_params_layer_done. A
 * resident layer needs nothing. */
int strata_params_prepare_layer(strata_model_t model, uint32_t layer, cudaStream_t stream);

/* The look-ahead (the next layer loads while this one computes): queues the load of the next
 * streamed layer after `after` (ring order: after the last comes the next token's first) into a
 * slot that is free or whose occupant reported done, behind that compute. No stream waits for it
 * until strata_params_prepare_layer asks for the layer. *prepared receives that layer (also
 * when it is in a slot already), or STRATA_PARAMS_NO_LAYER when nothing streams or no slot can
 * take it yet (with one slot, until the running layer's strata_params_layer_done). Call again
 * with the layer returned to fill more slots. A layer loaded ahead and never asked for gives its
 * slot to the layer strata_params_prepare_layer asks for. */
int strata_params_prepare_next(strata_model_t model, uint32_t after, uint32_t *prepared);

/* The layer's kernels were queued on `stream`: its slot may be reloaded after them. A layer
 * the model does not have: STRATA_INVALID_ARGUMENT. */
int strata_params_layer_done(strata_model_t model, uint32_t layer, cudaStream_t stream);

/* Copies `len` bytes of `layer` at `offset` (where it is now) into host memory (test support). */
int strata_params_read(strata_model_t model, uint32_t layer, uint64_t offset, void *dst,
                       size_t len);

/* Fills *out with the model's figures. */
int strata_params_model_stats(strata_model_t model, strata_params_model_stats_t *out);

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

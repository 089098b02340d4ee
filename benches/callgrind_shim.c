/* LD_PRELOAD shim that lets the host backend run under valgrind, whose client address space
 * holds no single mapping much above 32 GiB: the caching allocator reserves a 1 TiB arena and
 * the host backend a shadow of four times the machine's memory. For counting instructions
 * only (benches/callgrind_pairs.sh), never for anything that uses much memory:
 *
 * - sysconf(_SC_PHYS_PAGES) reports at most 2 GiB (the emulated host location's capacity);
 * - an anonymous PROT_NONE reservation above 4 GiB reserves only its first 4 GiB. The rest is
 *   a phantom: a munmap of it is dropped, and a MAP_FIXED mapping into it aborts the process
 *   (so a run that would have used it fails loudly instead of counting something else).
 *
 *   cc -O2 -shared -fPIC -o callgrind_shim.so benches/callgrind_shim.c -ldl
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#define CAP (4ull << 30)
#define PHYS_CAP (2ull << 30)
#define MAX_PHANTOMS 16

typedef void *(*mmap_fn)(void *, size_t, int, int, int, off_t);
typedef int (*munmap_fn)(void *, size_t);
typedef long (*sysconf_fn)(int);

/* [lo, hi): address ranges claimed but not reserved. */
static struct {
    uintptr_t lo, hi;
} phantoms[MAX_PHANTOMS];
static int n_phantoms;

static void *real_mmap(void *a, size_t n, int p, int f, int fd, off_t o) {
    static mmap_fn fn;
    if (!fn)
        fn = (mmap_fn)dlsym(RTLD_NEXT, "mmap");
    return fn(a, n, p, f, fd, o);
}

static int overlaps_phantom(uintptr_t lo, uintptr_t hi) {
    for (int i = 0; i < n_phantoms; i++)
        if (lo < phantoms[i].hi && phantoms[i].lo < hi)
            return 1;
    return 0;
}

void *mmap(void *addr, size_t len, int prot, int flags, int fd, off_t off) {
    uintptr_t a = (uintptr_t)addr;
    if ((flags & MAP_FIXED) && overlaps_phantom(a, a + len)) {
        fprintf(stderr, "callgrind_shim: MAP_FIXED into a phantom reservation at %p\n", addr);
        abort();
    }
    if (prot == PROT_NONE && (flags & MAP_ANONYMOUS) && !(flags & MAP_FIXED) && len > CAP &&
        n_phantoms < MAX_PHANTOMS) {
        void *p = real_mmap(addr, CAP, prot, flags, fd, off);
        if (p != MAP_FAILED) {
            phantoms[n_phantoms].lo = (uintptr_t)p + CAP;
            phantoms[n_phantoms].hi = (uintptr_t)p + len;
            n_phantoms++;
        }
        return p;
    }
    return real_mmap(addr, len, prot, flags, fd, off);
}

void *mmap64(void *addr, size_t len, int prot, int flags, int fd, off_t off) {
    return mmap(addr, len, prot, flags, fd, off);
}

int munmap(void *addr, size_t len) {
    static munmap_fn fn;
    if (!fn)
        fn = (munmap_fn)dlsym(RTLD_NEXT, "munmap");
    uintptr_t lo = (uintptr_t)addr, hi = lo + len;
    for (int i = 0; i < n_phantoms; i++) {
        /* Clip the phantom part off: unmap only what is really reserved. */
        if (lo < phantoms[i].hi && phantoms[i].lo < hi) {
            if (lo >= phantoms[i].lo)
                return hi > phantoms[i].hi ? fn((void *)phantoms[i].hi, hi - phantoms[i].hi) : 0;
            hi = phantoms[i].lo;
        }
    }
    return fn((void *)lo, hi - lo);
}

long sysconf(int name) {
    static sysconf_fn fn;
    if (!fn)
        fn = (sysconf_fn)dlsym(RTLD_NEXT, "sysconf");
    long v = fn(name);
    if (name == _SC_PHYS_PAGES) {
        long page = fn(_SC_PAGESIZE);
        long cap = (long)(PHYS_CAP / (unsigned long long)page);
        if (v > cap)
            v = cap;
    }
    return v;
}

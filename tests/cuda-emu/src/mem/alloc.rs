//! Memory the CUDA runtime's calls reach: `cuMemGetInfo`, pinned host memory
//! (`cuMemHostAlloc`) and `cuMemAlloc`/`cuMemFree` (sync and stream-ordered), the latter as a
//! handle mapped into a reservation of its own.

use super::*;

/// # Safety
///
/// As the driver's `cuMemGetInfo_v2`.
#[no_mangle]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    api(|| {
        let d = &emu()?.devices[current_device()?];
        let used = d.used.load(Ordering::Acquire);
        out(free, d.total.saturating_sub(used) as usize)?;
        out(total, d.total as usize)
    })
}

/// # Safety
///
/// As the driver's `cuMemHostAlloc`.
#[no_mangle]
pub unsafe extern "C" fn cuMemHostAlloc(
    pp: *mut *mut c_void,
    size: usize,
    flags: c_uint,
) -> CUresult {
    crate::charge(strata_latency::Call::HostAlloc);
    api(|| {
        current_device()?;
        if pp.is_null() || size == 0 || flags & !0b111 != 0 {
            return Err(INVALID_VALUE);
        }
        // SAFETY: fresh anonymous memory at a kernel-chosen address.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(OUT_OF_MEMORY);
        }
        with_state(|s| {
            s.pinned.insert(p as u64, size);
            Ok(())
        })?;
        out(pp, p)
    })
}

/// # Safety
///
/// As the driver's `cuMemFreeHost`.
#[no_mangle]
pub unsafe extern "C" fn cuMemFreeHost(p: *mut c_void) -> CUresult {
    crate::charge(strata_latency::Call::HostFree);
    api(|| {
        let len = with_state(|s| s.pinned.remove(&(p as u64)).ok_or(INVALID_VALUE))?;
        // SAFETY: the whole mapping `cuMemHostAlloc` made, freed once.
        unsafe { libc::munmap(p, len) };
        Ok(())
    })
}

/// `cuMemAlloc` memory: a handle of the current device mapped into its own reservation with
/// read/write access for that device.
fn alloc(size: usize) -> Res<u64> {
    let d = current_device()?;
    if size == 0 {
        return Err(INVALID_VALUE);
    }
    let size = (size as u64)
        .checked_next_multiple_of(granularity())
        .ok_or(OUT_OF_MEMORY)?;
    let phys = new_phys(Place::Device(d), size, false)?;
    let va = reserve(size, 0)?;
    with_state(|s| {
        let (_, set) = bits(Place::Device(d), 3);
        s.mappings.insert(
            va,
            Mapping {
                size,
                phys,
                offset: 0,
                access: vec![set; (size / granularity()) as usize],
            },
        );
        s.allocs.insert(va, (d, size));
        Ok(va)
    })
}

fn free_alloc(s: &mut State, ptr: u64) -> Res {
    let (_, size) = s.allocs.remove(&ptr).ok_or(INVALID_VALUE)?;
    s.mappings.remove(&ptr);
    free_reservation(s, ptr, size)
}

/// Frees every `cuMemAlloc` allocation of device `d` (its primary context was released).
pub(crate) fn free_context_allocations(d: usize) {
    let _ = with_state(|s| {
        let mine: Vec<u64> = s
            .allocs
            .iter()
            .filter(|(_, &(dev, _))| dev == d)
            .map(|(&p, _)| p)
            .collect();
        for p in mine {
            let _ = free_alloc(s, p);
        }
        Ok(())
    });
}

/// # Safety
///
/// As the driver's `cuMemAlloc_v2`.
#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, size: usize) -> CUresult {
    api(|| {
        if dptr.is_null() {
            return Err(INVALID_VALUE);
        }
        out(dptr, alloc(size)?)
    })
}

/// Synchronizes with the work of the allocation's device first (as `cuMemFree` does).
///
/// # Safety
///
/// As the driver's `cuMemFree_v2`.
#[no_mangle]
pub unsafe extern "C" fn cuMemFree_v2(ptr: CUdeviceptr) -> CUresult {
    api(|| {
        let d = with_state(|s| s.allocs.get(&ptr).map(|a| a.0).ok_or(INVALID_VALUE))?;
        crate::stream::synchronize_context(d);
        with_state(|s| free_alloc(s, ptr))
    })
}

fn alloc_async(dptr: *mut CUdeviceptr, size: usize, stream: CUstream) -> Res {
    // The stream must be valid in the current context; memory allocated now is valid at
    // every later point of the stream.
    crate::stream::target(stream)?;
    if dptr.is_null() {
        return Err(INVALID_VALUE);
    }
    out(dptr, alloc(size)?)
}

fn free_async(ptr: CUdeviceptr, stream: CUstream) -> Res {
    with_state(|s| s.allocs.get(&ptr).map(drop).ok_or(INVALID_VALUE))?;
    let target = crate::stream::target(stream)?;
    crate::stream::submit(
        &target,
        Box::new(move || {
            let _ = with_state(|s| free_alloc(s, ptr));
        }),
    );
    Ok(())
}

/// # Safety
///
/// As the driver's `cuMemAllocAsync`.
#[no_mangle]
pub unsafe extern "C" fn cuMemAllocAsync(
    dptr: *mut CUdeviceptr,
    size: usize,
    stream: CUstream,
) -> CUresult {
    api(|| alloc_async(dptr, size, stream))
}

/// # Safety
///
/// As the driver's `cuMemAllocAsync_ptsz`.
#[no_mangle]
pub unsafe extern "C" fn cuMemAllocAsync_ptsz(
    dptr: *mut CUdeviceptr,
    size: usize,
    stream: CUstream,
) -> CUresult {
    api(|| alloc_async(dptr, size, stream))
}

/// # Safety
///
/// As the driver's `cuMemFreeAsync`.
#[no_mangle]
pub unsafe extern "C" fn cuMemFreeAsync(ptr: CUdeviceptr, stream: CUstream) -> CUresult {
    api(|| free_async(ptr, stream))
}

/// # Safety
///
/// As the driver's `cuMemFreeAsync_ptsz`.
#[no_mangle]
pub unsafe extern "C" fn cuMemFreeAsync_ptsz(ptr: CUdeviceptr, stream: CUstream) -> CUresult {
    api(|| free_async(ptr, stream))
}

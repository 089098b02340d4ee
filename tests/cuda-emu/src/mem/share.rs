//! Sharing physical memory: allocation properties of a handle, and export/import as POSIX file
//! descriptors (a memfd crosses processes; its name says which device it was made for).

use super::*;

/// # Safety
///
/// As the driver's `cuMemGetAllocationPropertiesFromHandle`.
#[no_mangle]
pub unsafe extern "C" fn cuMemGetAllocationPropertiesFromHandle(
    prop: *mut CUmemAllocationProp,
    handle: CUmemGenericAllocationHandle,
) -> CUresult {
    api(|| {
        let phys = with_state(|s| s.handles.get(&handle).cloned().ok_or(INVALID_VALUE))?;
        let (kind, id) = match phys.place {
            Place::Device(d) => (CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, d as c_int),
            Place::Host => (CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST_NUMA, 0),
        };
        // SAFETY: an all-zero CUmemAllocationProp is valid (every enum has a zero variant, the
        // pointer may be null); the fields that matter are set below.
        let mut p: CUmemAllocationProp = unsafe { std::mem::zeroed() };
        p.type_ = CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        p.requestedHandleTypes = if phys.exportable {
            CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        } else {
            CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE
        };
        p.location = CUmemLocation { type_: kind, id };
        out(prop, p)
    })
}

/// # Safety
///
/// As the driver's `cuMemExportToShareableHandle`: for a POSIX descriptor, `shareable` points
/// to an `int`.
#[no_mangle]
pub unsafe extern "C" fn cuMemExportToShareableHandle(
    shareable: *mut c_void,
    handle: CUmemGenericAllocationHandle,
    kind: c_uint,
    flags: u64,
) -> CUresult {
    crate::charge(strata_latency::Call::Export);
    api(|| {
        if flags != 0 || kind != HANDLE_FD {
            return Err(INVALID_VALUE);
        }
        let phys = with_state(|s| s.handles.get(&handle).cloned().ok_or(INVALID_VALUE))?;
        if !phys.exportable {
            return Err(INVALID_VALUE);
        }
        // SAFETY: duplicates our own descriptor; the copy belongs to the caller.
        let fd = unsafe { libc::fcntl(phys.fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 0) };
        if fd < 0 {
            return Err(OUT_OF_MEMORY);
        }
        out(shareable.cast::<c_int>(), fd)
    })
}

/// The place an emulator memfd was made for, from its name (`/memfd:strata-cuda-emu:dev0`).
fn place_of_fd(fd: c_int) -> Res<Place> {
    let link = std::fs::read_link(format!("/proc/self/fd/{fd}")).map_err(|_| INVALID_VALUE)?;
    let name = link.to_string_lossy();
    let rest = name
        .strip_prefix("/memfd:strata-cuda-emu:")
        .ok_or(INVALID_VALUE)?;
    let rest = rest.split(' ').next().unwrap_or_default();
    if rest == "host" {
        return Ok(Place::Host);
    }
    let d: c_int = rest
        .strip_prefix("dev")
        .and_then(|d| d.parse().ok())
        .ok_or(INVALID_VALUE)?;
    Ok(Place::Device(device_index(emu()?, d)?))
}

/// Our own export comes back as a new reference to the same memory; another process's is
/// mapped anew (its size from the descriptor, its place from the memfd's name).
///
/// # Safety
///
/// As the driver's `cuMemImportFromShareableHandle`: for a POSIX descriptor, `os_handle` is the
/// descriptor value itself.
#[no_mangle]
pub unsafe extern "C" fn cuMemImportFromShareableHandle(
    handle: *mut CUmemGenericAllocationHandle,
    os_handle: *mut c_void,
    kind: c_uint,
) -> CUresult {
    crate::charge(strata_latency::Call::Import);
    api(|| {
        if kind != HANDLE_FD || handle.is_null() {
            return Err(INVALID_VALUE);
        }
        let fd = c_int::try_from(os_handle as usize).map_err(|_| INVALID_VALUE)?;
        // SAFETY: `st` is a valid out-pointer; an invalid descriptor is reported by fstat.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { libc::fstat(fd, &mut st) } != 0 {
            return Err(INVALID_VALUE);
        }
        let place = place_of_fd(fd)?;
        let h = with_state(|s| {
            let same = s.handles.values().find(|p| {
                // SAFETY: `pst` is a valid out-pointer; `p.fd` is our own descriptor.
                let mut pst: libc::stat = unsafe { std::mem::zeroed() };
                // SAFETY: as above.
                let ok = unsafe { libc::fstat(p.fd.as_raw_fd(), &mut pst) } == 0;
                ok && pst.st_dev == st.st_dev && pst.st_ino == st.st_ino
            });
            let phys = match same {
                Some(p) => Arc::clone(p),
                None => {
                    // SAFETY: duplicates the caller's descriptor (the driver does not take it).
                    let own = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
                    if own < 0 {
                        return Err(OUT_OF_MEMORY);
                    }
                    // SAFETY: `own` is a fresh descriptor nobody else owns.
                    let own = unsafe { OwnedFd::from_raw_fd(own) };
                    let size = st.st_size as u64;
                    let alias = map_alias(&own, size)?;
                    Arc::new(Phys {
                        fd: own,
                        size,
                        alias,
                        place,
                        exportable: true,
                        counted: None,
                    })
                }
            };
            let h = add_handle(s, phys);
            s.imported.insert(h);
            Ok(h)
        })?;
        out(handle, h)
    })
}

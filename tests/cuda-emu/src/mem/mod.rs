//! Memory: VMM reservations, physical handles, mappings and access, and the address
//! translation copies use; sharing handles in [`share`], `cuMemGetInfo`, pinned host memory and
//! `cuMemAlloc` in [`alloc`].
//!
//! A reservation is `PROT_NONE` address space the CPU never touches. A physical handle is a
//! `memfd` with one private read/write view (`alias`) through which the emulated copy engine
//! moves bytes; mappings only record which handle range backs which VA range, with access per
//! granule and per device.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::{c_int, c_uint, c_void};
use std::mem::offset_of;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use cudarc::driver::sys::{
    CUdeviceptr, CUmemAccessDesc, CUmemAllocationHandleType, CUmemAllocationProp,
    CUmemAllocationType, CUmemGenericAllocationHandle, CUmemLocation, CUmemLocationType, CUresult,
    CUstream,
};
use parking_lot::Mutex;

use crate::{
    api, current_device, device_index, emu, granularity, out, raw_u32, Res, INVALID_VALUE,
    NOT_SUPPORTED, OUT_OF_MEMORY,
};

const LOC_DEVICE: u32 = CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE as u32;
const LOC_HOST_NUMA: u32 = CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST_NUMA as u32;
const HANDLE_NONE: u32 = CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE.0;
const HANDLE_FD: u32 = CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR.0;
const PINNED: u32 = CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED as u32;

/// Where physical memory lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Place {
    Device(usize),
    Host,
}

/// Access bits of one granule: read `1 << 2d`, write `1 << (2d + 1)` for device `d`; the host
/// in the top two bits.
type AccessBits = u64;
const HOST_BITS: u32 = 62;

fn bits(place: Place, flags: u32) -> (AccessBits, AccessBits) {
    let shift = match place {
        Place::Device(d) => 2 * d as u32,
        Place::Host => HOST_BITS,
    };
    let mask = 0b11 << shift;
    let set = match flags {
        1 => 0b01 << shift,
        3 => 0b11 << shift,
        _ => 0,
    };
    (mask, set)
}

/// Physical memory: a memfd and its read/write view. Freed (and its device bytes returned) when
/// the last handle reference and the last mapping of it are gone.
pub(crate) struct Phys {
    fd: OwnedFd,
    size: u64,
    alias: usize,
    place: Place,
    exportable: bool,
    /// Counted against this device's memory (not for imports of another process's memory).
    counted: Option<usize>,
}

impl Drop for Phys {
    fn drop(&mut self) {
        // SAFETY: `alias` is this object's own mapping of `size` bytes, unmapped once here;
        // copies in flight hold an `Arc<Phys>`, so none uses it any more.
        unsafe { libc::munmap(self.alias as *mut c_void, self.size as usize) };
        if let (Some(d), Ok(emu)) = (self.counted, emu()) {
            emu.devices[d].used.fetch_sub(self.size, Ordering::AcqRel);
        }
    }
}

struct Mapping {
    size: u64,
    phys: Arc<Phys>,
    offset: u64,
    /// One entry per granule.
    access: Vec<AccessBits>,
}

#[derive(Default)]
struct State {
    /// start → (size, start of the whole OS mapping, its length)
    reservations: BTreeMap<u64, (u64, usize, usize)>,
    mappings: BTreeMap<u64, Mapping>,
    handles: HashMap<u64, Arc<Phys>>,
    /// Handles that `cuMemImportFromShareableHandle` returned (still live).
    imported: HashSet<u64>,
    next_handle: u64,
    /// `cuMemHostAlloc` memory: start → length.
    pinned: BTreeMap<u64, usize>,
    /// `cuMemAlloc` memory: start → (device, size).
    allocs: HashMap<u64, (usize, u64)>,
}

static STATE: Mutex<Option<State>> = Mutex::new(None);

fn with_state<T>(f: impl FnOnce(&mut State) -> Res<T>) -> Res<T> {
    emu()?;
    let mut guard = STATE.lock();
    f(guard.get_or_insert_with(State::default))
}

fn aligned(v: u64) -> bool {
    v % granularity() == 0
}

/// The place a caller's `CUmemLocation` names (validated).
///
/// # Safety
///
/// `loc` points to a readable `CUmemLocation`.
unsafe fn place_of(loc: *const CUmemLocation) -> Res<Place> {
    // SAFETY: the caller guarantees the struct; offsets come from cudarc's binding.
    let (kind, id) = unsafe {
        (
            raw_u32(loc.cast(), offset_of!(CUmemLocation, type_)),
            raw_u32(loc.cast(), offset_of!(CUmemLocation, id)) as i32,
        )
    };
    match kind {
        LOC_DEVICE => Ok(Place::Device(device_index(emu()?, id)?)),
        LOC_HOST_NUMA => Ok(Place::Host),
        _ => Err(INVALID_VALUE),
    }
}

/// Validates a caller's allocation properties: `(place, exportable)`.
///
/// # Safety
///
/// `prop` is null or points to a readable `CUmemAllocationProp`.
unsafe fn read_prop(prop: *const CUmemAllocationProp) -> Res<(Place, bool)> {
    if prop.is_null() {
        return Err(INVALID_VALUE);
    }
    // SAFETY: non-null; the caller guarantees the struct; offsets from cudarc's binding.
    let (kind, handles, place) = unsafe {
        (
            raw_u32(prop.cast(), offset_of!(CUmemAllocationProp, type_)),
            raw_u32(
                prop.cast(),
                offset_of!(CUmemAllocationProp, requestedHandleTypes),
            ),
            place_of(
                prop.cast::<u8>()
                    .add(offset_of!(CUmemAllocationProp, location))
                    .cast(),
            )?,
        )
    };
    if kind != PINNED {
        return Err(INVALID_VALUE);
    }
    match handles {
        HANDLE_NONE => Ok((place, false)),
        HANDLE_FD => Ok((place, true)),
        _ => Err(NOT_SUPPORTED),
    }
}

fn host_bytes() -> u64 {
    // SAFETY: `sysconf` only reads configuration values.
    let (pages, page) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    (pages.max(0) as u64).saturating_mul(page.max(0) as u64)
}

/// Maps `fd`'s `size` bytes read/write (the copy engine's view).
fn map_alias(fd: &OwnedFd, size: u64) -> Res<usize> {
    // SAFETY: a fresh shared mapping of our own descriptor at a kernel-chosen address.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            size as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_NORESERVE,
            fd.as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(OUT_OF_MEMORY);
    }
    Ok(p as usize)
}

fn new_phys(place: Place, size: u64, exportable: bool) -> Res<Arc<Phys>> {
    let emu = emu()?;
    let counted = match place {
        Place::Device(d) => {
            let dev = &emu.devices[d];
            let mut used = dev.used.load(Ordering::Acquire);
            loop {
                let next = used
                    .checked_add(size)
                    .filter(|&n| n <= dev.total)
                    .ok_or(OUT_OF_MEMORY)?;
                match dev
                    .used
                    .compare_exchange(used, next, Ordering::AcqRel, Ordering::Acquire)
                {
                    Ok(_) => break Some(d),
                    Err(now) => used = now,
                }
            }
        }
        Place::Host if size > host_bytes() => return Err(OUT_OF_MEMORY),
        Place::Host => None,
    };
    // Returns the device bytes if anything below fails.
    struct Undo(Option<usize>, u64);
    impl Drop for Undo {
        fn drop(&mut self) {
            if let (Some(d), Ok(driver)) = (self.0, crate::emu()) {
                driver.devices[d].used.fetch_sub(self.1, Ordering::AcqRel);
            }
        }
    }
    let undo = Undo(counted, size);
    let name = match place {
        Place::Device(d) => format!("strata-cuda-emu:dev{d}\0"),
        Place::Host => "strata-cuda-emu:host\0".to_string(),
    };
    // SAFETY: a NUL-terminated name; the new descriptor is owned below.
    let raw = unsafe { libc::memfd_create(name.as_ptr().cast(), libc::MFD_CLOEXEC) };
    if raw < 0 {
        return Err(OUT_OF_MEMORY);
    }
    // SAFETY: `raw` is a fresh descriptor nobody else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    // SAFETY: our own descriptor.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), size as libc::off_t) } != 0 {
        return Err(OUT_OF_MEMORY);
    }
    let alias = map_alias(&fd, size)?;
    std::mem::forget(undo);
    Ok(Arc::new(Phys {
        fd,
        size,
        alias,
        place,
        exportable,
        counted,
    }))
}

fn add_handle(state: &mut State, phys: Arc<Phys>) -> u64 {
    state.next_handle += 1;
    let h = 0x5eed_0000_0000 + state.next_handle;
    state.handles.insert(h, phys);
    h
}

/// # Safety
///
/// As the driver's `cuMemGetAllocationGranularity`.
#[no_mangle]
pub unsafe extern "C" fn cuMemGetAllocationGranularity(
    granularity: *mut usize,
    prop: *const CUmemAllocationProp,
    option: c_uint,
) -> CUresult {
    api(|| {
        emu()?;
        // SAFETY: the caller's contract.
        unsafe { read_prop(prop)? };
        if option > 1 {
            return Err(INVALID_VALUE);
        }
        out(granularity, crate::granularity() as usize)
    })
}

fn reserve(size: u64, alignment: u64) -> Res<u64> {
    if size == 0 || !aligned(size) || (alignment != 0 && !alignment.is_power_of_two()) {
        return Err(INVALID_VALUE);
    }
    let align = alignment.max(granularity());
    let len = size.checked_add(align).ok_or(INVALID_VALUE)?;
    let len = usize::try_from(len).map_err(|_| INVALID_VALUE)?;
    // SAFETY: fresh inaccessible address space at a kernel-chosen address.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if base == libc::MAP_FAILED {
        return Err(OUT_OF_MEMORY);
    }
    let start = (base as u64).div_ceil(align) * align;
    with_state(|s| {
        s.reservations.insert(start, (size, base as usize, len));
        Ok(start)
    })
}

/// # Safety
///
/// As the driver's `cuMemAddressReserve`.
#[no_mangle]
pub unsafe extern "C" fn cuMemAddressReserve(
    ptr: *mut CUdeviceptr,
    size: usize,
    alignment: usize,
    _addr: CUdeviceptr,
    flags: u64,
) -> CUresult {
    crate::charge(strata_latency::Call::Reserve);
    api(|| {
        emu()?;
        if flags != 0 || ptr.is_null() {
            return Err(INVALID_VALUE);
        }
        out(ptr, reserve(size as u64, alignment as u64)?)
    })
}

fn free_reservation(s: &mut State, ptr: u64, size: u64) -> Res {
    match s.reservations.get(&ptr) {
        Some(&(sz, _, _)) if sz == size => {}
        _ => return Err(INVALID_VALUE),
    }
    if s.mappings.range(ptr..ptr + size).next().is_some() {
        return Err(INVALID_VALUE);
    }
    let (_, base, len) = s.reservations.remove(&ptr).ok_or(INVALID_VALUE)?;
    // SAFETY: the whole OS mapping made by `reserve`, nothing of it in use.
    unsafe { libc::munmap(base as *mut c_void, len) };
    Ok(())
}

/// Refuses a range that still has mappings (stricter than the documentation says).
///
/// # Safety
///
/// As the driver's `cuMemAddressFree`.
#[no_mangle]
pub unsafe extern "C" fn cuMemAddressFree(ptr: CUdeviceptr, size: usize) -> CUresult {
    crate::charge(strata_latency::Call::FreeVa);
    api(|| with_state(|s| free_reservation(s, ptr, size as u64)))
}

/// # Safety
///
/// As the driver's `cuMemCreate`.
#[no_mangle]
pub unsafe extern "C" fn cuMemCreate(
    handle: *mut CUmemGenericAllocationHandle,
    size: usize,
    prop: *const CUmemAllocationProp,
    flags: u64,
) -> CUresult {
    crate::charge(strata_latency::Call::Create);
    api(|| {
        emu()?;
        // SAFETY: the caller's contract.
        let (place, exportable) = unsafe { read_prop(prop)? };
        let size = size as u64;
        if flags != 0 || handle.is_null() || size == 0 || !aligned(size) {
            return Err(INVALID_VALUE);
        }
        let phys = new_phys(place, size, exportable)?;
        let h = with_state(|s| Ok(add_handle(s, phys)))?;
        out(handle, h)
    })
}

/// # Safety
///
/// As the driver's `cuMemRelease`.
#[no_mangle]
pub unsafe extern "C" fn cuMemRelease(handle: CUmemGenericAllocationHandle) -> CUresult {
    crate::charge(strata_latency::Call::Release);
    api(|| {
        with_state(|s| {
            s.imported.remove(&handle);
            s.handles.remove(&handle).map(drop).ok_or(INVALID_VALUE)
        })
    })
}

/// Beyond the documented checks, two refusals a real driver made (REFERENCE.md §1.2, §1.8):
/// a non-zero `offset` is `CUDA_ERROR_NOT_SUPPORTED` (the documentation says "currently must
/// be zero"; driver 580.159 on an H200 answered 801), and so is an imported handle when
/// `STRATA_CUDA_EMU_IMPORTED_MAPS=refuse`.
///
/// # Safety
///
/// As the driver's `cuMemMap`.
#[no_mangle]
pub unsafe extern "C" fn cuMemMap(
    ptr: CUdeviceptr,
    size: usize,
    offset: usize,
    handle: CUmemGenericAllocationHandle,
    flags: u64,
) -> CUresult {
    crate::charge(strata_latency::Call::Map);
    api(|| {
        let (size, offset) = (size as u64, offset as u64);
        if flags != 0 || size == 0 || !aligned(ptr) || !aligned(size) || !aligned(offset) {
            return Err(INVALID_VALUE);
        }
        if offset != 0 {
            return Err(NOT_SUPPORTED);
        }
        let refuse_imported = emu()?.refuse_imported_maps;
        with_state(|s| {
            let phys = s.handles.get(&handle).cloned().ok_or(INVALID_VALUE)?;
            if refuse_imported && s.imported.contains(&handle) {
                return Err(NOT_SUPPORTED);
            }
            if offset.checked_add(size).is_none_or(|e| e > phys.size) {
                return Err(INVALID_VALUE);
            }
            let end = ptr.checked_add(size).ok_or(INVALID_VALUE)?;
            let inside = s
                .reservations
                .range(..=ptr)
                .next_back()
                .is_some_and(|(&r, &(rs, _, _))| end <= r + rs);
            let before = s
                .mappings
                .range(..ptr)
                .next_back()
                .is_some_and(|(&m, map)| m + map.size > ptr);
            let overlap = before || s.mappings.range(ptr..end).next().is_some();
            if !inside || overlap {
                return Err(INVALID_VALUE);
            }
            let granules = (size / granularity()) as usize;
            s.mappings.insert(
                ptr,
                Mapping {
                    size,
                    phys,
                    offset,
                    access: vec![0; granules],
                },
            );
            Ok(())
        })
    })
}

/// The mappings covering `ptr..ptr+size` exactly and contiguously (their start addresses).
fn covering(s: &State, ptr: u64, size: u64, whole: bool) -> Res<Vec<u64>> {
    let end = ptr.checked_add(size).ok_or(INVALID_VALUE)?;
    let mut starts = Vec::new();
    let first = s
        .mappings
        .range(..=ptr)
        .next_back()
        .filter(|(&m, map)| m + map.size > ptr)
        .map(|(&m, _)| m);
    let mut cursor = match first {
        Some(m) if !whole || m == ptr => m,
        _ => return Err(INVALID_VALUE),
    };
    while cursor < end {
        let map = s.mappings.get(&cursor).ok_or(INVALID_VALUE)?;
        starts.push(cursor);
        cursor += map.size;
    }
    if whole && cursor != end {
        return Err(INVALID_VALUE);
    }
    Ok(starts)
}

/// # Safety
///
/// As the driver's `cuMemUnmap`.
#[no_mangle]
pub unsafe extern "C" fn cuMemUnmap(ptr: CUdeviceptr, size: usize) -> CUresult {
    crate::charge(strata_latency::Call::Unmap);
    api(|| {
        let size = size as u64;
        if size == 0 || !aligned(ptr) || !aligned(size) {
            return Err(INVALID_VALUE);
        }
        with_state(|s| {
            let maps = covering(s, ptr, size, true)?;
            if crate::stream::touched_in_flight(ptr, size) {
                // The driver does not wait: the queued copy would touch unmapped memory.
                crate::fault(&format!(
                    "cuMemUnmap({ptr:#x}, {size:#x}) while queued work still uses the range"
                ));
            }
            for m in maps {
                s.mappings.remove(&m);
            }
            Ok(())
        })
    })
}

/// # Safety
///
/// As the driver's `cuMemSetAccess`: `desc` holds `count` descriptors.
#[no_mangle]
pub unsafe extern "C" fn cuMemSetAccess(
    ptr: CUdeviceptr,
    size: usize,
    desc: *const CUmemAccessDesc,
    count: usize,
) -> CUresult {
    crate::charge(strata_latency::Call::SetAccess);
    api(|| {
        let size = size as u64;
        if desc.is_null() || count == 0 || size == 0 || !aligned(ptr) || !aligned(size) {
            return Err(INVALID_VALUE);
        }
        let mut grants = Vec::with_capacity(count);
        for i in 0..count {
            // SAFETY: `desc` holds `count` descriptors (the caller's contract).
            let d = unsafe { desc.add(i) };
            // SAFETY: as above; offsets from cudarc's binding.
            let (place, flags) = unsafe {
                (
                    place_of(
                        d.cast::<u8>()
                            .add(offset_of!(CUmemAccessDesc, location))
                            .cast(),
                    )?,
                    raw_u32(d.cast(), offset_of!(CUmemAccessDesc, flags)),
                )
            };
            if !matches!(flags, 0 | 1 | 3) {
                return Err(INVALID_VALUE);
            }
            grants.push((place, flags));
        }
        with_state(|s| {
            let maps = covering(s, ptr, size, false)?;
            // Host access only for host memory (documented for HOST_NUMA grants).
            let host_grant = grants.iter().any(|g| g.0 == Place::Host);
            if host_grant && maps.iter().any(|m| s.mappings[m].phys.place != Place::Host) {
                return Err(INVALID_VALUE);
            }
            let end = ptr + size;
            for m in maps {
                let map = s.mappings.get_mut(&m).expect("covering found it");
                let from = ptr.max(m);
                let to = end.min(m + map.size);
                for g in ((from - m) / granularity())..((to - m) / granularity()) {
                    for &(place, flags) in &grants {
                        let (mask, set) = bits(place, flags);
                        let a = &mut map.access[g as usize];
                        *a = (*a & !mask) | set;
                    }
                }
            }
            Ok(())
        })
    })
}

/// # Safety
///
/// As the driver's `cuMemGetAccess`.
#[no_mangle]
pub unsafe extern "C" fn cuMemGetAccess(
    flags: *mut u64,
    location: *const CUmemLocation,
    ptr: CUdeviceptr,
) -> CUresult {
    api(|| {
        if location.is_null() {
            return Err(INVALID_VALUE);
        }
        // SAFETY: non-null; the caller's contract.
        let place = unsafe { place_of(location)? };
        let a = with_state(|s| {
            let m = covering(s, ptr, 1, false)?[0];
            let map = &s.mappings[&m];
            Ok(map.access[((ptr - m) / granularity()) as usize])
        })?;
        let (mask, _) = bits(place, 3);
        let got = (a & mask) >> mask.trailing_zeros();
        out(flags, got)
    })
}

mod alloc;
mod share;

pub(crate) use alloc::free_context_allocations;
pub use alloc::*;
pub use share::*;

/// One contiguous piece of a copy's source or destination, as a CPU address the copy engine
/// may use; device pieces keep their memory alive until the copy ran.
pub(crate) struct Piece {
    pub(crate) addr: usize,
    pub(crate) len: usize,
    pub(crate) _keep: Option<Arc<Phys>>,
}

/// What a copy endpoint is.
pub(crate) enum Endpoint {
    /// Device memory (VMM or `cuMemAlloc`), with access checked for the working device.
    Device(Vec<Piece>),
    /// `cuMemHostAlloc` memory.
    Pinned(Piece),
    /// Any other host memory.
    Pageable(Piece),
}

/// Resolves `ptr..ptr+len` for device `device` needing `write` (else read) access.
pub(crate) fn resolve(ptr: u64, len: u64, device: usize, write: bool) -> Res<Endpoint> {
    let end = ptr.checked_add(len).ok_or(INVALID_VALUE)?;
    let n = usize::try_from(len).map_err(|_| INVALID_VALUE)?;
    with_state(|s| {
        let in_reservation = s
            .reservations
            .range(..end)
            .next_back()
            .is_some_and(|(&r, &(rs, _, _))| r + rs > ptr);
        if !in_reservation {
            let pinned = s
                .pinned
                .range(..=ptr)
                .next_back()
                .is_some_and(|(&p, &l)| end <= p + l as u64);
            let piece = Piece {
                addr: ptr as usize,
                len: n,
                _keep: None,
            };
            return Ok(if pinned {
                Endpoint::Pinned(piece)
            } else {
                Endpoint::Pageable(piece)
            });
        }
        let need = bits(Place::Device(device), if write { 3 } else { 1 }).1;
        let mut pieces = Vec::new();
        for m in covering(s, ptr, len, false)? {
            let map = &s.mappings[&m];
            let from = ptr.max(m);
            let to = end.min(m + map.size);
            let first = (from - m) / granularity();
            let last = (to - 1 - m) / granularity();
            if (first..=last).any(|g| map.access[g as usize] & need != need) {
                return Err(INVALID_VALUE);
            }
            pieces.push(Piece {
                addr: map.phys.alias + (map.offset + from - m) as usize,
                len: (to - from) as usize,
                _keep: Some(Arc::clone(&map.phys)),
            });
        }
        Ok(Endpoint::Device(pieces))
    })
}

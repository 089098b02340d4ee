//! The block-copy kernel on a real device: NVRTC compiles `strata_kernels::blockcopy` once per
//! device (lazily), and each launch stages its `(src, dst)` address arrays into device memory,
//! stream-ordered.
//!
//! # Staging
//!
//! A [`Launcher`] keeps a small pool of [`Slot`]s. A slot is one granule of device memory (our own
//! VMM mapping, outside the backend's table: nobody else can name it), the same number of bytes of
//! pinned host memory, and an event. A launch of `n` pairs takes chunks of at most
//! [`chunk_pairs`] pairs (a slot's worth, within the grid limit); per chunk it
//!
//! 1. takes a slot whose event has completed (or waits for the oldest one when the pool is full,
//!    or when device memory for a new one is short), so nothing in flight still reads its host
//!    or device bytes;
//! 2. writes the source addresses, then the destination addresses, into the pinned staging;
//! 3. queues one host→device copy of those `16 n` bytes and the kernel launch (grid `n`, block
//!    [`THREADS_PER_BLOCK`]) on the caller's stream, then records the slot's event after them;
//! 4. returns the slot to the pool.
//!
//! The pinned bytes therefore stay untouched until the copy that reads them completed (the event
//! follows it on the same stream), and the device arrays until the kernel that reads them did.
//! Correct rather than clever: a full pool makes the host wait.
//!
//! Every driver object here belongs to the device's primary context; whoever drops a
//! [`Launcher`] or a [`Slot`] makes that context current first (the backend does, in its `Drop`
//! and around every launch).

use std::ffi::c_void;

use parking_lot::Mutex;
use strata_kernels::blockcopy::{CUDA_SOURCE, KERNEL_NAME, THREADS_PER_BLOCK};

use super::nvrtc::{self, Image};
use super::result::{self, CUfunction, CUmodule, CUstream};
use super::streams::raw_event;
use super::{device_location, Scratch};
use crate::error::{Error, Result};
use crate::types::{Access, DevicePtr};

/// Slots a launcher keeps before new launches wait for old ones (more are made only while every
/// slot is taken by a concurrent launch).
const POOL_SLOTS: usize = 4;

/// Bytes of one staged pair: a source and a destination address.
const PAIR_BYTES: u64 = 16;

/// The compilation attempts for a device of compute capability `cc` (`90` for 9.0), given the
/// real architectures NVRTC supports: machine code for exactly this architecture first (no JIT,
/// so no PTX-version mismatch with an older driver), then PTX for it; for a device newer than
/// NVRTC, PTX of the newest architecture below it (the driver JIT-compiles it forward). Empty
/// when NVRTC supports nothing at or below the device.
pub(crate) fn targets(cc: u32, supported: &[u32]) -> Vec<(Image, u32)> {
    if supported.contains(&cc) {
        return vec![(Image::Cubin, cc), (Image::Ptx, cc)];
    }
    supported
        .iter()
        .copied()
        .filter(|&a| a <= cc)
        .max()
        .map(|a| vec![(Image::Ptx, a)])
        .unwrap_or_default()
}

/// The program name NVRTC compiles the kernel under.
const PROGRAM_NAME: &std::ffi::CStr = c"strata_blockcopy.cu";

/// Compiles the block-copy kernel for `arch` into `image`, with NVRTC's log (its warnings).
pub(crate) fn compile_kernel(arch: u32, image: Image) -> Result<(Vec<u8>, String)> {
    nvrtc::compile_logged(CUDA_SOURCE, PROGRAM_NAME, arch, image)
}

/// Pairs per launch: what one slot stages, within the device's grid limit.
pub(crate) fn chunk_pairs(granularity: u64, max_grid: u32) -> usize {
    let per_slot = granularity / PAIR_BYTES;
    let n = per_slot.min(u64::from(max_grid)).max(1);
    usize::try_from(n).unwrap_or(usize::MAX)
}

/// A loaded module, unloaded on drop (context current, no launch in flight: the slots, dropped
/// first, waited for theirs).
struct Module(u64);

impl Drop for Module {
    fn drop(&mut self) {
        if crate::raii::process_is_exiting() {
            return;
        }
        // SAFETY: loaded once by `Launcher::new`, unloaded once here with its context current;
        // every launch of it was followed by a slot event that the slots' drops waited for.
        if let Err(e) = unsafe { result::module::unload(self.0 as usize as CUmodule) } {
            crate::raii::record_deferred(e);
        }
    }
}

/// Pinned host staging, freed on drop.
struct Pinned {
    ptr: u64,
}

impl Drop for Pinned {
    fn drop(&mut self) {
        if crate::raii::process_is_exiting() {
            return;
        }
        // SAFETY: allocated by `result::host::alloc`, freed once; the owning slot waited for its
        // event first, so no copy reads it any more.
        if let Err(e) = unsafe { result::host::free(self.ptr) } {
            crate::raii::record_deferred(e);
        }
    }
}

/// A physical handle, released on drop.
struct Phys(u64);

impl Drop for Phys {
    fn drop(&mut self) {
        if crate::raii::process_is_exiting() {
            return;
        }
        // SAFETY: created by `result::phys::create` for this slot only, released once; its
        // mapping (if any) is unmapped first (field order in `DeviceArrays`).
        if let Err(e) = unsafe { result::phys::release(self.0) } {
            crate::raii::record_deferred(e);
        }
    }
}

/// A mapping, unmapped on drop.
struct Mapped {
    va: u64,
    size: u64,
}

impl Drop for Mapped {
    fn drop(&mut self) {
        if crate::raii::process_is_exiting() {
            return;
        }
        // SAFETY: this exact range was mapped by `DeviceArrays::new`; the owning slot waited for
        // its event, so no kernel or copy touches it.
        if let Err(e) = unsafe { result::map::unmap(self.va, self.size) } {
            crate::raii::record_deferred(e);
        }
    }
}

/// One granule of device memory for the address arrays. Fields drop in order: unmap, release,
/// free the reservation.
struct DeviceArrays {
    mapped: Mapped,
    _phys: Phys,
    _va: Scratch,
}

impl DeviceArrays {
    /// Reserves, creates, maps and grants `device` read/write access to `size` bytes
    /// (`size` a multiple of the device's granularity; its context current). A failure part way
    /// unwinds through the owners made so far.
    fn new(device: u32, size: u64) -> Result<Self> {
        let va = Scratch {
            va: result::va::reserve(size, size)?,
            size,
        };
        let prop = result::phys::prop(device_location(device), false);
        let phys = Phys(result::phys::create(size, &prop)?);
        // SAFETY: `va` is our fresh reservation of exactly `size` bytes with nothing mapped;
        // the handle is live and `size` bytes long.
        unsafe { result::map::map(va.va, size, 0, phys.0)? };
        let mapped = Mapped { va: va.va, size };
        let desc = result::CUmemAccessDesc {
            location: device_location(device),
            flags: result::access::flags(Access::ReadWrite),
        };
        // SAFETY: the range was just mapped whole; nothing uses it yet.
        unsafe { result::access::set(va.va, size, &[desc])? };
        Ok(DeviceArrays {
            mapped,
            _phys: phys,
            _va: va,
        })
    }
}

/// An event of the launcher's context, destroyed on drop.
struct SlotEvent(u64);

impl Drop for SlotEvent {
    fn drop(&mut self) {
        if crate::raii::process_is_exiting() {
            return;
        }
        // SAFETY: created for this slot only, destroyed once.
        if let Err(e) = unsafe { result::event::destroy(raw_event(self.0)) } {
            crate::raii::record_deferred(e);
        }
    }
}

/// Staging for one chunk: device arrays, pinned host bytes of the same size, and the event
/// recorded after the last copy and launch that used them.
struct Slot {
    event: SlotEvent,
    pinned: Pinned,
    arrays: DeviceArrays,
}

impl Slot {
    fn new(device: u32, size: u64) -> Result<Self> {
        let event = SlotEvent(result::event::create()? as usize as u64);
        let pinned = Pinned {
            ptr: result::host::alloc(size)?,
        };
        let arrays = DeviceArrays::new(device, size)?;
        Ok(Slot {
            event,
            pinned,
            arrays,
        })
    }

    /// True when nothing queued with this slot is still in flight.
    fn idle(&self) -> Result<bool> {
        // SAFETY: the event is live (owned by this slot).
        unsafe { result::event::query(raw_event(self.event.0)) }
    }

    /// Waits until nothing queued with this slot is in flight.
    fn wait(&self) -> Result<()> {
        // SAFETY: the event is live (owned by this slot).
        unsafe { result::event::synchronize(raw_event(self.event.0)) }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        // The memory fields drop after this: wait for the last copy and kernel that use them.
        if !crate::raii::process_is_exiting() {
            if let Err(e) = self.wait() {
                crate::raii::record_deferred(e);
            }
        }
    }
}

struct Pool {
    idle: Vec<Slot>,
    made: usize,
}

/// The compiled kernel of one device and its staging slots.
pub(crate) struct Launcher {
    device: u32,
    /// Bytes of one slot (one granule).
    slot_bytes: u64,
    chunk: usize,
    function: u64,
    pool: Mutex<Pool>,
    /// Dropped after the pool (field order): slots wait for their launches first.
    _module: Module,
    /// How the module was built, for diagnostics.
    built: String,
}

impl std::fmt::Debug for Launcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Launcher")
            .field("device", &self.device)
            .field("chunk", &self.chunk)
            .field("built", &self.built)
            .finish_non_exhaustive()
    }
}

impl Launcher {
    /// Compiles and loads the kernel for `device` (its context current). Every failure is
    /// [`Error::Unsupported`]: no NVRTC, no suitable architecture, a module the driver refuses.
    pub(crate) fn new(device: u32, cu: result::CUdevice, granularity: u64) -> Result<Self> {
        let missing = result::missing_symbols(result::KERNEL_SYMBOLS);
        if !missing.is_empty() {
            return Err(Error::Unsupported(format!(
                "block-copy kernel: the CUDA driver lacks {}",
                missing.join(", ")
            )));
        }
        nvrtc::check_present()?;
        use cudarc::driver::sys::CUdevice_attribute as A;
        let major = result::device::attribute(cu, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = result::device::attribute(cu, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        let max_grid = result::device::attribute(cu, A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X)?;
        let cc = u32::try_from(major * 10 + minor)
            .map_err(|_| Error::Unsupported(format!("compute capability {major}.{minor}")))?;
        let max_grid = u32::try_from(max_grid).unwrap_or(0);
        if max_grid == 0 || granularity < PAIR_BYTES {
            return Err(Error::Unsupported(format!(
                "block-copy kernel: grid limit {max_grid}, granularity {granularity}"
            )));
        }
        let supported = nvrtc::supported_archs()?;
        let kernel = std::ffi::CString::new(KERNEL_NAME)
            .map_err(|_| Error::Unsupported("kernel name contains NUL".into()))?;
        let mut failures = Vec::new();
        for (image, arch) in targets(cc, &supported) {
            let loaded = compile_kernel(arch, image).and_then(|(bytes, _log)| {
                // SAFETY: `bytes` is NVRTC's complete output (PTX NUL-terminated by `compile`);
                // the device's context is current (this fn's contract).
                let module = Module(unsafe { result::module::load_data(&bytes)? } as usize as u64);
                // SAFETY: the module was just loaded and is alive (owned by `module`).
                let f =
                    unsafe { result::module::function(module.0 as usize as CUmodule, &kernel)? };
                Ok((module, f as usize as u64))
            });
            match loaded {
                Ok((module, function)) => {
                    // The first staging slot now: a launcher that cannot stage even one chunk
                    // is no launcher (the caller falls back to DMA).
                    let first = Slot::new(device, granularity)?;
                    return Ok(Launcher {
                        device,
                        slot_bytes: granularity,
                        chunk: chunk_pairs(granularity, max_grid),
                        function,
                        pool: Mutex::new(Pool {
                            idle: vec![first],
                            made: 1,
                        }),
                        _module: module,
                        built: format!("{image:?} for {arch} (device {cc})"),
                    });
                }
                Err(e) => failures.push(format!("{image:?} {arch}: {e}")),
            }
        }
        Err(Error::Unsupported(format!(
            "block-copy kernel for compute capability {major}.{minor} (NVRTC supports {supported:?}): {}",
            if failures.is_empty() {
                "no architecture to compile for".to_string()
            } else {
                failures.join("; ")
            }
        )))
    }

    /// Takes an idle slot, makes one (up to [`POOL_SLOTS`], more only while none is in the
    /// pool), or waits for the oldest. When making one fails (device memory is full, say) and a
    /// slot is in the pool, it waits for that one instead: the launcher made its first slot at
    /// creation, so a launch does not fail for want of staging while another one can serve.
    fn acquire(&self) -> Result<Slot> {
        let oldest = {
            let mut pool = self.pool.lock();
            for i in 0..pool.idle.len() {
                if pool.idle[i].idle()? {
                    return Ok(pool.idle.remove(i));
                }
            }
            if pool.made < POOL_SLOTS || pool.idle.is_empty() {
                pool.made += 1;
                None
            } else {
                Some(pool.idle.remove(0))
            }
        };
        let slot = match oldest {
            Some(slot) => slot,
            None => match Slot::new(self.device, self.slot_bytes) {
                Ok(fresh) => return Ok(fresh),
                Err(e) => {
                    let mut pool = self.pool.lock();
                    pool.made -= 1;
                    if pool.idle.is_empty() {
                        return Err(e);
                    }
                    pool.idle.remove(0)
                }
            },
        };
        match slot.wait() {
            Ok(()) => Ok(slot),
            Err(e) => {
                self.abandon(slot);
                Err(e)
            }
        }
    }

    fn give_back(&self, slot: Slot) {
        self.pool.lock().idle.push(slot);
    }

    /// A slot whose last use could not be waited for: the device may still read its pinned
    /// bytes or device arrays, so neither is freed nor reused. Its memory leaks on purpose (a
    /// driver error already happened; freeing could be a use-after-free on the device).
    #[cold]
    fn abandon(&self, slot: Slot) {
        std::mem::forget(slot);
        self.pool.lock().made -= 1;
    }

    /// Queues the kernel over `pairs` on `stream`, chunk by chunk (see the module docs).
    ///
    /// # Safety
    ///
    /// 1. The device's context is current and `stream` is null or a live stream of it.
    /// 2. Every range `(src, len)` and `(dst, len)` of `pairs` is device VA mapped with read
    ///    (source) or read/write (destination) access for this device, or pinned host memory,
    ///    valid until the launch completes; destinations are pairwise disjoint and disjoint from
    ///    every source (`VaTable::check_blocks`).
    pub(crate) unsafe fn launch(
        &self,
        stream: CUstream,
        len: u64,
        pairs: &[(DevicePtr, DevicePtr)],
    ) -> Result<()> {
        for chunk in pairs.chunks(self.chunk) {
            let slot = self.acquire()?;
            // SAFETY: the caller's contract for the context, the stream and the ranges.
            let queued = unsafe { self.queue_chunk(&slot, stream, len, chunk) };
            if let Err(e) = queued {
                // Part of the chunk may be queued without the slot's event after it: only a
                // drained stream makes the slot's bytes reusable.
                // SAFETY: the stream is null or live with its context current (caller).
                match unsafe { result::stream::synchronize(stream) } {
                    Ok(()) => self.give_back(slot),
                    Err(_) => self.abandon(slot),
                }
                return Err(e);
            }
            self.give_back(slot);
        }
        Ok(())
    }

    /// Stages one chunk into `slot` and queues copy, launch and the slot's event.
    ///
    /// # Safety
    ///
    /// As [`Launcher::launch`]; `slot` is idle (taken by [`Launcher::acquire`]) and
    /// `chunk.len() <= self.chunk`.
    unsafe fn queue_chunk(
        &self,
        slot: &Slot,
        stream: CUstream,
        len: u64,
        chunk: &[(DevicePtr, DevicePtr)],
    ) -> Result<()> {
        let n = chunk.len();
        let count = u32::try_from(n).map_err(|_| Error::Overflow("block-copy chunk"))?;
        let half = u64::from(count)
            .checked_mul(8)
            .ok_or(Error::Overflow("block-copy staging"))?;
        let bytes = half
            .checked_mul(2)
            .filter(|&b| b <= self.slot_bytes)
            .ok_or(Error::Overflow("block-copy staging"))?;
        // SAFETY: the pinned allocation holds `slot_bytes >= 16 n` bytes, page-aligned (so
        // aligned for `u64`), and is exclusively ours: the slot is out of the pool and its event
        // completed, so no queued copy reads it.
        let words =
            unsafe { std::slice::from_raw_parts_mut(slot.pinned.ptr as usize as *mut u64, 2 * n) };
        let (srcs, dsts) = words.split_at_mut(n);
        for ((s, d), &(src, dst)) in srcs.iter_mut().zip(dsts.iter_mut()).zip(chunk) {
            *s = src;
            *d = dst;
        }
        let dev = slot.arrays.mapped.va;
        // SAFETY: source: `bytes` of pinned host memory written above and untouched until the
        // slot's event (recorded after this copy) completes; destination: the slot's device
        // arrays, mapped read/write for this device, idle (event completed). The stream is the
        // caller's, context current.
        unsafe { result::memcpy::copy_async(dev, slot.pinned.ptr, bytes, stream)? };
        let mut src_arg: u64 = dev;
        let mut dst_arg: u64 = dev + half;
        let mut len_arg: u64 = len;
        let mut count_arg: u32 = count;
        let mut params: [*mut c_void; 4] = [
            (&mut src_arg as *mut u64).cast(),
            (&mut dst_arg as *mut u64).cast(),
            (&mut len_arg as *mut u64).cast(),
            (&mut count_arg as *mut u32).cast(),
        ];
        // SAFETY: the function belongs to this launcher's live module in the current context;
        // the four parameters match `strata_copy_blocks(const u64*, const u64*, u64, unsigned)`;
        // the address arrays are queued before it on the same stream, and every range they name
        // is valid for this device until completion (caller); grid = pairs in the chunk.
        unsafe {
            result::launch::kernel(
                self.function as usize as CUfunction,
                count,
                THREADS_PER_BLOCK,
                &mut params,
                stream,
            )?
        };
        // SAFETY: the slot's event is live and in this context; the stream is the caller's.
        unsafe { result::event::record(raw_event(slot.event.0), stream) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_architecture_first_then_ptx() {
        let supported = [75, 80, 86, 89, 90];
        assert_eq!(
            targets(90, &supported),
            vec![(Image::Cubin, 90), (Image::Ptx, 90)]
        );
        assert_eq!(targets(87, &supported), vec![(Image::Ptx, 86)]);
        // A device newer than NVRTC: PTX of the newest architecture it knows.
        assert_eq!(targets(120, &supported), vec![(Image::Ptx, 90)]);
        // A device older than every supported architecture: nothing to try.
        assert!(targets(52, &supported).is_empty());
        assert!(targets(90, &[]).is_empty());
    }

    #[test]
    fn chunks_fit_a_slot_and_the_grid() {
        assert_eq!(chunk_pairs(2 << 20, i32::MAX as u32), (2 << 20) / 16);
        assert_eq!(chunk_pairs(2 << 20, 65535), 65535);
        assert_eq!(chunk_pairs(16, 65535), 1);
    }
}

//! `DirectResource`: every allocation is its own reservation, physical handle and mapping, freed
//! at once on deallocate — the scheme of vLLM's `CuMemAllocator` and torch_memory_saver. No
//! caching: the baseline the caching allocator is measured and conformance-tested against.

use std::collections::VecDeque;
use std::sync::Arc;

use parking_lot::Mutex;
use rustc_hash::{FxHashMap, FxHashSet};
use strata_vmm::{
    round_up, Access, Backend, CreateFlags, DevicePtr, Error, Location, Mapping, PhysicalMemory,
    Reservation, Result, StreamHandle,
};

use crate::resource::MemoryResource;

/// How many recently freed pointers are remembered to tell a double free from a foreign pointer.
const FREED_MEMORY: usize = 4096;

struct State {
    live: FxHashMap<DevicePtr, Mapping>,
    freed: FxHashSet<DevicePtr>,
    freed_order: VecDeque<DevicePtr>,
}

/// One reservation + create + map per allocation.
pub struct DirectResource {
    backend: Arc<dyn Backend>,
    device: u32,
    granularity: u64,
    state: Mutex<State>,
}

impl DirectResource {
    pub fn new(backend: Arc<dyn Backend>, device: u32) -> Result<Self> {
        if device >= backend.device_count() {
            return Err(Error::NoDevice(device.into()));
        }
        let granularity = backend.granularity(Location::Device(device))?;
        Ok(DirectResource {
            backend,
            device,
            granularity,
            state: Mutex::new(State {
                live: FxHashMap::default(),
                freed: FxHashSet::default(),
                freed_order: VecDeque::new(),
            }),
        })
    }

    /// Bytes mapped for live allocations.
    pub fn mapped_bytes(&self) -> u64 {
        self.state.lock().live.values().map(Mapping::size).sum()
    }
}

impl MemoryResource for DirectResource {
    fn allocate(&self, size: u64, _stream: StreamHandle) -> Result<DevicePtr> {
        if size == 0 {
            return Ok(0);
        }
        let location = Location::Device(self.device);
        let rounded = round_up(size, self.granularity).ok_or(Error::OutOfMemory {
            location,
            requested: size,
            available: 0,
        })?;
        // Physical memory first: capacity is what runs out, VA almost never does.
        let phys = Arc::new(PhysicalMemory::create(
            &self.backend,
            location,
            rounded,
            CreateFlags::empty(),
        )?);
        let reservation = Arc::new(Reservation::new(&self.backend, rounded, 0)?);
        let va = reservation.ptr();
        let mapping = Mapping::new(
            &reservation,
            va,
            phys,
            0,
            rounded,
            &[(location, Access::ReadWrite)],
        )?;
        let mut state = self.state.lock();
        if state.freed.remove(&va) {
            state.freed_order.retain(|&p| p != va);
        }
        state.live.insert(va, mapping);
        Ok(va)
    }

    fn deallocate(&self, ptr: DevicePtr, stream: StreamHandle) -> Result<()> {
        if ptr == 0 {
            return Ok(());
        }
        let mapping = {
            let mut state = self.state.lock();
            match state.live.remove(&ptr) {
                Some(m) => {
                    if state.freed_order.len() == FREED_MEMORY {
                        if let Some(old) = state.freed_order.pop_front() {
                            state.freed.remove(&old);
                        }
                    }
                    state.freed.insert(ptr);
                    state.freed_order.push_back(ptr);
                    m
                }
                None if state.freed.contains(&ptr) => return Err(Error::DoubleFree(ptr)),
                None => return Err(Error::UnknownPointer(ptr)),
            }
        };
        // Unmap does not wait for in-flight work: order it after the stream's last use.
        self.backend.stream_synchronize(stream)?;
        mapping.unmap().map(drop)
    }

    fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    fn device(&self) -> u32 {
        self.device
    }
}

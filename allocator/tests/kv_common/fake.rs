//! A minimal, strict emulation of the VMM contract in plain Rust memory: strict VMM
//! preconditions, byte storage per physical handle, map fault injection.

use std::collections::{BTreeMap, HashMap};
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use strata_vmm::{
    Access, Backend, BackendKind, CopyDesc, CreateFlags, DeviceInfo, DevicePtr, Error, EventHandle,
    LiveCounts, Location, MemInfo, PhysHandle, Result, StreamHandle,
};

struct Phys {
    bytes: Vec<u8>,
    released: bool,
    maps: usize,
}

#[derive(Clone, Copy)]
struct Map {
    size: u64,
    handle: u64,
    offset: u64,
    access: Access,
}

#[derive(Default)]
struct State {
    next_va: u64,
    reservations: BTreeMap<u64, u64>,
    phys: HashMap<u64, Phys>,
    next_handle: u64,
    used: u64,
    maps: BTreeMap<u64, Map>,
    streams: u64,
    events: u64,
    next_id: u64,
}

impl State {
    fn drop_phys_if_dead(&mut self, handle: u64) {
        if let Some(p) = self.phys.get(&handle) {
            if p.released && p.maps == 0 {
                self.used -= p.bytes.len() as u64;
                self.phys.remove(&handle);
            }
        }
    }

    /// Start addresses of the whole mappings that cover `va..va+size` exactly.
    fn whole_maps(&self, va: u64, size: u64) -> Result<Vec<u64>> {
        let end = va + size;
        if let Some((&s, m)) = self.maps.range(..va).next_back() {
            if s + m.size > va {
                return Err(Error::PartialUnmap { va, size });
            }
        }
        let mut cursor = va;
        let mut starts = Vec::new();
        for (&s, m) in self.maps.range(va..end) {
            if s != cursor {
                return Err(Error::NotMapped { va, size });
            }
            if s + m.size > end {
                return Err(Error::PartialUnmap { va, size });
            }
            starts.push(s);
            cursor = s + m.size;
        }
        if cursor != end {
            return Err(Error::NotMapped { va, size });
        }
        Ok(starts)
    }
}

pub struct Fake {
    gran: u64,
    capacity: u64,
    state: Mutex<State>,
    maps_done: AtomicU64,
    fail_map_at: AtomicU64,
}

impl Fake {
    pub fn new(gran: u64, capacity: u64) -> Fake {
        Fake {
            gran,
            capacity,
            state: Mutex::new(State {
                next_va: 1 << 40,
                next_id: 1,
                ..State::default()
            }),
            maps_done: AtomicU64::new(0),
            fail_map_at: AtomicU64::new(0),
        }
    }

    /// Makes the `n`-th map call from now fail with an injected fault.
    pub fn fail_nth_map(&self, n: u64) {
        let done = self.maps_done.load(Ordering::SeqCst);
        self.fail_map_at.store(done + n, Ordering::SeqCst);
    }

    fn aligned(&self, what: &'static str, value: u64) -> Result<()> {
        if value % self.gran != 0 {
            return Err(Error::Misaligned {
                what,
                value,
                granularity: self.gran,
            });
        }
        Ok(())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `f` over each piece of `va..va+len` with its physical bytes.
    fn with_bytes(
        &self,
        va: u64,
        len: u64,
        write: bool,
        mut f: impl FnMut(&mut [u8], usize),
    ) -> Result<()> {
        let mut st = self.lock();
        let end = va + len;
        let mut cursor = va;
        while cursor < end {
            let Some((&start, &m)) = st
                .maps
                .range(..=cursor)
                .next_back()
                .filter(|(&s, m)| cursor < s + m.size)
            else {
                return Err(Error::IllegalAccess {
                    va,
                    size: len,
                    reason: "not mapped",
                });
            };
            let allowed = match m.access {
                Access::ReadWrite => true,
                Access::Read => !write,
                Access::None => false,
            };
            if !allowed {
                return Err(Error::IllegalAccess {
                    va,
                    size: len,
                    reason: "access not granted",
                });
            }
            let piece_end = end.min(start + m.size);
            let off = (m.offset + cursor - start) as usize;
            let n = (piece_end - cursor) as usize;
            let phys = st.phys.get_mut(&m.handle).expect("mapped handle is alive");
            f(&mut phys.bytes[off..off + n], (cursor - va) as usize);
            cursor = piece_end;
        }
        Ok(())
    }
}

impl Backend for Fake {
    fn kind(&self) -> BackendKind {
        BackendKind::Host
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
    fn device_count(&self) -> u32 {
        1
    }
    fn device_info(&self, device: u32) -> Result<DeviceInfo> {
        if device != 0 {
            return Err(Error::NoDevice(device.into()));
        }
        Ok(DeviceInfo {
            ordinal: 0,
            name: "fake".into(),
            total_memory: self.capacity,
            granularity: self.gran,
        })
    }
    fn granularity(&self, _location: Location) -> Result<u64> {
        Ok(self.gran)
    }
    fn mem_info(&self, _device: u32) -> Result<MemInfo> {
        let used = self.lock().used;
        Ok(MemInfo {
            free: self.capacity - used,
            total: self.capacity,
        })
    }
    fn reserve(&self, size: u64, alignment: u64) -> Result<DevicePtr> {
        if size == 0 {
            return Err(Error::InvalidArgument("zero reservation".into()));
        }
        self.aligned("reservation size", size)?;
        let align = alignment.max(self.gran);
        let mut st = self.lock();
        let ptr = st.next_va.div_ceil(align) * align;
        st.next_va = ptr + size + self.gran;
        st.reservations.insert(ptr, size);
        Ok(ptr)
    }
    fn free_va(&self, ptr: DevicePtr, size: u64) -> Result<()> {
        let mut st = self.lock();
        if st.reservations.get(&ptr) != Some(&size) {
            return Err(Error::NotReserved { va: ptr, size });
        }
        if st.maps.range(ptr..ptr + size).next().is_some() {
            return Err(Error::StillMapped { va: ptr, size });
        }
        st.reservations.remove(&ptr);
        Ok(())
    }
    fn create(&self, location: Location, size: u64, _flags: CreateFlags) -> Result<PhysHandle> {
        if size == 0 {
            return Err(Error::InvalidArgument("zero create".into()));
        }
        self.aligned("create size", size)?;
        let mut st = self.lock();
        if st.used + size > self.capacity {
            return Err(Error::OutOfMemory {
                location,
                requested: size,
                available: self.capacity - st.used,
            });
        }
        st.used += size;
        let h = st.next_handle + 1;
        st.next_handle = h;
        st.phys.insert(
            h,
            Phys {
                bytes: vec![0xa5; size as usize],
                released: false,
                maps: 0,
            },
        );
        Ok(PhysHandle(h))
    }
    fn release(&self, handle: PhysHandle) -> Result<()> {
        let mut st = self.lock();
        match st.phys.get_mut(&handle.0) {
            Some(p) if !p.released => p.released = true,
            _ => {
                return Err(Error::InvalidHandle {
                    kind: "physical",
                    id: handle.0,
                })
            }
        }
        st.drop_phys_if_dead(handle.0);
        Ok(())
    }
    fn handle_size(&self, handle: PhysHandle) -> Result<u64> {
        let st = self.lock();
        match st.phys.get(&handle.0) {
            Some(p) if !p.released => Ok(p.bytes.len() as u64),
            _ => Err(Error::InvalidHandle {
                kind: "physical",
                id: handle.0,
            }),
        }
    }
    fn map(&self, va: DevicePtr, size: u64, handle: PhysHandle, offset: u64) -> Result<()> {
        if size == 0 {
            return Err(Error::InvalidArgument("zero map".into()));
        }
        self.aligned("map va", va)?;
        self.aligned("map size", size)?;
        self.aligned("map offset", offset)?;
        let n = self.maps_done.fetch_add(1, Ordering::SeqCst) + 1;
        if self.fail_map_at.load(Ordering::SeqCst) == n {
            return Err(Error::InjectedFault("map"));
        }
        let mut st = self.lock();
        match st.phys.get(&handle.0) {
            Some(p) if !p.released && offset + size <= p.bytes.len() as u64 => {}
            _ => {
                return Err(Error::InvalidHandle {
                    kind: "physical",
                    id: handle.0,
                })
            }
        }
        let inside = st
            .reservations
            .range(..=va)
            .next_back()
            .is_some_and(|(&r, &rs)| va + size <= r + rs);
        if !inside {
            return Err(Error::NotReserved { va, size });
        }
        let overlaps = st
            .maps
            .range(..va + size)
            .next_back()
            .is_some_and(|(&s, m)| s + m.size > va);
        if overlaps {
            return Err(Error::AlreadyMapped { va, size });
        }
        st.maps.insert(
            va,
            Map {
                size,
                handle: handle.0,
                offset,
                access: Access::None,
            },
        );
        st.phys.get_mut(&handle.0).expect("checked").maps += 1;
        Ok(())
    }
    fn unmap(&self, va: DevicePtr, size: u64) -> Result<()> {
        self.aligned("unmap va", va)?;
        self.aligned("unmap size", size)?;
        let mut st = self.lock();
        for start in st.whole_maps(va, size)? {
            let m = st.maps.remove(&start).expect("listed");
            st.phys.get_mut(&m.handle).expect("mapped handle").maps -= 1;
            st.drop_phys_if_dead(m.handle);
        }
        Ok(())
    }
    fn set_access(&self, va: DevicePtr, size: u64, grants: &[(Location, Access)]) -> Result<()> {
        self.aligned("access va", va)?;
        self.aligned("access size", size)?;
        let access = grants
            .iter()
            .find(|(l, _)| *l == Location::Device(0))
            .map_or(Access::None, |g| g.1);
        let mut st = self.lock();
        for start in st.whole_maps(va, size)? {
            st.maps.get_mut(&start).expect("listed").access = access;
        }
        Ok(())
    }
    fn export_fd(&self, _handle: PhysHandle) -> Result<OwnedFd> {
        Err(Error::Unsupported("fake export".into()))
    }
    fn import_fd(&self, _fd: BorrowedFd<'_>) -> Result<PhysHandle> {
        Err(Error::Unsupported("fake import".into()))
    }
    fn stream_create(&self, _device: u32) -> Result<StreamHandle> {
        let mut st = self.lock();
        st.streams += 1;
        st.next_id += 1;
        Ok(StreamHandle(st.next_id))
    }
    fn stream_destroy(&self, _stream: StreamHandle) -> Result<()> {
        self.lock().streams -= 1;
        Ok(())
    }
    fn stream_synchronize(&self, _stream: StreamHandle) -> Result<()> {
        Ok(())
    }
    fn event_create(&self) -> Result<EventHandle> {
        let mut st = self.lock();
        st.events += 1;
        st.next_id += 1;
        Ok(EventHandle(st.next_id))
    }
    fn event_destroy(&self, _event: EventHandle) -> Result<()> {
        self.lock().events -= 1;
        Ok(())
    }
    fn event_record(&self, _event: EventHandle, _stream: StreamHandle) -> Result<()> {
        Ok(())
    }
    fn event_query(&self, _event: EventHandle) -> Result<bool> {
        Ok(true)
    }
    fn event_synchronize(&self, _event: EventHandle) -> Result<()> {
        Ok(())
    }
    fn stream_wait_event(&self, _stream: StreamHandle, _event: EventHandle) -> Result<()> {
        Ok(())
    }
    unsafe fn copy_async(&self, _stream: StreamHandle, _copies: &[CopyDesc]) -> Result<()> {
        Err(Error::Unsupported(
            "fake copy_async (use write/read)".into(),
        ))
    }
    fn memset_async(
        &self,
        _stream: StreamHandle,
        dst: DevicePtr,
        value: u8,
        len: u64,
    ) -> Result<()> {
        self.with_bytes(dst, len, true, |bytes, _| bytes.fill(value))
    }
    fn live_counts(&self) -> LiveCounts {
        let st = self.lock();
        LiveCounts {
            reservations: st.reservations.len() as u64,
            handles: st.phys.values().filter(|p| !p.released).count() as u64,
            mappings: st.maps.len() as u64,
            streams: st.streams,
            events: st.events,
        }
    }
    fn write(&self, dst: DevicePtr, src: &[u8]) -> Result<()> {
        self.with_bytes(dst, src.len() as u64, true, |bytes, at| {
            bytes.copy_from_slice(&src[at..at + bytes.len()])
        })
    }
    fn read(&self, src: DevicePtr, dst: &mut [u8]) -> Result<()> {
        self.with_bytes(src, dst.len() as u64, false, |bytes, at| {
            dst[at..at + bytes.len()].copy_from_slice(bytes)
        })
    }
}

//! Streams and events of the CUDA backend: the bodies of [`Backend`](crate::Backend)'s stream
//! and event calls, and the gates that keep a handle alive while another thread uses it.

use std::sync::Arc;

use parking_lot::{Mutex, RwLock};

use super::result::{self, CUevent, CUstream};
use super::{CudaBackend, State};
use crate::error::{Error, Result};
use crate::types::{EventHandle, StreamHandle};

/// A stream; `alive` (under `gate`) guards against use after destroy from another thread.
#[derive(Debug)]
pub(super) struct StreamObj {
    device: u32,
    raw: u64,
    gate: RwLock<bool>,
}

/// Per-device driver events behind one [`EventHandle`].
#[derive(Debug)]
pub(super) struct EventState {
    /// The event in each device's context, created on first record there (0: none yet).
    per_device: Vec<u64>,
    /// The device whose event was recorded last (`None`: never recorded, i.e. complete).
    last: Option<u32>,
}

#[derive(Debug)]
pub(super) struct EventObj {
    gate: RwLock<bool>,
    state: Mutex<EventState>,
}

impl CudaBackend {
    /// Finds the stream; the returned object's gate must be read-locked by the caller.
    pub(super) fn stream_obj(&self, stream: StreamHandle) -> Result<Option<Arc<StreamObj>>> {
        if stream == StreamHandle::DEFAULT {
            return Ok(None);
        }
        let state = self.state.lock();
        state
            .streams
            .get(&stream.0)
            .cloned()
            .map(Some)
            .ok_or(Error::InvalidHandle {
                kind: "stream",
                id: stream.0,
            })
    }

    /// Runs `f` on the raw event of `event`'s last record, with that record's device current
    /// and the event's gate held (so no other thread destroys it meanwhile); `unrecorded` when it
    /// was never recorded (complete, as CUDA reports it).
    pub(super) fn with_last_record<T>(
        &self,
        event: EventHandle,
        unrecorded: T,
        f: impl FnOnce(u64) -> Result<T>,
    ) -> Result<T> {
        self.with_live_event(event, |obj| {
            let (device, raw) = {
                let st = obj.state.lock();
                match st.last {
                    None => return Ok(unrecorded),
                    Some(d) => (d, st.per_device[d as usize]),
                }
            };
            self.enter(device)?;
            f(raw)
        })
    }

    /// Runs `f` on `event`'s object with its gate held: no other thread destroys the event
    /// meanwhile, and a destroyed one is an invalid handle.
    fn with_live_event<R>(
        &self,
        event: EventHandle,
        f: impl FnOnce(&EventObj) -> Result<R>,
    ) -> Result<R> {
        let gone = || Error::InvalidHandle {
            kind: "event",
            id: event.0,
        };
        let obj = self
            .state
            .lock()
            .events
            .get(&event.0)
            .cloned()
            .ok_or_else(gone)?;
        let alive = obj.gate.read();
        if !*alive {
            return Err(gone());
        }
        f(&obj)
    }

    /// Runs `f` with the stream's device context current and its raw handle, holding the
    /// stream's gate so that no other thread destroys it meanwhile. The default stream runs on
    /// `default_device`.
    pub(super) fn with_stream<R>(
        &self,
        stream: StreamHandle,
        default_device: u32,
        f: impl FnOnce(u32, CUstream) -> Result<R>,
    ) -> Result<R> {
        let obj = self.stream_obj(stream)?;
        match obj {
            None => {
                self.enter(default_device)?;
                f(default_device, std::ptr::null_mut())
            }
            Some(obj) => {
                let alive = obj.gate.read();
                if !*alive {
                    return Err(Error::InvalidHandle {
                        kind: "stream",
                        id: stream.0,
                    });
                }
                self.enter(obj.device)?;
                f(obj.device, raw_stream(obj.raw))
            }
        }
    }

    /// The device a created stream belongs to.
    pub(super) fn stream_device(state: &State, stream: StreamHandle) -> Result<u32> {
        state
            .streams
            .get(&stream.0)
            .map(|s| s.device)
            .ok_or(Error::InvalidHandle {
                kind: "stream",
                id: stream.0,
            })
    }

    /// [`Backend::stream_create`](crate::Backend::stream_create).
    pub(super) fn create_stream(&self, device: u32) -> Result<StreamHandle> {
        self.enter(device)?;
        let raw = result::stream::create()? as usize as u64;
        let obj = Arc::new(StreamObj {
            device,
            raw,
            gate: RwLock::new(true),
        });
        self.state.lock().streams.insert(raw, obj);
        Ok(StreamHandle(raw))
    }

    /// [`Backend::stream_destroy`](crate::Backend::stream_destroy).
    pub(super) fn destroy_stream(&self, stream: StreamHandle) -> Result<()> {
        let obj = {
            let mut state = self.state.lock();
            state
                .streams
                .remove(&stream.0)
                .ok_or(Error::InvalidHandle {
                    kind: "stream",
                    id: stream.0,
                })?
        };
        // Waits for calls on this stream in other threads to finish.
        let mut alive = obj.gate.write();
        *alive = false;
        self.enter(obj.device)?;
        // SAFETY: the stream was live (in our table until just now), is removed from the table
        // and marked dead under its gate, so nobody uses it again; destroyed exactly once.
        unsafe { result::stream::destroy(raw_stream(obj.raw)) }
    }

    /// [`Backend::stream_synchronize`](crate::Backend::stream_synchronize).
    pub(super) fn synchronize_stream(&self, stream: StreamHandle) -> Result<()> {
        if stream == StreamHandle::DEFAULT {
            // The legacy stream is per context: synchronize each device's.
            for d in 0..self.devices.len() as u32 {
                self.enter(d)?;
                // SAFETY: the null stream is always valid with a context current.
                unsafe { result::stream::synchronize(std::ptr::null_mut())? };
            }
            return Ok(());
        }
        self.with_stream(stream, 0, |_, raw| {
            // SAFETY: `with_stream` holds the stream's gate (alive) with its context current.
            unsafe { result::stream::synchronize(raw) }
        })
    }

    /// [`Backend::event_create`](crate::Backend::event_create).
    pub(super) fn create_event(&self) -> Result<EventHandle> {
        self.enter(0)?;
        let raw = result::event::create()? as usize as u64;
        let mut per_device = vec![0u64; self.devices.len()];
        per_device[0] = raw;
        let obj = Arc::new(EventObj {
            gate: RwLock::new(true),
            state: Mutex::new(EventState {
                per_device,
                last: None,
            }),
        });
        self.state.lock().events.insert(raw, obj);
        Ok(EventHandle(raw))
    }

    /// [`Backend::event_destroy`](crate::Backend::event_destroy).
    pub(super) fn destroy_event(&self, event: EventHandle) -> Result<()> {
        let obj = {
            let mut state = self.state.lock();
            state.events.remove(&event.0).ok_or(Error::InvalidHandle {
                kind: "event",
                id: event.0,
            })?
        };
        let mut alive = obj.gate.write();
        *alive = false;
        let per_device = std::mem::take(&mut obj.state.lock().per_device);
        let mut first_err = None;
        for (d, raw) in per_device.into_iter().enumerate() {
            if raw == 0 {
                continue;
            }
            let destroyed = self.enter(d as u32).and_then(|_| {
                // SAFETY: each per-device event is live, owned by this handle only, removed
                // from the table and marked dead under the gate: destroyed exactly once.
                unsafe { result::event::destroy(raw_event(raw)) }
            });
            if let Err(e) = destroyed {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// [`Backend::event_record`](crate::Backend::event_record).
    pub(super) fn record_event(&self, event: EventHandle, stream: StreamHandle) -> Result<()> {
        self.with_live_event(event, |obj| {
            self.with_stream(stream, 0, |device, raw_s| {
                let mut st = obj.state.lock();
                let slot = &mut st.per_device[device as usize];
                if *slot == 0 {
                    // The context of `device` is current (`with_stream`).
                    *slot = result::event::create()? as usize as u64;
                }
                let raw_e = *slot;
                // SAFETY: the event is live (gate held, created in this stream's context) and the
                // stream is null or live (gate held by `with_stream`), with its context current.
                unsafe { result::event::record(raw_event(raw_e), raw_s)? };
                st.last = Some(device);
                Ok(())
            })
        })
    }

    /// [`Backend::event_query`](crate::Backend::event_query).
    pub(super) fn query_event(&self, event: EventHandle) -> Result<bool> {
        self.with_last_record(event, true, |raw| {
            // SAFETY: the event is live (its gate is held for this call).
            unsafe { result::event::query(raw_event(raw)) }
        })
    }

    /// [`Backend::event_synchronize`](crate::Backend::event_synchronize).
    pub(super) fn synchronize_event(&self, event: EventHandle) -> Result<()> {
        self.with_last_record(event, (), |raw| {
            // SAFETY: the event is live (its gate is held for this call).
            unsafe { result::event::synchronize(raw_event(raw)) }
        })
    }

    /// [`Backend::stream_wait_event`](crate::Backend::stream_wait_event).
    pub(super) fn wait_event(&self, stream: StreamHandle, event: EventHandle) -> Result<()> {
        self.with_live_event(event, |obj| {
            let raw_e = {
                let st = obj.state.lock();
                // Waiting for an event never recorded is a no-op (as in CUDA).
                st.last.map(|d| st.per_device[d as usize])
            };
            self.with_stream(stream, 0, |_, raw_s| match raw_e {
                None => Ok(()),
                // SAFETY: both handles are live (gates held); the driver allows an event of another
                // context here.
                Some(raw_e) => unsafe { result::stream::wait_event(raw_s, raw_event(raw_e)) },
            })
        })
    }
}

pub(super) fn raw_stream(raw: u64) -> CUstream {
    raw as usize as CUstream
}

pub(super) fn raw_event(raw: u64) -> CUevent {
    raw as usize as CUevent
}

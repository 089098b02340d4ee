//! Lending across processes: a lender offers pages of exportable physical memory to a borrower
//! over a Unix socket. Each page travels as a file descriptor (`SCM_RIGHTS`; memory created
//! with `CreateFlags::EXPORTABLE`, `export_fd`/`import_fd`); the lender admits a borrower only
//! by its `SO_PEERCRED` credentials (same uid, or an allow-list). Revocation: the lender sends
//! `Revoke(lease, deadline)`; the borrower stops new copies on that lease at once, drains its
//! own, unmaps, and acknowledges. Without an acknowledgement by the deadline the lender
//! reclaims anyway and tells the borrower; either way the borrower's next access to the lease
//! is an error ([`Error::StaleId`]), never bytes of memory the lender took back. Every access
//! first drains the frames already queued on the socket, so a revocation sent before an access
//! is always seen by it.
//!
//! Set-up probe: some drivers import a handle but cannot map it (an H200 virtual machine, driver
//! 580.159: `CUDA_ERROR_NOT_SUPPORTED`). The borrower probe-maps one granule of the first
//! handle it imports and answers `Probed` or `Unsupported` with the driver's words; the
//! lender's first [`Lender::offer`] waits for that answer, so both sides report
//! [`Error::Unsupported`] with the same words, and neither closes on the other mid-frame.
//!
//! Frames are 32 bytes: `tag: u32, 0: u32, lease: u64, a: u64, b: u64`; a text (the refusal's
//! words) follows its frame as `a` bytes in text frames whose last 24 bytes carry it.

use std::collections::{HashMap, VecDeque};
use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use strata_vmm::ipc::{self, PeerCred, FRAME};
use strata_vmm::{
    Access, Backend, CreateFlags, Error, Location, Mapping, PhysicalMemory, Reservation, Result,
};

const HELLO: u32 = 1;
const OFFER: u32 = 2;
const REFUSE: u32 = 3;
const REVOKE: u32 = 4;
const ACK: u32 = 5;
const RECLAIMED: u32 = 6;
const NOTE: u32 = 7;
const PROBED: u32 = 8;
const UNSUPPORTED: u32 = 9;
const TEXT: u32 = 10;
/// Longest refusal text sent.
const MAX_TEXT: usize = 1024;
/// How long the lender's first offer waits for the borrower's probe.
const PROBE_WAIT: Duration = Duration::from_secs(30);

/// Sends `tag` with `text` (cut at [`MAX_TEXT`] bytes) in the frames after it.
fn send_text(stream: &UnixStream, tag: u32, text: &str) -> Result<()> {
    let mut end = text.len().min(MAX_TEXT);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let bytes = &text.as_bytes()[..end];
    ipc::send_frame(stream, &encode(tag, 0, bytes.len() as u64, 0), &[])?;
    for chunk in bytes.chunks(FRAME - 8) {
        let mut f = encode(TEXT, 0, 0, 0);
        f[8..8 + chunk.len()].copy_from_slice(chunk);
        ipc::send_frame(stream, &f, &[])?;
    }
    Ok(())
}

/// Receives the `len` bytes of text that follow a frame (see [`send_text`]).
fn recv_text(stream: &UnixStream, len: u64) -> Result<String> {
    let len = usize::try_from(len)
        .ok()
        .filter(|&l| l <= MAX_TEXT)
        .ok_or_else(|| Error::InvalidState(format!("text of {len} bytes")))?;
    let mut bytes = Vec::with_capacity(len);
    while bytes.len() < len {
        let Some((f, _)) = ipc::recv_frame(stream)? else {
            return Err(Error::InvalidState("socket closed inside a text".into()));
        };
        if decode(&f).0 != TEXT {
            return Err(Error::InvalidState("text frame expected".into()));
        }
        let take = (len - bytes.len()).min(FRAME - 8);
        bytes.extend_from_slice(&f[8..8 + take]);
    }
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

fn encode(tag: u32, lease: u64, a: u64, b: u64) -> [u8; FRAME] {
    let mut f = [0u8; FRAME];
    f[0..4].copy_from_slice(&tag.to_le_bytes());
    f[8..16].copy_from_slice(&lease.to_le_bytes());
    f[16..24].copy_from_slice(&a.to_le_bytes());
    f[24..32].copy_from_slice(&b.to_le_bytes());
    f
}

fn decode(f: &[u8; FRAME]) -> (u32, u64, u64, u64) {
    let u64_at = |i: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&f[i..i + 8]);
        u64::from_le_bytes(b)
    };
    let mut t = [0u8; 4];
    t.copy_from_slice(&f[0..4]);
    (u32::from_le_bytes(t), u64_at(8), u64_at(16), u64_at(24))
}

/// Who may borrow: processes of the lender's own uid (if `same_uid`) and the uids listed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CredentialPolicy {
    pub same_uid: bool,
    pub allow_uids: Vec<u32>,
}

impl CredentialPolicy {
    /// Same uid only.
    pub fn same_uid() -> Self {
        CredentialPolicy {
            same_uid: true,
            allow_uids: Vec::new(),
        }
    }

    /// True when a peer with credentials `peer` may borrow from a lender running as `own_uid`.
    pub fn admits(&self, own_uid: u32, peer: &PeerCred) -> bool {
        (self.same_uid && peer.uid == own_uid) || self.allow_uids.contains(&peer.uid)
    }
}

/// How a revocation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RevokeOutcome {
    /// The borrower acknowledged in time.
    Acknowledged,
    /// The deadline passed: the lender reclaimed anyway.
    Forced,
}

struct LentPage {
    /// Keeps the reservation and the physical memory alive until the lease ends.
    _mapping: Mapping,
    va: u64,
    size: u64,
}

/// The lending side of one connection.
pub struct Lender {
    backend: Arc<dyn Backend>,
    device: u32,
    stream: UnixStream,
    leases: HashMap<u64, LentPage>,
    next_lease: u64,
    notes: VecDeque<u64>,
    acked: Vec<u64>,
    /// The borrower's answer to the set-up probe: `None` until it came.
    probe: Option<std::result::Result<(), String>>,
}

impl Lender {
    /// Accepts one borrower on `listener` and checks its `SO_PEERCRED` credentials.
    pub fn accept(
        listener: &UnixListener,
        backend: Arc<dyn Backend>,
        device: u32,
        policy: &CredentialPolicy,
    ) -> Result<Lender> {
        let (stream, _) = listener.accept().map_err(|source| Error::Os {
            call: "accept",
            source,
        })?;
        let cred = ipc::peer_cred(&stream)?;
        Self::admit(stream, cred, backend, device, policy)
    }

    /// Admits (or refuses, telling the borrower) the peer of `stream` whose credentials are
    /// `cred`: what [`Lender::accept`] does with the kernel's answer, open to injected input.
    pub fn admit(
        stream: UnixStream,
        cred: PeerCred,
        backend: Arc<dyn Backend>,
        device: u32,
        policy: &CredentialPolicy,
    ) -> Result<Lender> {
        let hello = ipc::recv_frame(&stream)?;
        if !matches!(hello.as_ref().map(|(f, _)| decode(f).0), Some(HELLO)) {
            return Err(Error::InvalidState("borrower did not say hello".into()));
        }
        if !policy.admits(ipc::current_uid(), &cred) {
            ipc::send_frame(&stream, &encode(REFUSE, 0, u64::from(cred.uid), 0), &[])?;
            return Err(Error::InvalidState(format!(
                "borrower pid {} uid {} refused by the credential policy",
                cred.pid, cred.uid
            )));
        }
        Ok(Lender {
            backend,
            device,
            stream,
            leases: HashMap::new(),
            next_lease: 1,
            notes: VecDeque::new(),
            acked: Vec::new(),
            probe: None,
        })
    }

    /// Creates `size` bytes of exportable memory on the lender's device, maps it for the
    /// lender, and sends it to the borrower. Returns the lease id. The first offer waits for
    /// the borrower's probe: [`Error::Unsupported`], with the borrower's driver's words, when
    /// it cannot map what it imports (then and for every later offer).
    pub fn offer(&mut self, size: u64) -> Result<u64> {
        if let Some(Err(words)) = &self.probe {
            return Err(borrower_cannot_map(words));
        }
        let phys = Arc::new(PhysicalMemory::create(
            &self.backend,
            Location::Device(self.device),
            size,
            CreateFlags::EXPORTABLE,
        )?);
        let reservation = Arc::new(Reservation::new(&self.backend, size, 0)?);
        let mapping = Mapping::new(
            &reservation,
            reservation.ptr(),
            Arc::clone(&phys),
            0,
            size,
            &[(Location::Device(self.device), Access::ReadWrite)],
        )?;
        let fd = self.backend.export_fd(phys.handle())?;
        let lease = self.next_lease;
        ipc::send_frame(
            &self.stream,
            &encode(OFFER, lease, size, u64::from(self.device)),
            &[fd.as_fd()],
        )?;
        self.next_lease += 1;
        self.leases.insert(
            lease,
            LentPage {
                va: reservation.ptr(),
                _mapping: mapping,
                size,
            },
        );
        let until = Instant::now() + PROBE_WAIT;
        while self.probe.is_none() {
            if !self.pump(until)? && Instant::now() >= until {
                return Err(Error::InvalidState(
                    "the borrower did not answer the set-up probe in time".into(),
                ));
            }
        }
        if let Some(Err(words)) = &self.probe {
            self.leases.remove(&lease);
            return Err(borrower_cannot_map(words));
        }
        Ok(lease)
    }

    fn page(&self, lease: u64, offset: u64, len: usize) -> Result<u64> {
        let p = self.leases.get(&lease).ok_or(Error::StaleId {
            kind: "lease",
            index: lease as u32,
            generation: 0,
        })?;
        if offset.checked_add(len as u64).is_none_or(|e| e > p.size) {
            return Err(Error::InvalidArgument("range outside the lease".into()));
        }
        Ok(p.va + offset)
    }

    /// The lender's own view of a lease (a backend copy out of its mapping).
    pub fn read(&self, lease: u64, offset: u64, dst: &mut [u8]) -> Result<()> {
        let va = self.page(lease, offset, dst.len())?;
        self.backend.read(va, dst)
    }

    /// Writes through the lender's own mapping.
    pub fn write(&self, lease: u64, offset: u64, src: &[u8]) -> Result<()> {
        let va = self.page(lease, offset, src.len())?;
        self.backend.write(va, src)
    }

    /// Reads one frame (waiting at most until `until`); records notes and acks.
    fn pump(&mut self, until: Instant) -> Result<bool> {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(false);
        }
        set_timeout(&self.stream, left)?;
        match ipc::recv_frame(&self.stream) {
            Ok(Some((f, _))) => {
                let (tag, lease, a, _) = decode(&f);
                match tag {
                    ACK => self.acked.push(lease),
                    NOTE => self.notes.push_back(a),
                    PROBED => self.probe = Some(Ok(())),
                    UNSUPPORTED => self.probe = Some(Err(recv_text(&self.stream, a)?)),
                    _ => {}
                }
                Ok(true)
            }
            Ok(None) => Err(Error::InvalidState("borrower closed the socket".into())),
            Err(e) if timed_out(&e) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Waits for the borrower's next note (an application message).
    pub fn wait_note(&mut self, timeout: Duration) -> Result<u64> {
        let until = Instant::now() + timeout;
        loop {
            if let Some(n) = self.notes.pop_front() {
                return Ok(n);
            }
            if !self.pump(until)? && Instant::now() >= until {
                return Err(Error::InvalidState(
                    "no note from the borrower in time".into(),
                ));
            }
        }
    }

    /// Asks the borrower to give `lease` back within `deadline`; reclaims it either way.
    pub fn revoke(&mut self, lease: u64, deadline: Duration) -> Result<RevokeOutcome> {
        if !self.leases.contains_key(&lease) {
            return Err(Error::StaleId {
                kind: "lease",
                index: lease as u32,
                generation: 0,
            });
        }
        let ms = u64::try_from(deadline.as_millis()).unwrap_or(u64::MAX);
        ipc::send_frame(&self.stream, &encode(REVOKE, lease, ms, 0), &[])?;
        let until = Instant::now() + deadline;
        let outcome = loop {
            if let Some(i) = self.acked.iter().position(|&l| l == lease) {
                self.acked.swap_remove(i);
                break RevokeOutcome::Acknowledged;
            }
            if !self.pump(until)? && Instant::now() >= until {
                break RevokeOutcome::Forced;
            }
        };
        if outcome == RevokeOutcome::Forced {
            // The borrower stopped copies on this lease when the revocation arrived (it reads
            // queued frames before every access); tell it the lease is gone for good.
            ipc::send_frame(&self.stream, &encode(RECLAIMED, lease, 0, 0), &[])?;
        }
        self.leases.remove(&lease);
        Ok(outcome)
    }
}

fn borrower_cannot_map(words: &str) -> Error {
    Error::Unsupported(format!(
        "the borrower cannot map memory it imports: {words}"
    ))
}

fn set_timeout(stream: &UnixStream, d: Duration) -> Result<()> {
    stream
        .set_read_timeout(Some(d.max(Duration::from_millis(1))))
        .map_err(|source| Error::Os {
            call: "set_read_timeout",
            source,
        })
}

fn timed_out(e: &Error) -> bool {
    matches!(e, Error::Os { source, .. }
        if matches!(source.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut))
}

/// What the borrower hears.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BorrowerEvent {
    /// A page arrived and is mapped for the borrower's device.
    Offered { lease: u64, size: u64 },
    /// The lender wants the lease back within `deadline`; copies on it are refused from now.
    Revoking { lease: u64, deadline: Duration },
    /// The lender reclaimed the lease without an acknowledgement.
    Reclaimed { lease: u64 },
    /// The lender refused this process's credentials.
    Refused,
}

enum LeaseState {
    Active,
    Revoking,
}

struct Borrowed {
    state: LeaseState,
    va: u64,
    size: u64,
    _mapping: Mapping,
}

/// The borrowing side of one connection.
pub struct Borrower {
    backend: Arc<dyn Backend>,
    device: u32,
    stream: UnixStream,
    leases: HashMap<u64, Borrowed>,
    events: VecDeque<BorrowerEvent>,
    /// The set-up probe's outcome: `None` before the first offer.
    probe: Option<std::result::Result<(), String>>,
}

impl Borrower {
    /// Connects to a lender listening at `path` and introduces itself.
    pub fn connect(path: &Path, backend: Arc<dyn Backend>, device: u32) -> Result<Borrower> {
        let stream = UnixStream::connect(path).map_err(|source| Error::Os {
            call: "connect",
            source,
        })?;
        ipc::send_frame(&stream, &encode(HELLO, 0, 0, 0), &[])?;
        Ok(Borrower {
            backend,
            device,
            stream,
            leases: HashMap::new(),
            events: VecDeque::new(),
            probe: None,
        })
    }

    /// Imports `fd`; for the first handle, probe-maps one granule of it and tells the lender
    /// whether that worked (the refusal in the driver's words).
    fn import(&mut self, fd: std::os::fd::BorrowedFd<'_>) -> Result<Arc<PhysicalMemory>> {
        let imported = self.backend.import_fd(fd).and_then(|handle| {
            PhysicalMemory::from_imported(&self.backend, handle, Location::Device(self.device))
        });
        let probed = imported.and_then(|phys| {
            let phys = Arc::new(phys);
            if self.probe.is_none() {
                let g = self.backend.granularity(Location::Device(self.device))?;
                let scratch = Arc::new(Reservation::new(&self.backend, g, 0)?);
                Mapping::new(&scratch, scratch.ptr(), Arc::clone(&phys), 0, g, &[])?;
            }
            Ok(phys)
        });
        match probed {
            Ok(phys) => {
                if self.probe.is_none() {
                    ipc::send_frame(&self.stream, &encode(PROBED, 0, 0, 0), &[])?;
                    self.probe = Some(Ok(()));
                }
                Ok(phys)
            }
            Err(Error::Unsupported(words)) if self.probe.is_none() => {
                send_text(&self.stream, UNSUPPORTED, &words)?;
                self.probe = Some(Err(words.clone()));
                Err(Error::Unsupported(words))
            }
            Err(e) => Err(e),
        }
    }

    fn handle_frame(&mut self, frame: [u8; FRAME], fds: Vec<std::os::fd::OwnedFd>) -> Result<()> {
        let (tag, lease, a, _) = decode(&frame);
        match tag {
            OFFER => {
                let fd = fds
                    .first()
                    .ok_or(Error::InvalidState("offer without a descriptor".into()))?;
                let phys = self.import(fd.as_fd())?;
                let size = phys.size();
                let reservation = Arc::new(Reservation::new(&self.backend, size, 0)?);
                let mapping = Mapping::new(
                    &reservation,
                    reservation.ptr(),
                    phys,
                    0,
                    size,
                    &[(Location::Device(self.device), Access::ReadWrite)],
                )?;
                self.leases.insert(
                    lease,
                    Borrowed {
                        state: LeaseState::Active,
                        va: reservation.ptr(),
                        size,
                        _mapping: mapping,
                    },
                );
                self.events
                    .push_back(BorrowerEvent::Offered { lease, size });
            }
            REVOKE => {
                // Step 1 of Harvest's order: no new copies on this lease.
                if let Some(b) = self.leases.get_mut(&lease) {
                    b.state = LeaseState::Revoking;
                }
                self.events.push_back(BorrowerEvent::Revoking {
                    lease,
                    deadline: Duration::from_millis(a),
                });
            }
            RECLAIMED => {
                self.leases.remove(&lease); // unmaps; the imported reference goes
                self.events.push_back(BorrowerEvent::Reclaimed { lease });
            }
            REFUSE => self.events.push_back(BorrowerEvent::Refused),
            other => {
                return Err(Error::InvalidState(format!("unknown frame tag {other}")));
            }
        }
        Ok(())
    }

    /// Handles every frame already queued on the socket, without waiting.
    fn drain_socket(&mut self) -> Result<()> {
        while ipc::readable(&self.stream)? {
            self.stream
                .set_read_timeout(None)
                .map_err(|source| Error::Os {
                    call: "set_read_timeout",
                    source,
                })?;
            match ipc::recv_frame(&self.stream)? {
                Some((f, fds)) => self.handle_frame(f, fds)?,
                None => return Ok(()), // closed
            }
        }
        Ok(())
    }

    /// The next event, waiting at most `timeout`. [`Error::Unsupported`], in the driver's
    /// words, when this process cannot map what it imports (from the first offer on).
    pub fn next_event(&mut self, timeout: Duration) -> Result<BorrowerEvent> {
        let until = Instant::now() + timeout;
        loop {
            if let Some(Err(words)) = &self.probe {
                return Err(Error::Unsupported(words.clone()));
            }
            self.drain_socket()?;
            if let Some(e) = self.events.pop_front() {
                return Ok(e);
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::InvalidState(
                    "no event from the lender in time".into(),
                ));
            }
            set_timeout(&self.stream, left)?;
            match ipc::recv_frame(&self.stream) {
                Ok(Some((f, fds))) => self.handle_frame(f, fds)?,
                Ok(None) => return Err(Error::InvalidState("lender closed the socket".into())),
                Err(e) if timed_out(&e) => {}
                Err(e) => return Err(e),
            }
        }
    }

    fn usable(&mut self, lease: u64, offset: u64, len: usize) -> Result<u64> {
        self.drain_socket()?;
        let stale = Error::StaleId {
            kind: "borrowed lease",
            index: lease as u32,
            generation: 0,
        };
        let b = self.leases.get(&lease).ok_or(stale)?;
        if !matches!(b.state, LeaseState::Active) {
            return Err(Error::StaleId {
                kind: "borrowed lease (being revoked)",
                index: lease as u32,
                generation: 0,
            });
        }
        if offset.checked_add(len as u64).is_none_or(|e| e > b.size) {
            return Err(Error::InvalidArgument("range outside the lease".into()));
        }
        Ok(b.va + offset)
    }

    /// Writes into a borrowed page (a backend copy into the imported mapping).
    pub fn write(&mut self, lease: u64, offset: u64, src: &[u8]) -> Result<()> {
        let va = self.usable(lease, offset, src.len())?;
        self.backend.write(va, src)
    }

    /// Reads a borrowed page.
    pub fn read(&mut self, lease: u64, offset: u64, dst: &mut [u8]) -> Result<()> {
        let va = self.usable(lease, offset, dst.len())?;
        self.backend.read(va, dst)
    }

    /// Gives a lease back: unmaps it (its copies are synchronous, so none is in flight) and
    /// acknowledges the revocation.
    pub fn ack(&mut self, lease: u64) -> Result<()> {
        self.leases.remove(&lease);
        ipc::send_frame(&self.stream, &encode(ACK, lease, 0, 0), &[])
    }

    /// Sends an application message to the lender.
    pub fn note(&self, value: u64) -> Result<()> {
        ipc::send_frame(&self.stream, &encode(NOTE, 0, value, 0), &[])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_allow_list_and_same_uid_rules() {
        let cred = |uid| PeerCred {
            pid: 1,
            uid,
            gid: 1,
        };
        let p = CredentialPolicy::same_uid();
        assert!(p.admits(1000, &cred(1000)));
        assert!(!p.admits(1000, &cred(1001)));
        let p = CredentialPolicy {
            same_uid: false,
            allow_uids: vec![42],
        };
        assert!(p.admits(1000, &cred(42)));
        assert!(!p.admits(1000, &cred(1000)));
        let p = CredentialPolicy {
            same_uid: true,
            allow_uids: vec![42],
        };
        assert!(p.admits(7, &cred(42)) && p.admits(7, &cred(7)) && !p.admits(7, &cred(8)));
        assert_eq!(decode(&encode(OFFER, 9, 10, 11)), (OFFER, 9, 10, 11));
    }
}

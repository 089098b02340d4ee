//! Device-side copies between requests' tokens and memory outside the space, ordered on the
//! caller's stream: [`KvBlockManager::queue_token_copies`] (an engine's own KV blocks offloaded
//! into a space's requests, or loaded back from them, without the host touching the bytes).

use std::collections::HashMap;
use std::sync::Arc;

use strata_allocator::Kind;
use strata_vmm::{DevicePtr, Error, Event, Result, StreamHandle};

use super::{unknown, Inner, KvBlockManager, RequestId};

/// Which way [`KvBlockManager::queue_token_copies`] moves bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenCopyDirection {
    /// From memory outside the space into the requests' tokens.
    In,
    /// From the requests' tokens to memory outside the space.
    Out,
}

/// Tokens `first_token..` of `request` in the `kind` tensor of `layer`, and the address outside
/// the space they are copied from or to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenCopy {
    pub request: RequestId,
    pub layer: u32,
    pub kind: Kind,
    pub first_token: u32,
    pub other: DevicePtr,
}

impl KvBlockManager {
    /// Queues copies of `tokens` tokens each between requests' tokens and the memory at each
    /// copy's `other` address on `stream`, after the requests' earlier copies (the stream waits
    /// for them; the host does not). `submit` receives the `(src, dst)` pairs of `len` bytes and
    /// queues them on `stream`: the caller's own copy, since only it can vouch for the memory on
    /// the other side. Every run must lie within its request's tokens, in resident blocks
    /// ([`Error::InvalidArgument`] / [`Error::InvalidState`], nothing queued); `In` drops the
    /// clean copies of the blocks it writes. The event recorded on `stream` after the copies
    /// becomes each request's last copy, so spills, revocations, host-side reads, truncation and
    /// release wait for it; it is returned too. The manager's lock is held throughout, so no
    /// revocation unmaps a page between the checks and the submission.
    pub fn queue_token_copies(
        &self,
        direction: TokenCopyDirection,
        tokens: u32,
        copies: &[TokenCopy],
        stream: StreamHandle,
        submit: impl FnOnce(&[(DevicePtr, DevicePtr)], u64) -> Result<()>,
    ) -> Result<Arc<Event>> {
        if tokens == 0 {
            return Err(Error::InvalidArgument("tokens is 0".into()));
        }
        let len = u64::from(tokens) * self.config.bytes_per_token;
        let backend = self.store.backend();
        let mut inner = self.inner.lock();
        let Inner { space, reqs, .. } = &mut *inner;
        let mut pairs = Vec::with_capacity(copies.len());
        // Request -> the blocks this call writes (`In`), every request touched once.
        let mut touched: HashMap<u64, Vec<usize>> = HashMap::new();
        for c in copies {
            let q = reqs.get(&c.request.0).ok_or(unknown(c.request))?;
            let (ptr, range) = self.span(space, q, c.layer, c.kind, c.first_token, len as usize)?;
            let blocks = self.blocks_of(&range);
            for p in blocks.clone() {
                if !space.is_resident(q.slot, p)? {
                    return Err(Error::InvalidState(format!(
                        "block {p} of request {} is not resident: make_resident before copying",
                        c.request.0
                    )));
                }
            }
            let at = ptr + range.start;
            pairs.push(match direction {
                TokenCopyDirection::In => (c.other, at),
                TokenCopyDirection::Out => (at, c.other),
            });
            let written = touched.entry(c.request.0).or_default();
            if direction == TokenCopyDirection::In {
                written.extend(blocks);
            }
        }
        for r in touched.keys() {
            if let Some(ev) = &reqs[r].ready {
                backend.stream_wait_event(stream, ev.handle())?;
            }
        }
        let event = Arc::new(Event::new(backend)?);
        submit(&pairs, len)?;
        // Queued: from here on the bookkeeping follows the bytes, whatever fails next.
        let recorded = event.record(stream);
        for (r, written) in touched {
            let Some(q) = reqs.get_mut(&r) else { continue };
            // The bytes change: their clean copies would be stale.
            for p in written {
                if let Some(ids) = q.clean.remove(&p) {
                    self.release_objects(&ids);
                }
            }
            if recorded.is_ok() {
                q.ready = Some(Arc::clone(&event));
            }
        }
        match recorded {
            Ok(()) => Ok(event),
            Err(e) => {
                // No event covers the copies: wait for them here before anyone relies on them.
                backend.stream_synchronize(stream)?;
                Err(e)
            }
        }
    }
}

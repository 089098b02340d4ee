//! Host-side access to a request's KV: [`KvBlockManager::write_kv`] and
//! [`KvBlockManager::read_kv`].

use std::ops::Range;

use strata_allocator::{Kind, KvSpace};
use strata_vmm::{DevicePtr, Error, Result};

use crate::object::Tier;

use super::{get, lost_first, unknown, Inner, KvBlockManager, Req, RequestId};

impl KvBlockManager {
    /// Writes tokens `first_token..` of `r` (whole tokens of `data`, already appended) in the
    /// `kind` tensor of `layer` with a backend copy, after the last copy into the request: the
    /// host-side path for tests and CPU engines. Their blocks must be resident.
    pub fn write_kv(
        &self,
        r: RequestId,
        layer: u32,
        kind: Kind,
        first_token: u32,
        data: &[u8],
    ) -> Result<()> {
        let mut inner = self.inner.lock();
        let Inner { space, reqs, .. } = &mut *inner;
        let q = reqs.get_mut(&r.0).ok_or(unknown(r))?;
        let (ptr, range) = self.span(space, q, layer, kind, first_token, data.len())?;
        for p in self.blocks_of(&range) {
            if !space.is_resident(q.slot, p)? {
                return Err(Error::InvalidState(format!(
                    "block {p} of request {} is not resident: make_resident before writing",
                    r.0
                )));
            }
        }
        if let Some(ev) = &q.ready {
            ev.synchronize()?;
        }
        // The bytes change: their clean copies would be stale.
        for p in self.blocks_of(&range) {
            if let Some(ids) = q.clean.remove(&p) {
                self.release_objects(&ids);
            }
        }
        self.store.backend().write(ptr + range.start, data)
    }

    /// Reads tokens `first_token..` of `r` (whole tokens of `out`) in the `kind` tensor of
    /// `layer`, from wherever each block is: the device (after the last copy into it) or its
    /// store objects. Returns the slowest tier read. Lost blocks are [`Error::InvalidState`].
    pub fn read_kv(
        &self,
        r: RequestId,
        layer: u32,
        kind: Kind,
        first_token: u32,
        out: &mut [u8],
    ) -> Result<Tier> {
        let inner = self.inner.lock();
        let q = get(&inner.reqs, r)?;
        let (ptr, range) = self.span(&inner.space, q, layer, kind, first_token, out.len())?;
        let tensor = (layer as usize) * 2 + usize::from(kind == Kind::V);
        let block = self.store.block_size();
        let mut slowest = Tier::Hbm;
        let mut chunk = strata_vmm::try_host_vec(block)?;
        let mut at = range.start;
        while at < range.end {
            let p = (at / self.page) as usize;
            let end = range.end.min((p as u64 + 1) * self.page);
            let dst = &mut out[(at - range.start) as usize..(end - range.start) as usize];
            if let Some(ids) = q.spilled.get(&p) {
                // One store object per chunk of the page.
                let per_tensor = ids.len() / (2 * self.config.layers as usize);
                let mut pos = at;
                while pos < end {
                    let within = pos - p as u64 * self.page;
                    let c = (within / block) as usize;
                    let stop = end.min(p as u64 * self.page + (c as u64 + 1) * block);
                    let tier = self.store.read(ids[tensor * per_tensor + c], &mut chunk)?;
                    slowest = slowest.max(tier);
                    let from = (within % block) as usize;
                    let n = (stop - pos) as usize;
                    dst[(pos - at) as usize..(pos - at) as usize + n]
                        .copy_from_slice(&chunk[from..from + n]);
                    pos = stop;
                }
            } else if inner.space.is_resident(q.slot, p)? {
                if let Some(ev) = &q.ready {
                    ev.synchronize()?;
                }
                self.store.backend().read(ptr + at, dst)?;
            } else {
                return Err(lost_first(r.0));
            }
            at = end;
        }
        Ok(slowest)
    }

    /// The slot address of tensor `(layer, kind)` and the byte range of `len` bytes of whole
    /// tokens from `first_token`, checked against the request's tokens.
    pub(super) fn span(
        &self,
        space: &KvSpace,
        q: &Req,
        layer: u32,
        kind: Kind,
        first_token: u32,
        len: usize,
    ) -> Result<(DevicePtr, Range<u64>)> {
        let bpt = self.config.bytes_per_token;
        let ptr = space.slot_ptr(q.slot, layer, kind)?;
        let start = u64::from(first_token) * bpt;
        let end = start + len as u64;
        let tokens = u64::from(space.tokens(q.slot)?);
        if len == 0 || len as u64 % bpt != 0 || end > tokens * bpt {
            return Err(Error::InvalidArgument(format!(
                "{len} bytes from token {first_token} are not whole tokens within the request's {tokens}"
            )));
        }
        Ok((ptr, start..end))
    }

    pub(super) fn blocks_of(&self, range: &Range<u64>) -> Range<usize> {
        (range.start / self.page) as usize..range.end.div_ceil(self.page) as usize
    }
}

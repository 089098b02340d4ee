//! Batched device-side copies between requests' tokens and an engine's own memory
//! (`strata_kv_copy_tokens`), ordered on the caller's stream.

use std::ffi::c_int;

use strata_tiers::transfer::coalesce;
use strata_tiers::{TokenCopy, TokenCopyDirection};
use strata_vmm::{device_work, Error};

use crate::boundary;
use crate::{stream_of, CudaStream};

use super::{kind_of, positive, slice, space};

/// `strata_kv_token_copy_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub struct strata_kv_token_copy_t {
    pub request: u64,
    pub layer: u32,
    pub kind: c_int,
    pub first_token: u32,
    pub reserved: u32,
    pub address: u64,
}

/// Queues `count` copies of `tokens` tokens each between requests' tokens and memory outside
/// the space on `stream` (`STRATA_KV_COPY_IN` = 0 into the requests, `STRATA_KV_COPY_OUT` = 1
/// out of them): one launch of the block-copy kernel, or one batch of copies where the backend
/// cannot launch it. The host does not wait.
///
/// # Safety
///
/// `copies` is NULL with `count == 0`, or readable for `count` entries. Each `address` range
/// (`tokens` tokens of the space's bytes per token) is device memory mapped for the stream's
/// device, or host memory that stays valid, and that nobody else reads (for `OUT`) or writes,
/// until the copies complete (the caller synchronizes `stream`).
#[no_mangle]
pub unsafe extern "C" fn strata_kv_copy_tokens(
    kv: u64,
    direction: c_int,
    tokens: u32,
    copies: *const strata_kv_token_copy_t,
    count: usize,
    stream: CudaStream,
) -> c_int {
    boundary::status("strata_kv_copy_tokens", || {
        let s = space(kv)?;
        let direction = match direction {
            0 => TokenCopyDirection::In,
            1 => TokenCopyDirection::Out,
            d => {
                return Err(Error::InvalidArgument(format!(
                    "direction {d} (STRATA_KV_COPY_IN = 0 or STRATA_KV_COPY_OUT = 1)"
                )))
            }
        };
        let tokens = positive("tokens", tokens)?;
        // SAFETY: this function's contract.
        let raw = unsafe { slice("copies", copies, count) }?;
        let mut list = Vec::with_capacity(raw.len());
        for c in raw {
            if c.reserved != 0 {
                return Err(Error::InvalidArgument(
                    "strata_kv_token_copy_t.reserved must be zero".into(),
                ));
            }
            list.push(TokenCopy {
                request: s.request(c.request)?,
                layer: c.layer,
                kind: kind_of(c.kind)?,
                first_token: c.first_token,
                other: c.address,
            });
        }
        if list.is_empty() {
            return Ok(());
        }
        let stream = stream_of(stream);
        let backend = s.manager.store().backend();
        s.manager
            .queue_token_copies(direction, tokens, &list, stream, |pairs, len| {
                if let Ok(work) = device_work(backend) {
                    // SAFETY: the space's side was checked resident under the manager's lock,
                    // which is held until the copies are queued; the other side is this
                    // function's contract (valid, untouched until the stream is synchronized).
                    match unsafe { work.copy_blocks_async(stream, len, pairs) } {
                        // No kernel here (CUDA without NVRTC) or no room for its staging: DMA.
                        Err(Error::Unsupported(_)) => {}
                        Err(e) if e.is_out_of_memory() => {}
                        other => return other,
                    }
                }
                let mut sorted = pairs.to_vec();
                sorted.sort_unstable();
                // SAFETY: as above.
                unsafe { backend.copy_async(stream, &coalesce(&sorted, len)) }
            })
            .map(drop)
    })
}

//! The panic boundary and the thread-local last error.
//!
//! Every export runs its body through [`status`], [`pointer`] or [`void`]: a Rust error becomes
//! a status (or NULL) plus a message in the calling thread's last error; a panic is caught
//! (`catch_unwind`) and reported as [`Status::Internal`]. Nothing unwinds into C.

use std::cell::RefCell;
use std::ffi::{c_char, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use strata_vmm::{Error, Result};

use crate::status::Status;

thread_local! {
    /// The message of the calling thread's most recent failure (NUL-terminated).
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// Records `message` as the calling thread's last error (interior NULs are replaced).
pub fn set_last_error(call: &str, message: &str) {
    let text = format!("{call}: {message}").replace('\0', "\\0");
    let c = CString::new(text).unwrap_or_default();
    // During thread teardown the slot may be gone: the message is then dropped, never a panic.
    let _ = LAST_ERROR.try_with(|slot| {
        if let Ok(mut slot) = slot.try_borrow_mut() {
            *slot = c;
        }
    });
}

/// Clears the calling thread's last error (no allocation when it is already clear).
pub fn clear_last_error() {
    let _ = LAST_ERROR.try_with(|slot| {
        if let Ok(mut slot) = slot.try_borrow_mut() {
            if !slot.is_empty() {
                *slot = CString::default();
            }
        }
    });
}

/// Pointer to the calling thread's last error; valid until the thread's next strata call.
pub fn last_error_ptr() -> *const c_char {
    LAST_ERROR
        .try_with(|slot| slot.borrow().as_ptr())
        .unwrap_or(c"".as_ptr())
}

/// The calling thread's last error, copied (tests).
#[cfg(test)]
pub fn last_error() -> String {
    LAST_ERROR.with(|slot| slot.borrow().to_string_lossy().into_owned())
}

fn record(call: &str, error: &Error) -> Status {
    let status = Status::of(error);
    set_last_error(call, &format!("{error} ({})", status.name()));
    status
}

#[cold]
#[inline(never)]
fn record_panic(call: &str, payload: Box<dyn std::any::Any + Send>) -> Status {
    let what = payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic with no message".into());
    set_last_error(
        call,
        &format!(
            "internal error (panic caught at the C boundary): {what} ({})",
            Status::Internal.name()
        ),
    );
    // The payload's destructor could itself panic: leak it instead of dropping it here.
    std::mem::forget(payload);
    Status::Internal
}

/// Runs `body` behind the panic boundary and returns its status as an `int`.
#[inline]
pub fn status(call: &str, body: impl FnOnce() -> Result<()>) -> i32 {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => Status::Ok as i32,
        Ok(Err(e)) => record(call, &e) as i32,
        Err(payload) => record_panic(call, payload) as i32,
    }
}

/// Runs `body` behind the panic boundary; an error or a panic gives `fallback` (NULL, -1).
#[inline]
pub fn value<T>(call: &str, fallback: T, body: impl FnOnce() -> Result<T>) -> T {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => {
            record(call, &e);
            fallback
        }
        Err(payload) => {
            record_panic(call, payload);
            fallback
        }
    }
}

/// Runs `body` behind the panic boundary for an export that returns nothing (PyTorch's
/// signatures): failures only set the last error.
#[inline]
pub fn void(call: &str, body: impl FnOnce() -> Result<()>) {
    status(call, body);
}

/// Runs `body` behind the panic boundary for one of PyTorch's hooks, which return nothing: a
/// failure sets the last error, a success clears it, so the caller can read the outcome without
/// clearing it first.
#[inline]
pub fn hook(call: &str, body: impl FnOnce() -> Result<()>) {
    if status(call, body) == Status::Ok as i32 {
        clear_last_error();
    }
}

/// Borrows a C string argument: NULL and invalid UTF-8 are [`Error::InvalidArgument`].
///
/// # Safety
///
/// `ptr` is NULL or points to a NUL-terminated string that stays valid and unmodified for the
/// returned lifetime.
pub unsafe fn c_str<'a>(what: &str, ptr: *const c_char) -> Result<&'a str> {
    if ptr.is_null() {
        return Err(Error::InvalidArgument(format!("{what} is NULL")));
    }
    // SAFETY: non-NULL and, by this function's contract, NUL-terminated and valid for 'a.
    let c = unsafe { CStr::from_ptr(ptr) };
    c.to_str()
        .map_err(|e| Error::InvalidArgument(format!("{what} is not valid UTF-8: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn panics_become_internal_status_and_a_message() {
        let s = status("strata_test", || panic!("boom {}", 42));
        assert_eq!(s, Status::Internal as i32);
        let msg = last_error();
        assert!(msg.starts_with("strata_test: internal error"), "{msg}");
        assert!(msg.contains("boom 42"), "{msg}");
        let v = value("strata_test", 7u32, || panic!("static message"));
        assert_eq!(v, 7);
        assert!(last_error().contains("static message"));
    }

    #[test]
    fn errors_carry_their_status_name_and_clear_resets() {
        let s = status("strata_x", || Err(Error::DoubleFree(0x100)));
        assert_eq!(s, Status::DoubleFree as i32);
        let msg = last_error();
        assert!(
            msg.contains("double free of 0x100") && msg.contains("STRATA_DOUBLE_FREE"),
            "{msg}"
        );
        clear_last_error();
        assert_eq!(last_error(), "");
        set_last_error("strata_y", "a\0b");
        assert_eq!(last_error(), "strata_y: a\\0b");
    }

    #[test]
    fn c_strings_are_checked() {
        // SAFETY: NULL is allowed by the contract.
        let e = unsafe { c_str("tag", std::ptr::null()) }.unwrap_err();
        assert!(e.to_string().contains("tag is NULL"));
        let bad = [0xffu8, 0xfe, 0];
        // SAFETY: a NUL-terminated byte string that lives for the call.
        let e = unsafe { c_str("tag", bad.as_ptr().cast()) }.unwrap_err();
        assert!(e.to_string().contains("not valid UTF-8"));
        // SAFETY: as above.
        assert_eq!(unsafe { c_str("tag", c"kv".as_ptr()) }.unwrap(), "kv");
    }
}

//! Unix-socket helpers for cross-process lending (REFERENCE.md §1 item 8): file descriptors of
//! exported physical memory travel with `SCM_RIGHTS`, and the peer's credentials come from
//! `SO_PEERCRED`. Messages are fixed-size frames, so a descriptor always arrives with the frame
//! it was sent with.

use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

use crate::error::{Error, Result};

/// Bytes of one frame.
pub const FRAME: usize = 32;
/// Most descriptors one frame carries.
pub const MAX_FDS: usize = 4;

/// The credentials of the process at the other end of a socket (`SO_PEERCRED`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerCred {
    pub pid: i32,
    pub uid: u32,
    pub gid: u32,
}

/// The credentials of the peer of `stream`, as the kernel recorded them at connect time.
pub fn peer_cred(stream: &UnixStream) -> Result<PeerCred> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are live locals of the sizes the kernel writes for SO_PEERCRED;
    // the descriptor belongs to `stream`, borrowed for the call.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(Error::os("getsockopt(SO_PEERCRED)"));
    }
    Ok(PeerCred {
        pid: cred.pid,
        uid: cred.uid,
        gid: cred.gid,
    })
}

/// The real user id of this process.
pub fn current_uid() -> u32 {
    // SAFETY: getuid has no preconditions and cannot fail.
    unsafe { libc::getuid() }
}

fn cmsg_space(n: usize) -> usize {
    // SAFETY: CMSG_SPACE is a pure size computation.
    unsafe { libc::CMSG_SPACE((n * std::mem::size_of::<RawFd>()) as u32) as usize }
}

/// Sends one frame with up to [`MAX_FDS`] descriptors attached (`SCM_RIGHTS`).
pub fn send_frame(stream: &UnixStream, frame: &[u8; FRAME], fds: &[BorrowedFd<'_>]) -> Result<()> {
    if fds.len() > MAX_FDS {
        return Err(Error::InvalidArgument(format!(
            "{} descriptors in one frame (at most {MAX_FDS})",
            fds.len()
        )));
    }
    let mut control = vec![0u64; cmsg_space(MAX_FDS).div_ceil(8)];
    let mut iov = libc::iovec {
        iov_base: frame.as_ptr() as *mut libc::c_void,
        iov_len: FRAME,
    };
    // SAFETY: an all-zero msghdr is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = cmsg_space(fds.len()) as _;
        // SAFETY: `msg_control` points at `control`, which is 8-byte aligned and at least
        // CMSG_SPACE(fds) bytes long, so the first header and its data lie inside it.
        unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len =
                libc::CMSG_LEN((fds.len() * std::mem::size_of::<RawFd>()) as u32) as _;
            let data = libc::CMSG_DATA(cmsg).cast::<RawFd>();
            for (i, fd) in fds.iter().enumerate() {
                data.add(i).write_unaligned(fd.as_raw_fd());
            }
        }
    }
    let mut sent = 0usize;
    while sent < FRAME {
        if sent > 0 {
            // The descriptors went with the first bytes; the rest of the frame is plain data.
            msg.msg_control = std::ptr::null_mut();
            msg.msg_controllen = 0;
            iov.iov_base = frame[sent..].as_ptr() as *mut libc::c_void;
            iov.iov_len = FRAME - sent;
            msg.msg_iov = &mut iov;
        }
        // SAFETY: `msg` points at live `iov` (inside `frame`) and, if set, `control`; the
        // socket descriptor is borrowed from `stream` for the call.
        let n = unsafe { libc::sendmsg(stream.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(Error::Os {
                call: "sendmsg",
                source: e,
            });
        }
        sent += n as usize;
    }
    Ok(())
}

/// Receives one frame and the descriptors attached to it. `Ok(None)`: the peer closed the
/// socket before a frame began. Honors the stream's read timeout (an `Os` error on expiry).
pub fn recv_frame(stream: &UnixStream) -> Result<Option<([u8; FRAME], Vec<OwnedFd>)>> {
    let mut frame = [0u8; FRAME];
    let mut fds = Vec::new();
    let mut got = 0usize;
    let mut control = vec![0u64; cmsg_space(MAX_FDS).div_ceil(8)];
    while got < FRAME {
        let mut iov = libc::iovec {
            iov_base: frame[got..].as_mut_ptr().cast(),
            iov_len: FRAME - got,
        };
        // SAFETY: an all-zero msghdr is a valid empty header.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = (control.len() * 8) as _;
        // SAFETY: `msg` points at live `iov` (inside `frame`) and `control`, sized as declared.
        let n = unsafe { libc::recvmsg(stream.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(Error::Os {
                call: "recvmsg",
                source: e,
            });
        }
        // SAFETY: the kernel filled `msg_controllen` bytes of `control`; the CMSG macros walk
        // only inside that, and every SCM_RIGHTS payload holds whole descriptors it gave us.
        unsafe {
            let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
            while !cmsg.is_null() {
                if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                    let header = libc::CMSG_LEN(0) as usize;
                    let count = ((*cmsg).cmsg_len as usize - header) / std::mem::size_of::<RawFd>();
                    let data = libc::CMSG_DATA(cmsg).cast::<RawFd>();
                    for i in 0..count {
                        fds.push(OwnedFd::from_raw_fd(data.add(i).read_unaligned()));
                    }
                }
                cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
            }
        }
        if n == 0 {
            if got == 0 {
                return Ok(None);
            }
            return Err(Error::InvalidState("socket closed inside a frame".into()));
        }
        got += n as usize;
    }
    Ok(Some((frame, fds)))
}

/// True when a read on `stream` would not block now (a frame is queued, or the peer closed).
pub fn readable(stream: &UnixStream) -> Result<bool> {
    let mut pfd = libc::pollfd {
        fd: stream.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    loop {
        // SAFETY: one live `pollfd` for a descriptor borrowed from `stream`; timeout 0.
        let rc = unsafe { libc::poll(&mut pfd, 1, 0) };
        if rc >= 0 {
            return Ok(rc > 0 && pfd.revents & (libc::POLLIN | libc::POLLHUP) != 0);
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(Error::Os {
                call: "poll",
                source: e,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn frames_carry_descriptors_and_credentials() {
        let (a, b) = UnixStream::pair().unwrap();
        let cred = peer_cred(&a).unwrap();
        assert_eq!(cred.uid, current_uid());
        assert_eq!(cred.pid, std::process::id() as i32);
        assert!(!readable(&b).unwrap());
        let file = tempfile_fd();
        let mut frame = [0u8; FRAME];
        frame[0] = 7;
        frame[31] = 9;
        send_frame(&a, &frame, &[file.as_fd()]).unwrap();
        send_frame(&a, &[1u8; FRAME], &[]).unwrap();
        assert!(readable(&b).unwrap());
        let (got, fds) = recv_frame(&b).unwrap().unwrap();
        assert_eq!(got, frame);
        assert_eq!(fds.len(), 1);
        let (got, fds) = recv_frame(&b).unwrap().unwrap();
        assert_eq!(got, [1u8; FRAME]);
        assert!(fds.is_empty());
        drop(a);
        assert!(recv_frame(&b).unwrap().is_none());
    }

    fn tempfile_fd() -> OwnedFd {
        let f = std::fs::File::open("/dev/null").unwrap();
        OwnedFd::from(f)
    }
}

//! The three socket calls the engine needs, as thin wrappers that turn `errno` into
//! `io::Error`: a vectored send that never raises SIGPIPE, a plain receive, and a peek.

use std::io;
use std::os::fd::RawFd;

/// Sends from `first` then `second` in one call. Returns bytes written (0 for empty input).
pub fn send2(fd: RawFd, first: &[u8], second: &[u8]) -> io::Result<usize> {
    let mut iov = [
        libc::iovec { iov_base: first.as_ptr() as *mut libc::c_void, iov_len: first.len() },
        libc::iovec { iov_base: second.as_ptr() as *mut libc::c_void, iov_len: second.len() },
    ];
    let (start, count) = if first.is_empty() { (1, 1) } else { (0, 2) };
    // SAFETY: a zeroed msghdr is a valid empty message; we then point it at our iovecs.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov[start..].as_mut_ptr();
    msg.msg_iovlen = count;
    // SAFETY: the iovecs point into live slices for their stated lengths, and sendmsg only reads
    // them; `fd` is a socket owned by the caller.
    let n = unsafe { libc::sendmsg(fd, &msg, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) };
    if n < 0 { Err(io::Error::last_os_error()) } else { Ok(n as usize) }
}

/// Receives into `buf`; `Ok(0)` means the peer closed the connection.
pub fn recv(fd: RawFd, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: `buf` is writable for its whole length.
    let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) };
    if n < 0 { Err(io::Error::last_os_error()) } else { Ok(n as usize) }
}

/// Copies what is queued on the socket into `buf` without consuming it.
pub fn peek(fd: RawFd, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: `buf` is writable for its whole length.
    let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT | libc::MSG_PEEK) };
    if n < 0 { Err(io::Error::last_os_error()) } else { Ok(n as usize) }
}

/// Waits for events on `fds` for at most `timeout_ms` (retrying on EINTR).
pub fn poll(fds: &mut [libc::pollfd], timeout_ms: i32) -> io::Result<usize> {
    loop {
        // SAFETY: `fds` is a valid, writable array of pollfd of the length we pass.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout_ms) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

pub fn would_block(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::WouldBlock || e.kind() == io::ErrorKind::Interrupted
}

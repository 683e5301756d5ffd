//! Cross-memory attach: reading a peer process's memory with one kernel copy
//! (`process_vm_readv`), for collectives on ordinary tensors (algorithms/host/allreduce_cma.rs)
//! that would otherwise pass every byte through the shared-memory slots twice.
//!
//! The kernel allows it where this process may ptrace the peer (same user, and a Yama
//! `ptrace_scope` of 0; containers may also forbid the call). So a group probes once, at
//! set-up ([`probe`]): each rank reads a peer's segment header through the peer's own address
//! of it and compares it with what the shared mapping shows. Only if every rank can read every
//! peer does the group use it (group.rs), and then every rank takes the same path.
//!
//! A peer's address is its word: the kernel checks every remote range (a bad one is `EFAULT`,
//! and reads only the peer's own memory), while this side writes only into its own buffers.

use std::io;

/// Copies `local.len()` bytes of process `pid`, from its address `remote`, into `local`.
pub fn read(pid: i32, remote: u64, local: &mut [u8]) -> io::Result<()> {
    let mut done = 0;
    while done < local.len() {
        let at = remote.checked_add(done as u64).ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
        let rest = &mut local[done..];
        let local_iov = libc::iovec { iov_base: rest.as_mut_ptr().cast(), iov_len: rest.len() };
        let remote_iov = libc::iovec { iov_base: at as usize as *mut libc::c_void, iov_len: rest.len() };
        // SAFETY: the local iovec is `rest`, writable for its length and borrowed mutably for
        // the call; the remote one is only an address in the other process, which the kernel
        // checks (it never touches this process's memory through it).
        let n = unsafe { libc::process_vm_readv(pid, &local_iov, 1, &remote_iov, 1, 0) };
        match n {
            n if n > 0 => done += n as usize,
            0 => return Err(io::Error::from(io::ErrorKind::UnexpectedEof)),
            _ => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
    Ok(())
}

/// Whether `pid`'s memory at `remote` holds `expect`, read through cross-memory attach.
pub fn probe(pid: i32, remote: u64, expect: &[u8]) -> bool {
    let mut got = vec![0u8; expect.len()];
    read(pid, remote, &mut got).is_ok() && got == expect
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_this_process_and_refuses_bad_addresses() {
        let me = std::process::id() as i32;
        let data: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        let mut out = vec![0u8; data.len()];
        read(me, data.as_ptr() as u64, &mut out).unwrap();
        assert_eq!(out, data);
        assert!(probe(me, data.as_ptr() as u64 + 7, &data[7..70]));
        assert!(!probe(me, data.as_ptr() as u64 + 8, &data[7..70]), "other bytes compare unequal");
        assert!(read(me, 8, &mut out[..8]).is_err(), "an unmapped address is an error, not a read");
        assert!(read(me, u64::MAX - 2, &mut out[..8]).is_err());
        assert!(read(i32::MAX, data.as_ptr() as u64, &mut out[..8]).is_err(), "no such process");
    }
}

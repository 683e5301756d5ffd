//! Cross-memory attach: reading a peer process's memory with one kernel copy
//! (`process_vm_readv`), for collectives on ordinary tensors (algorithms/host/allreduce_cma.rs)
//! that would otherwise pass every byte through the shared-memory slots twice.
//!
//! The kernel allows it where this process may ptrace the peer (same user, and a Yama
//! `ptrace_scope` of 0; containers may also forbid the call). So a group probes once, at
//! set-up ([`probe`]): each rank reads a peer's segment header through the peer's own address
//! of it and compares it with what the shared mapping shows. Only if every rank can read every
//! peer does the group use it (setup.rs), and then every rank takes the same path: the group
//! then reports its [`CmaPeers`].
//!
//! A peer's address is its word: the kernel checks every remote range (a bad one is `EFAULT`,
//! and reads only the peer's own memory), while this side writes only into its own buffers.

use std::io;
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::layout::RankHeader;
use super::segment::Segment;
use crate::buf::RawBuf;
use crate::error::{CommError, Result};
use crate::keys::Key;
use crate::rendezvous::{Store, rendezvous_error};

/// The peers of a host group that every rank reads by cross-memory attach, present where the
/// group agreed on it at set-up: each rank's pid, whether ordinary tensors are read that way
/// too (else only the pinned buffers of staged broadcasts), and how many ops read them.
pub struct CmaPeers {
    pids: Vec<i32>,
    ordinary: bool,
    ops: u64,
}

impl CmaPeers {
    /// The peers whose segments are `segments` (index = local rank), if every segment's pid is
    /// a kernel pid (cross-memory attach addresses processes by it).
    pub fn of(segments: &[Segment], ordinary: bool) -> Option<CmaPeers> {
        let pids = segments.iter().map(|s| i32::try_from(s.header().pid.0.load(Ordering::Relaxed)).ok()).collect::<Option<_>>()?;
        Some(CmaPeers { pids, ordinary, ops: 0 })
    }

    /// Whether every rank reads ordinary tensors by cross-memory attach too (`XCCL_RS_CMA=1`).
    pub fn ordinary(&self) -> bool {
        self.ordinary
    }

    /// Local rank `r`'s pid.
    pub fn pid(&self, r: usize) -> i32 {
        self.pids[r]
    }

    /// Operations that ran by cross-memory attach so far (diagnostics and tests).
    pub fn ops(&self) -> u64 {
        self.ops
    }

    pub fn count_op(&mut self) {
        self.ops += 1;
    }
}

/// Whether this rank can read every peer's memory by cross-memory attach: each peer's header,
/// read through the address the peer published (`Key::ShmCma`), must equal this rank's mapping
/// of it (the same shared memory). A peer in another pid namespace, a ptrace policy that
/// forbids it, or a seccomp filter all make it false. `members`, `rank` and `namespace` as in
/// `ShmGroup::setup`; `segments` are every rank's, mapped here.
pub fn probe_peers(store: &dyn Store, members: &[usize], rank: usize, namespace: &str, segments: &[Segment], timeout: Duration) -> Result<bool> {
    let me = members[rank];
    let mut all = true;
    for (peer, &member) in members.iter().enumerate() {
        let raw = store.get(&Key::ShmCma { namespace, rank: peer }.text(), timeout).map_err(|e| rendezvous_error(me, member, e))?;
        if peer == rank {
            continue;
        }
        let header = segments[peer].header();
        let pid = header.pid.0.load(Ordering::Relaxed);
        let Some(addr) = std::str::from_utf8(&raw).ok().and_then(|v| v.parse::<u64>().ok()) else {
            return Err(CommError::io(format!("rank {member} published an unusable header address for cross-memory attach")));
        };
        // The magic word and the pid, as this rank's mapping shows them.
        let mut expect = [0u8; 16];
        expect[..8].copy_from_slice(&header.magic.0.load(Ordering::Relaxed).to_ne_bytes());
        expect[8..].copy_from_slice(&pid.to_ne_bytes());
        let pid_offset = std::mem::offset_of!(RankHeader, pid) as u64;
        let readable = i32::try_from(pid)
            .is_ok_and(|p| probe(p, addr, &expect[..8]) && addr.checked_add(pid_offset).is_some_and(|a| probe(p, a, &expect[8..])));
        if !readable {
            tracing::debug!("rank {me}: cannot read rank {member} (pid {pid}) by cross-memory attach; collectives use the slots");
        }
        all &= readable;
    }
    Ok(all)
}

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

/// Whether this process's `buf` can be read by cross-memory attach, tried on its first and last
/// byte: the kernel refuses memory it cannot pin page by page (a device driver's mapping, say),
/// which a peer would then fail to read.
pub fn readable(buf: RawBuf) -> bool {
    if buf.is_empty() {
        return true;
    }
    let me = std::process::id() as i32;
    [0, buf.len() - 1].iter().all(|&at| {
        let byte = buf.sub(at, 1);
        // SAFETY: `byte` is one byte inside `buf`, valid for reads for the op (RawBuf::new's
        // contract); it is only read here.
        let want = unsafe { *byte.ptr() };
        probe(me, byte.ptr() as u64, &[want])
    })
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

    #[test]
    fn ordinary_memory_is_readable_by_this_process() {
        let mut data = vec![7u8; 3 << 20];
        data[(3 << 20) - 1] = 9;
        assert!(readable(RawBuf::from_slice(&mut data)));
        assert!(readable(RawBuf::from_slice(&mut data[5..6])));
        assert!(readable(RawBuf::from_slice(&mut [])));
    }
}

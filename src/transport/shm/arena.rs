//! A rank's staging arena as a file (staging/shared.rs says what it is for): shared memory that
//! outlives the group that first used it, so that its registration with the device runtime,
//! which costs about as much as the copies of a small sync, is paid once per process.
//!
//! Unlike segments and heaps it has no name: it is a memfd, so nothing of it is ever visible in
//! /dev/shm, and peers open it through `/proc/<pid>/fd/<fd>` of its owner, as a process of the
//! same user may where it may read the owner's /proc entry (setup.rs checks that every rank can
//! before a group uses arenas). The file's first page holds a magic word and a random token,
//! which the owner also publishes in its header (`ArenaIdentity`, layout.rs): a peer maps the
//! file only if both match and it has the size published, so a descriptor number that meanwhile
//! names another file is refused, never read.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::sync::atomic::{AtomicU64, Ordering};

use memmap2::{MmapOptions, MmapRaw};

use super::heap::HEAP_PAGE;
use super::layout::ArenaId;
use crate::buf::RawBuf;
use crate::error::{CommError, Result};

/// The page before an arena's data: [`MAGIC`], the token's two words, the data's bytes.
const HEADER: usize = HEAP_PAGE;
const MAGIC: u64 = u64::from_le_bytes(*b"XCRARENA");

/// The most data bytes a peer's arena may claim (a bound on what a peer can make us map).
const MOST_BYTES: u64 = 1 << 40;

/// This process's arena file, mapped.
pub struct ArenaFile {
    map: MmapRaw,
    /// Kept open: peers open the arena through it.
    file: File,
    token: [u64; 2],
    bytes: usize,
}

// SAFETY: the mapping is plain shared memory; who writes its bytes when is the business of the
// staging job that holds the arena (staging/job.rs) and of the broadcast's counter protocol.
unsafe impl Send for ArenaFile {}
// SAFETY: as above.
unsafe impl Sync for ArenaFile {}

impl ArenaFile {
    /// A new arena of `bytes` of data, its pages reserved (a full memory is an error here, not
    /// a SIGBUS later).
    pub fn create(bytes: usize) -> Result<ArenaFile> {
        let fail = |what: &str, e: io::Error| CommError::io(format!("cannot {what} a staging arena of {bytes} bytes: {e}"));
        // SAFETY: plain syscall with a NUL-terminated name; the descriptor it returns is ours.
        let fd = unsafe { libc::memfd_create(c"xccl_rs-arena".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(fail("create", io::Error::last_os_error()));
        }
        // SAFETY: `fd` was just created and is owned by nothing else.
        let file = unsafe { File::from_raw_fd(fd) };
        let len = HEADER + bytes;
        file.set_len(len as u64).map_err(|e| fail("size", e))?;
        // SAFETY: plain syscall on a descriptor we own.
        let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len as libc::off_t) };
        if rc != 0 {
            return Err(fail("reserve", io::Error::from_raw_os_error(rc)));
        }
        let map = MmapOptions::new().len(len).map_raw(&file).map_err(|e| fail("map", e))?;
        let mut token = [0u8; 16];
        getrandom::fill(&mut token).map_err(|e| CommError::io(format!("getrandom failed: {e}")))?;
        let token = [u64::from_ne_bytes(token[..8].try_into().unwrap()), u64::from_ne_bytes(token[8..].try_into().unwrap())];
        let words = header_words(&map);
        for (word, value) in words.iter().zip([MAGIC, token[0], token[1], bytes as u64]) {
            word.store(value, Ordering::Relaxed);
        }
        Ok(ArenaFile { map, file, token, bytes })
    }

    /// What this rank publishes for peers to open it (`RankHeader::arena`).
    pub fn id(&self) -> ArenaId {
        ArenaId { fd: self.file.as_raw_fd() as u64, token: self.token, bytes: self.bytes as u64 }
    }

    /// The address of the data in this process.
    pub fn data(&self) -> usize {
        self.map.as_ptr() as usize + HEADER
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

/// A peer's arena, mapped here.
pub struct PeerArena {
    map: MmapRaw,
    id: ArenaId,
}

// SAFETY: as for ArenaFile: plain shared memory, read only at ranges its owner published for an
// op, while the op's counters keep the owner from rewriting them.
unsafe impl Send for PeerArena {}
// SAFETY: as above.
unsafe impl Sync for PeerArena {}

impl PeerArena {
    /// Maps the arena that process `pid` published as `id`, if the file it names is that arena
    /// (its size, magic word and token).
    pub fn open(pid: u64, id: ArenaId) -> Result<PeerArena> {
        let refuse = |why: String| CommError::io(format!("cannot map the staging arena of process {pid}: {why}"));
        if id.bytes == 0 || id.bytes > MOST_BYTES {
            return Err(refuse(format!("it claims {} bytes", id.bytes)));
        }
        let file = open_peer_fd(pid, id.fd).map_err(|e| refuse(e.to_string()))?;
        let meta = file.metadata().map_err(|e| refuse(e.to_string()))?;
        let len = HEADER + id.bytes as usize;
        if !meta.is_file() || meta.len() != len as u64 {
            return Err(refuse(format!("descriptor {} is not a file of {len} bytes", id.fd)));
        }
        let map = MmapOptions::new().len(len).map_raw(&file).map_err(|e| refuse(e.to_string()))?;
        let words: Vec<u64> = header_words(&map).iter().map(|w| w.load(Ordering::Relaxed)).collect();
        if words != [MAGIC, id.token[0], id.token[1], id.bytes] {
            return Err(refuse(format!("descriptor {} is not the arena it published", id.fd)));
        }
        Ok(PeerArena { map, id })
    }

    pub fn id(&self) -> ArenaId {
        self.id
    }

    /// The data's address here and its bytes.
    pub fn data(&self) -> (usize, usize) {
        (self.map.as_ptr() as usize + HEADER, self.id.bytes as usize)
    }

    /// `len` bytes of the data from `offset`, if they lie inside it.
    pub fn range(&self, offset: u64, len: usize) -> Option<RawBuf> {
        let (data, bytes) = self.data();
        let offset = usize::try_from(offset).ok()?;
        if offset.checked_add(len)? > bytes {
            return None;
        }
        // SAFETY: `[offset, offset + len)` lies inside the data, which the mapping holds for as
        // long as `self` lives.
        Some(unsafe { RawBuf::new((data + offset) as *mut u8, len) })
    }
}

/// The header page's words, as atomics: a peer's bytes are valid for any bit pattern.
fn header_words(map: &MmapRaw) -> &[AtomicU64] {
    // SAFETY: the mapping is at least a page long, page-aligned and lives as long as the borrow;
    // AtomicU64 is valid for any bit pattern and may be shared between processes.
    unsafe { std::slice::from_raw_parts(map.as_ptr() as *const AtomicU64, 4) }
}

/// Opens descriptor `fd` of process `pid` through /proc: the same file, opened anew here.
pub fn open_peer_fd(pid: u64, fd: u64) -> io::Result<File> {
    OpenOptions::new().read(true).write(true).custom_flags(libc::O_CLOEXEC).open(format!("/proc/{pid}/fd/{fd}"))
}

/// Whether `a` and `b` are the same file.
pub fn same_file(a: &File, b: &File) -> bool {
    match (a.metadata(), b.metadata()) {
        (Ok(a), Ok(b)) => (a.dev(), a.ino()) == (b.dev(), b.ino()),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pid() -> u64 {
        std::process::id() as u64
    }

    #[test]
    fn a_peer_maps_the_arena_it_was_told_of_and_sees_its_bytes() {
        let own = ArenaFile::create(3 * HEAP_PAGE).unwrap();
        // SAFETY: the data is 3 pages long and ours.
        unsafe { std::ptr::write_bytes(own.data() as *mut u8, 9, own.bytes()) };
        let peer = PeerArena::open(pid(), own.id()).unwrap();
        let seen = peer.range(HEAP_PAGE as u64, 100).unwrap();
        // SAFETY: `range` checked that it lies in the mapping.
        assert!(unsafe { std::slice::from_raw_parts(seen.ptr(), 100) }.iter().all(|&b| b == 9));
        assert!(peer.range(3 * HEAP_PAGE as u64 - 8, 16).is_none(), "a range past the end was accepted");
        assert!(peer.range(u64::MAX - 4, 8).is_none(), "an overflowing range was accepted");
    }

    #[test]
    fn a_wrong_token_size_or_descriptor_is_refused() {
        let own = ArenaFile::create(HEAP_PAGE).unwrap();
        let id = own.id();
        let token = [id.token[0] ^ 1, id.token[1]];
        assert!(PeerArena::open(pid(), ArenaId { token, ..id }).is_err(), "a wrong token was accepted");
        assert!(PeerArena::open(pid(), ArenaId { bytes: 2 * HEAP_PAGE as u64, ..id }).is_err(), "a wrong size was accepted");
        assert!(PeerArena::open(pid(), ArenaId { bytes: 0, ..id }).is_err());
        let other = ArenaFile::create(HEAP_PAGE).unwrap();
        assert!(PeerArena::open(pid(), ArenaId { fd: other.id().fd, ..id }).is_err(), "another arena's descriptor was accepted");
        let stdin = ArenaId { fd: 0, ..id };
        assert!(PeerArena::open(pid(), stdin).is_err());
    }
}

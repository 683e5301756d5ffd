//! One rank's shared-memory segment: a file in /dev/shm created with O_EXCL and mode 0600
//! under an unguessable name (files.rs), mapped by every rank of the group, and unlinked by its creator as
//! soon as every rank has mapped it — from then on nothing of ours is visible in /dev/shm, even
//! if a process is killed. Until then, `Drop` unlinks it on every path out of set-up.
//!
//! Layout (offsets in bytes):
//! ```text
//! 0       RankHeader    counters, abort flag, op descriptors (cache-line padded)
//! 4096    slot 0        `slot_bytes` bytes of data
//! 4096+c  slot 1        `slot_bytes` bytes of data
//! ```

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::PathBuf;

use memmap2::{MmapOptions, MmapRaw};

use super::files;
use super::layout::{HEADER_BYTES, RankHeader};
use crate::error::{CommError, Result};

/// What every segment's name starts with.
const PREFIX: &str = "xccl_rs-";

pub struct Segment {
    map: MmapRaw,
    /// Kept open for the segment's life: peers may open this rank's files through it
    /// (`RankHeader::segment_fd`, setup.rs).
    file: File,
    slot_bytes: usize,
    /// Set while the file still exists and this rank created it.
    owned_path: Option<PathBuf>,
}

// SAFETY: the mapping is plain shared memory; all cross-thread/process access to its header goes
// through atomics, and data slots are accessed under the counter protocol (group.rs).
unsafe impl Send for Segment {}
// SAFETY: as above.
unsafe impl Sync for Segment {}

fn total_bytes(slot_bytes: usize) -> usize {
    HEADER_BYTES + 2 * slot_bytes
}

/// Whether `name` is what [`Segment::create`] makes: `xccl_rs-<pid>-<32 hex digits>`.
pub fn is_segment_name(name: &str) -> bool {
    files::is_name(PREFIX, name)
}

impl Segment {
    /// Creates this rank's segment; returns it and its name (a file name in /dev/shm).
    pub fn create(slot_bytes: usize) -> Result<(Segment, String)> {
        let (file, path, name) = files::create(PREFIX)?;
        let size = total_bytes(slot_bytes);
        let mapped = file
            .set_len(size as u64)
            .map_err(|e| format!("cannot size {} to {size} bytes: {e}", path.display()))
            .and_then(|_| {
                // Reserve the pages now: a full /dev/shm is an error here, not a SIGBUS later.
                // SAFETY: plain syscall on a file descriptor we own.
                let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, size as libc::off_t) };
                if rc == 0 {
                    Ok(())
                } else {
                    Err(format!(
                        "cannot reserve {size} bytes in /dev/shm for {}: {} (is /dev/shm full? lower XCCL_RS_SHM_CHUNK_BYTES)",
                        path.display(),
                        std::io::Error::from_raw_os_error(rc)
                    ))
                }
            })
            .and_then(|_| MmapOptions::new().len(size).map_raw(&file).map_err(|e| format!("cannot map {}: {e}", path.display())));
        let map = match mapped {
            Ok(map) => map,
            Err(message) => {
                let _ = std::fs::remove_file(&path);
                return Err(CommError::io(message));
            }
        };
        let seg = Segment { map, file, slot_bytes, owned_path: Some(path) };
        // Touch every page now, so the first collective pays no page faults.
        // SAFETY: the mapping is `size` bytes long and writable; no one else has it yet.
        unsafe { std::ptr::write_bytes(seg.map.as_mut_ptr(), 0, size) };
        seg.header().init(std::process::id() as u64, seg.file.as_raw_fd() as u64);
        Ok((seg, name))
    }

    /// Maps a peer's segment by name. The name must be one of ours (checked), so a peer cannot
    /// make us open an arbitrary file, and a symbolic link is not followed.
    pub fn open(name: &str, slot_bytes: usize) -> Result<Segment> {
        let (file, path) = files::open(PREFIX, name, "segment")?;
        let size = total_bytes(slot_bytes);
        let actual = file.metadata().map_err(|e| CommError::io(e.to_string()))?.len();
        if actual != size as u64 {
            return Err(CommError::io(format!(
                "segment {name} has {actual} bytes, expected {size} (XCCL_RS_SHM_CHUNK_BYTES differs between ranks?)"
            )));
        }
        let map = MmapOptions::new()
            .len(size)
            .populate()
            .map_raw(&file)
            .map_err(|e| CommError::io(format!("cannot map {}: {e}", path.display())))?;
        Ok(Segment { map, file, slot_bytes, owned_path: None })
    }

    /// Removes the file (every rank has mapped it); the memory lives on until the last unmap.
    pub fn unlink(&mut self) {
        if let Some(path) = self.owned_path.take() {
            let _ = std::fs::remove_file(path);
        }
    }

    /// The segment's file, as this process opened it.
    pub fn file(&self) -> &File {
        &self.file
    }

    pub fn header(&self) -> &RankHeader {
        // SAFETY: the mapping starts with a RankHeader-sized, page-aligned region that lives as
        // long as `self`; RankHeader holds only atomics, which are valid for any bit pattern and
        // safe to share between processes.
        unsafe { &*(self.map.as_ptr() as *const RankHeader) }
    }

    /// Start of data slot `slot` (0 or 1), `slot_bytes` bytes long.
    pub fn slot_ptr(&self, slot: usize) -> *mut u8 {
        debug_assert!(slot < 2);
        // SAFETY: HEADER_BYTES + slot * slot_bytes + slot_bytes <= total_bytes(slot_bytes), the mapping length.
        unsafe { self.map.as_mut_ptr().add(HEADER_BYTES + (slot & 1) * self.slot_bytes) }
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        self.unlink();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::shm::files::SHM_DIR;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn segments_are_private_unguessable_and_never_reached_through_a_link() {
        let (mut seg, name) = Segment::create(4096).unwrap();
        assert!(is_segment_name(&name), "{name}");
        let path = PathBuf::from(SHM_DIR).join(&name);
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "{name} is readable by others");
        // A link named like a segment is refused, even one pointing at a real segment.
        let link = format!("xccl_rs-{}-{}", std::process::id(), "ab".repeat(16));
        let link_path = PathBuf::from(SHM_DIR).join(&link);
        std::os::unix::fs::symlink(&path, &link_path).unwrap();
        let through_link = Segment::open(&link, 4096);
        let _ = std::fs::remove_file(&link_path);
        assert!(through_link.is_err(), "a symbolic link was followed");
        assert!(Segment::open(&name, 4096).is_ok());
        assert!(Segment::open(&format!("../{name}"), 4096).is_err());
        seg.unlink();
        assert!(!path.exists(), "unlink left the file");
    }
}

//! A rank's *heap*: shared memory from which tensors are allocated (`xccl_rs.empty`, torch's
//! `Backend.allocate_tensor`), so that the peers of its host group can read them in place.
//! Collectives whose buffers lie in the heaps skip the slots (algorithms/host/zero_copy.rs; the
//! all-reduce: algorithms/host/push.rs).
//!
//! The heap is one sparse file in /dev/shm of `XCCL_RS_SHM_HEAP_BYTES`, made like a segment
//! (O_EXCL, mode 0600, an unguessable name, unlinked once every rank has mapped it). Sparse:
//! it costs address space, not memory, until a tensor is allocated in it. An allocation
//! reserves its pages with `posix_fallocate` (a full /dev/shm is an error there, not a SIGBUS
//! later) and freeing punches them out again, so memory goes back to the system as soon as the
//! tensor dies, in every rank's mapping.
//!
//! A peer's heap is only ever read or written at an offset and length that peer published for
//! one op (the zero-copy all-reduce writes each rank's reduced part into every peer's tensor);
//! `PeerHeap::range` bounds both by the size the file really has.

use std::collections::BTreeMap;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::Arc;

use memmap2::{MmapOptions, MmapRaw};
use parking_lot::Mutex;

use super::files;
use crate::buf::RawBuf;
use crate::error::{CommError, Result};
use crate::staging::{DeviceCopies, SharedStaging};

/// What every heap's name starts with.
const PREFIX: &str = "xccl_rs-heap-";

/// Allocations are whole pages: punching a hole frees only whole pages, and page alignment
/// is more than any dtype (or SIMD load) needs.
pub const HEAP_PAGE: usize = 4096;

/// Whether `name` is what [`Heap::create`] makes: `xccl_rs-heap-<pid>-<32 hex digits>`.
pub fn is_heap_name(name: &str) -> bool {
    files::is_name(PREFIX, name)
}

/// This rank's heap. Shared (`Arc`) by the group and by every tensor allocated from it, so a
/// tensor outlives its group safely.
pub struct Heap {
    map: MmapRaw,
    file: File,
    len: usize,
    /// Free ranges, offset → length, coalesced (first fit).
    free: Mutex<BTreeMap<usize, usize>>,
    owned_path: Mutex<Option<PathBuf>>,
}

// SAFETY: the mapping is plain shared memory; the free list is behind a mutex; who reads and
// writes an allocation's bytes is the business of the tensor that owns it and of the
// collectives' counter protocol (group.rs), exactly as for ordinary tensor memory.
unsafe impl Send for Heap {}
// SAFETY: as above.
unsafe impl Sync for Heap {}

impl Heap {
    /// Creates this rank's heap of `len` bytes (rounded down to pages); returns it and its name.
    pub fn create(len: usize) -> Result<(Heap, String)> {
        let len = len / HEAP_PAGE * HEAP_PAGE;
        let (file, path, name) = files::create(PREFIX)?;
        let mapped = file.set_len(len as u64).map_err(|e| format!("cannot size {} to {len} bytes: {e}", path.display())).and_then(|_| {
            MmapOptions::new().len(len).map_raw(&file).map_err(|e| format!("cannot map {} ({len} bytes): {e}", path.display()))
        });
        match mapped {
            Ok(map) => {
                let free = if len > 0 { BTreeMap::from([(0, len)]) } else { BTreeMap::new() };
                Ok((Heap { map, file, len, free: Mutex::new(free), owned_path: Mutex::new(Some(path)) }, name))
            }
            Err(message) => {
                let _ = std::fs::remove_file(&path);
                Err(CommError::io(format!("{message} (lower XCCL_RS_SHM_HEAP_BYTES, or 0 for no heap)")))
            }
        }
    }

    /// Removes the file (every rank has mapped it).
    pub fn unlink(&self) {
        if let Some(path) = self.owned_path.lock().take() {
            let _ = std::fs::remove_file(path);
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Where `buf` lies in this heap (its offset), if it lies wholly inside.
    pub fn offset_of(&self, buf: RawBuf) -> Option<usize> {
        let base = self.map.as_ptr() as usize;
        let at = (buf.ptr() as usize).checked_sub(base)?;
        (at.checked_add(buf.len())? <= self.len).then_some(at)
    }

    /// Where `views` lie in this heap: the first one's offset and their spacing, when all lie
    /// in it, have equal lengths and are evenly spaced without overlapping.
    pub fn placement(&self, views: &[RawBuf]) -> Option<(usize, usize)> {
        let first = *views.first()?;
        let offset = self.offset_of(first)?;
        let stride = views.get(1).map_or(first.len(), |v| (v.ptr() as usize).wrapping_sub(first.ptr() as usize));
        let evenly = views.iter().enumerate().all(|(k, v)| {
            v.len() == first.len()
                && self.offset_of(*v).is_some()
                && (v.ptr() as usize).wrapping_sub(first.ptr() as usize) == k.wrapping_mul(stride)
        });
        (evenly && (views.len() == 1 || stride >= first.len())).then_some((offset, stride))
    }

    /// Allocates `bytes` (at least one page), with its pages reserved in /dev/shm.
    pub fn alloc(self: &Arc<Heap>, bytes: usize) -> Result<HeapBlock> {
        let want = bytes
            .max(1)
            .div_ceil(HEAP_PAGE)
            .checked_mul(HEAP_PAGE)
            .ok_or_else(|| CommError::invalid("allocation size overflows"))?;
        let offset = {
            let mut free = self.free.lock();
            let Some((&at, &len)) = free.iter().find(|&(_, &len)| len >= want) else {
                let largest = free.values().max().copied().unwrap_or(0);
                return Err(CommError::io(format!(
                    "the shared-memory heap has no free range of {want} bytes (heap {} bytes, largest free range {largest}); raise XCCL_RS_SHM_HEAP_BYTES",
                    self.len
                )));
            };
            free.remove(&at);
            if len > want {
                free.insert(at + want, len - want);
            }
            at
        };
        // SAFETY: plain syscall on the heap's own descriptor, over a range inside the file.
        let rc = unsafe { libc::posix_fallocate(self.file.as_raw_fd(), offset as libc::off_t, want as libc::off_t) };
        if rc != 0 {
            self.release(offset, want);
            return Err(CommError::io(format!(
                "cannot reserve {want} bytes in /dev/shm for a tensor: {} (is /dev/shm full?)",
                std::io::Error::from_raw_os_error(rc)
            )));
        }
        Ok(HeapBlock { heap: self.clone(), offset, len: want })
    }

    /// Gives a range back: its pages are punched out (their memory returns to the system, in
    /// every rank's mapping), then it joins the free list, merged with its neighbours.
    fn release(&self, offset: usize, len: usize) {
        // SAFETY: plain syscall on our descriptor; the range is one we handed out and whose
        // tensor is gone, so no one reads it any more.
        unsafe {
            libc::fallocate(
                self.file.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                offset as libc::off_t,
                len as libc::off_t,
            )
        };
        let mut free = self.free.lock();
        let (mut at, mut len) = (offset, len);
        if let Some((&prev, &prev_len)) = free.range(..at).next_back()
            && prev + prev_len == at
        {
            free.remove(&prev);
            at = prev;
            len += prev_len;
        }
        if let Some(next_len) = free.remove(&(at + len)) {
            len += next_len;
        }
        free.insert(at, len);
    }

    /// Bytes currently handed out.
    pub fn allocated(&self) -> usize {
        self.len - self.free.lock().values().sum::<usize>()
    }
}

impl Drop for Heap {
    fn drop(&mut self) {
        self.unlink();
    }
}

/// One allocation; freed when dropped (the tensor's deleter drops it).
pub struct HeapBlock {
    heap: Arc<Heap>,
    offset: usize,
    len: usize,
}

impl HeapBlock {
    pub fn address(&self) -> usize {
        self.heap.map.as_ptr() as usize + self.offset
    }
    /// The block's bytes.
    pub fn buf(&self) -> RawBuf {
        // SAFETY: [offset, offset + len) lies inside the heap's mapping (alloc handed it out),
        // which lives as long as `self.heap`; the block is this allocation's alone.
        unsafe { RawBuf::new(self.address() as *mut u8, self.len) }
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for HeapBlock {
    fn drop(&mut self) {
        self.heap.release(self.offset, self.len);
    }
}

/// A peer's heap, mapped here.
pub struct PeerHeap {
    map: MmapRaw,
    len: usize,
}

// SAFETY: see Heap; this rank reads and writes a peer's heap only at ranges that peer
// published for an op, under the counter protocol.
unsafe impl Send for PeerHeap {}
// SAFETY: as above.
unsafe impl Sync for PeerHeap {}

impl PeerHeap {
    /// Maps a peer's heap by name; the name must be one of ours (checked) and a symbolic link
    /// is not followed. Its size is whatever the file has (ranks may configure different sizes).
    pub fn open(name: &str) -> Result<PeerHeap> {
        let (file, path) = files::open(PREFIX, name, "heap")?;
        let len = file.metadata().map_err(|e| CommError::io(e.to_string()))?.len();
        let len = usize::try_from(len).map_err(|_| CommError::io(format!("heap {name} is too large to map")))?;
        let map = MmapOptions::new()
            .len(len)
            .map_raw(&file)
            .map_err(|e| CommError::io(format!("cannot map {}: {e}", path.display())))?;
        Ok(PeerHeap { map, len })
    }

    /// The peer's bytes `[offset, offset + len)`, if that range lies inside its heap.
    pub fn range(&self, offset: usize, len: usize) -> Option<RawBuf> {
        if offset.checked_add(len)? > self.len {
            return None;
        }
        // SAFETY: the range lies inside the mapping (checked above), which lives as long as
        // `self`; the peer published it as its buffer of the current op (counter protocol).
        Some(unsafe { RawBuf::new(self.map.as_mut_ptr().add(offset), len) })
    }

    /// The peer's `count` buffers of `len` bytes, the first at `offset`, `stride` bytes apart
    /// (as it published them for an op), if every one lies inside its heap.
    pub fn views(&self, offset: u64, stride: u64, count: usize, len: usize) -> Option<Vec<RawBuf>> {
        let offset = usize::try_from(offset).ok()?;
        let stride = usize::try_from(stride).ok()?;
        (0..count).map(|k| k.checked_mul(stride).and_then(|d| d.checked_add(offset)).and_then(|o| self.range(o, len))).collect()
    }
}

/// A host group's heaps as one rank has them, set up with the group (setup.rs): its own, which
/// tensors are allocated from, and, where the group agreed on zero-copy, every peer's mapped
/// here; and how many ops read them in place.
pub struct Heaps {
    /// This rank's staging arena and the peers' it read from (staging/shared.rs).
    staging: SharedStaging,
    own: Arc<Heap>,
    /// Every peer's heap (None at this rank's index), present where every rank has a heap and
    /// mapped every peer's: the same on every rank (agreed at set-up), so every rank takes the
    /// same path through a collective.
    peers: Option<Vec<Option<PeerHeap>>>,
    zero_copy_ops: u64,
    last_zero_copy_seq: Option<u64>,
}

impl Heaps {
    /// `registered_staging`: whether a broadcast root may stage in a registered arena (and every
    /// rank can open every peer's: setup.rs).
    pub fn new(own: Arc<Heap>, peers: Option<Vec<Option<PeerHeap>>>, registered_staging: bool) -> Heaps {
        Heaps { staging: SharedStaging::new(registered_staging), own, peers, zero_copy_ops: 0, last_zero_copy_seq: None }
    }

    /// The address of this rank's staging arena, taken the first time (SharedStaging::arena).
    pub fn staging_arena(&mut self, bytes: usize, device: &mut dyn DeviceCopies) -> Result<Option<usize>> {
        self.staging.arena(bytes, device)
    }

    pub fn staging(&self) -> &SharedStaging {
        &self.staging
    }

    pub fn staging_mut(&mut self) -> &mut SharedStaging {
        &mut self.staging
    }

    /// This rank's heap.
    pub fn own(&self) -> &Arc<Heap> {
        &self.own
    }

    /// Whether collectives may read peers' buffers in their heaps: the same on every rank.
    pub fn zero_copy(&self) -> bool {
        self.peers.is_some()
    }

    /// Local rank `r`'s heap, mapped here, where the group agreed on zero-copy.
    pub fn peer(&self, r: usize) -> Option<&PeerHeap> {
        self.peers.as_ref()?.get(r)?.as_ref()
    }

    /// Operations that ran zero-copy so far (diagnostics and tests).
    pub fn zero_copy_ops(&self) -> u64 {
        self.zero_copy_ops
    }

    /// Counts the op of sequence number `seq` as zero-copy, once however many pipeline chunks
    /// of it run zero-copy (they share the op's number).
    pub fn count_zero_copy_op(&mut self, seq: u64) {
        if self.last_zero_copy_seq != Some(seq) {
            self.last_zero_copy_seq = Some(seq);
            self.zero_copy_ops += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::shm::files::SHM_DIR;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    fn reserved_bytes(name: &str) -> u64 {
        std::fs::metadata(PathBuf::from(SHM_DIR).join(name)).unwrap().blocks() * 512
    }

    #[test]
    fn allocations_reserve_pages_and_give_them_back() {
        let (heap, name) = Heap::create(64 * HEAP_PAGE).unwrap();
        let heap = Arc::new(heap);
        assert!(is_heap_name(&name), "{name}");
        let mode = std::fs::metadata(PathBuf::from(SHM_DIR).join(&name)).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert_eq!(reserved_bytes(&name), 0, "a new heap must be sparse");
        let a = heap.alloc(1).unwrap();
        let b = heap.alloc(3 * HEAP_PAGE + 1).unwrap();
        assert_eq!((a.len(), b.len()), (HEAP_PAGE, 4 * HEAP_PAGE));
        assert_eq!(reserved_bytes(&name), 5 * HEAP_PAGE as u64);
        assert!(a.address() + a.len() <= b.address() || b.address() + b.len() <= a.address(), "allocations overlap");
        let peer = PeerHeap::open(&name).unwrap();
        // SAFETY: `b` is ours and 4 pages long.
        unsafe { std::ptr::write_bytes(b.address() as *mut u8, 7, b.len()) };
        let offset = heap.offset_of(b.buf()).unwrap();
        let seen = peer.range(offset, b.len()).unwrap();
        // SAFETY: the range lies inside the peer mapping (range checked it).
        assert!(unsafe { std::slice::from_raw_parts(seen.ptr(), seen.len()) }.iter().all(|&x| x == 7), "the peer sees other bytes");
        assert!(peer.range(64 * HEAP_PAGE - 8, 16).is_none(), "a range past the end was accepted");
        assert!(peer.range(usize::MAX - 4, 8).is_none(), "an overflowing range was accepted");
        drop(b);
        assert_eq!(reserved_bytes(&name), HEAP_PAGE as u64, "freeing kept the pages");
        drop(a);
        assert_eq!(heap.allocated(), 0);
        let whole = heap.alloc(64 * HEAP_PAGE).unwrap();
        assert!(heap.alloc(1).is_err(), "a full heap allocated");
        drop(whole);
        heap.unlink();
        assert!(!PathBuf::from(SHM_DIR).join(&name).exists());
    }

    #[test]
    fn peers_find_evenly_spaced_views_where_they_were_placed() {
        let (heap, name) = Heap::create(16 * HEAP_PAGE).unwrap();
        let heap = Arc::new(heap);
        let block = heap.alloc(4 * HEAP_PAGE).unwrap();
        let whole = block.buf();
        let base = heap.offset_of(whole).unwrap();
        // Four views of 1000 bytes, 1024 apart (a reduce-scatter's input views).
        let views: Vec<RawBuf> = (0..4).map(|k| whole.sub(k * 1024, 1000)).collect();
        assert_eq!(heap.placement(&views), Some((base, 1024)));
        assert_eq!(heap.placement(&views[..1]), Some((base, 1000)));
        assert_eq!(heap.placement(&[views[0], views[2], views[1]]), None, "views out of order");
        assert_eq!(heap.placement(&[whole.sub(0, 1000), whole.sub(500, 1000)]), None, "overlapping views");
        let mut outside = vec![0u8; 1000];
        assert_eq!(heap.placement(&[views[0], RawBuf::from_slice(&mut outside)]), None, "a view outside the heap");
        let peer = PeerHeap::open(&name).unwrap();
        let seen = peer.views(base as u64, 1024, 4, 1000).unwrap();
        assert!(seen.iter().zip(&views).all(|(s, v)| heap.offset_of(*v) == Some(s.ptr() as usize - peer.map.as_ptr() as usize)));
        let last = (16 * HEAP_PAGE - 1000) as u64;
        assert!(peer.views(last, 0, 3, 1000).is_some());
        assert!(peer.views(last, 1024, 2, 1000).is_none(), "a view past the end was accepted");
        assert!(peer.views(0, u64::MAX / 2, 3, 8).is_none(), "an overflowing spacing was accepted");
        drop(block);
    }

    #[test]
    fn only_heap_names_are_opened() {
        assert!(PeerHeap::open("../etc/passwd").is_err());
        assert!(PeerHeap::open(&format!("xccl_rs-heap-1-{}", "g".repeat(32))).is_err());
        let (heap, name) = Heap::create(HEAP_PAGE).unwrap();
        let link = format!("xccl_rs-heap-{}-{}", std::process::id(), "cd".repeat(16));
        let link_path = PathBuf::from(SHM_DIR).join(&link);
        std::os::unix::fs::symlink(PathBuf::from(SHM_DIR).join(&name), &link_path).unwrap();
        let through_link = PeerHeap::open(&link);
        let _ = std::fs::remove_file(&link_path);
        assert!(through_link.is_err(), "a symbolic link was followed");
        drop(heap);
    }
}

//! Registered shared staging: a broadcast's root stages its accelerator tensor in its
//! shared-memory heap, registered with the device runtime, and each receiver copies it onto its
//! own device straight from there (the root's heap, mapped in the receiver's process and
//! registered there too). No host copy is left between the root's copy off its device and the
//! receivers' copies onto theirs: the broadcast runs at its link's speed.
//!
//! The root's *arena* is one block of its heap, [`WINDOW_SETS`] pipeline chunks, allocated and
//! registered the first time a job can use it and kept where it is for the group's life.
//! Registering costs about as much as touching every page, so it is done once. And because the
//! arena never moves, a receiver may keep its registrations of the root's arena for the
//! group's life too, which a receiver could not do for other heap memory: that may be freed
//! and its offsets handed out again, and a registration kept across that would pin the old
//! pages and copy stale bytes. So a root says with each op whether its buffer lies in its arena
//! (`Placement::arena`), and receivers copy from the device runtime's side only then.
//!
//! Where the runtime cannot register host memory (XPU in torch today), or the heap has no room,
//! nothing changes: pinned blocks from the runtime's allocator, and a host copy per receiver.

use std::sync::Arc;
use std::time::Instant;

use super::plan::WINDOW_SETS;
use super::DeviceCopies;
use crate::buf::RawBuf;
use crate::error::Result;
use crate::transport::shm::heap::{HEAP_PAGE, Heap, HeapBlock};

/// Host memory registered with a device runtime; unregistered when dropped, which must happen
/// before the memory is unmapped.
pub struct HostRegistration {
    address: usize,
    bytes: usize,
    unregister: fn(usize),
}

impl HostRegistration {
    /// `bytes` at `address`, registered; `unregister(address)` ends the registration.
    pub fn new(address: usize, bytes: usize, unregister: fn(usize)) -> HostRegistration {
        HostRegistration { address, bytes, unregister }
    }

    fn end(&self) -> usize {
        self.address + self.bytes
    }

    fn covers(&self, from: usize, to: usize) -> bool {
        self.address <= from && to <= self.end()
    }

    fn overlaps(&self, from: usize, to: usize) -> bool {
        from < self.end() && self.address < to
    }
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        (self.unregister)(self.address);
    }
}

/// The bytes of a rank's arena at pipeline chunks of `chunk_bytes`: a window's sets of one
/// slot (plan.rs), which also holds a tensor of up to two chunks whole.
pub fn arena_bytes(chunk_bytes: usize) -> usize {
    WINDOW_SETS.saturating_mul(chunk_bytes)
}

/// This rank's arena and its registrations of peers' arenas, kept by its group's heaps
/// (transport/shm/heap.rs `Heaps`), which drop it before they unmap any heap.
pub struct SharedStaging {
    arena: Option<Arena>,
    /// Not to be asked for an arena: `XCCL_RS_REGISTERED_STAGING=0`, or the runtime or the heap
    /// refused one once.
    refused: bool,
    /// Ranges of peers' arenas as they are mapped here, registered.
    peers: Vec<HostRegistration>,
}

struct Arena {
    // Declared first: dropped, so unregistered, before the block is freed.
    _registration: HostRegistration,
    block: HeapBlock,
}

impl SharedStaging {
    /// `enabled`: whether a root may stage in an arena (`XCCL_RS_REGISTERED_STAGING`).
    pub fn new(enabled: bool) -> SharedStaging {
        SharedStaging { arena: None, refused: !enabled, peers: Vec::new() }
    }

    /// The address of this rank's arena of `bytes`: allocated in `heap` and registered through
    /// `device` the first time. None where the runtime cannot register host memory, or the heap
    /// cannot hold it (then later jobs stage through pinned blocks, as without a heap).
    pub fn arena(&mut self, heap: &Arc<Heap>, bytes: usize, device: &mut dyn DeviceCopies) -> Result<Option<usize>> {
        if self.arena.is_none() && !self.refused {
            self.refused = true;
            if let Ok(block) = heap.alloc(bytes) {
                let started = Instant::now();
                if let Some(registration) = device.register(block.address(), block.len())? {
                    tracing::debug!(bytes, ms = started.elapsed().as_secs_f64() * 1e3, "registered the staging arena");
                    self.arena = Some(Arena { _registration: registration, block });
                    self.refused = false;
                }
            }
        }
        Ok(self.arena.as_ref().map(|a| a.block.address()))
    }

    /// Whether `buf` lies in this rank's arena.
    pub fn holds(&self, buf: RawBuf) -> bool {
        self.arena.as_ref().is_some_and(|a| {
            let (at, end) = (buf.ptr() as usize, buf.ptr() as usize + buf.len());
            a.block.address() <= at && end <= a.block.address() + a.block.len()
        })
    }

    /// Makes sure `source`, part of a peer's arena mapped here at `[.., mapped_end)`, is
    /// registered in this process: if no registration covers it, registers the `granule` bytes
    /// from the page it starts in (the arena's slots are chunks apart, so the chunks that one
    /// slot holds share one registration), clamped to the mapping. Whether it is registered:
    /// false where the runtime cannot register, or an earlier registration overlaps it only in
    /// part (the peer staged at other offsets than before; the caller copies on the host).
    pub fn register_peer_range(&mut self, source: RawBuf, granule: usize, mapped_end: usize, device: &mut dyn DeviceCopies) -> Result<bool> {
        let from = source.ptr() as usize;
        let to = from + source.len();
        if self.peers.iter().any(|r| r.covers(from, to)) {
            return Ok(true);
        }
        let start = from / HEAP_PAGE * HEAP_PAGE;
        let end = start.saturating_add(granule.max(to - start)).min(mapped_end);
        if end < to || self.peers.iter().any(|r| r.overlaps(start, end)) {
            return Ok(false);
        }
        let started = Instant::now();
        match device.register(start, end - start)? {
            Some(registration) => {
                tracing::debug!(bytes = end - start, ms = started.elapsed().as_secs_f64() * 1e3, "registered part of a peer's staging arena");
                self.peers.push(registration);
                Ok(true)
            }
            None => Ok(false),
        }
    }
}

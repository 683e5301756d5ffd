//! The header at the start of every rank's segment. Every field is an atomic, so any bit
//! pattern a peer leaves there is a valid value: we compare peers' values, and the one we use
//! as an offset (`heap_at`) is bounds-checked first.
//!
//! Writers and orderings:
//! - `produced`, `reduced`, `consumed`: written only by the owning rank, with Release, after
//!   the data they announce is in place; read by peers with Acquire before they touch that data.
//!   They count blocks: "I have finished step X of block g" is the value g (monotonic for the
//!   life of the group).
//! - `desc[slot]`, and `heap_at[slot]`, `heap_stride[slot]`, `cma_addr[slot]` (a [`Placement`]):
//!   written by the owner before it publishes `produced` for the first block of an operation
//!   (which uses that slot); read by peers after they see that `produced`. They live on
//!   `produced`'s cache line (`ProducedLine`). A peer's `heap_at` is used as an offset only
//!   after bounds checks against that peer's heap (heap.rs).
//! - `aborted`: set (Release) by the owner when it fails (`ABORT_FAILED`, after writing
//!   `abort_message`) or when it closes its communicator (`ABORT_CLOSED`); peers check it while
//!   waiting on that rank.
//! - `segment_fd`: written once by the owner before it publishes its magic word.
//! - `arena` (an [`ArenaIdentity`]): written by the owner before it publishes `produced` for the
//!   first block of an op whose buffer lies in its staging arena, and the same for the group's
//!   life after that; read by peers after they see that `produced`, and trusted only once the
//!   file it names shows them the same token (transport/shm/arena.rs).
//! - `epoch`, `sleepers`: used in rank 0's header only, by every rank: the group's futex word
//!   and the number of ranks asleep on it (SeqCst, Dekker-style: see group.rs).

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use super::desc::Desc;

pub const HEADER_BYTES: usize = 4096;
pub const ABORT_FAILED: u32 = 1;
pub const ABORT_CLOSED: u32 = 2;
/// Bytes of an abort message kept in the header (longer ones are cut).
pub const ABORT_MESSAGE_BYTES: usize = 1024;
const MAGIC: u64 = u64::from_le_bytes(*b"XCRSHM05");

/// One value alone on its cache lines (128 bytes: adjacent-line prefetch pairs lines).
#[repr(C, align(128))]
pub struct Padded<T>(pub T);

/// What every rank says about the operation that starts at a block: compared across ranks
/// before any rank reads another's data.
#[repr(C)]
#[derive(Default)]
pub struct OpDesc {
    pub seq: AtomicU64,
    /// The bytes of [`Desc::kind`], [`Desc::dtype`], [`Desc::reduce`], [`Desc::chunk_log`], in
    /// that order, then zeros (little-endian).
    pub codes: AtomicU64,
    pub count: AtomicU64,
    pub root: AtomicU64,
}

impl OpDesc {
    pub fn store(&self, d: Desc) {
        self.seq.store(d.seq, Ordering::Relaxed);
        self.codes.store(u64::from_le_bytes([d.kind, d.dtype, d.reduce, d.chunk_log, 0, 0, 0, 0]), Ordering::Relaxed);
        self.count.store(d.count, Ordering::Relaxed);
        self.root.store(d.root, Ordering::Relaxed);
    }
    pub fn load(&self) -> Desc {
        let [kind, dtype, reduce, chunk_log, ..] = self.codes.load(Ordering::Relaxed).to_le_bytes();
        Desc {
            seq: self.seq.load(Ordering::Relaxed),
            kind,
            dtype,
            reduce,
            chunk_log,
            count: self.count.load(Ordering::Relaxed),
            root: self.root.load(Ordering::Relaxed),
        }
    }
}

/// `produced` and the two op descriptions share one cache line: a peer that waits for
/// `produced` and then checks the description (every op's first block) takes one cache miss
/// for both, not two (the owner writes both before it publishes `produced`).
#[repr(C)]
pub struct ProducedLine {
    pub produced: AtomicU64,
    pub desc: [OpDesc; 2],
    /// Where this rank's buffer of the op lies in its heap (heap.rs): offset + 1, or 0 when
    /// it is not in the heap. Written with `desc`, not compared: ranks may differ here.
    pub heap_at: [AtomicU64; 2],
    /// The distance in bytes between this rank's consecutive buffers of the op (the input
    /// views of a reduce-scatter), with `heap_at`; its top bit is [`Placement::arena`].
    pub heap_stride: [AtomicU64; 2],
    /// Where this rank's first buffer of the op lies in its own address space, for peers
    /// that read it by cross-memory attach (cma.rs). Written with `desc`.
    pub cma_addr: [AtomicU64; 2],
}

const _: () = assert!(std::mem::size_of::<ProducedLine>() <= 128);

/// Where a rank's buffers of an op lie, published with its description (`heap_at`,
/// `heap_stride`, `cma_addr` of `ProducedLine`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Placement {
    /// In its heap: the first buffer's offset and the spacing of the buffers; None when they
    /// are not all there.
    pub heap: Option<(u64, u64)>,
    /// The first buffer's address in the rank's own process, for cross-memory attach; 0 where
    /// the rank does not offer them to be read that way (a broadcast's root, host/broadcast_shm.rs).
    pub addr: u64,
    /// They lie in the rank's staging arena (staging/shared.rs), and `heap` gives their place in
    /// it, not in the heap. Carried in `heap_stride`'s top bit.
    pub arena: bool,
}

/// The bit of `heap_stride` that carries [`Placement::arena`] (a stride is less than a heap).
const ARENA_BIT: u64 = 1 << 63;

impl ProducedLine {
    pub fn store_placement(&self, slot: usize, p: Placement) {
        let (at, stride) = p.heap.map_or((0, 0), |(offset, stride)| (offset + 1, stride & !ARENA_BIT));
        self.heap_at[slot].store(at, Ordering::Relaxed);
        self.heap_stride[slot].store(if p.arena { stride | ARENA_BIT } else { stride }, Ordering::Relaxed);
        self.cma_addr[slot].store(p.addr, Ordering::Relaxed);
    }

    pub fn load_placement(&self, slot: usize) -> Placement {
        let at = self.heap_at[slot].load(Ordering::Relaxed);
        let stride = self.heap_stride[slot].load(Ordering::Relaxed);
        let heap = (at != 0).then(|| (at - 1, stride & !ARENA_BIT));
        Placement { heap, addr: self.cma_addr[slot].load(Ordering::Relaxed), arena: heap.is_some() && stride & ARENA_BIT != 0 }
    }
}

/// Which file holds a rank's staging arena, for peers to open it (transport/shm/arena.rs): the
/// descriptor that its process keeps open on it, the arena's random token (also written in
/// the file itself) and its data bytes. All zero while the rank has no arena.
#[repr(C)]
#[derive(Default)]
pub struct ArenaIdentity {
    pub fd: AtomicU64,
    pub token: [AtomicU64; 2],
    pub bytes: AtomicU64,
}

/// [`ArenaIdentity`]'s values.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ArenaId {
    pub fd: u64,
    pub token: [u64; 2],
    pub bytes: u64,
}

impl ArenaIdentity {
    pub fn store(&self, id: ArenaId) {
        self.fd.store(id.fd, Ordering::Relaxed);
        self.token[0].store(id.token[0], Ordering::Relaxed);
        self.token[1].store(id.token[1], Ordering::Relaxed);
        self.bytes.store(id.bytes, Ordering::Relaxed);
    }

    pub fn load(&self) -> ArenaId {
        ArenaId {
            fd: self.fd.load(Ordering::Relaxed),
            token: [self.token[0].load(Ordering::Relaxed), self.token[1].load(Ordering::Relaxed)],
            bytes: self.bytes.load(Ordering::Relaxed),
        }
    }
}

#[repr(C)]
pub struct RankHeader {
    pub magic: Padded<AtomicU64>,
    pub pid: Padded<AtomicU64>,
    /// The descriptor that the owner keeps open on its segment's file: a peer that can open it
    /// through /proc can open the owner's arena the same way (setup.rs).
    pub segment_fd: Padded<AtomicU64>,
    pub arena: Padded<ArenaIdentity>,
    pub line: Padded<ProducedLine>,
    pub reduced: Padded<AtomicU64>,
    pub consumed: Padded<AtomicU64>,
    pub aborted: Padded<AtomicU32>,
    pub epoch: Padded<AtomicU32>,
    pub sleepers: Padded<AtomicU32>,
    /// Nonzero while this rank is in a step over TCP (a mixed group's representatives), so that
    /// a local rank waiting for it can tell it from a stuck rank (group.rs, `wait_for`).
    pub remote_wait: Padded<AtomicU32>,
    pub abort_len: Padded<AtomicU64>,
    /// UTF-8 bytes of the failure, packed little-endian into words.
    pub abort_message: [AtomicU64; ABORT_MESSAGE_BYTES / 8],
}

const _: () = assert!(std::mem::size_of::<RankHeader>() <= HEADER_BYTES);

impl RankHeader {
    pub fn init(&self, pid: u64, segment_fd: u64) {
        self.pid.0.store(pid, Ordering::Relaxed);
        self.segment_fd.0.store(segment_fd, Ordering::Relaxed);
        self.magic.0.store(MAGIC, Ordering::Release);
    }

    pub fn is_valid(&self) -> bool {
        self.magic.0.load(Ordering::Acquire) == MAGIC
    }

    /// Records why this rank failed (cut to ABORT_MESSAGE_BYTES), then raises the flag.
    pub fn set_aborted(&self, why: u32, message: &str) {
        let bytes = &message.as_bytes()[..message.len().min(ABORT_MESSAGE_BYTES)];
        for (i, word) in self.abort_message.iter().enumerate() {
            let mut w = [0u8; 8];
            for (j, b) in w.iter_mut().enumerate() {
                *b = bytes.get(i * 8 + j).copied().unwrap_or(0);
            }
            word.store(u64::from_le_bytes(w), Ordering::Relaxed);
        }
        self.abort_len.0.store(bytes.len() as u64, Ordering::Relaxed);
        self.aborted.0.store(why, Ordering::Release);
    }

    /// The peer's abort message; its length is bounded here, whatever the peer wrote.
    pub fn abort_message(&self) -> String {
        let len = (self.abort_len.0.load(Ordering::Relaxed) as usize).min(ABORT_MESSAGE_BYTES);
        let bytes: Vec<u8> = self.abort_message.iter().flat_map(|w| w.load(Ordering::Relaxed).to_le_bytes()).take(len).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

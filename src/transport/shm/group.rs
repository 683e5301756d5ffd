//! A group's view of all segments, and the counter protocol collectives use on them.
//!
//! Terms: the group's work is cut into *blocks*, numbered 1, 2, … for the life of the group
//! (every rank numbers them the same way, because every rank runs the same operations). Block
//! g uses data slot g % 2 of each segment. For each block a rank publishes three counters:
//! `Produced` (my slot holds my input for block g), `Reduced` (my slot holds my reduced part),
//! `Consumed` (I have finished reading peers' slots for block g). Before writing its slot for
//! block g a rank waits until every rank has `Consumed` ≥ g − 2: the slot's previous user,
//! block g − 2, is finished everywhere. That gives double buffering: a rank can fill block
//! g + 1 while peers still read block g.
//!
//! Waiting spins (then yields the core) for `XCCL_RS_SPIN_US`, then sleeps on the group futex (rank 0's `epoch`),
//! waking every 100 ms to check the deadline, the group's abort switch (abort.rs), peers' abort flags and whether peers' processes
//! still exist.

use std::sync::atomic::{AtomicU32, Ordering, fence};
use std::time::{Duration, Instant};

use std::sync::Arc;

use super::futex;
use super::heap::{Heap, PeerHeap};
use super::layout::{ABORT_CLOSED, ABORT_FAILED, Code, Desc, RankHeader};
use super::segment::Segment;
use super::settings::ShmSettings;
use crate::error::{CommError, ErrorKind, Result};
use crate::par::Par;
use crate::keys::Key;
use crate::rendezvous::{Store, rendezvous_error};
use crate::transport::{OpCtx, RawBuf};

/// Turns of the busy spin (a `pause` each, then a poll) before a waiting rank starts yielding
/// its core between polls.
const SPIN_TURNS: u32 = 512;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Counter {
    Produced,
    Reduced,
    Consumed,
}

/// How much longer a rank waits, once, when every rank it waits for is in a step over TCP: long
/// enough for their own timeout, and their TCP timeout round (transport/tcp/timeout_round.rs),
/// to come first.
pub const WAITING_PEER_GRACE: Duration = Duration::from_millis(1500);

/// Marks this rank as in a step over TCP (RankHeader::remote_wait) while it lives.
struct RemoteWait<'a>(&'a AtomicU32);

impl<'a> RemoteWait<'a> {
    fn new(flag: &'a AtomicU32) -> RemoteWait<'a> {
        flag.store(1, Ordering::Release);
        RemoteWait(flag)
    }
}

impl Drop for RemoteWait<'_> {
    fn drop(&mut self) {
        self.0.store(0, Ordering::Release);
    }
}

/// The shared-memory group of some ranks on one host: every rank of a single-host group, or
/// one host's ranks of a group that spans several (see hosts.rs). `rank` and `size`, and every
/// rank argument of the methods, are *local* indices 0..size; `members` maps them to the
/// group's ranks, which error messages name.
pub struct ShmGroup {
    rank: usize,
    size: usize,
    members: Vec<usize>,
    chunk: usize,
    segments: Vec<Segment>,
    next_block: u64,
    spin: Duration,
    /// This rank's threads for large block steps.
    par: Par,
    /// Peers' pids are meaningful here (same pid namespace), so a vanished pid means a dead rank.
    pids_visible: bool,
    /// This rank's heap (heap.rs), and every peer's mapped here (None at this rank's index).
    heap: Option<Arc<Heap>>,
    peer_heaps: Vec<Option<PeerHeap>>,
    /// Every rank has a heap and has mapped every peer's: the same on every rank (agreed at
    /// set-up), so every rank takes the same path through a collective.
    zero_copy: bool,
    zero_copy_ops: u64,
    last_zero_copy_seq: Option<u64>,
    /// Every rank can read every peer's memory with cross-memory attach (cma.rs), probed and
    /// agreed at set-up; with it, each peer's pid.
    cma: Option<Vec<i32>>,
    cma_ops: u64,
    /// `ShmSettings::oneshot_bytes`.
    oneshot_bytes: usize,
    /// `ShmSettings::pipeline_chunk_log`.
    pipeline_chunk_log: u8,
}

/// What identifies "this host and this /dev/shm" (NCCL's shm transport checks both).
pub fn host_identity() -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(super::segment::SHM_DIR).ok()?;
    let mut buf = [0u8; 256];
    // SAFETY: `buf` is writable for its whole length.
    if unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } != 0 {
        return None;
    }
    let len = buf.iter().position(|&c| c == 0).unwrap_or(buf.len());
    Some(format!("{}|{}|{}", String::from_utf8_lossy(&buf[..len]), meta.dev(), meta.ino()))
}

/// Every segment's pid as a kernel pid, if all are (cross-memory attach addresses them).
fn segments_pids(segments: &[Segment]) -> Option<Vec<i32>> {
    segments.iter().map(|s| i32::try_from(s.header().pid.0.load(Ordering::Relaxed)).ok()).collect()
}

fn pid_alive(pid: u64) -> bool {
    if pid == 0 || pid > i32::MAX as u64 {
        return false;
    }
    // SAFETY: signal 0 only checks for existence and permission; it sends nothing.
    let rc = unsafe { libc::kill(pid as libc::pid_t, 0) };
    if rc != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH) {
        return false;
    }
    // A killed process stays a zombie until its parent reaps it: that is dead too.
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !stat.rsplit_once(')').is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
        Err(_) => true,
    }
}

impl ShmGroup {
    /// Creates this rank's segment, maps every peer's, and unlinks ours once all ranks have
    /// mapped everything. `members` are the group ranks of the local indices (`rank` is this
    /// rank's local index); `namespace` keeps the store keys of different hosts' groups apart
    /// (empty for a single-host group, whose keys are then `xccl_rs/shm/<rank>`).
    pub fn setup(store: &dyn Store, members: &[usize], rank: usize, namespace: &str, settings: ShmSettings, par: Par) -> Result<ShmGroup> {
        let ShmSettings { slot_bytes: chunk, spin, timeout, heap_bytes, cma, .. } = settings;
        let size = members.len();
        let me = members[rank];
        let (own, name) = Segment::create(chunk)?;
        store.set(&Key::ShmSegment { namespace, rank }.text(), name.as_bytes())?;
        // Where this process sees its own header: peers probe cross-memory attach with it.
        let own_header = own.header() as *const RankHeader as u64;
        store.set(&Key::ShmCma { namespace, rank }.text(), own_header.to_string().as_bytes())?;
        // A heap that cannot be made (address space limits, say) leaves the group without
        // zero-copy, not without shared memory.
        let heap = match (heap_bytes >= super::heap::HEAP_PAGE).then(|| Heap::create(heap_bytes)).transpose() {
            Ok(heap) => heap.map(|(heap, name)| (Arc::new(heap), name)),
            Err(e) => {
                tracing::warn!("rank {me}: no shared-memory heap, so no zero-copy collectives: {}", e.message);
                None
            }
        };
        let heap_name = heap.as_ref().map_or(String::new(), |(_, name)| name.clone());
        store.set(&Key::ShmHeap { namespace, rank }.text(), heap_name.as_bytes())?;
        let heap = heap.map(|(heap, _)| heap);
        let mut segments = Vec::with_capacity(size);
        let mut own = Some(own);
        for (peer, &member) in members.iter().enumerate() {
            if peer == rank {
                segments.push(own.take().expect("own segment placed once"));
                continue;
            }
            let peer_name = store.get(&Key::ShmSegment { namespace, rank: peer }.text(), timeout).map_err(|e| rendezvous_error(me, member, e))?;
            segments.push(Segment::open(&String::from_utf8_lossy(&peer_name), chunk)?);
        }
        let mut peer_heaps: Vec<Option<PeerHeap>> = Vec::with_capacity(size);
        for (peer, &member) in members.iter().enumerate() {
            if peer == rank || heap.is_none() {
                peer_heaps.push(None);
                continue;
            }
            let name = store.get(&Key::ShmHeap { namespace, rank: peer }.text(), timeout).map_err(|e| rendezvous_error(me, member, e))?;
            let name = String::from_utf8_lossy(&name);
            // A peer's heap that cannot be mapped here (an address-space limit, say) leaves the
            // group without zero-copy: this rank then says so below, and every rank agrees.
            peer_heaps.push(match name.is_empty() {
                true => None,
                false => PeerHeap::open(&name)
                    .map_err(|e| {
                        tracing::warn!("rank {me}: rank {member}'s heap is not mapped, so no zero-copy collectives: {}", e.message)
                    })
                    .ok(),
            });
        }
        let all_heaps = heap.is_some() && peer_heaps.iter().enumerate().all(|(peer, h)| peer == rank || h.is_some());
        let reads_peers = cma && Self::probe_cma(store, members, rank, namespace, &segments, timeout)?;
        // "h": this rank can take part in zero-copy collectives; "c": it can read every peer
        // by cross-memory attach. Every rank must see the same.
        let mut said = vec![if all_heaps { b'h' } else { b'1' }];
        if reads_peers {
            said.push(b'c');
        }
        store.set(&Key::ShmMapped { namespace, rank }.text(), &said)?;
        let (mut zero_copy, mut all_read) = (true, true);
        for (peer, &member) in members.iter().enumerate() {
            let mapped =
                store.get(&Key::ShmMapped { namespace, rank: peer }.text(), timeout).map_err(|e| rendezvous_error(me, member, e))?;
            zero_copy &= mapped.first() == Some(&b'h');
            all_read &= mapped.get(1) == Some(&b'c');
        }
        segments[rank].unlink();
        if let Some(heap) = &heap {
            heap.unlink();
        }
        for (peer, seg) in segments.iter().enumerate() {
            if !seg.header().is_valid() {
                return Err(CommError::io(format!("rank {}'s shared-memory segment is not initialized", members[peer])));
            }
        }
        let pids_visible = segments.iter().all(|s| pid_alive(s.header().pid.0.load(Ordering::Relaxed)));
        Ok(ShmGroup {
            rank,
            size,
            members: members.to_vec(),
            chunk,
            next_block: 1,
            spin,
            par,
            pids_visible,
            heap,
            peer_heaps,
            zero_copy,
            zero_copy_ops: 0,
            last_zero_copy_seq: None,
            cma: all_read.then(|| segments_pids(&segments)).flatten(),
            cma_ops: 0,
            segments,
            oneshot_bytes: settings.oneshot_bytes,
            pipeline_chunk_log: settings.pipeline_chunk_log,
        })
    }

    /// Whether this rank can read every peer's memory by cross-memory attach: each peer's
    /// header, read through the address the peer published, must equal this rank's mapping of
    /// it (the same shared memory). A peer in another pid namespace, a ptrace policy that
    /// forbids it, or a seccomp filter all make it false.
    fn probe_cma(
        store: &dyn Store,
        members: &[usize],
        rank: usize,
        namespace: &str,
        segments: &[Segment],
        timeout: Duration,
    ) -> Result<bool> {
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
            let readable = i32::try_from(pid).is_ok_and(|p| {
                super::cma::probe(p, addr, &expect[..8])
                    && addr.checked_add(pid_offset).is_some_and(|a| super::cma::probe(p, a, &expect[8..]))
            });
            if !readable {
                tracing::debug!("rank {me}: cannot read rank {member} (pid {pid}) by cross-memory attach; collectives use the slots");
            }
            all &= readable;
        }
        Ok(all)
    }

    pub fn rank(&self) -> usize {
        self.rank
    }
    /// The group's rank of local rank `r`, for messages.
    pub fn group_rank(&self, r: usize) -> usize {
        self.members[r]
    }
    pub fn size(&self) -> usize {
        self.size
    }
    /// Blocks this group has used so far (each moves up to one slot per rank): how much work
    /// went through shared memory, for diagnostics and tests.
    pub fn blocks_used(&self) -> u64 {
        self.next_block - 1
    }
    /// This rank's heap, where it has one (tensors allocated from it can be read in place).
    pub fn heap(&self) -> Option<&Arc<Heap>> {
        self.heap.as_ref()
    }

    /// Whether collectives may read peers' buffers in their heaps: the same on every rank.
    pub fn zero_copy(&self) -> bool {
        self.zero_copy
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

    /// Whether collectives may read peers' buffers by cross-memory attach: the same on every
    /// rank.
    pub fn cma(&self) -> bool {
        self.cma.is_some()
    }

    /// Operations that ran by cross-memory attach so far (diagnostics and tests).
    pub fn cma_ops(&self) -> u64 {
        self.cma_ops
    }

    pub fn count_cma_op(&mut self) {
        self.cma_ops += 1;
    }

    /// After rank `r`'s `Produced` ≥ g: its pid and the address, in its own memory, of the
    /// first buffer of the op (`describe_heap` publishes it with the heap offset).
    pub fn cma_peer(&self, g: u64, r: usize) -> (i32, u64) {
        let pids = self.cma.as_ref().expect("cross-memory attach was agreed");
        (pids[r], self.header(r).line.0.cma_addr[(g % 2) as usize].load(Ordering::Relaxed))
    }

    /// Records, with the description of the op starting at block `g`, where this rank's
    /// `views` of the op lie in its heap: the first one's offset and their spacing, when all
    /// lie in the heap, have equal lengths and are evenly spaced without overlapping; else
    /// "not in the heap". Also the first view's address in this process, for peers that read
    /// it by cross-memory attach.
    pub fn describe_heap(&self, g: u64, views: &[RawBuf]) {
        let placed = || -> Option<(u64, u64)> {
            let heap = self.heap.as_ref()?;
            let first = *views.first()?;
            let at = heap.offset_of(first)?;
            let stride = views.get(1).map_or(first.len(), |v| (v.ptr() as usize).wrapping_sub(first.ptr() as usize));
            let evenly = views.iter().enumerate().all(|(k, v)| {
                v.len() == first.len()
                    && heap.offset_of(*v).is_some()
                    && (v.ptr() as usize).wrapping_sub(first.ptr() as usize) == k.wrapping_mul(stride)
            });
            (evenly && (views.len() == 1 || stride >= first.len())).then_some((at as u64 + 1, stride as u64))
        };
        let (at, stride) = placed().unwrap_or((0, 0));
        let line = &self.header(self.rank).line.0;
        line.heap_at[(g % 2) as usize].store(at, Ordering::Relaxed);
        line.heap_stride[(g % 2) as usize].store(stride, Ordering::Relaxed);
        line.cma_addr[(g % 2) as usize].store(views.first().map_or(0, |v| v.ptr() as u64), Ordering::Relaxed);
    }

    /// After every rank's `Produced` ≥ g (with `describe_heap`): whether every rank's views of
    /// the op lie in its heap. Every rank reads the same published values, so all decide alike.
    pub fn all_in_heap(&self, g: u64) -> bool {
        (0..self.size).all(|r| self.in_heap(g, r))
    }

    /// After rank `r`'s `Produced` ≥ g: whether `r` said its views of the op lie in its heap.
    pub fn in_heap(&self, g: u64, r: usize) -> bool {
        self.zero_copy && self.header(r).line.0.heap_at[(g % 2) as usize].load(Ordering::Relaxed) != 0
    }

    /// After every rank's `Produced` ≥ g: peer `r`'s `count` views of `len` bytes, read in
    /// place in its heap, or None if it said they are not there. A peer's ranges are used only
    /// once they lie inside its heap; one outside is an error (a corrupt or hostile peer), not
    /// a read.
    pub fn heap_views(&self, g: u64, r: usize, count: usize, len: usize) -> Result<Option<Vec<RawBuf>>> {
        debug_assert!(r != self.rank, "a rank's own views are its op's buffers");
        let line = &self.header(r).line.0;
        let at = line.heap_at[(g % 2) as usize].load(Ordering::Relaxed);
        if at == 0 || !self.zero_copy {
            return Ok(None);
        }
        let stride = line.heap_stride[(g % 2) as usize].load(Ordering::Relaxed);
        let outside = || {
            CommError::io(format!(
                "rank {} published {count} buffers of {len} bytes at offset {} (spacing {stride}) of its heap, which lie outside it",
                self.members[r],
                at - 1
            ))
        };
        let heap = self.peer_heaps[r].as_ref().ok_or_else(outside)?;
        let offset = usize::try_from(at - 1).map_err(|_| outside())?;
        let stride = usize::try_from(stride).map_err(|_| outside())?;
        (0..count)
            .map(|k| k.checked_mul(stride).and_then(|d| d.checked_add(offset)).and_then(|o| heap.range(o, len)).ok_or_else(outside))
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }

    /// This rank's threads for the copies and reductions of a block step.
    pub fn par(&self) -> &Par {
        &self.par
    }

    /// Bytes of one data slot.
    pub fn chunk(&self) -> usize {
        self.chunk
    }

    /// What each rank of a one-shot all-reduce may read (`ShmSettings::oneshot_bytes`).
    pub fn oneshot_bytes(&self) -> usize {
        self.oneshot_bytes
    }

    /// log2 of the pipeline's chunk size, part of every op's description.
    pub fn pipeline_chunk_log(&self) -> u8 {
        self.pipeline_chunk_log
    }

    /// Reserves `blocks` consecutive block numbers for one operation; returns the first.
    pub fn begin_op(&mut self, blocks: u64) -> u64 {
        let first = self.next_block;
        self.next_block += blocks;
        first
    }

    /// `rank`'s data slot for block `g`, `chunk` bytes.
    pub fn slot(&self, rank: usize, g: u64) -> RawBuf {
        // SAFETY: the slot lies inside a mapping that lives as long as `self`; who writes and
        // who reads it when is governed by the counter protocol above, which every algorithm
        // follows (a slot is written only by its owner, between `Consumed` ≥ g − 2 everywhere
        // and its `Produced`/`Reduced` for g; read by peers only after those).
        unsafe { RawBuf::new(self.segments[rank].slot_ptr((g % 2) as usize), self.chunk) }
    }

    fn header(&self, rank: usize) -> &RankHeader {
        self.segments[rank].header()
    }

    fn counter(&self, rank: usize, c: Counter) -> u64 {
        let h = self.header(rank);
        let a = match c {
            Counter::Produced => &h.line.0.produced,
            Counter::Reduced => &h.reduced.0,
            Counter::Consumed => &h.consumed.0,
        };
        a.load(Ordering::Acquire)
    }

    /// Announces that this rank finished step `c` of block `g`.
    pub fn publish(&self, c: Counter, g: u64) {
        let h = self.header(self.rank);
        let a = match c {
            Counter::Produced => &h.line.0.produced,
            Counter::Reduced => &h.reduced.0,
            Counter::Consumed => &h.consumed.0,
        };
        a.store(g, Ordering::Release);
        self.wake();
    }

    /// Wakes the ranks asleep on the group futex, if any. The common case, every waiter still
    /// spinning, costs a fence and a load of a line that only sleepers write: no rank writes a
    /// shared line per publish (an `epoch` increment on every publish made all ranks of the
    /// group contend for rank 0's line, several times per op).
    ///
    /// Dekker-style with `wait_for`: we store the counter, fence, read `sleepers`; a waiter
    /// increments `sleepers`, fences, re-reads the counters, then sleeps only while `epoch`
    /// still has the value it read before that re-check. So either we see the sleeper (and bump
    /// `epoch` and wake it: its futex wait then returns at once or is woken), or it sees our
    /// counter and does not sleep.
    fn wake(&self) {
        let ctl = self.header(0);
        fence(Ordering::SeqCst);
        if ctl.sleepers.0.load(Ordering::Relaxed) > 0 {
            ctl.epoch.0.fetch_add(1, Ordering::SeqCst);
            futex::wake_all(&ctl.epoch.0);
        }
    }

    /// Records this rank's description of the operation starting at block `g`.
    pub fn describe(&self, g: u64, desc: Desc) {
        self.header(self.rank).line.0.desc[(g % 2) as usize].store(desc);
    }

    /// After every rank's `Produced` ≥ g: checks that all ranks described the same operation.
    /// Every rank runs the same comparison, so a mismatch fails every rank at once.
    pub fn check_descs(&self, g: u64, ctx: &OpCtx) -> Result<()> {
        let mine = self.header(self.rank).line.0.desc[(g % 2) as usize].load();
        for peer in (0..self.size).filter(|&p| p != self.rank) {
            let theirs = self.header(peer).line.0.desc[(g % 2) as usize].load();
            if theirs != mine {
                let what = if theirs.seq != mine.seq || theirs.kind != mine.kind {
                    "ranks must call the same collectives in the same order"
                } else if theirs.dtype != mine.dtype {
                    "dtype mismatch"
                } else if theirs.chunk_log != mine.chunk_log {
                    "XCCL_RS_PIPELINE_CHUNK_BYTES differs between the ranks"
                } else if theirs.reduce != mine.reduce {
                    "reduce op mismatch"
                } else if theirs.count != mine.count {
                    "size mismatch"
                } else {
                    "root mismatch"
                };
                return Err(CommError::mismatch(format!(
                    "{}: rank {} called {}, rank {} called {} ({what})",
                    ctx.describe(),
                    self.members[peer],
                    describe_desc(&theirs),
                    self.members[self.rank],
                    describe_desc(&mine)
                )));
            }
        }
        Ok(())
    }

    /// Waits until every rank in `ranks` has counter `c` ≥ g.
    pub fn wait_for(&self, c: Counter, g: u64, ranks: impl Iterator<Item = usize> + Clone, ctx: &OpCtx) -> Result<()> {
        let lagging = || ranks.clone().filter(|&r| self.counter(r, c) < g);
        // Counters only grow, so ranks found done stay done: the spin re-reads only from the
        // first rank still lagging (one cache line per poll while waiting for it).
        let mut done_before = 0usize;
        let mut all_done = || match ranks.clone().enumerate().skip(done_before).find(|&(_, r)| self.counter(r, c) < g) {
            Some((i, _)) => {
                done_before = i;
                false
            }
            None => true,
        };
        if all_done() {
            return Ok(());
        }
        // Spin briefly, polling on every turn (a peer's publish is seen within a cache-line
        // transfer), then keep polling while yielding the core (a peer may need it: ranks can
        // outnumber cores), then sleep on the futex. Bounded by `XCCL_RS_SPIN_US` in all.
        // The clock is first read after 64 turns: most waits end sooner, and a clock read
        // costs more than a poll.
        let mut spin_until: Option<Instant> = None;
        let mut n = 0u32;
        loop {
            if n < SPIN_TURNS {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
            n = n.saturating_add(1);
            if all_done() {
                return Ok(());
            }
            if n % 64 == 0 || n > SPIN_TURNS {
                let now = Instant::now();
                match spin_until {
                    None => spin_until = Some(now + self.spin),
                    Some(until) if now >= until => break,
                    Some(_) => {}
                }
            }
        }
        let ctl = self.header(0);
        let mut next_liveness_check = Instant::now();
        let mut deadline = ctx.deadline;
        let mut extended = false;
        loop {
            let epoch = ctl.epoch.0.load(Ordering::SeqCst);
            if lagging().next().is_none() {
                return Ok(());
            }
            if let Some(e) = ctx.aborted() {
                return Err(e);
            }
            let now = Instant::now();
            if now >= next_liveness_check {
                self.check_peers(lagging(), ctx)?;
                next_liveness_check = now + Duration::from_millis(100);
            }
            // The ranks we wait for all wait on remote ranks: they will time out on those and say
            // whom (their abort is seen within 100 ms), which names the right rank here too;
            // blaming them now would not. (Local ranks never wait for each other alone: every
            // op begins by waiting for every local rank's description.)
            if now >= deadline && !extended && lagging().all(|r| self.in_remote_wait(r)) {
                deadline += WAITING_PEER_GRACE;
                extended = true;
            }
            if now >= deadline {
                let silent: Vec<usize> = lagging().map(|r| self.members[r]).collect();
                let waits: Vec<String> = lagging().filter_map(|r| self.waits_of(r)).collect();
                let waits = if waits.is_empty() { String::new() } else { format!(" ({})", waits.join(", ")) };
                return Err(CommError::new(
                    ErrorKind::Timeout,
                    format!(
                        "{}: timed out after {} ms; ranks not heard from: {silent:?}{waits} (is a rank stuck, dead, or in a different collective?)",
                        ctx.describe(),
                        ctx.timeout.as_millis()
                    ),
                ));
            }
            ctl.sleepers.0.fetch_add(1, Ordering::SeqCst);
            fence(Ordering::SeqCst); // pairs with the fence in `wake`
            if lagging().next().is_some() {
                let nap = deadline.saturating_duration_since(now).min(Duration::from_millis(100));
                futex::wait(&ctl.epoch.0, epoch, nap);
            }
            ctl.sleepers.0.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Runs `f`, a step over TCP, with this rank marked as waiting on it (see `wait_for`).
    pub fn in_remote_step<R>(&self, f: impl FnOnce() -> R) -> R {
        let _waiting = RemoteWait::new(&self.header(self.rank).remote_wait.0);
        f()
    }

    /// Whether local rank `r` is in a step over TCP (in_remote_step).
    fn in_remote_wait(&self, r: usize) -> bool {
        self.header(r).remote_wait.0.load(Ordering::Acquire) != 0
    }

    /// What a rank in `lagging` is waiting for, for a timeout message.
    fn waits_of(&self, local: usize) -> Option<String> {
        self.in_remote_wait(local).then(|| format!("rank {} waits for a remote rank", self.members[local]))
    }

    pub fn wait_all(&self, c: Counter, g: u64, ctx: &OpCtx) -> Result<()> {
        self.wait_for(c, g, 0..self.size, ctx)
    }

    /// Any rank that failed (and so aborted the group: a failure on any rank revokes it, also
    /// one that already did its part of this op, e.g. aborted from another thread) fails the
    /// wait; so does a rank we wait for that closed its communicator or whose process is gone.
    /// Only lagging ranks count for those: a rank that already did its part of this operation
    /// may legitimately have moved on, or exited.
    fn check_peers(&self, lagging: impl Iterator<Item = usize>, ctx: &OpCtx) -> Result<()> {
        for local in (0..self.size).filter(|&r| r != self.rank) {
            let h = self.header(local);
            if h.aborted.0.load(Ordering::Acquire) == ABORT_FAILED {
                return Err(CommError::peer(format!(
                    "{}: rank {} failed and aborted the group: {}",
                    ctx.describe(),
                    self.members[local],
                    h.abort_message()
                )));
            }
        }
        for local in lagging {
            let h = self.header(local);
            let peer = self.members[local];
            match h.aborted.0.load(Ordering::Acquire) {
                ABORT_CLOSED => {
                    return Err(CommError::peer(format!(
                        "{}: rank {peer} closed its communicator while rank {} waited for it in this collective",
                        ctx.describe(),
                        self.members[self.rank]
                    )));
                }
                _ => {}
            }
            let pid = h.pid.0.load(Ordering::Relaxed);
            if self.pids_visible && !pid_alive(pid) {
                return Err(CommError::peer(format!(
                    "{}: rank {peer} (pid {pid}) exited and closed its connections while rank {} waited for it (did it crash?)",
                    ctx.describe(),
                    self.members[self.rank]
                )));
            }
        }
        Ok(())
    }

    /// Marks this rank failed, so peers waiting on it fail within 100 ms instead of at their
    /// timeout.
    pub fn abort(&self, message: &str) {
        self.header(self.rank).set_aborted(ABORT_FAILED, message);
        self.wake();
    }
}

/// "allreduce of 1000 float32 (SUM) #5 root 0" for mismatch messages.
fn describe_desc(d: &Desc) -> String {
    let op = match d.op() {
        Code::Known(k) => k.name().to_string(),
        Code::Unknown(c) => format!("an unknown op (code {c})"),
    };
    let dtype = match d.dtype() {
        Code::Known(t) => t.name().to_string(),
        Code::Unknown(c) => format!("an unknown dtype (code {c})"),
    };
    let reduce = match d.reduce() {
        Code::Known(r) => r.name().to_string(),
        Code::Unknown(c) => format!("code {c}"),
    };
    format!("{op} #{} with {} elements of {dtype} (op {reduce}, root {})", d.seq, d.count, d.root as i64)
}

impl Drop for ShmGroup {
    /// Tells ranks that still wait on this one that it is gone (unless it already failed).
    fn drop(&mut self) {
        let own = self.header(self.rank);
        if own.aborted.0.load(Ordering::Relaxed) == 0 {
            own.set_aborted(ABORT_CLOSED, "");
        }
        self.wake();
    }
}

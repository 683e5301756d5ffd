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
//! Waiting spins (then yields the core) for `XCCL_RS_SPIN_US`, then sleeps on the group futex
//! (rank 0's `epoch`), waking every 100 ms to check the deadline, the group's abort switch
//! (abort.rs), peers' abort flags and whether peers' processes still exist.
//!
//! Besides the counters, the group holds each op's description (desc.rs), checked across ranks
//! on the op's first block, and where each rank's buffers of the op lie (`Placement`). How the
//! group is set up is setup.rs; what it can do besides the slots, it reports (heap.rs, cma.rs).

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};
use std::time::{Duration, Instant};

use super::cma::CmaPeers;
use super::desc::Desc;
use super::futex;
use super::heap::Heaps;
use super::layout::{ABORT_CLOSED, ABORT_FAILED, ArenaId, Placement, RankHeader};
use super::segment::Segment;
use super::settings::ShmSettings;
use crate::error::{CommError, ErrorKind, Result};
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
/// group's ranks, which error messages name. Set up by setup.rs, which also gives it what the
/// group can do besides the slots: read tensors in the ranks' heaps, or peers' memory by
/// cross-memory attach ([`heaps`](Self::heaps), [`cma`](Self::cma)).
pub struct ShmGroup {
    rank: usize,
    members: Vec<usize>,
    settings: ShmSettings,
    segments: Vec<Segment>,
    next_block: u64,
    /// Peers' pids are meaningful here (same pid namespace), so a vanished pid means a dead rank.
    pids_visible: bool,
    heaps: Option<Heaps>,
    cma: Option<CmaPeers>,
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
    /// The group of every rank's `segments` (index = local rank, all mapped and checked),
    /// `members` their group ranks, `rank` this rank's local index.
    pub(super) fn new(
        rank: usize,
        members: &[usize],
        settings: ShmSettings,
        segments: Vec<Segment>,
        heaps: Option<Heaps>,
        cma: Option<CmaPeers>,
    ) -> ShmGroup {
        let pids_visible = segments.iter().all(|s| pid_alive(s.header().pid.0.load(Ordering::Relaxed)));
        ShmGroup { rank, members: members.to_vec(), settings, segments, next_block: 1, pids_visible, heaps, cma }
    }

    pub fn rank(&self) -> usize {
        self.rank
    }
    /// The group's rank of local rank `r`, for messages.
    pub fn group_rank(&self, r: usize) -> usize {
        self.members[r]
    }
    pub fn size(&self) -> usize {
        self.members.len()
    }
    /// Blocks this group has used so far (each moves up to one slot per rank): how much work
    /// went through shared memory, for diagnostics and tests.
    pub fn blocks_used(&self) -> u64 {
        self.next_block - 1
    }
    /// This rank's heap and, where the group agreed on zero-copy, its peers' (heap.rs); None
    /// where this rank has no heap.
    pub fn heaps(&self) -> Option<&Heaps> {
        self.heaps.as_ref()
    }

    pub fn heaps_mut(&mut self) -> Option<&mut Heaps> {
        self.heaps.as_mut()
    }

    /// The peers as cross-memory attach reads them (cma.rs), where every rank can read every
    /// peer: the same on every rank.
    pub fn cma(&self) -> Option<&CmaPeers> {
        self.cma.as_ref()
    }

    pub fn cma_mut(&mut self) -> Option<&mut CmaPeers> {
        self.cma.as_mut()
    }

    /// Bytes of one data slot.
    pub fn slot_bytes(&self) -> usize {
        self.settings.slot_bytes
    }

    /// What each rank of a one-shot all-reduce may read (`ShmSettings::oneshot_bytes`).
    pub fn oneshot_bytes(&self) -> usize {
        self.settings.oneshot_bytes
    }

    /// log2 of the pipeline's chunk size, part of every op's description.
    pub fn pipeline_chunk_log(&self) -> u8 {
        self.settings.pipeline_chunk_log
    }

    /// Reserves `blocks` consecutive block numbers for one operation; returns the first.
    pub fn begin_op(&mut self, blocks: u64) -> u64 {
        let first = self.next_block;
        self.next_block += blocks;
        first
    }

    /// `rank`'s data slot for block `g`, `slot_bytes` bytes.
    pub fn slot(&self, rank: usize, g: u64) -> RawBuf {
        // SAFETY: the slot lies inside a mapping that lives as long as `self`; who writes and
        // who reads it when is governed by the counter protocol above, which every algorithm
        // follows (a slot is written only by its owner, between `Consumed` ≥ g − 2 everywhere
        // and its `Produced`/`Reduced` for g; read by peers only after those).
        unsafe { RawBuf::new(self.segments[rank].slot_ptr((g % 2) as usize), self.slot_bytes()) }
    }

    fn header(&self, rank: usize) -> &RankHeader {
        self.segments[rank].header()
    }

    /// Rank `rank`'s word of counter `c`.
    fn counter_word(&self, rank: usize, c: Counter) -> &AtomicU64 {
        let h = self.header(rank);
        match c {
            Counter::Produced => &h.line.0.produced,
            Counter::Reduced => &h.reduced.0,
            Counter::Consumed => &h.consumed.0,
        }
    }

    fn counter(&self, rank: usize, c: Counter) -> u64 {
        self.counter_word(rank, c).load(Ordering::Acquire)
    }

    /// Announces that this rank finished step `c` of block `g`.
    pub fn publish(&self, c: Counter, g: u64) {
        self.counter_word(self.rank, c).store(g, Ordering::Release);
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

    /// Records, with the description of the op starting at block `g`, where this rank's
    /// buffers of it lie.
    pub fn place(&self, g: u64, placement: Placement) {
        self.header(self.rank).line.0.store_placement((g % 2) as usize, placement);
    }

    /// Records which file holds this rank's staging arena, before it publishes an op placed in it.
    pub fn publish_arena(&self, id: ArenaId) {
        self.header(self.rank).arena.0.store(id);
    }

    /// After rank `r`'s `Produced` for an op it placed in its arena: its process and arena.
    pub fn arena_of(&self, r: usize) -> (u64, ArenaId) {
        let header = self.header(r);
        (header.pid.0.load(Ordering::Relaxed), header.arena.0.load())
    }

    /// After rank `r`'s `Produced` ≥ g: where `r` said its buffers of the op lie.
    pub fn placement(&self, g: u64, r: usize) -> Placement {
        self.header(r).line.0.load_placement((g % 2) as usize)
    }

    /// After every rank's `Produced` ≥ g: checks that all ranks described the same operation.
    /// Every rank runs the same comparison, so a mismatch fails every rank at once.
    pub fn check_descs(&self, g: u64, ctx: &OpCtx) -> Result<()> {
        let mine = self.header(self.rank).line.0.desc[(g % 2) as usize].load();
        for peer in (0..self.size()).filter(|&p| p != self.rank) {
            let theirs = self.header(peer).line.0.desc[(g % 2) as usize].load();
            if theirs != mine {
                return Err(CommError::mismatch(format!(
                    "{}: rank {} called {}, rank {} called {} ({})",
                    ctx.describe(),
                    self.members[peer],
                    theirs.describe(),
                    self.members[self.rank],
                    mine.describe(),
                    mine.mismatch(&theirs)
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
            if n.is_multiple_of(64) || n > SPIN_TURNS {
                let now = Instant::now();
                match spin_until {
                    None => spin_until = Some(now + self.settings.spin),
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
        self.wait_for(c, g, 0..self.size(), ctx)
    }

    /// Any rank that failed (and so aborted the group: a failure on any rank revokes it, also
    /// one that already did its part of this op, e.g. aborted from another thread) fails the
    /// wait; so does a rank we wait for that closed its communicator or whose process is gone.
    /// Only lagging ranks count for those: a rank that already did its part of this operation
    /// may legitimately have moved on, or exited.
    fn check_peers(&self, lagging: impl Iterator<Item = usize>, ctx: &OpCtx) -> Result<()> {
        for local in (0..self.size()).filter(|&r| r != self.rank) {
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
            if h.aborted.0.load(Ordering::Acquire) == ABORT_CLOSED {
                return Err(CommError::peer(format!(
                    "{}: rank {peer} closed its communicator while rank {} waited for it in this collective",
                    ctx.describe(),
                    self.members[self.rank]
                )));
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

//! The engine of the OFI transport: posts a phase's headers and payloads, then reads the
//! completion queue until every post has completed, checking each header as it arrives.
//!
//! Waiting: the queue is polled for `XCCL_RS_SPIN_US`, then the progress thread sleeps in
//! `poll(2)` on the queue's file descriptor (after fi_trywait says it may), the TCP control
//! connections (a peer's abort frame or its death end the wait: tcp `watch_control`) and the
//! group's abort switch. A provider without a descriptor (efa; `XCCL_RS_OFI_WAIT_FD=0`) is
//! busy-polled, as aws-ofi-nccl and MPICH do: the thread yields its core between looks, so
//! that ranks outnumbering cores still run, and looks at the control connections every
//! millisecond; after [`BUSY_POLL`] with nothing completed it polls in 1 ms sleeps. A peer whose
//! control connection closes (it exited) is reported once the queue, read a little longer,
//! has not finished the phase: its last messages may still be there.
//!
//! A phase that fails (a mismatch, a peer's abort, the timeout) cancels its outstanding posts and
//! reads their completions before it returns, so that no buffer of the phase is the provider's
//! any more; if they do not all come back within [`RECLAIM`], the endpoint is given up
//! ([`Endpoint::abandon`]: never read again) and the transport refuses later phases.

use std::ffi::c_void;
use std::time::{Duration, Instant};

use super::OfiTransport;
use super::header::{HEADER_LEN, Header};
use super::pool::{self, Pooled};
use super::shim::{Completion, Endpoint, FI_ETRUNC, Posted};
use crate::error::{CommError, Result};
use crate::transport::{Direction, MessageId, OpCtx, Transfer, Transport, check_message};

/// How long a failed phase waits for its cancelled posts.
const RECLAIM: Duration = Duration::from_secs(1);
/// The longest single sleep, so that the deadline and the abort switch are looked at often.
const MAX_SLEEP_MS: i32 = 100;
/// How long a wait without a file descriptor busy-polls after its last completion before it
/// polls in 1 ms sleeps: longer than a large message takes to arrive, so that a transfer in
/// progress never waits on a sleep, while a rank idle in a barrier stops burning its core.
const BUSY_POLL: Duration = Duration::from_millis(100);
/// How long a wait goes on reading the queue after an involved peer closed its control
/// connection: a peer that sent its last message and exited closes the control connection
/// while that message may still wait in the fabric's queue, unread.
const CLOSED_PEER_GRACE: Duration = Duration::from_millis(200);

/// libfabric's FI_CONTEXT2: space the provider may use while it holds an operation.
pub(super) type Context = [u64; 8];

/// What a post is for.
#[derive(Clone, Copy, Debug)]
pub(super) enum Role {
    /// A header or a payload this rank sends.
    Send,
    RecvHeader(usize),
    RecvPayload(usize),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum State {
    Waiting,
    Posted,
    Done,
}

/// One send or receive of a phase.
pub(super) struct Post {
    pub role: Role,
    pub peer: usize,
    pub send: bool,
    pub ptr: *mut u8,
    pub len: usize,
    pub tag: u64,
    pub state: State,
}

/// A phase's posts, with their contexts (which do not move: `contexts` is allocated once, before
/// the first post). Sends and receives are each handed to libfabric in their order, but apart:
/// a provider whose receive queue is full still takes the phase's sends, and the other way
/// round, so that two ranks that each post many receives before their sends do not wait on
/// each other.
pub(super) struct Posts {
    pub list: Vec<Post>,
    contexts: Vec<Context>,
    /// The first send, and the first receive, not yet handed to libfabric.
    next_send: usize,
    next_recv: usize,
    pub outstanding: usize,
}

impl Posts {
    pub fn new(list: Vec<Post>) -> Posts {
        let contexts = vec![[0u64; 8]; list.len()];
        let mut p = Posts { list, contexts, next_send: 0, next_recv: 0, outstanding: 0 };
        p.next_send = p.first_from(0, true);
        p.next_recv = p.first_from(0, false);
        p
    }

    fn context(&mut self, i: usize) -> *mut c_void {
        self.contexts[i].as_mut_ptr().cast()
    }

    /// The first send (or receive) at `i` or after it; the list's length if none.
    fn first_from(&self, i: usize, send: bool) -> usize {
        self.list[i.min(self.list.len())..].iter().position(|p| p.send == send).map_or(self.list.len(), |k| i + k)
    }

    /// The post whose context a completion returned, if it is one of ours.
    pub fn index_of(&self, context: *mut c_void) -> Option<usize> {
        let base = self.contexts.as_ptr() as usize;
        let at = (context as usize).checked_sub(base)?;
        let i = at / std::mem::size_of::<Context>();
        (at % std::mem::size_of::<Context>() == 0 && i < self.list.len() && self.list[i].state == State::Posted).then_some(i)
    }

    /// Hands libfabric the receives, then the sends, not yet handed, each in order until the
    /// provider is busy with that kind.
    pub fn post_more(&mut self, ep: &mut Endpoint, addrs: &[u64], ctx: &OpCtx) -> Result<()> {
        for send in [false, true] {
            loop {
                let i = if send { self.next_send } else { self.next_recv };
                if i >= self.list.len() {
                    break;
                }
                let context = self.context(i);
                let p = &self.list[i];
                let dest = addrs[p.peer];
                // SAFETY: every buffer of a phase stays valid and unused by anything else until
                // the phase ends (the Transport contract), headers live in the phase's vectors,
                // and the phase does not end while a post is outstanding (it reclaims them
                // first); contexts never move (allocated once).
                let r = unsafe {
                    if send { ep.tsend(p.ptr, p.len, dest, p.tag, context) } else { ep.trecv(p.ptr, p.len, dest, p.tag, context) }
                };
                match r.map_err(|e| CommError::io(format!("{}: {e} (rank {})", ctx.describe(), p.peer)))? {
                    Posted::Busy => break,
                    Posted::Yes => {
                        self.list[i].state = State::Posted;
                        self.outstanding += 1;
                        let next = self.first_from(i + 1, send);
                        if send { self.next_send = next } else { self.next_recv = next }
                    }
                }
            }
        }
        Ok(())
    }

    /// Every post has been handed to libfabric.
    pub fn all_posted(&self) -> bool {
        self.next_send == self.list.len() && self.next_recv == self.list.len()
    }

    /// Peers with a post not yet done: those whose death or silence ends the phase.
    fn involved(&self, size: usize) -> Vec<bool> {
        let mut v = vec![false; size];
        for p in self.list.iter().filter(|p| p.state != State::Done) {
            v[p.peer] = true;
        }
        v
    }

    pub fn finished(&self) -> bool {
        self.all_posted() && self.outstanding == 0
    }
}

/// When a wait started, when it last looked at the control connections, and a peer's close
/// it has seen but not yet reported.
pub(super) struct Waiting {
    /// When the wait started: the last completion (a wait restarts after each).
    since: Instant,
    spin_until: Instant,
    last_look: Instant,
    /// The error for an involved peer's closed control connection, and when to report it if
    /// the queue has not finished the phase by then ([`CLOSED_PEER_GRACE`]).
    peer_closed: Option<(CommError, Instant)>,
}

impl Waiting {
    pub fn new(spin: Duration) -> Waiting {
        let now = Instant::now();
        Waiting { since: now, spin_until: now + spin, last_look: now, peer_closed: None }
    }
}

impl OfiTransport {
    pub(super) fn endpoint(&mut self, ctx: &OpCtx) -> Result<&mut Endpoint> {
        match (&mut self.ep, &self.broken) {
            (Some(ep), _) => Ok(ep),
            (None, Some(why)) => Err(CommError::io(format!("{}: the libfabric endpoint was closed after an earlier error: {why}", ctx.describe()))),
            (None, None) => Err(CommError::aborted(format!("{}: the group was destroyed", ctx.describe()))),
        }
    }

    /// Nothing completed just now: spins, or sleeps until the queue, a control connection or
    /// the abort switch has something (or [`MAX_SLEEP_MS`]). Fails on an abort, a dead
    /// involved peer, or the deadline (with `on_timeout`'s message).
    pub(super) fn wait(&mut self, involved: &[bool], w: &mut Waiting, ctx: &OpCtx, on_timeout: impl FnOnce() -> String) -> Result<()> {
        if let Some(e) = ctx.aborted() {
            return Err(e);
        }
        let now = Instant::now();
        if now >= ctx.deadline {
            return Err(CommError::timeout(on_timeout()));
        }
        if let Some((e, report_at)) = &w.peer_closed {
            if now >= *report_at {
                return Err(e.clone());
            }
            std::thread::sleep(Duration::from_micros(200));
            return Ok(());
        }
        let abort_fd = ctx.abort.as_ref().and_then(|a| a.fd()).unwrap_or(-1);
        let spinning = now < w.spin_until;
        let busy_poll = self.ep.as_ref().is_some_and(|ep| ep.wait_fd().is_none()) && now.duration_since(w.since) < BUSY_POLL;
        if spinning || busy_poll {
            if now.duration_since(w.last_look) >= Duration::from_millis(1) {
                w.last_look = now;
                self.watch_control(involved, &[], 0, w, ctx)?;
            }
            if spinning {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
            return Ok(());
        }
        let left_ms = ctx.deadline.saturating_duration_since(now).as_millis().clamp(1, MAX_SLEEP_MS as u128) as i32;
        let ep = self.endpoint(ctx)?;
        let (fds, wait_ms) = match ep.wait_fd() {
            Some(fd) if ep.may_sleep() => ([fd, abort_fd], left_ms),
            // The queue has something to read first: only look at the control connections.
            Some(_) => ([-1, abort_fd], 0),
            None => ([-1, abort_fd], 1),
        };
        w.last_look = now;
        self.watch_control(involved, &fds, wait_ms, w, ctx)
    }

    /// The control connections' news: an abort frame fails the wait at once; an involved
    /// peer's close starts [`CLOSED_PEER_GRACE`] in `w`, for its last messages to be read.
    fn watch_control(&mut self, involved: &[bool], fds: &[i32], wait_ms: i32, w: &mut Waiting, ctx: &OpCtx) -> Result<()> {
        match self.tcp.watch_control(involved, fds, wait_ms, ctx) {
            Err(e) if self.tcp.closed_among(involved) => {
                let report_at = (Instant::now() + CLOSED_PEER_GRACE).min(ctx.deadline);
                w.peer_closed = Some((e, report_at));
                Ok(())
            }
            r => r.map(|_| ()),
        }
    }

    /// A failed phase: cancels every outstanding post and reads completions until each is back;
    /// gives the endpoint up if they do not come back within RECLAIM.
    fn reclaim(&mut self, posts: &mut Posts, ctx: &OpCtx) {
        let Some(ep) = self.ep.as_mut() else { return };
        for i in 0..posts.list.len() {
            if posts.list[i].state == State::Posted {
                let c = posts.context(i);
                // SAFETY: post `i` is outstanding on this endpoint (state Posted).
                unsafe { ep.cancel(c) };
            }
        }
        let until = Instant::now() + RECLAIM;
        let mut done = [Completion::default(); 32];
        while posts.outstanding > 0 && Instant::now() < until {
            let Some(ep) = self.ep.as_mut() else { return };
            let n = match ep.poll(&mut done) {
                Ok(n) => n,
                Err(_) => break,
            };
            for c in &done[..n] {
                let Some(i) = posts.index_of(c.context) else {
                    // A held send's or a look-ahead's; a failure there is the next phase's to report.
                    if let Err(e) = self.complete_outside_phase(c, ctx) {
                        self.held.failed.get_or_insert(e);
                    }
                    continue;
                };
                posts.list[i].state = State::Done;
                posts.outstanding -= 1;
            }
            if n == 0 {
                std::thread::sleep(Duration::from_micros(200));
            }
        }
        if posts.outstanding > 0 {
            let why = format!("{} posts did not come back after a failed phase", posts.outstanding);
            tracing::warn!(rank = self.rank, "{why}; giving the libfabric endpoint up");
            if let Some(ep) = self.ep.take() {
                ep.abandon();
            }
            self.broken = Some(why);
        }
    }

    /// The error for a failed completion: the control connections' explanation (a peer that
    /// aborted or died) where there is one, else libfabric's.
    fn failed_post(&mut self, post: &Post, c: &Completion, ctx: &OpCtx) -> CommError {
        let mut involved = vec![false; self.size];
        involved[post.peer] = true;
        if let Err(e) = self.tcp.watch_control(&involved, &[], 0, ctx) {
            return e;
        }
        let lib = self.ep.as_ref().map(|e| e.lib().strerror(c.err as i64)).unwrap_or_default();
        let what = if post.send { "sending to" } else { "receiving from" };
        CommError::peer(format!("{}: {what} rank {} over libfabric failed: {lib} (provider error {})", ctx.describe(), post.peer, c.prov_errno))
    }

    /// A completion that is no post of the running phase: a held send's or a look-ahead's.
    pub(super) fn complete_outside_phase(&mut self, c: &Completion, ctx: &OpCtx) -> Result<()> {
        if self.complete_lookahead(c, ctx)? {
            return Ok(());
        }
        self.complete_held(c, ctx)
    }

    /// Runs a phase's posts to the end. A receive marked in `from_lookahead` takes its header
    /// from the peer's look-ahead (lookahead.rs) instead of a post of its own.
    fn run_phase(&mut self, transfers: &[Transfer], posts: &mut Posts, got: &mut [Option<Header>], from_lookahead: &mut [bool], ctx: &OpCtx, inbox: &[[u8; HEADER_LEN]]) -> Result<()> {
        // Per transfer, a message of it that came with the wrong size: (its size, the expected).
        let mut truncated: Vec<Option<(u64, usize)>> = vec![None; transfers.len()];
        let mut done = [Completion::default(); 32];
        let mut w = Waiting::new(self.spin);
        loop {
            let addrs = std::mem::take(&mut self.addrs);
            let r = self.endpoint(ctx).and_then(|ep| posts.post_more(ep, &addrs, ctx));
            self.addrs = addrs;
            r?;
            for t in 0..transfers.len() {
                if !from_lookahead[t] {
                    continue;
                }
                if let Some(h) = self.stash[transfers[t].peer].pop_front() {
                    check_message(&transfers[t].id, transfers[t].buf.len() as u64, &h.id, h.payload_len, transfers[t].peer, ctx)?;
                    got[t] = Some(h);
                    from_lookahead[t] = false;
                }
            }
            if posts.finished() && !from_lookahead.contains(&true) {
                return Ok(());
            }
            let n = self.endpoint(ctx)?.poll(&mut done).map_err(|e| CommError::io(format!("{}: {e}", ctx.describe())))?;
            for c in &done[..n] {
                let Some(i) = posts.index_of(c.context) else {
                    self.complete_outside_phase(c, ctx)?;
                    continue;
                };
                posts.list[i].state = State::Done;
                posts.outstanding -= 1;
                let role = posts.list[i].role;
                match (role, c.err) {
                    (Role::RecvPayload(t), FI_ETRUNC) => truncated[t] = Some((c.len + c.olen, posts.list[i].len)),
                    (_, 0) => {}
                    (_, _) => return Err(self.failed_post(&posts.list[i], c, ctx)),
                }
                match role {
                    Role::RecvHeader(t) => {
                        let peer = transfers[t].peer;
                        let h = Header::decode(&inbox[t], c.len as usize)
                            .map_err(|m| CommError::io(format!("{}: from rank {peer}: {m}", ctx.describe())))?;
                        check_message(&transfers[t].id, transfers[t].buf.len() as u64, &h.id, h.payload_len, peer, ctx)?;
                        got[t] = Some(h);
                    }
                    Role::RecvPayload(t) if c.err == 0 && c.len != posts.list[i].len as u64 => truncated[t] = Some((c.len, posts.list[i].len)),
                    _ => {}
                }
            }
            // A payload of the wrong size is reported once its header passed (the header's
            // error says more when it did not).
            for (t, bad) in truncated.iter().enumerate() {
                if let (Some((len, expected)), Some(_)) = (bad, got[t]) {
                    return Err(CommError::mismatch(format!(
                        "{}: rank {} sent a message of {len} bytes, rank {} expected {expected} (size mismatch)",
                        ctx.describe(),
                        transfers[t].peer,
                        ctx.rank,
                    )));
                }
            }
            if n > 0 {
                w = Waiting::new(self.spin);
                continue;
            }
            let mut involved = posts.involved(self.size);
            let mut silent = Vec::new();
            for t in (0..transfers.len()).filter(|&t| from_lookahead[t]) {
                involved[transfers[t].peer] = true;
                silent.push(transfers[t].peer);
            }
            self.wait(&involved, &mut w, ctx, || timeout_message(posts, &silent, ctx))?;
        }
    }
}

/// What a phase's timeout says: whom it waited for (`silent`: peers whose look-ahead is due).
fn timeout_message(posts: &Posts, silent: &[usize], ctx: &OpCtx) -> String {
    let pending = |send: bool| {
        let mut v: Vec<usize> = posts.list.iter().filter(|p| p.state != State::Done && p.send == send).map(|p| p.peer).collect();
        if !send {
            v.extend_from_slice(silent);
        }
        v.sort_unstable();
        v.dedup();
        v
    };
    let (silent, blocked) = (pending(false), pending(true));
    let mut msg = format!("{}: timed out after {} ms", ctx.describe(), ctx.timeout.as_millis());
    if !silent.is_empty() {
        msg += &format!("; ranks not heard from: {silent:?}");
    }
    if !blocked.is_empty() {
        msg += &format!("; ranks not accepting data: {blocked:?}");
    }
    msg
}

impl Transport for OfiTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn exchange(&mut self, transfers: &[Transfer], ctx: &OpCtx) -> Result<()> {
        let result = self.exchange_phase(transfers, ctx);
        self.failed |= result.is_err();
        result
    }

    fn probe_any(&mut self, accept: &dyn Fn(usize, &MessageId) -> bool, ctx: &OpCtx) -> Result<usize> {
        self.endpoint(ctx)?;
        let result = match self.held.failed.take() {
            Some(e) => Err(e),
            None => self.probe(accept, ctx),
        };
        self.failed |= result.is_err();
        result
    }

    fn abort(&mut self, ctx: &OpCtx, message: &str) {
        self.aborted = true;
        self.tcp.abort(ctx, message);
    }

    fn progress(&mut self) -> Option<Duration> {
        self.progress_held()
    }

    fn close(&mut self) {
        if !self.aborted {
            self.deliver_held(self.linger);
        }
        let clean = !self.aborted && !self.failed && self.held.is_empty() && self.withdraw_lookaheads();
        // Sends still in flight (a peer gone, a link down) are what closing may crash on.
        match self.ep.take() {
            Some(ep) if clean => {
                let generation = self.generations[self.rank];
                let pooled = Pooled { ep, key: self.key.clone(), generation, known: std::mem::take(&mut self.known) };
                pool::give_back(pooled, self.tags.generations());
            }
            Some(ep) if !self.held.is_empty() => ep.abandon(),
            ep => drop(ep),
        }
        self.held.clear();
        self.lookahead.iter_mut().for_each(|l| *l = None);
        self.tcp.close();
    }
}

impl OfiTransport {
    /// One phase of `exchange`: held, or posted and run to its end.
    fn exchange_phase(&mut self, transfers: &[Transfer], ctx: &OpCtx) -> Result<()> {
        self.endpoint(ctx)?;
        if let Some(e) = self.held.failed.take() {
            return Err(e);
        }
        for tr in transfers {
            self.check_transfer(tr, ctx)?;
        }
        if self.held.takes(transfers, ctx) {
            return self.send_held(transfers, ctx);
        }
        let mut got: Vec<Option<Header>> = vec![None; transfers.len()];
        let mut from_lookahead = vec![false; transfers.len()];
        let mut lookahead_taken = vec![false; self.size];
        let mut outbox = vec![[0u8; HEADER_LEN]; transfers.len()];
        let mut inbox = vec![[0u8; HEADER_LEN]; transfers.len()];
        let mut list = Vec::with_capacity(transfers.len() * 2);
        for (t, tr) in transfers.iter().enumerate() {
            let header_tag = self.header_tag(tr.peer, tr.dir);
            let post = |role, send, ptr: *mut u8, len, tag| Post { role, peer: tr.peer, send, ptr, len, tag, state: State::Waiting };
            match tr.dir {
                Direction::Send => {
                    outbox[t] = Header { id: tr.id, payload_len: tr.buf.len() as u64 }.encode();
                    list.push(post(Role::Send, true, outbox[t].as_mut_ptr(), HEADER_LEN, header_tag));
                }
                Direction::Recv => match self.stash[tr.peer].pop_front() {
                    // Receive-from-any-source read this header already.
                    Some(h) => {
                        check_message(&tr.id, tr.buf.len() as u64, &h.id, h.payload_len, tr.peer, ctx)?;
                        got[t] = Some(h);
                    }
                    // The look-ahead holds the peer's next header, for this phase's first
                    // receive from it; a later receive posts its own, which matches the header
                    // after (receives of one tag match in the order they were posted).
                    None if self.awaits_lookahead(tr.peer) && !lookahead_taken[tr.peer] => {
                        lookahead_taken[tr.peer] = true;
                        from_lookahead[t] = true;
                    }
                    None => list.push(post(Role::RecvHeader(t), false, inbox[t].as_mut_ptr(), HEADER_LEN, header_tag)),
                },
            }
            let role = if tr.dir == Direction::Send { Role::Send } else { Role::RecvPayload(t) };
            for (at, len) in self.cutting.pieces(tr.buf.len()) {
                // SAFETY: `at + len` is within the transfer's buffer (Cutting::pieces).
                let ptr = unsafe { tr.buf.ptr().add(at) };
                list.push(post(role, tr.dir == Direction::Send, ptr, len, self.payload_tag(tr.peer, tr.dir, &tr.id)));
            }
        }
        let mut posts = Posts::new(list);
        let result = self.run_phase(transfers, &mut posts, &mut got, &mut from_lookahead, ctx, &inbox);
        if posts.outstanding > 0 {
            self.reclaim(&mut posts, ctx);
        }
        result
    }

    /// A transfer this transport can carry: to another rank of the group.
    fn check_transfer(&self, tr: &Transfer, ctx: &OpCtx) -> Result<()> {
        if tr.peer >= self.size || tr.peer == self.rank {
            return Err(CommError::invalid(format!("{}: transfer to invalid peer {}", ctx.describe(), tr.peer)));
        }
        Ok(())
    }
}

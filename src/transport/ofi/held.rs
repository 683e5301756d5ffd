//! Sends that complete before their receiver has asked for them, as they do over TCP (the
//! socket buffers hold the bytes): a point-to-point phase of sends only copies its payloads
//! into buffers of its own, hands them to libfabric, and returns. Without this, a ring of
//! `isend` then `irecv` deadlocks on any message past the provider's eager size (rendezvous
//! waits for the receive), where over TCP it deadlocks only past the socket buffers.
//!
//! libfabric moves a held send only while someone reads the completion queue (manual
//! progress), so the group's progress thread reads it between ops
//! ([`Transport::progress`](crate::transport::Transport::progress)).
//! At most [`BYTES_PER_PEER`] are held per peer, like a socket's buffers; a send beyond that
//! waits for its receiver as before. A held send that fails fails the rank's next operation.
//! Closing the group waits for held sends (up to the group's timeout) so that a rank that
//! sends and leaves still delivers; closing after an abort does not.

use std::time::{Duration, Instant};

use super::OfiTransport;
use super::exchange::{Post, Posts, Role, State, Waiting};
use super::header::{HEADER_LEN, Header};
use super::shim::Completion;
use crate::error::{CommError, Result};
use crate::transport::{Direction, OpCtx, Transfer};
use crate::types::OpKind;

/// The most bytes of held sends to one peer: about what a TCP connection's buffers hold.
pub const BYTES_PER_PEER: usize = 4 << 20;
/// How often held sends are progressed while the group runs no op.
const IDLE_PROGRESS: Duration = Duration::from_micros(200);

/// One phase's held sends: its posts, and the copies they read from (which must outlive them).
struct HeldPhase {
    posts: Posts,
    _headers: Vec<Box<[u8; HEADER_LEN]>>,
    _payloads: Vec<Box<[u8]>>,
    /// Payload bytes per peer, returned to the budget when the phase is done.
    bytes: Vec<(usize, usize)>,
    /// "send #3 on rank 1", for the error of a send that fails later.
    what: String,
}

// SAFETY: the posts' raw pointers point only into this phase's own boxes (`_headers`,
// `_payloads`), which move with it and are freed with it; the transport that owns it runs on one
// thread at a time (behind the group's worker lock), as its endpoint does.
unsafe impl Send for HeldPhase {}

/// The held sends of a transport, oldest first.
#[derive(Default)]
pub struct Held {
    phases: Vec<HeldPhase>,
    /// Bytes held per peer.
    bytes: Vec<usize>,
    /// A held send that failed while no phase ran, for the next phase to report.
    pub failed: Option<CommError>,
}

impl Held {
    pub fn new(size: usize) -> Held {
        Held { phases: Vec::new(), bytes: vec![0; size], failed: None }
    }

    pub fn is_empty(&self) -> bool {
        self.phases.is_empty()
    }

    /// Whether `transfers` is a phase to hold: point-to-point sends only, within the budget.
    pub fn takes(&self, transfers: &[Transfer], ctx: &OpCtx) -> bool {
        if ctx.op != OpKind::Send || transfers.iter().any(|t| t.dir != Direction::Send) {
            return false;
        }
        let mut adding = vec![0usize; self.bytes.len()];
        for t in transfers {
            adding[t.peer] += t.buf.len();
        }
        adding.iter().zip(&self.bytes).all(|(&a, &held)| a == 0 || held + a <= BYTES_PER_PEER)
    }

    /// Peers that a held send still waits for.
    pub fn peers(&self) -> Vec<bool> {
        self.bytes.iter().map(|&b| b > 0).collect()
    }

    /// Takes a completion that belongs to a held send: `Ok(true)` if it did, an error if that
    /// send failed. `describe` names a libfabric error code.
    pub fn complete(&mut self, c: &Completion, describe: impl Fn(i32) -> String) -> Result<bool> {
        let Some((k, i)) = self.phases.iter().enumerate().find_map(|(k, p)| p.posts.index_of(c.context).map(|i| (k, i))) else {
            return Ok(false);
        };
        let phase = &mut self.phases[k];
        phase.posts.list[i].state = State::Done;
        phase.posts.outstanding -= 1;
        let failed = (c.err != 0).then(|| {
            let peer = phase.posts.list[i].peer;
            CommError::peer(format!(
                "{} (completed earlier, its bytes held by this rank): sending to rank {peer} over libfabric failed: {} (provider error {})",
                phase.what,
                describe(c.err),
                c.prov_errno
            ))
        });
        if phase.posts.finished() {
            let phase = self.phases.remove(k);
            for (peer, n) in phase.bytes {
                self.bytes[peer] -= n;
            }
        }
        failed.map_or(Ok(true), Err)
    }

    /// Drops every held send (the endpoint that had them is closed).
    pub fn clear(&mut self) {
        self.phases.clear();
        self.bytes.iter_mut().for_each(|b| *b = 0);
    }
}

impl OfiTransport {
    /// A completion that is no post of the running phase: a held send's, or an error.
    pub(super) fn complete_held(&mut self, c: &Completion, ctx: &OpCtx) -> Result<()> {
        let lib = self.ep.as_ref().map(|e| *e.lib());
        match self.held.complete(c, |code| lib.map(|l| l.strerror(code as i64)).unwrap_or_default())? {
            true => Ok(()),
            false => Err(CommError::io(format!("{}: a libfabric completion for no post of this phase", ctx.describe()))),
        }
    }

    /// Copies `transfers` (sends only, [`Held::takes`]) and hands them to libfabric; returns
    /// once every one is posted, without waiting for its receiver.
    pub(super) fn send_held(&mut self, transfers: &[Transfer], ctx: &OpCtx) -> Result<()> {
        let mut headers = Vec::with_capacity(transfers.len());
        let mut payloads = Vec::with_capacity(transfers.len());
        let mut list = Vec::with_capacity(transfers.len() * 2);
        let mut bytes = Vec::with_capacity(transfers.len());
        for tr in transfers {
            let post = |ptr: *mut u8, len, tag| Post { role: Role::Send, peer: tr.peer, send: true, ptr, len, tag, state: State::Waiting };
            let mut header = Box::new(Header { id: tr.id, payload_len: tr.buf.len() as u64 }.encode());
            list.push(post(header.as_mut_ptr(), HEADER_LEN, self.header_tag(tr.peer, Direction::Send)));
            headers.push(header);
            if !tr.buf.is_empty() {
                // SAFETY: the transfer's buffer is valid for its length for the whole phase (the
                // Transport contract), and this phase only reads it.
                let mut copy: Box<[u8]> = unsafe { std::slice::from_raw_parts(tr.buf.ptr(), tr.buf.len()) }.into();
                for (at, len) in self.cutting.pieces(copy.len()) {
                    // SAFETY: `at + len` is within the copy (Cutting::pieces).
                    list.push(post(unsafe { copy.as_mut_ptr().add(at) }, len, self.payload_tag(tr.peer, Direction::Send, &tr.id)));
                }
                payloads.push(copy);
                bytes.push((tr.peer, tr.buf.len()));
            }
        }
        for &(peer, n) in &bytes {
            self.held.bytes[peer] += n;
        }
        // The boxes do not move when the phase moves into the list: the posts point into them.
        self.held.phases.push(HeldPhase { posts: Posts::new(list), _headers: headers, _payloads: payloads, bytes, what: ctx.describe() });
        let mut done = [Completion::default(); 32];
        let mut w = Waiting::new(self.spin);
        loop {
            let k = self.held.phases.len() - 1;
            let ep = self.ep.as_mut().ok_or_else(|| CommError::aborted(format!("{}: the group was destroyed", ctx.describe())))?;
            self.held.phases[k].posts.post_more(ep, &self.addrs, ctx)?;
            let posts = &self.held.phases[k].posts;
            if posts.all_posted() {
                return Ok(());
            }
            // The provider is busy: progress it (reading completions) until it takes more.
            let n = self.endpoint(ctx)?.poll(&mut done).map_err(|e| CommError::io(format!("{}: {e}", ctx.describe())))?;
            for c in &done[..n] {
                self.complete_held(c, ctx)?;
            }
            if n > 0 {
                w = Waiting::new(self.spin);
                continue;
            }
            let involved = self.held.peers();
            self.wait(&involved, &mut w, ctx, || format!("{}: timed out after {} ms handing sends to libfabric", ctx.describe(), ctx.timeout.as_millis()))?;
        }
    }

    /// Between ops: reads the completions of held sends, which move only while someone reads
    /// the queue (libfabric's manual progress), so that a receiver that asks later is answered.
    pub(super) fn progress_held(&mut self) -> Option<Duration> {
        if self.held.is_empty() {
            return None;
        }
        let ctx = OpCtx { op: OpKind::Send, seq: 0, rank: self.rank, deadline: Instant::now(), timeout: Duration::ZERO, abort: None };
        let mut done = [Completion::default(); 32];
        loop {
            let Some(ep) = self.ep.as_mut() else {
                self.held.clear();
                return None;
            };
            let Ok(n @ 1..) = ep.poll(&mut done) else { break };
            for c in &done[..n] {
                if let Err(e) = self.complete_outside_phase(c, &ctx) {
                    self.held.failed.get_or_insert(e);
                }
            }
        }
        (!self.held.is_empty()).then_some(IDLE_PROGRESS)
    }

    /// Before the endpoint closes: progresses held sends until they are done, their peers have
    /// closed their control connections, or `linger` has passed.
    pub(super) fn deliver_held(&mut self, linger: Duration) {
        let ctx = OpCtx { op: OpKind::Send, seq: 0, rank: self.rank, deadline: Instant::now() + linger, timeout: linger, abort: None };
        let mut done = [Completion::default(); 32];
        let mut w = Waiting::new(self.spin);
        while !self.held.is_empty() {
            let Some(ep) = self.ep.as_mut() else { return };
            let Ok(n) = ep.poll(&mut done) else { return };
            for c in &done[..n] {
                if let Err(e) = self.complete_outside_phase(c, &ctx) {
                    tracing::warn!(rank = self.rank, "a held send failed as the group closed: {e}");
                }
            }
            if n > 0 {
                w = Waiting::new(self.spin);
                continue;
            }
            let involved = self.held.peers();
            if let Err(e) = self.wait(&involved, &mut w, &ctx, || "held sends not delivered".into()) {
                tracing::warn!(rank = self.rank, "closing with sends not delivered: {e}");
                return;
            }
        }
    }
}

//! Receive-from-any-source over libfabric: a *look-ahead* receive per peer for its next header,
//! kept posted until that header comes, however many ops later.
//!
//! A probe posts a look-ahead to every peer that has none and returns the first peer whose
//! header it accepts; the others stay posted rather than being cancelled (a cancel that never
//! comes back would cost the endpoint: libfabric's `tcp;ofi_rxm` leaves some unanswered). A
//! header that a look-ahead received waits in the peer's stash for the receive it describes;
//! while a peer's look-ahead is posted, the next receive from that peer takes its header from
//! there instead of posting its own (it would otherwise match the header after); the receives
//! after it, in the same phase or later, post their own, each matching the header after.

use std::time::{Duration, Instant};

use super::OfiTransport;
use super::exchange::{Context, Waiting};
use super::header::{HEADER_LEN, Header};
use super::shim::{Completion, FI_ECANCELED, Posted};
use crate::error::{CommError, Result};
use crate::transport::{Direction, MessageId, OpCtx};
use crate::types::OpKind;

/// How long the group's end waits for its cancelled look-aheads before it closes the endpoint
/// rather than reuse it.
const WITHDRAW: Duration = Duration::from_millis(200);

/// One posted look-ahead: its buffer and context, boxed so that they stay where libfabric was
/// told they are until it completes.
pub struct LookAhead {
    buf: Box<[u8; HEADER_LEN]>,
    context: Box<Context>,
}

impl LookAhead {
    fn owns(&self, context: *mut std::ffi::c_void) -> bool {
        std::ptr::eq(context.cast_const().cast::<Context>(), &*self.context)
    }
}

impl OfiTransport {
    /// Takes a completion of a look-ahead: its header goes to the peer's stash. `Ok(false)` if
    /// the completion is no look-ahead's.
    pub(super) fn complete_lookahead(&mut self, c: &Completion, ctx: &OpCtx) -> Result<bool> {
        let Some(peer) = self.lookahead.iter().position(|l| l.as_ref().is_some_and(|l| l.owns(c.context))) else {
            return Ok(false);
        };
        let posted = self.lookahead[peer].take().expect("found above");
        match c.err {
            0 => {
                let h = Header::decode(&posted.buf[..], c.len as usize).map_err(|m| CommError::io(format!("{}: from rank {peer}: {m}", ctx.describe())))?;
                self.stash[peer].push_back(h);
                Ok(true)
            }
            FI_ECANCELED => Ok(true),
            code => {
                let lib = self.ep.as_ref().map(|e| e.lib().strerror(code as i64)).unwrap_or_default();
                Err(CommError::peer(format!("{}: receiving from rank {peer} over libfabric failed: {lib} (provider error {})", ctx.describe(), c.prov_errno)))
            }
        }
    }

    /// At the group's end: cancels every posted look-ahead and reads the queue until each is
    /// back (cancelled, or completed by a header that came meanwhile), for a short while.
    /// Whether none is left posted: only then may the endpoint serve another group (pool.rs).
    pub(super) fn withdraw_lookaheads(&mut self) -> bool {
        let Some(ep) = self.ep.as_mut() else { return false };
        for l in self.lookahead.iter_mut().flatten() {
            // SAFETY: this look-ahead is posted on this endpoint and not yet completed (a
            // completed one leaves `self.lookahead`).
            unsafe { ep.cancel(l.context.as_mut_ptr().cast()) };
        }
        let ctx = OpCtx { op: OpKind::RecvAnySource, seq: 0, rank: self.rank, deadline: Instant::now(), timeout: Duration::ZERO, abort: None };
        let until = Instant::now() + WITHDRAW;
        let mut done = [Completion::default(); 32];
        while self.lookahead.iter().any(Option::is_some) && Instant::now() < until {
            let Some(Ok(n)) = self.ep.as_mut().map(|ep| ep.poll(&mut done)) else { return false };
            for c in &done[..n] {
                if self.complete_outside_phase(c, &ctx).is_err() {
                    return false;
                }
            }
            if n == 0 {
                std::thread::sleep(Duration::from_micros(100));
            }
        }
        self.lookahead.iter().all(Option::is_none)
    }

    /// Whether the next receive from `peer` must take its header from the look-ahead.
    pub(super) fn awaits_lookahead(&self, peer: usize) -> bool {
        self.lookahead[peer].is_some()
    }

    /// Posts a look-ahead to `peer`; `false` when the provider is busy (try again after
    /// reading completions).
    fn post_lookahead(&mut self, peer: usize, ctx: &OpCtx) -> Result<bool> {
        let mut l = LookAhead { buf: Box::new([0u8; HEADER_LEN]), context: Box::new([0u64; 8]) };
        let (dest, tag) = (self.addrs[peer], self.header_tag(peer, Direction::Recv));
        let ep = self.endpoint(ctx)?;
        // SAFETY: the buffer and context are boxed and kept in `self.lookahead` (which drops
        // after the endpoint closes) until this receive completes.
        let r = unsafe { ep.trecv(l.buf.as_mut_ptr(), HEADER_LEN, dest, tag, l.context.as_mut_ptr().cast()) };
        match r.map_err(|e| CommError::io(format!("{}: {e} (rank {peer})", ctx.describe())))? {
            Posted::Busy => Ok(false),
            Posted::Yes => {
                self.lookahead[peer] = Some(l);
                Ok(true)
            }
        }
    }

    /// Waits until some peer's next header satisfies `accept`, and returns that peer (the header
    /// stays in its stash for the receive).
    pub(super) fn probe(&mut self, accept: &dyn Fn(usize, &MessageId) -> bool, ctx: &OpCtx) -> Result<usize> {
        let mut done = [Completion::default(); 32];
        let mut w = Waiting::new(self.spin);
        loop {
            // A peer whose stashed header was refused cannot offer another before that one is
            // received; every other peer gets a look-ahead.
            let mut waiting_for = vec![false; self.size];
            let mut busy = false;
            let rank = self.rank;
            for p in (0..self.size).filter(|&p| p != rank) {
                match self.stash[p].front() {
                    Some(h) if accept(p, &h.id) => return Ok(p),
                    Some(_) => {}
                    None => {
                        waiting_for[p] = true;
                        if self.lookahead[p].is_none() && !busy {
                            busy = !self.post_lookahead(p, ctx)?;
                        }
                    }
                }
            }
            let n = self.endpoint(ctx)?.poll(&mut done).map_err(|e| CommError::io(format!("{}: {e}", ctx.describe())))?;
            for c in &done[..n] {
                if !self.complete_lookahead(c, ctx)? {
                    self.complete_held(c, ctx)?;
                }
            }
            if n > 0 {
                w = Waiting::new(self.spin);
                continue;
            }
            let timeout = ctx.timeout;
            self.wait(&waiting_for, &mut w, ctx, || {
                format!("{}: timed out after {} ms: no rank sent a matching message", ctx.describe(), timeout.as_millis())
            })?;
        }
    }
}

//! Transports move messages between ranks. An algorithm describes one phase of a collective as
//! a list of [`Transfer`]s (send this buffer to rank a, receive that one from rank b) and the
//! transport completes them all, concurrently, before the phase ends. Transfers to the same peer
//! in the same direction complete in list order. Each message carries a [`MessageId`], which
//! the receiver checks against its own before it takes a byte of the payload; how the identity
//! travels (TCP's frame header, tcp/frame.rs) is the transport's business. TCP implements the
//! trait, and `Subset` views some of its ranks as a smaller group; shared memory (shm/) has a
//! block protocol of its own.

pub mod shm;
pub mod subset;
pub mod tcp;

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::abort::AbortSwitch;
use crate::error::{CommError, Result};
use crate::types::OpKind;
pub use crate::buf::RawBuf;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    Send,
    Recv,
}

/// What a message says it belongs to. Codes are those of the bridge's shared enums (types.rs),
/// kept as sent: a receiver must be able to name a peer's unknown code in its error.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MessageId {
    /// OpKind code; point-to-point messages carry `Send`'s on both sides.
    pub op: u8,
    /// DType code.
    pub dtype: u8,
    /// The reduction's ReduceOp code (all-reduce, reduce, reduce-scatter), else 0.
    pub reduce: u8,
    /// Collective sequence number, or the per-pair point-to-point number.
    pub seq: u64,
    /// Elements the sender's operation agreed on for this pair.
    pub count: u64,
    /// Root of a rooted collective, tag of a point-to-point message, else 0.
    pub key: i64,
}

/// One message of a phase. For a send, `id` is what the message announces and `buf` the
/// payload; for a receive, `id` is what this rank expects and `buf` where the payload lands
/// (its length is the exact payload length expected).
#[derive(Clone, Copy, Debug)]
pub struct Transfer {
    pub peer: usize,
    pub dir: Direction,
    pub id: MessageId,
    pub buf: RawBuf,
}

/// What the transport needs to know about the operation a phase belongs to, for deadlines and
/// for error messages.
#[derive(Clone, Debug)]
pub struct OpCtx {
    pub op: OpKind,
    /// Collective sequence number (or the p2p number for point-to-point).
    pub seq: u64,
    pub rank: usize,
    pub deadline: Instant,
    pub timeout: Duration,
    /// The group's abort switch (abort.rs): raised, it stops the op where it waits.
    pub abort: Option<Arc<AbortSwitch>>,
}

impl OpCtx {
    /// "allreduce #17 on rank 0": how every error of an op says where it happened.
    pub fn describe(&self) -> String {
        format!("{} #{} on rank {}", self.op.name(), self.seq, self.rank)
    }

    /// The error to stop with when the group's abort switch was raised.
    pub fn aborted(&self) -> Option<CommError> {
        self.abort.as_ref().filter(|a| a.is_raised()).map(|a| a.error(&self.describe()))
    }

    /// `e` with its message led by [`describe`](Self::describe).
    pub fn annotate(&self, e: CommError) -> CommError {
        e.within(self.describe())
    }
}

pub trait Transport: Send {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    /// Completes every transfer, or fails the whole phase.
    fn exchange(&mut self, transfers: &[Transfer], ctx: &OpCtx) -> Result<()>;
    /// Waits until some peer's next message satisfies `accept(peer, id)` (without consuming it)
    /// and returns that peer. Used by receive-from-any-source.
    fn probe_any(&mut self, accept: &dyn Fn(usize, &MessageId) -> bool, ctx: &OpCtx) -> Result<usize>;
    /// Tells every peer that this rank failed `ctx`'s operation, best effort, never blocking.
    fn abort(&mut self, ctx: &OpCtx, message: &str);
    /// Closes every connection (the group is being destroyed).
    fn close(&mut self);
}

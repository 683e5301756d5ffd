//! Transports move messages between ranks. An algorithm describes one phase of a collective as
//! a list of [`Transfer`]s (send this buffer to rank a, receive that one from rank b) and the
//! transport completes them all, concurrently, before the phase ends. Transfers to the same peer
//! in the same direction complete in list order. Each message carries a [`MessageId`], which
//! the receiver checks against its own before it takes a byte of the payload; how the identity
//! travels (TCP's frame header, tcp/frame.rs; OFI's header message, ofi/header.rs) is the
//! transport's business, and [`check_message`] words every mismatch the same way. TCP and OFI
//! (libfabric) implement the trait, and `Subset` views some of a transport's ranks as a smaller
//! group; shared memory (shm/) has a block protocol of its own.

pub mod choice;
pub mod ofi;
pub mod shm;
pub mod subset;
pub mod tcp;

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::abort::AbortSwitch;
use crate::error::{CommError, Result};
use crate::types::{OpKind, dtype_code_name, op_code_name};
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

/// Compares what a peer's message says (`got`, with `got_len` payload bytes) with what this
/// rank expects (`expect`, `expect_len` bytes); the error says what differs, in the words of
/// every transport ("allreduce #17 on rank 0: rank 2 sent 4096 bytes, rank 0 expected 8192").
pub fn check_message(expect: &MessageId, expect_len: u64, got: &MessageId, got_len: u64, peer: usize, ctx: &OpCtx) -> Result<()> {
    let me = ctx.rank;
    let what = ctx.describe();
    if got.op != expect.op || got.seq != expect.seq {
        return Err(CommError::mismatch(format!(
            "{what}: rank {peer} sent data for {} #{}, but rank {me} is in {} #{} \
             (ranks must call the same collectives in the same order)",
            op_code_name(got.op),
            got.seq,
            op_code_name(expect.op),
            expect.seq
        )));
    }
    if got.dtype != expect.dtype {
        return Err(CommError::mismatch(format!(
            "{what}: rank {peer} sent {} elements, rank {me} expected {} (dtype mismatch)",
            dtype_code_name(got.dtype),
            dtype_code_name(expect.dtype)
        )));
    }
    if got.reduce != expect.reduce {
        let name = |code: u8| crate::types::ReduceOp::from_code(code).map_or("an unknown op", |r| r.name());
        return Err(CommError::mismatch(format!(
            "{what}: rank {peer} reduces with {}, rank {me} with {} (reduce op mismatch)",
            name(got.reduce),
            name(expect.reduce)
        )));
    }
    if got.key != expect.key {
        let is_p2p = OpKind::from_code(expect.op).is_some_and(|k| k.is_p2p());
        let name = if is_p2p { "tag" } else { "root" };
        return Err(CommError::mismatch(format!(
            "{what}: rank {peer} used {name} {}, rank {me} used {name} {} ({name} mismatch)",
            got.key, expect.key
        )));
    }
    if got.count != expect.count {
        return Err(CommError::mismatch(format!(
            "{what}: rank {peer} sent {} elements of {}, rank {me} expected {} (size mismatch)",
            got.count,
            dtype_code_name(got.dtype),
            expect.count
        )));
    }
    if got_len != expect_len {
        return Err(CommError::mismatch(format!(
            "{what}: rank {peer} sent {got_len} bytes, rank {me} expected {expect_len} (size mismatch)"
        )));
    }
    Ok(())
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
    /// Moves work that outlives its phase (OFI's held sends) while the group runs no op, for
    /// a transport that only progresses when asked; returns how soon to call again, or `None`
    /// when nothing is in flight.
    fn progress(&mut self) -> Option<Duration> {
        None
    }
}

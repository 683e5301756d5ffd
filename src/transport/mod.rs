//! Transports move frames between ranks. An algorithm describes one phase of a collective as a
//! list of [`Transfer`]s (send this buffer to rank a, receive that one from rank b) and the
//! transport completes them all, concurrently, before the phase ends. Transfers to the same peer
//! in the same direction complete in list order. TCP implements the trait, and `Subset` views
//! some of its ranks as a smaller group; shared memory (shm/) has a block protocol of its own.

pub mod shm;
pub mod subset;
pub mod tcp;

use std::time::{Duration, Instant};

use crate::error::{CommError, Result};
use crate::types::OpKind;
pub use crate::buf::RawBuf;
pub use tcp::frame::Header;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    Send,
    Recv,
}

/// One message of a phase. For a send, `header` is what goes on the wire and `buf` the payload;
/// for a receive, `header` is what this rank expects and `buf` where the payload lands (its
/// length is the exact payload length expected).
#[derive(Clone, Copy, Debug)]
pub struct Transfer {
    pub peer: usize,
    pub dir: Direction,
    pub header: Header,
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
}

impl OpCtx {
    /// "allreduce #17 on rank 0": how every error message starts.
    pub fn describe(&self) -> String {
        format!("xccl_rs: {} #{} on rank {}", self.op.name(), self.seq, self.rank)
    }

    /// `e` with its message prefixed by [`describe`](Self::describe).
    pub fn annotate(&self, e: CommError) -> CommError {
        CommError::new(e.kind, format!("{}: {}", self.describe(), e.message))
    }
}

pub trait Transport: Send {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    /// Completes every transfer, or fails the whole phase.
    fn exchange(&mut self, transfers: &[Transfer], ctx: &OpCtx) -> Result<()>;
    /// Waits until some peer's next frame satisfies `accept(peer, header)` (without consuming it) and returns
    /// that peer. Used by receive-from-any-source.
    fn probe_any(&mut self, accept: &dyn Fn(usize, &Header) -> bool, ctx: &OpCtx) -> Result<usize>;
    /// Tells every peer that this rank failed `ctx`'s operation, best effort, never blocking.
    fn abort(&mut self, ctx: &OpCtx, message: &str);
    /// Closes every connection (the group is being destroyed).
    fn close(&mut self);
}

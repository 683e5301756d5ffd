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

use std::time::{Duration, Instant};

use crate::error::{CommError, Result};
use crate::types::OpKind;

/// A contiguous host buffer owned by the caller for the duration of an operation.
#[derive(Clone, Copy, Debug)]
pub struct RawBuf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a RawBuf is only an address and a length; the caller of `RawBuf::new` guarantees the
// memory stays valid and is not used by anyone else until the operation completes, which is
// what moving it to the progress thread needs.
unsafe impl Send for RawBuf {}

impl RawBuf {
    /// # Safety
    /// `ptr` must be valid for reads and writes of `len` bytes until the operation that uses
    /// this buffer completes, and nothing else may access the memory meanwhile except through
    /// RawBufs of the same operation. `ptr` may be dangling when `len` is 0.
    pub unsafe fn new(ptr: *mut u8, len: usize) -> RawBuf {
        RawBuf { ptr, len }
    }

    /// A buffer over a Rust slice, for tests and scratch space owned by the core.
    pub fn from_slice(s: &mut [u8]) -> RawBuf {
        RawBuf { ptr: s.as_mut_ptr(), len: s.len() }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// The sub-buffer `[offset, offset + len)`. Panics when out of bounds: callers compute
    /// ranges from lengths they validated, so a failure here is a bug, never peer input.
    pub fn sub(&self, offset: usize, len: usize) -> RawBuf {
        assert!(offset.checked_add(len).is_some_and(|end| end <= self.len), "RawBuf::sub out of bounds");
        // In bounds (checked above), so the result stays inside the caller's buffer. Wrapping
        // arithmetic: the buffer may be a placeholder (src/pipeline.rs) that points nowhere yet.
        RawBuf { ptr: self.ptr.wrapping_add(offset), len }
    }

    /// Copies `self` into `dst` (equal lengths); a no-op when both are the same memory.
    pub fn copy_to(&self, dst: RawBuf) {
        assert_eq!(self.len, dst.len, "RawBuf::copy_to length mismatch");
        if self.len == 0 || self.ptr == dst.ptr {
            return;
        }
        // SAFETY: both are valid for `len` bytes (RawBuf::new's contract). Distinct views of one
        // operation never partially overlap (buffers are whole tensors or disjoint sub-ranges),
        // and exact equality was handled above, so the ranges do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr, dst.ptr, self.len) }
    }
}

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
    /// Waits until some peer's next message satisfies `accept(peer, id)` (without consuming it)
    /// and returns that peer. Used by receive-from-any-source.
    fn probe_any(&mut self, accept: &dyn Fn(usize, &MessageId) -> bool, ctx: &OpCtx) -> Result<usize>;
    /// Tells every peer that this rank failed `ctx`'s operation, best effort, never blocking.
    fn abort(&mut self, ctx: &OpCtx, message: &str);
    /// Closes every connection (the group is being destroyed).
    fn close(&mut self);
}

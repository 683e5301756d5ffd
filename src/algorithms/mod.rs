//! Collective algorithms, one per file, in three families:
//!
//! - `*_shm.rs`, used when every rank of the group is on this host: data moves through
//!   shared-memory slots in blocks, synchronized by counters (transport/shm/group.rs).
//! - `*_direct.rs` (and all-to-all, point-to-point), over TCP: each is written against
//!   [`Phase`]: it lists the sends and receives of one step and lets the transport complete
//!   them together. They are *direct*: a rank exchanges with each peer itself (a full mesh).
//! - `hier_*.rs`, used by a *mixed* group (several hosts, some with two or more of its ranks):
//!   a shared-memory step among each host's ranks and a direct step over TCP among one rank
//!   per host (hier.rs). Ops without a hierarchical version run direct over TCP.
//!
//! In the first two families a reduction sums all ranks' inputs in one pass, in rank order,
//! accumulating bf16/fp16 in fp32 with a single rounding; each element is computed on one rank
//! (or identically on all), so every rank ends with the same bits. A hierarchical reduction
//! rounds once per level (hier.rs).

pub mod allgather_direct;
pub mod allgather_shm;
pub mod allreduce_direct;
pub mod allreduce_shm;
pub mod alltoall_pairwise;
pub mod barrier_all;
pub mod barrier_shm;
pub mod broadcast_direct;
pub mod broadcast_shm;
pub mod gather_direct;
pub mod hier;
pub mod hier_allgather;
pub mod hier_allreduce;
pub mod hier_barrier;
pub mod hier_broadcast;
pub mod hier_reduce;
pub mod p2p;
pub mod reduce_direct;
pub mod reduce_scatter_direct;
pub mod reduce_scatter_shm;
pub mod reduce_shm;
pub mod scatter_direct;
pub mod scatter_shm;
pub mod shm_blocks;

use crate::error::Result;
use crate::op::Op;
use crate::reduce::Reduction;
use crate::transport::shm::{Desc, ShmGroup};
use crate::transport::{Direction, MessageId, OpCtx, RawBuf, Transfer, Transport};
use crate::types::DType;

/// What an algorithm works with: the transport, the op's context, and reusable scratch memory.
pub struct Step<'a> {
    pub transport: &'a mut dyn Transport,
    pub ctx: &'a OpCtx,
    pub dtype: DType,
    /// The `count` every frame of this op carries (see the frame docs): checked by receivers.
    pub count: u64,
    /// Root or tag, carried in every frame.
    pub key: i64,
    /// The reduction's ReduceOp code (else 0), carried in every frame and checked.
    pub reduce: u8,
    pub segment_bytes: usize,
    pub scratch: &'a mut Vec<u8>,
    /// Present when every rank is on this host and shared memory is allowed: the group's
    /// shared memory. In a mixed group (`mixed` present): this host's ranks' shared memory,
    /// present when the host has two or more.
    pub shm: Option<&'a mut ShmGroup>,
    /// Present when the group is mixed (hier.rs): the host map, and scratch of its own.
    pub mixed: Option<&'a mut hier::Mixed>,
    /// All-reduces up to this many bytes take the one-shot shared-memory path.
    pub shm_oneshot_bytes: usize,
    /// log2 of the pipeline's chunk size (pipeline.rs), part of the shared-memory description
    /// so that ranks configured differently fail instead of exchanging different ranges.
    pub chunk_log: u32,
    /// The size of the whole group: AVG's divisor. It is the transport's size, except in the
    /// leaders' step of a hierarchical collective, which runs among fewer ranks.
    pub world_size: usize,
}

impl Step<'_> {
    pub fn rank(&self) -> usize {
        self.transport.rank()
    }
    pub fn size(&self) -> usize {
        self.transport.size()
    }

    /// The reduction `op` asks for, AVG dividing by the whole group's size.
    pub fn reduction(&self, op: &Op) -> Reduction {
        op.reduction(self.world_size)
    }

    /// Elements per segment of a reduction round.
    pub fn segment_elems(&self) -> usize {
        (self.segment_bytes / self.dtype.size()).max(1)
    }

    /// Scratch of at least `bytes` bytes (grown, never shrunk, so steady state allocates nothing).
    pub fn scratch(&mut self, bytes: usize) -> RawBuf {
        if self.scratch.len() < bytes {
            self.scratch.resize(bytes, 0);
        }
        RawBuf::from_slice(&mut self.scratch[..bytes])
    }

    /// A fresh phase whose messages carry this op's identity.
    pub fn phase(&self) -> Phase {
        let id = MessageId { op: self.ctx.op as u8, dtype: self.dtype as u8, reduce: self.reduce, seq: self.ctx.seq, count: 0, key: self.key };
        Phase { id, transfers: Vec::new() }
    }

    /// The confirmation step of an operation in which some ranks only send: each receiver
    /// sends an empty frame back to each rank it received from, and each such sender waits for
    /// it. Without it a sender would return Ok even when its receiver rejected the data (wrong
    /// size, wrong root, another collective); with it, the sender reads the receiver's abort.
    pub fn confirm(&mut self, received_from: &[usize], sent_to: &[usize]) -> Result<()> {
        let empty = RawBuf::from_slice(&mut []);
        let mut phase = self.phase();
        for &peer in received_from {
            phase.send(peer, empty, 0);
        }
        for &peer in sent_to {
            phase.recv(peer, empty, 0);
        }
        self.run(phase)
    }

    pub fn run(&mut self, phase: Phase) -> Result<()> {
        if phase.transfers.is_empty() {
            return Ok(());
        }
        self.transport.exchange(&phase.transfers, self.ctx)
    }
}

/// The transfers of one step.
pub struct Phase {
    id: MessageId,
    pub transfers: Vec<Transfer>,
}

impl Phase {
    /// Send `buf` to `peer`, announcing `count` elements (the op's agreed count).
    pub fn send(&mut self, peer: usize, buf: RawBuf, count: u64) {
        self.transfers.push(Transfer { peer, dir: Direction::Send, id: MessageId { count, ..self.id }, buf });
    }

    /// Receive exactly `buf.len()` bytes from `peer`, which must announce `count` elements.
    pub fn recv(&mut self, peer: usize, buf: RawBuf, count: u64) {
        self.transfers.push(Transfer { peer, dir: Direction::Recv, id: MessageId { count, ..self.id }, buf });
    }
}

/// Splits `n` elements into `parts` near-equal consecutive ranges; returns range `i` as
/// (start, len). The first `n % parts` ranges get one element more.
pub fn split_range(n: usize, parts: usize, i: usize) -> (usize, usize) {
    let base = n / parts;
    let extra = n % parts;
    let start = i * base + i.min(extra);
    (start, base + usize::from(i < extra))
}

/// What every rank of a shared-memory group says about `op` before touching peers' data.
fn describe(step: &Step<'_>, op: &Op) -> Desc {
    Desc {
        seq: step.ctx.seq,
        kind: op.kind as u64
            | (op.dtype as u64) << 8
            | if op.is_reduction() { (op.reduce_op as u64) << 16 } else { 0 }
            | (step.chunk_log as u64) << 24,
        count: step.count,
        root: step.key as u64,
    }
}

/// Runs one collective op (not point-to-point) to completion.
pub fn run_collective(step: &mut Step<'_>, op: &Op) -> Result<()> {
    use crate::types::OpKind::*;
    if step.mixed.is_some() {
        let desc = describe(step, op);
        return match op.kind {
            AllReduce => hier_allreduce::run(step, op, desc),
            Broadcast => hier_broadcast::run(step, op, desc),
            Reduce => hier_reduce::run(step, op, desc),
            AllGather => hier_allgather::run(step, op, desc),
            Barrier => hier_barrier::run(step, desc),
            _ => run_direct(step, op),
        };
    }
    if op.kind != AllToAll {
        let desc = describe(step, op);
        if let Some(shm) = step.shm.as_deref_mut() {
            let ctx = step.ctx;
            return match op.kind {
                AllReduce => allreduce_shm::run(shm, ctx, op, desc, step.shm_oneshot_bytes),
                Broadcast => broadcast_shm::run(shm, ctx, op, desc),
                Reduce => reduce_shm::run(shm, ctx, op, desc),
                AllGather => allgather_shm::run(shm, ctx, op, desc, None),
                Gather => allgather_shm::run(shm, ctx, op, desc, Some(op.root as usize)),
                Scatter => scatter_shm::run(shm, ctx, op, desc),
                ReduceScatter => reduce_scatter_shm::run(shm, ctx, op, desc),
                Barrier => barrier_shm::run(shm, ctx, desc),
                AllToAll | Send | Recv | RecvAnySource => unreachable!("not a shared-memory collective"),
            };
        }
    }
    run_direct(step, op)
}

/// Runs `op` with the TCP algorithms, every rank talking to its peers itself.
fn run_direct(step: &mut Step<'_>, op: &Op) -> Result<()> {
    use crate::types::OpKind::*;
    match op.kind {
        AllReduce => allreduce_direct::run(step, op),
        Broadcast => broadcast_direct::run(step, op),
        Reduce => reduce_direct::run(step, op),
        AllGather => allgather_direct::run(step, op),
        Gather => gather_direct::run(step, op),
        Scatter => scatter_direct::run(step, op),
        ReduceScatter => reduce_scatter_direct::run(step, op),
        AllToAll => alltoall_pairwise::run(step, op),
        Barrier => barrier_all::run(step),
        Send | Recv | RecvAnySource => unreachable!("point-to-point ops run through p2p.rs"),
    }
}

#[cfg(test)]
mod tests {
    use super::split_range;
    use crate::failures::Failures;

    #[test]
    fn split_covers_everything() {
        let mut failures = Failures::new();
        for n in [0usize, 1, 5, 7, 100, 1001] {
            for parts in 1..6 {
                let mut next = 0;
                for i in 0..parts {
                    let (s, l) = split_range(n, parts, i);
                    failures.eq(s, next, format_args!("n {n} parts {parts}: start of part {i}"));
                    next = s + l;
                }
                failures.eq(next, n, format_args!("n {n} parts {parts}: end of the last part"));
            }
        }
        failures.finish("split_range");
    }
}

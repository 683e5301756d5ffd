//! Collective algorithms, in three families, one directory each, one algorithm per file named
//! `<collective>_<algorithm>.rs`. Which one serves an op, and on which path, is decided in one
//! place, the table in select.rs, from the op's kind, the shape of the group's fabric
//! (fabric.rs), the op's size and the capabilities of the group's shared memory;
//! [`run_collective`] hands each path the part of the fabric it runs on.
//!
//! - `host/` (`*_shm.rs`), used when every rank of the group is on this host: data moves
//!   through shared-memory slots in blocks, synchronized by counters (transport/shm/group.rs).
//! - `mesh/` (`*_direct.rs`, all-to-all, point-to-point), over TCP: each is written against
//!   [`Phase`]: it lists the sends and receives of one step and lets the transport complete
//!   them together. They are *direct*: a rank exchanges with each peer itself (a full mesh).
//! - `mixed/` (`*_hier.rs`), used by a *mixed* group (several hosts, some with two or more of
//!   its ranks): a shared-memory step among each host's ranks and a direct step over TCP among
//!   one rank per host (mixed/mod.rs). Ops without a hierarchical version run direct over TCP.
//!
//! In the first two families a reduction sums all ranks' inputs in one pass, in rank order,
//! accumulating bf16/fp16 in fp32 with a single rounding; each element is computed on one rank
//! (or identically on all), so every rank ends with the same bits. A hierarchical reduction
//! rounds once per level (mixed/mod.rs).

pub mod host;
pub mod mesh;
pub mod mixed;
pub mod select;
pub mod split;

use crate::error::Result;
use crate::op::{Op, OpIdentity};
use crate::par::Par;
use crate::reduce::Reduction;
use crate::staging::DirectOutput;
use crate::fabric::Parts;
use crate::transport::{Direction, MessageId, OpCtx, RawBuf, Transfer, Transport};
use crate::types::DType;
use select::Path::{self, Only};

/// What an algorithm works with: the mesh (or a subset of it), the op's context and identity,
/// the mesh's settings, this rank's compute threads, and reusable scratch memory. Facts of the
/// op an algorithm runs (its dtype, buffers, root, reduction) are read from the op it is given;
/// shared memory, where a fabric has it, is handed to the algorithms that use it beside the
/// step, with its settings.
pub struct Step<'a> {
    pub transport: &'a mut dyn Transport,
    pub ctx: &'a OpCtx,
    /// The threads that split the copies and reductions of a shared-memory step (par.rs).
    pub par: &'a Par,
    /// What every frame of this op carries and its receivers check: the submitted op's, not
    /// that of the chunk or level the algorithm runs (see `OpIdentity`).
    pub identity: OpIdentity,
    /// A TCP reduction's round size (`XCCL_RS_SEGMENT_BYTES`), a setting of the mesh.
    pub round_bytes: usize,
    pub scratch: &'a mut Vec<u8>,
    /// The size of the whole group: AVG's divisor. It is the transport's size, except in the
    /// leaders' step of a hierarchical collective, which runs among fewer ranks.
    pub world_size: usize,
    /// The staging of the op's accelerator tensors, where the op may take its output from a
    /// peer's registered memory straight onto the device (staging/shared.rs).
    pub direct_output: Option<&'a mut dyn DirectOutput>,
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

    /// Elements of `dtype` a TCP reduction receives from each peer per round.
    pub fn round_elems(&self, dtype: DType) -> usize {
        (self.round_bytes / dtype.size()).max(1)
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
        Phase { id: self.identity.message(self.ctx.seq), transfers: Vec::new() }
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

/// Runs one collective op (not point-to-point) to completion on `path`, the one the table
/// (select.rs) picked for it on this fabric, giving that path the part of the fabric it runs on.
pub fn run_collective(step: &mut Step<'_>, parts: &mut Parts, op: &Op, path: Path) -> Result<()> {
    use select::Algorithm::*;
    let ctx = step.ctx;
    match (path, parts) {
        (Only(AllReduceDirect), _) => mesh::allreduce_direct::run(step, op),
        (Only(BroadcastDirect), _) => mesh::broadcast_direct::run(step, op),
        (Only(ReduceDirect), _) => mesh::reduce_direct::run(step, op),
        (Only(AllGatherDirect), _) => mesh::allgather_direct::run(step, op),
        (Only(GatherDirect), _) => mesh::gather_direct::run(step, op),
        (Only(ScatterDirect), _) => mesh::scatter_direct::run(step, op),
        (Only(ReduceScatterDirect), _) => mesh::reduce_scatter_direct::run(step, op),
        (Only(AllToAllPairwise), _) => mesh::alltoall_pairwise::run(step, op),
        (Only(BarrierDirect), _) => mesh::barrier_direct::run(step),
        (Only(AllReduceHier), Parts::Mixed(mixed)) => mixed::allreduce_hier::run(step, mixed, op),
        (Only(BroadcastHier), Parts::Mixed(mixed)) => mixed::broadcast_hier::run(step, mixed, op),
        (Only(ReduceHier), Parts::Mixed(mixed)) => mixed::reduce_hier::run(step, mixed, op),
        (Only(AllGatherHier), Parts::Mixed(mixed)) => mixed::allgather_hier::run(step, mixed, op),
        (Only(BarrierHier), Parts::Mixed(mixed)) => mixed::barrier_hier::run(step, mixed),
        (Only(AllReduceRing), _) => mesh::allreduce_ring::run(step, op),
        (Only(AllReduceRail), Parts::Mixed(mixed)) => mixed::allreduce_rail::run(step, mixed, op, mesh::allreduce_direct::run),
        (Path::AllReduceRailRing, Parts::Mixed(mixed)) => mixed::allreduce_rail::run(step, mixed, op, mesh::allreduce_ring::run),
        (Only(BroadcastRail), Parts::Mixed(mixed)) => mixed::broadcast_rail::run(step, mixed, op),
        (Only(AllGatherRail), Parts::Mixed(mixed)) => mixed::allgather_rail::run(step, mixed, op),
        (Only(ReduceScatterRail), Parts::Mixed(mixed)) => mixed::reduce_scatter_rail::run(step, mixed, op),
        (Only(ReduceRail), Parts::Mixed(mixed)) => mixed::reduce_rail::run(step, mixed, op),
        (Only(PointToPoint), _) => unreachable!("point-to-point ops run through mesh/p2p.rs"),
        // Every other path is a shared-memory one, which the table picks only on a Host fabric.
        (path, Parts::Host(shm)) => {
            let desc = host::blocks::describe(shm, ctx.seq, &step.identity);
            host::run(path, shm, step.par, ctx, op, desc, step.direct_output.as_mut().map(|d| &mut **d as &mut dyn DirectOutput))
        }
        (path, _) => unreachable!("{path} does not run on this fabric"),
    }
}

//! The selection table: the concrete path that runs an op, from the op's kind, the shape of the
//! group's fabric (fabric.rs), the op's size and what the group's shared memory can do (its
//! slot size, heaps, cross-memory attach). It is the one place that chooses before an op;
//! `run_collective` (mod.rs) only dispatches on what [`select`] returns.
//!
//! First the row, [`algorithm`]: which algorithm serves an op of each kind on each shape. A
//! row's algorithm is of the fabric's own family (`*Shm` on `Host`, `*Hier` on `Mixed`) or of
//! the mesh, which every fabric has: all-to-all goes over the mesh everywhere (pairs exchange
//! distinct data, which shared-memory slots would only copy once more), and so do the
//! collectives that have no hierarchical version yet. Then, within the four shared-memory
//! algorithms that have more than one path, the path, by the size thresholds below (one
//! function each, with its reason). Every rank computes the same path: the capabilities were
//! agreed at set-up, and the sizes are compared across ranks by the op's description.
//!
//! Some choices can only be taken during the op, from what every rank publishes with its first
//! block; they stay in the algorithm files, and the paths that contain them say so by name
//! (`…OrZeroCopy`, `…ZeroCopy`):
//! - whether every rank's buffers lie in its heap, so that the op reads them in place: the
//!   pre-sync of `AllGatherZeroCopy`, `ReduceScatterZeroCopy` and `AllReduceCmaOrZeroCopy`
//!   (host/zero_copy.rs), the first block of `AllReduceSlotsOrZeroCopy` and, the root's answer
//!   only, of `BroadcastSlotsOrZeroCopy`. When the answer is no, the op goes on through the
//!   slots (or, for `AllReduceCmaOrZeroCopy`, by cross-memory attach);
//! - the restart through the slots of `AllReduceSlotsOrZeroCopy` when the ranks' answers
//!   differ (host/allreduce_shm.rs).

use std::collections::HashSet;
use std::fmt;

use crate::fabric::{Parts, Shape};
use crate::op::Op;
use crate::transport::shm::ShmGroup;
use crate::types::OpKind;

/// Every algorithm, named `<Collective><Algorithm>` like its file: a row of the table, and
/// what the statistics name (stats.rs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Algorithm {
    AllReduceDirect,
    BroadcastDirect,
    ReduceDirect,
    AllGatherDirect,
    GatherDirect,
    ScatterDirect,
    ReduceScatterDirect,
    AllToAllPairwise,
    BarrierDirect,
    AllReduceShm,
    BroadcastShm,
    ReduceShm,
    AllGatherShm,
    GatherShm,
    ScatterShm,
    ReduceScatterShm,
    BarrierShm,
    AllReduceHier,
    BroadcastHier,
    ReduceHier,
    AllGatherHier,
    BarrierHier,
    /// Sends and receives: the worker runs them in batches over the mesh (mesh/p2p.rs).
    PointToPoint,
}

/// The concrete path that runs one op (one pipeline chunk of it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Path {
    /// An algorithm that runs one way at every size.
    Only(Algorithm),
    /// One synchronization, every rank reducing the whole tensor from all slots
    /// (host/allreduce_one_shot.rs).
    AllReduceOneShot,
    /// Blocks through the slots, on a group without heaps (host/allreduce_shm.rs).
    AllReduceSlots,
    /// Blocks through the slots, the first block asking whether every tensor lies in its heap;
    /// zero-copy if so (host/allreduce_shm.rs, host/push.rs).
    AllReduceSlotsOrZeroCopy,
    /// A pre-sync, then zero-copy if every tensor lies in its heap, else by cross-memory attach
    /// (host/allreduce_cma.rs).
    AllReduceCmaOrZeroCopy,
    /// Blocks through the root's slot (host/broadcast_shm.rs).
    BroadcastSlots,
    /// Blocks through the root's slot, the first block asking whether the root's tensor lies in
    /// its heap; the others copy it from there if so (host/broadcast_shm.rs).
    BroadcastSlotsOrZeroCopy,
    /// Blocks through every rank's slot (host/allgather_shm.rs).
    AllGatherSlots,
    /// A pre-sync, then reading the peers' inputs in their heaps, or the slots if some are not
    /// there (host/allgather_zero_copy.rs).
    AllGatherZeroCopy,
    /// Lanes of every rank's slot (host/reduce_scatter_shm.rs).
    ReduceScatterSlots,
    /// A pre-sync, then reducing the peers' inputs in their heaps, or the slots if some are not
    /// there (host/reduce_scatter_zero_copy.rs).
    ReduceScatterZeroCopy,
}

impl fmt::Display for Path {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Path::Only(algorithm) => write!(f, "{algorithm:?}"),
            path => write!(f, "{path:?}"),
        }
    }
}

/// What a shared-memory group can do, as the table needs it.
#[derive(Clone, Copy, Debug)]
pub struct ShmCaps {
    pub ranks: usize,
    /// A slot's size (`XCCL_RS_SHM_CHUNK_BYTES`).
    pub slot_bytes: usize,
    /// `XCCL_RS_SHM_ONESHOT_BYTES`.
    pub oneshot_bytes: usize,
    /// Every rank has a heap, so buffers may be read in place (transport/shm/heap.rs).
    pub heaps: bool,
    /// Ranks read each other's memory by cross-memory attach (`XCCL_RS_CMA`).
    pub cma: bool,
}

impl ShmCaps {
    pub fn of(shm: &ShmGroup) -> ShmCaps {
        ShmCaps {
            ranks: shm.size(),
            slot_bytes: shm.slot_bytes(),
            oneshot_bytes: shm.oneshot_bytes(),
            heaps: shm.heaps().is_some_and(|h| h.zero_copy()),
            cma: shm.cma().is_some(),
        }
    }
}

/// A fabric as the table sees it: its shape, and on one host its shared memory's capabilities.
#[derive(Clone, Copy, Debug)]
pub enum FabricCaps {
    Mesh,
    Host(ShmCaps),
    Mixed,
}

impl FabricCaps {
    pub fn of(parts: &Parts) -> FabricCaps {
        match parts {
            Parts::Mesh => FabricCaps::Mesh,
            Parts::Host(shm) => FabricCaps::Host(ShmCaps::of(shm)),
            Parts::Mixed(_) => FabricCaps::Mixed,
        }
    }

    pub fn shape(&self) -> Shape {
        match self {
            FabricCaps::Mesh => Shape::Mesh,
            FabricCaps::Host(_) => Shape::Host,
            FabricCaps::Mixed => Shape::Mixed,
        }
    }
}

/// The algorithm that serves `op` on a fabric of shape `shape`: the table's row.
pub fn algorithm(op: OpKind, shape: Shape) -> Algorithm {
    use Algorithm::*;
    use OpKind::*;
    // One row per op: its algorithm on a Mesh, on a Host, on a Mixed fabric.
    let row = |on_mesh, on_host, on_mixed| match shape {
        Shape::Mesh => on_mesh,
        Shape::Host => on_host,
        Shape::Mixed => on_mixed,
    };
    match op {
        AllReduce => row(AllReduceDirect, AllReduceShm, AllReduceHier),
        Broadcast => row(BroadcastDirect, BroadcastShm, BroadcastHier),
        Reduce => row(ReduceDirect, ReduceShm, ReduceHier),
        AllGather => row(AllGatherDirect, AllGatherShm, AllGatherHier),
        Gather => row(GatherDirect, GatherShm, GatherDirect),
        Scatter => row(ScatterDirect, ScatterShm, ScatterDirect),
        ReduceScatter => row(ReduceScatterDirect, ReduceScatterShm, ReduceScatterDirect),
        AllToAll => AllToAllPairwise,
        Barrier => row(BarrierDirect, BarrierShm, BarrierHier),
        Send | Recv | RecvAnySource => PointToPoint,
    }
}

/// The path that runs an op of kind `op` and `bytes` (as [`op_bytes`] counts them) on `fabric`.
pub fn select(op: OpKind, fabric: &FabricCaps, bytes: usize) -> Path {
    let row = algorithm(op, fabric.shape());
    let FabricCaps::Host(shm) = fabric else { return Path::Only(row) };
    match row {
        Algorithm::AllReduceShm => allreduce_on_host(shm, bytes),
        Algorithm::BroadcastShm => broadcast_on_host(shm, bytes),
        Algorithm::AllGatherShm if tries_zero_copy(shm, bytes) => Path::AllGatherZeroCopy,
        Algorithm::AllGatherShm => Path::AllGatherSlots,
        Algorithm::ReduceScatterShm if tries_zero_copy(shm, bytes) => Path::ReduceScatterZeroCopy,
        Algorithm::ReduceScatterShm => Path::ReduceScatterSlots,
        other => Path::Only(other),
    }
}

/// [`select`] for `op` itself.
pub fn select_for(op: &Op, fabric: &FabricCaps) -> Path {
    let ranks = match fabric {
        FabricCaps::Host(shm) => shm.ranks,
        _ => 1,
    };
    select(op.kind, fabric, op_bytes(op, ranks))
}

/// The size the thresholds compare, in bytes: the op's largest set of buffers on one rank. An
/// all-gather's outputs (every rank's input) and a reduce-scatter's inputs (every rank's
/// output) are `ranks` times its own piece; an all-reduce's or a broadcast's is its tensor.
pub fn op_bytes(op: &Op, ranks: usize) -> usize {
    let first = |bufs: &[crate::transport::RawBuf]| bufs.first().map_or(0, |b| b.len());
    match op.kind {
        OpKind::AllGather => first(&op.inputs) * ranks,
        OpKind::ReduceScatter => first(&op.outputs) * ranks,
        _ => first(&op.outputs),
    }
}

/// The all-reduce's path on one host (a whole-host group, or a host's step of a mixed one).
pub fn allreduce_on_host(shm: &ShmCaps, bytes: usize) -> Path {
    if takes_one_shot(shm, bytes) {
        Path::AllReduceOneShot
    } else if reads_by_cma(shm, bytes) {
        Path::AllReduceCmaOrZeroCopy
    } else if shm.heaps {
        Path::AllReduceSlotsOrZeroCopy
    } else {
        Path::AllReduceSlots
    }
}

/// The broadcast's path on one host (a whole-host group, or a host's step of a mixed one).
pub fn broadcast_on_host(shm: &ShmCaps, bytes: usize) -> Path {
    if tries_zero_copy(shm, bytes) { Path::BroadcastSlotsOrZeroCopy } else { Path::BroadcastSlots }
}

/// Whether an all-reduce of `bytes` takes the one-shot path. There each rank reads every other
/// rank's slot whole, `(ranks - 1) × bytes`, which must stay within `XCCL_RS_SHM_ONESHOT_BYTES`
/// (and the tensor within one slot). So the limit shrinks as the group grows: each rank's reads
/// grow with the group, while the blocked path's grow with the tensor alone.
pub fn takes_one_shot(shm: &ShmCaps, bytes: usize) -> bool {
    bytes <= shm.slot_bytes && bytes.saturating_mul(shm.ranks.saturating_sub(1).max(1)) <= shm.oneshot_bytes
}

/// The smallest all-reduce (bytes) that reads by cross-memory attach: below it the pre-sync
/// and the system calls cost more than the slots' second copy saves. A constant, not a
/// setting: it decides whether the pre-sync happens, so every rank must use the same value.
pub const CMA_MIN_BYTES: usize = 1 << 20;

/// Whether an all-reduce of `bytes`, past the one-shot limit, reads by cross-memory attach.
pub fn reads_by_cma(shm: &ShmCaps, bytes: usize) -> bool {
    shm.cma && bytes >= CMA_MIN_BYTES
}

/// The smallest op (bytes, as [`op_bytes`] counts them) that tries a zero-copy path: an
/// all-gather's or reduce-scatter's pre-sync, when the answer is no, is one synchronization
/// more than the slot path needs, small beside the slot path's copies only from this size; a
/// broadcast asks from the same size. A constant, not a setting, for the reason of
/// [`CMA_MIN_BYTES`].
pub const ZERO_COPY_MIN_BYTES: usize = 1 << 20;

/// Whether an all-gather, reduce-scatter or broadcast of `bytes` tries the zero-copy path.
pub fn tries_zero_copy(shm: &ShmCaps, bytes: usize) -> bool {
    shm.heaps && bytes >= ZERO_COPY_MIN_BYTES
}

/// What a group has run, so that `XCCL_RS_LOG=debug` names each path the table chose once.
#[derive(Default)]
pub struct FirstUses(HashSet<(OpKind, Path, u32)>);

impl FirstUses {
    /// Logs, at debug level, `path`, chosen for `op` on a fabric of `shape`, the first time the
    /// group runs it for that op with a per-rank piece of `bytes` in its size class (the powers
    /// of two); free when debug logging is off.
    pub fn note(&mut self, op: OpKind, shape: Shape, path: Path, bytes: usize, rank: usize) {
        if !tracing::enabled!(tracing::Level::DEBUG) {
            return;
        }
        let class = usize::BITS - bytes.leading_zeros(); // bytes < 2^class
        if self.0.insert((op, path, class)) {
            let up_to = if class >= usize::BITS { "any size".to_string() } else { format!("< {} B", 1usize << class) };
            let algorithm = algorithm(op, shape);
            tracing::debug!(rank, ?op, ?shape, ?algorithm, %path, size = %up_to, "first use of a path");
        }
    }
}

#[cfg(test)]
mod tests;

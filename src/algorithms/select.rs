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
//!   only, of `BroadcastSlotsOrZeroCopy` and `BroadcastCmaOrZeroCopy`. When the answer is no,
//!   the op goes on through the slots (or, for the `…CmaOrZeroCopy` paths, by cross-memory
//!   attach);
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
    AllReduceRing,
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
    AllReduceRail,
    BroadcastRail,
    AllGatherRail,
    ReduceScatterRail,
    ReduceRail,
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
    /// The rail-aligned all-reduce whose step between hosts is a ring (mixed/allreduce_rail.rs
    /// with mesh/allreduce_ring.rs); `Only(AllReduceRail)` runs that step direct.
    AllReduceRailRing,
    /// Blocks through the root's slot (host/broadcast_shm.rs).
    BroadcastSlots,
    /// Blocks through the root's slot, the first block asking whether the root's tensor lies in
    /// its heap; the others copy it from there if so (host/broadcast_shm.rs).
    BroadcastSlotsOrZeroCopy,
    /// The root says with the first block where its tensor lies; the others copy it from its
    /// heap or read it by cross-memory attach, where the root allows it (its staged pinned
    /// buffer, or any tensor with `XCCL_RS_CMA=1`), else through its slot (host/broadcast_shm.rs).
    BroadcastCmaOrZeroCopy,
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
    /// Ranks read each other's memory by cross-memory attach (`XCCL_RS_CMA`): at least the
    /// pinned buffers of staged broadcasts.
    pub cma: bool,
    /// Also ordinary tensors (`XCCL_RS_CMA=1`).
    pub cma_ordinary: bool,
}

impl ShmCaps {
    pub fn of(shm: &ShmGroup) -> ShmCaps {
        ShmCaps {
            ranks: shm.size(),
            slot_bytes: shm.slot_bytes(),
            oneshot_bytes: shm.oneshot_bytes(),
            heaps: shm.heaps().is_some_and(|h| h.zero_copy()),
            cma: shm.cma().is_some(),
            cma_ordinary: shm.cma().is_some_and(|c| c.ordinary()),
        }
    }
}

/// What a mixed fabric's host map allows, as the table needs it.
#[derive(Clone, Copy, Debug)]
pub struct MixedCaps {
    /// The group's size.
    pub ranks: usize,
    /// How many hosts.
    pub hosts: usize,
    /// The ranks per host when every host has the same number, at least two (hosts.rs
    /// `HostMap::uniform`): then the hosts' rails line up and the rail-aligned algorithms run.
    pub rails: Option<usize>,
}

/// A fabric as the table sees it: its shape, and its shared memory's capabilities on one host
/// or its host map's across several.
#[derive(Clone, Copy, Debug)]
pub enum FabricCaps {
    /// TCP among this many ranks.
    Mesh(usize),
    Host(ShmCaps),
    Mixed(MixedCaps),
}

impl FabricCaps {
    /// The capabilities of a group of `ranks` whose fabric has `parts`.
    pub fn of(parts: &Parts, ranks: usize) -> FabricCaps {
        match parts {
            Parts::Mesh => FabricCaps::Mesh(ranks),
            Parts::Host(shm) => FabricCaps::Host(ShmCaps::of(shm)),
            Parts::Mixed(m) => FabricCaps::Mixed(MixedCaps {
                ranks: m.hosts.world_size(),
                hosts: m.hosts.host_count(),
                rails: m.hosts.uniform().filter(|&k| k >= 2),
            }),
        }
    }

    pub fn shape(&self) -> Shape {
        match self {
            FabricCaps::Mesh(_) => Shape::Mesh,
            FabricCaps::Host(_) => Shape::Host,
            FabricCaps::Mixed(_) => Shape::Mixed,
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

/// The algorithm that serves an op of kind `op` and `bytes` on `fabric`: the row, or on a mixed
/// fabric its rail-aligned version where [`across_hosts`] picks it.
pub fn algorithm_of(op: OpKind, fabric: &FabricCaps, bytes: usize) -> Algorithm {
    let row = algorithm(op, fabric.shape());
    match fabric {
        FabricCaps::Mixed(mixed) => across_hosts(row, mixed, bytes),
        FabricCaps::Mesh(ranks) => on_mesh(row, *ranks, bytes),
        FabricCaps::Host(_) => row,
    }
}

/// The algorithm that `path`, picked for an op of kind `op` on `fabric`, belongs to (what
/// statistics name): an algorithm's own path names it, a shared-memory path its row.
pub fn algorithm_of_path(path: Path, op: OpKind, fabric: &FabricCaps) -> Algorithm {
    match path {
        Path::Only(algorithm) => algorithm,
        Path::AllReduceRailRing => Algorithm::AllReduceRail,
        _ => algorithm(op, fabric.shape()),
    }
}

/// The path that runs an op of kind `op` and `bytes` (as [`op_bytes`] counts them) on `fabric`.
pub fn select(op: OpKind, fabric: &FabricCaps, bytes: usize) -> Path {
    let row = algorithm(op, fabric.shape());
    let shm = match fabric {
        FabricCaps::Host(shm) => shm,
        FabricCaps::Mixed(mixed) => return on_mixed(row, mixed, bytes),
        FabricCaps::Mesh(ranks) => return Path::Only(on_mesh(row, *ranks, bytes)),
    };
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
        FabricCaps::Mixed(mixed) => mixed.ranks,
        FabricCaps::Mesh(_) => 1,
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

/// The algorithm of a mixed group's op of `bytes` (as [`op_bytes`] counts them) whose row is
/// `row`: the rail-aligned version where the hosts' rails line up and the op reaches
/// [`RAIL_MIN_BYTES`], else the row (the leader scheme, or direct). Uneven hosts always take
/// the row: a host without a local rank i would leave rail i's share with no one to carry it.
pub fn across_hosts(row: Algorithm, mixed: &MixedCaps, bytes: usize) -> Algorithm {
    if mixed.rails.is_none() || bytes < RAIL_MIN_BYTES {
        return row;
    }
    match row {
        Algorithm::AllReduceHier => Algorithm::AllReduceRail,
        Algorithm::BroadcastHier => Algorithm::BroadcastRail,
        Algorithm::AllGatherHier => Algorithm::AllGatherRail,
        Algorithm::ReduceScatterDirect => Algorithm::ReduceScatterRail,
        Algorithm::ReduceHier => Algorithm::ReduceRail,
        other => other,
    }
}

/// A mixed group's path: [`across_hosts`]'s algorithm, and for a rail-aligned all-reduce the
/// step between hosts ([`rings_between`]).
fn on_mixed(row: Algorithm, mixed: &MixedCaps, bytes: usize) -> Path {
    match across_hosts(row, mixed, bytes) {
        Algorithm::AllReduceRail if rings_between(mixed.hosts, bytes) => Path::AllReduceRailRing,
        algorithm => Path::Only(algorithm),
    }
}

/// A mesh's all-reduce of `bytes` among `ranks`: the ring where [`rings_between`] says so.
fn on_mesh(row: Algorithm, ranks: usize, bytes: usize) -> Algorithm {
    match row {
        Algorithm::AllReduceDirect if rings_between(ranks, bytes) => Algorithm::AllReduceRing,
        other => other,
    }
}

/// Whether an all-reduce of `bytes` among `members` ranks that talk over the network (a mesh's
/// ranks, or the hosts of a rail) runs as a ring rather than direct. Both send each byte twice;
/// the direct exchange does it in two steps of latency but over a connection to every member,
/// the ring in 2(members − 1) steps over two connections. Up to [`RING_MIN_MEMBERS`] − 1
/// members the connections cost little and the steps would; from there, for ops large enough
/// that bandwidth rules ([`RAIL_MIN_BYTES`]), the ring keeps a rank's connections at two, so a
/// large group connects to its ring neighbours, not to everyone. Small ops stay direct (fewer
/// steps; their connections are made on first use).
pub fn rings_between(members: usize, bytes: usize) -> bool {
    members >= RING_MIN_MEMBERS && bytes >= RAIL_MIN_BYTES
}

/// The fewest members whose large all-reduce runs as a ring (see [`rings_between`]).
pub const RING_MIN_MEMBERS: usize = 9;

/// The smallest op (bytes, as [`op_bytes`] counts them) that runs rail-aligned across hosts.
/// A rail-aligned op has one shared-memory step more than the leader scheme's (or, for a
/// reduce-scatter or all-gather, one per host) and k times as many messages between hosts,
/// each 1/k the size; below this size those synchronizations and per-message costs outweigh
/// spreading the bytes over k links. A constant, not a setting: every rank must choose alike.
pub const RAIL_MIN_BYTES: usize = 256 << 10;

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
    if shm.cma && bytes >= CMA_MIN_BYTES {
        Path::BroadcastCmaOrZeroCopy
    } else if tries_zero_copy(shm, bytes) {
        Path::BroadcastSlotsOrZeroCopy
    } else {
        Path::BroadcastSlots
    }
}

/// Whether an all-reduce of `bytes` takes the one-shot path. There each rank reads every other
/// rank's slot whole, `(ranks - 1) × bytes`, which must stay within `XCCL_RS_SHM_ONESHOT_BYTES`
/// (and the tensor within one slot). So the limit shrinks as the group grows: each rank's reads
/// grow with the group, while the blocked path's grow with the tensor alone.
pub fn takes_one_shot(shm: &ShmCaps, bytes: usize) -> bool {
    bytes <= shm.slot_bytes && bytes.saturating_mul(shm.ranks.saturating_sub(1).max(1)) <= shm.oneshot_bytes
}

/// The smallest all-reduce or broadcast (bytes) that reads by cross-memory attach: below it
/// the synchronization and the system calls cost more than the slots' second copy saves (a
/// broadcast of that size asks its root where its tensor lies, `BroadcastCmaOrZeroCopy`). A
/// constant, not a setting: it decides whether the pre-sync happens, so every rank must use the
/// same value.
pub const CMA_MIN_BYTES: usize = 1 << 20;

/// Whether an all-reduce of `bytes`, past the one-shot limit, reads by cross-memory attach.
pub fn reads_by_cma(shm: &ShmCaps, bytes: usize) -> bool {
    shm.cma_ordinary && bytes >= CMA_MIN_BYTES
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
    pub fn note(&mut self, op: OpKind, fabric: &FabricCaps, path: Path, bytes: usize, rank: usize) {
        if !tracing::enabled!(tracing::Level::DEBUG) {
            return;
        }
        let class = usize::BITS - bytes.leading_zeros(); // bytes < 2^class
        if self.0.insert((op, path, class)) {
            let up_to = if class >= usize::BITS { "any size".to_string() } else { format!("< {} B", 1usize << class) };
            let shape = fabric.shape();
            let why = match fabric {
                FabricCaps::Mixed(MixedCaps { rails: None, .. }) => "hosts of unequal size: no rail-aligned algorithms",
                _ => "",
            };
            let algorithm = algorithm_of_path(path, op, fabric);
            tracing::debug!(rank, ?op, ?shape, ?algorithm, %path, size = %up_to, why, "first use of a path");
        }
    }
}

#[cfg(test)]
mod tests;

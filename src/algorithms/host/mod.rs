//! The algorithms over one host's shared memory (`ShmGroup`, transport/shm/group.rs): data
//! moves through each rank's two slots in blocks, synchronized by counters. Buffers that every
//! rank allocated in its shared-memory heap skip the slots: the zero-copy paths (zero_copy.rs).
//!
//! Each algorithm file runs the paths select.rs names for it and calls no other algorithm file;
//! what several of them run is in the helpers: blocks.rs (the steps every block repeats),
//! slots.rs (the slot loops several algorithms share), zero_copy.rs (the pre-sync and reading
//! peers' heaps), push.rs (the zero-copy all-reduce that two all-reduce paths may end in).
//! [`run`] runs a path that select.rs picked.

pub mod allgather_shm;
pub mod allgather_zero_copy;
pub mod allreduce_cma;
pub mod allreduce_one_shot;
pub mod allreduce_shm;
pub mod barrier_shm;
pub mod blocks;
pub mod broadcast_shm;
pub mod gather_shm;
pub mod push;
pub mod reduce_scatter_shm;
pub mod reduce_scatter_zero_copy;
pub mod reduce_shm;
pub mod scatter_shm;
pub mod slots;
pub mod zero_copy;

use crate::algorithms::select::{Algorithm, Path};
use crate::error::Result;
use crate::op::Op;
use crate::par::Par;
use crate::staging::DirectOutput;
use crate::transport::OpCtx;
use crate::transport::shm::{Desc, ShmGroup};

/// Runs `op` on `path`, one of the shared-memory paths (select.rs), with this rank's compute
/// threads `par` for the copies and reductions of its steps; a broadcast's receiver may take
/// its output straight onto its device through `direct` (broadcast_shm.rs).
pub fn run(path: Path, shm: &mut ShmGroup, par: &Par, ctx: &OpCtx, op: &Op, desc: Desc, direct: Option<&mut dyn DirectOutput>) -> Result<()> {
    use Path::*;
    match path {
        AllReduceOneShot => allreduce_one_shot::run(shm, ctx, op, desc),
        AllReduceSlots => allreduce_shm::run(shm, par, ctx, op, desc),
        AllReduceSlotsOrZeroCopy => allreduce_shm::run_asking_heap(shm, par, ctx, op, desc),
        AllReduceCmaOrZeroCopy => allreduce_cma::run(shm, par, ctx, op, desc),
        BroadcastSlots => broadcast_shm::run(shm, par, ctx, op, desc),
        BroadcastSlotsOrZeroCopy => broadcast_shm::run_asking_root_heap(shm, par, ctx, op, desc, direct),
        BroadcastCmaOrZeroCopy => broadcast_shm::run_asking_root_whereabouts(shm, par, ctx, op, desc, direct),
        AllGatherSlots => allgather_shm::run(shm, par, ctx, op, desc),
        AllGatherZeroCopy => allgather_zero_copy::run(shm, par, ctx, op, desc),
        ReduceScatterSlots => reduce_scatter_shm::run(shm, par, ctx, op, desc),
        ReduceScatterZeroCopy => reduce_scatter_zero_copy::run(shm, par, ctx, op, desc),
        Only(Algorithm::ReduceShm) => reduce_shm::run(shm, par, ctx, op, desc),
        Only(Algorithm::GatherShm) => gather_shm::run(shm, par, ctx, op, desc),
        Only(Algorithm::ScatterShm) => scatter_shm::run(shm, par, ctx, op, desc),
        Only(Algorithm::BarrierShm) => barrier_shm::run(shm, ctx, desc),
        Only(_) | AllReduceRailRing => unreachable!("{path} is not a shared-memory path"),
    }
}

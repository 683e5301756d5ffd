//! What the zero-copy collectives share (`*_zero_copy.rs`). When the ranks' buffers lie in
//! their heaps (transport/shm/heap.rs: tensors from `xccl_rs.empty` or torch's
//! `Backend.allocate_tensor`), ranks read each other's buffers where they are instead of
//! passing them through the slots.
//!
//! Whether they do is agreed per op, during it, in the *pre-sync*: each rank publishes where its
//! buffers lie together with the op's description, and waits for every rank's. Then every rank
//! reads every rank's answer, so all take the same path. Which ops have a pre-sync at all
//! (those whose size repays one synchronization more when the answer is no) is select.rs's
//! choice, made before the op.
//!
//! Every zero-copy op ends by waiting until every rank has published `Consumed` for the
//! pre-sync's block: only then has no peer any reason left to read this rank's buffers, which
//! the caller may overwrite as soon as the op returns. Broadcast and all-reduce through the
//! slots need no pre-sync: each rank gives its answer with the first block of the slot path and
//! fills no slot if it is yes (broadcast_shm.rs, where only the root's answer counts;
//! allreduce_shm.rs).
//!
//! The group reports its heaps (`ShmGroup::heaps`, transport/shm/heap.rs) and carries each
//! rank's `Placement` of an op's buffers beside its description; the helpers here publish this
//! rank's and turn a peer's into its buffers, bounded by its heap.

use super::blocks::{exchange_produced, wait_slot_free};
use crate::error::{CommError, Result};
use crate::transport::shm::layout::Placement;
use crate::transport::shm::{Desc, ShmGroup};
use crate::transport::{OpCtx, RawBuf};

/// The pre-sync: reserves one block, publishes where `views` lie with the op's description,
/// waits for every rank's and checks the descriptions. Returns the block number.
pub fn presync(shm: &mut ShmGroup, ctx: &OpCtx, desc: Desc, views: &[RawBuf]) -> Result<u64> {
    let g = shm.begin_op(1);
    wait_slot_free(shm, g, ctx)?;
    describe_views(shm, g, views, true);
    exchange_produced(shm, g, Some(desc), ctx)?;
    Ok(g)
}

/// Records, with the description of the op starting at block `g`, where this rank's `views`
/// of the op lie: in its staging arena (staging/shared.rs; then it also records which file that
/// is), or in its heap when all lie there evenly spaced (`Heap::placement`); and, if `by_cma`,
/// the first one's address in this process, for peers that read it by cross-memory attach
/// (else 0).
pub fn describe_views(shm: &ShmGroup, g: u64, views: &[RawBuf], by_cma: bool) {
    let addr = views.first().filter(|_| by_cma).map_or(0, |v| v.ptr() as u64);
    let staging = shm.heaps().map(|h| h.staging());
    let in_arena = staging.and_then(|s| Some((s.placement(views)?, s.id()?)));
    if let Some((_, id)) = in_arena {
        shm.publish_arena(id);
    }
    let heap = match in_arena {
        Some((placement, _)) => Some(placement),
        None => shm.heaps().and_then(|h| h.own().placement(views)).map(|(offset, stride)| (offset as u64, stride as u64)),
    };
    shm.place(g, Placement { heap, addr, arena: in_arena.is_some() });
}

/// After rank `r`'s `Produced` ≥ g: whether `r` said its views of the op lie in its heap (or
/// its staging arena), on a group whose ranks read each other's heaps.
pub fn in_heap(shm: &ShmGroup, g: u64, r: usize) -> bool {
    shm.heaps().is_some_and(|h| h.zero_copy()) && shm.placement(g, r).heap.is_some()
}

/// After every rank's `Produced` ≥ g: whether every rank's views of the op lie in its heap.
/// Every rank reads the same published values, so all decide alike.
pub fn all_in_heap(shm: &ShmGroup, g: u64) -> bool {
    (0..shm.size()).all(|r| in_heap(shm, g, r))
}

/// Peer `r`'s `count` views of `len` bytes, read in place in its heap, once `in_heap(shm, g,
/// r)` said they are there. A peer's ranges are used only once they lie inside its heap; one
/// outside is an error (a corrupt or hostile peer), not a read.
pub fn peer_views(shm: &ShmGroup, g: u64, r: usize, count: usize, len: usize) -> Result<Vec<RawBuf>> {
    debug_assert!(r != shm.rank(), "a rank's own views are its op's buffers");
    let heaps = shm.heaps().filter(|h| h.zero_copy());
    let placement = shm.placement(g, r);
    let (Some(heaps), Some((offset, stride)), false) = (heaps, placement.heap, placement.arena) else {
        return Err(CommError::io(format!("local rank {r}'s buffers are not in its heap")));
    };
    heaps.peer(r).and_then(|heap| heap.views(offset, stride, count, len)).ok_or_else(|| {
        CommError::io(format!(
            "rank {} published {count} buffers of {len} bytes at offset {offset} (spacing {stride}) of its heap, which lie outside it",
            shm.group_rank(r)
        ))
    })
}

/// Counts the op of sequence number `seq` as zero-copy (`Heaps::count_zero_copy_op`).
pub fn count_zero_copy(shm: &mut ShmGroup, seq: u64) {
    if let Some(heaps) = shm.heaps_mut() {
        heaps.count_zero_copy_op(seq);
    }
}

/// Whether `a` and `b` share a byte.
pub fn overlap(a: RawBuf, b: RawBuf) -> bool {
    let (a0, b0) = (a.ptr() as usize, b.ptr() as usize);
    !a.is_empty() && !b.is_empty() && a0 < b0 + b.len() && b0 < a0 + a.len()
}

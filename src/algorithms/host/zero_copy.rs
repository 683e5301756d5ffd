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

use super::blocks::{exchange_produced, wait_slot_free};
use crate::error::{CommError, Result};
use crate::transport::shm::{Desc, ShmGroup};
use crate::transport::{OpCtx, RawBuf};

/// The pre-sync: reserves one block, publishes where `views` lie with the op's description,
/// waits for every rank's and checks the descriptions. Returns the block number.
pub fn presync(shm: &mut ShmGroup, ctx: &OpCtx, desc: Desc, views: &[RawBuf]) -> Result<u64> {
    let g = shm.begin_op(1);
    wait_slot_free(shm, g, ctx)?;
    shm.describe_heap(g, views);
    exchange_produced(shm, g, Some(desc), ctx)?;
    Ok(g)
}

/// Peer `r`'s `count` views of `len` bytes in its heap, once `shm.in_heap(g, r)` said they are
/// there (bounds-checked by `heap_views`).
pub fn peer_views(shm: &ShmGroup, g: u64, r: usize, count: usize, len: usize) -> Result<Vec<RawBuf>> {
    shm.heap_views(g, r, count, len)?.ok_or_else(|| CommError::io(format!("local rank {r}'s buffers are not in its heap")))
}

/// Whether `a` and `b` share a byte.
pub fn overlap(a: RawBuf, b: RawBuf) -> bool {
    let (a0, b0) = (a.ptr() as usize, b.ptr() as usize);
    !a.is_empty() && !b.is_empty() && a0 < b0 + b.len() && b0 < a0 + a.len()
}

//! All-reduce in place, zero-copy: when every rank's tensor lies in its heap
//! (transport/shm/heap.rs: tensors from `xccl_rs.empty` or torch's `Backend.allocate_tensor`),
//! ranks read each other's tensors where they are instead of passing them through the slots.
//!
//! Whether they do is agreed per op. Each rank publishes where its tensor lies together with
//! the op's description: one synchronization, the *pre-sync*. Then every rank reads every
//! rank's answer, so all take the same path. When some tensor is not in a heap, the pre-sync is
//! one synchronization more than the slot path would have needed, so only tensors of at least
//! [`ZERO_COPY_MIN_BYTES`] try (the slot path's own time there is hundreds of µs).
//!
//! The algorithm (B_r: rank r's tensor, cut in `size` parts as the blocked path cuts a block):
//! 1. After the pre-sync every input is ready. Rank r reduces part r of every B_j into part r
//!    of its own B_r (its own part is a source and the destination: `reduce_raw` allows them to
//!    be exactly equal), then publishes `Reduced`.
//! 2. Once all have, part j of B_j is final everywhere: rank r copies it into part j of B_r for
//!    every j ≠ r, then publishes `Consumed`.
//! 3. Once all have, no rank reads B_r any more, and the op returns (the caller may then write
//!    its tensor).
//!
//! Rank r writes only its own tensor, and only parts no peer reads at that step: in step 1 part
//! r (peers read their own parts), in step 2 the parts j ≠ r (peers read part r). Per rank this
//! moves N bytes read and N/n written in step 1, (n−1)/n·N read and written in step 2: about 3N
//! of memory traffic, against 5N through the slots. Every element is reduced once, on its
//! part's owner, in rank order: every rank ends with the same bits as on the slot path.

use super::allreduce_shm::blocked;
use super::blocks::{exchange_produced, finish_block, wait_slot_free};
use crate::algorithms::split::split_range;
use crate::error::Result;
use crate::op::Op;
use crate::transport::OpCtx;
use crate::transport::shm::{Counter, Desc, ShmGroup};

/// The smallest all-reduce that tries the zero-copy path. Every rank must use the same value
/// (it decides whether the pre-sync happens), so it is a constant, not a setting.
pub const ZERO_COPY_MIN_BYTES: usize = 1 << 20;

/// Whether an all-reduce of `bytes` on `shm` goes through the pre-sync (the same on every rank).
pub fn tries(shm: &ShmGroup, bytes: usize) -> bool {
    shm.zero_copy() && bytes >= ZERO_COPY_MIN_BYTES
}

/// Runs the all-reduce zero-copy if every rank's tensor is in its heap, else through the slots.
pub fn run(shm: &mut ShmGroup, ctx: &OpCtx, op: &Op, desc: Desc) -> Result<()> {
    let buf = op.outputs[0];
    let g = shm.begin_op(1);
    wait_slot_free(shm, g, ctx)?;
    shm.describe_heap(g, buf);
    exchange_produced(shm, g, Some(desc), ctx)?;
    let Some(bufs) = shm.heap_bufs(g, buf.len(), buf)? else {
        finish_block(shm, g);
        return blocked(shm, ctx, op, desc, None);
    };
    shm.count_zero_copy_op();
    let (rank, size) = (shm.rank(), shm.size());
    let esz = op.dtype.size();
    let part = |r: usize| {
        let (s, l) = split_range(buf.len() / esz, size, r);
        (s * esz, l * esz)
    };
    let (my_start, my_len) = part(rank);
    if my_len > 0 {
        let srcs: Vec<*const u8> = bufs.iter().map(|b| b.sub(my_start, my_len).ptr() as *const u8).collect();
        let reduction = op.reduction(size);
        // SAFETY: every rank's tensor holds its input (all published Produced for g after their
        // input was ready) and has `buf.len()` bytes (the descriptions matched, and heap_bufs
        // bounded each range by its heap); the destination, my part of my own tensor, is
        // exactly equal to srcs[rank] and disjoint from the other sources (other tensors); no
        // peer writes any of these ranges before all have published Reduced (step 2).
        unsafe { shm.par().reduce(&reduction, bufs[rank].sub(my_start, my_len).ptr(), &srcs, my_len / esz, esz) };
    }
    shm.publish(Counter::Reduced, g);
    shm.wait_all(Counter::Reduced, g, ctx)?;
    let copies: Vec<_> = (0..size)
        .filter(|&r| r != rank)
        .map(|r| {
            let (s, l) = part(r);
            (bufs[r].sub(s, l), buf.sub(s, l))
        })
        .collect();
    shm.par().copy_all(&copies);
    shm.publish(Counter::Consumed, g);
    shm.wait_all(Counter::Consumed, g, ctx)
}

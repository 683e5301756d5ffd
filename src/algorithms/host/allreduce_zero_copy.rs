//! All-reduce in place, zero-copy (zero_copy.rs): every rank's tensor lies in its heap.
//!
//! B_r is rank r's tensor, cut in `size` parts as the blocked path cuts a block.
//! 1. After the pre-sync every input is ready. Rank r reduces part r of every B_j into part r
//!    of its own B_r (its own part is a source and the destination: `reduce_raw` allows them to
//!    be exactly equal), then publishes `Reduced`.
//! 2. Once all have, part j of B_j is final everywhere: rank r copies it into part j of B_r for
//!    every j ≠ r, then publishes `Consumed`, and waits for everyone's (zero_copy.rs).
//!
//! Rank r writes only its own tensor, and only parts no peer reads at that step: in step 1 part
//! r (peers read their own parts), in step 2 the parts j ≠ r (peers read part r). Per rank this
//! moves N bytes read and N/n written in step 1, (n−1)/n·N read and written in step 2: about 3N
//! of memory traffic, against 5N through the slots. Every element is reduced once, on its
//! part's owner, in rank order: every rank ends with the same bits as on the slot path.

use super::allreduce_shm::blocked;
use super::blocks::finish_block;
use super::zero_copy::{peer_views, presync};
use crate::algorithms::split::split_range;
use crate::error::Result;
use crate::op::Op;
use crate::transport::OpCtx;
use crate::transport::shm::{Counter, Desc, ShmGroup};

/// Runs the all-reduce zero-copy if every rank's tensor is in its heap, else by cross-memory
/// attach where the group can, else through the slots.
pub fn run(shm: &mut ShmGroup, ctx: &OpCtx, op: &Op, desc: Desc) -> Result<()> {
    let buf = op.outputs[0];
    let g = presync(shm, ctx, desc, &[buf])?;
    if !shm.all_in_heap(g) && shm.cma() {
        return super::allreduce_cma::run(shm, ctx, op, g);
    }
    if !shm.all_in_heap(g) {
        finish_block(shm, g);
        return blocked(shm, ctx, op, desc, None);
    }
    let (rank, size) = (shm.rank(), shm.size());
    let mut bufs = Vec::with_capacity(size);
    for r in 0..size {
        bufs.push(if r == rank { buf } else { peer_views(shm, g, r, 1, buf.len())?[0] });
    }
    shm.count_zero_copy_op();
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
        // input was ready) and has `buf.len()` bytes (the descriptions matched, and heap_views
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

//! All-reduce in place, zero-copy (zero_copy.rs): every rank's tensor lies in its heap.
//!
//! B_r is rank r's tensor. It goes in blocks of one slot's size (the same ranges on every rank),
//! each cut in `size` parts as the blocked path cuts a block. Per block:
//! 1. Rank r reduces part r of the block of every B_j into part r of its own B_r (its own part
//!    is a source and the destination: `reduce_raw` allows them to be exactly equal), then
//!    publishes `Reduced` for the block (the pre-sync made every input ready).
//! 2. Once all have, part j of B_j is final everywhere: rank r copies it into part j of B_r for
//!    every j ≠ r, and goes on with the next block.
//!
//! After the last block every rank publishes `Consumed` and waits for everyone's (zero_copy.rs).
//!
//! Rank r writes only its own tensor, and only parts no peer reads at that step: in step 1 part
//! r (peers read their own parts), in step 2 the parts j ≠ r (peers read part r); blocks are
//! disjoint, so a rank may start the next block while peers still copy this one. Per rank this
//! moves N bytes read and N/n written in step 1, (n−1)/n·N read and written in step 2: about 3N
//! of memory traffic, against 5N through the slots. In blocks, what step 2 reads the peers
//! have just written, and what it overwrites they have just read: both are still in the
//! shared cache, so fewer of step 2's bytes go to memory (docs/perf.md measures it).
//! Every element is reduced once, on its part's owner, in rank order: every rank ends with the
//! same bits as on the slot path.

use super::allreduce_shm::blocked;
use super::blocks::{block_count, block_range, finish_block};
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
    let piece = block_bytes(shm.chunk(), esz);
    let blocks = block_count(buf.len(), piece);
    // Block b's reductions are announced as `Reduced` for g + b (the pre-sync took g).
    let last = g + blocks as u64 - 1;
    let next = shm.begin_op(blocks as u64 - 1);
    debug_assert!(blocks == 1 || next == g + 1, "the blocks follow the pre-sync's");
    let reduction = op.reduction(size);
    for b in 0..blocks {
        let (start, len) = block_range(buf.len(), piece, b);
        let part = |r: usize| {
            let (s, l) = split_range(len / esz, size, r);
            (start + s * esz, l * esz)
        };
        let (my_start, my_len) = part(rank);
        if my_len > 0 {
            let srcs: Vec<*const u8> = bufs.iter().map(|t| t.sub(my_start, my_len).ptr() as *const u8).collect();
            // SAFETY: every rank's tensor holds its input (all published Produced for g after
            // their input was ready) and has `buf.len()` bytes (the descriptions matched, and
            // heap_views bounded each range by its heap); the destination, my part of this
            // block of my own tensor, is exactly equal to srcs[rank] and disjoint from the
            // other sources (other tensors); no peer writes any of these ranges before all
            // have published Reduced for this block (step 2).
            unsafe { shm.par().reduce(&reduction, bufs[rank].sub(my_start, my_len).ptr(), &srcs, my_len / esz, esz) };
        }
        let gb = g + b as u64;
        shm.publish(Counter::Reduced, gb);
        shm.wait_all(Counter::Reduced, gb, ctx)?;
        let copies: Vec<_> = (0..size)
            .filter(|&r| r != rank)
            .map(|r| {
                let (s, l) = part(r);
                (bufs[r].sub(s, l), buf.sub(s, l))
            })
            .collect();
        shm.par().copy_all_out(&copies, buf.len());
    }
    shm.publish(Counter::Consumed, last);
    shm.wait_all(Counter::Consumed, last, ctx)
}

/// Bytes of every tensor that one block covers, whole elements: the slot size, so that what
/// the ranks reduce in a block (`size` × this, read from every tensor) is still in the shared
/// cache when each rank copies the other ranks' parts. Every rank agrees on it: the slot size
/// is part of the op's description. (With the copies' streaming stores, blocks of 4 MiB took
/// 13.0 ms at 64 MiB and 8 ranks against 14.7-15.5 ms for the whole tensor in one block,
/// docs/perf.md.)
fn block_bytes(chunk: usize, esz: usize) -> usize {
    chunk / esz * esz
}

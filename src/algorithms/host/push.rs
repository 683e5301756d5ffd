//! All-reduce in place, zero-copy (zero_copy.rs): every rank's tensor lies in its heap. A piece
//! that two all-reduce paths share, not a path select.rs picks: each of them finds during the op
//! that every tensor is in its heap (allreduce_shm.rs after its first block, allreduce_cma.rs
//! after its pre-sync) and then finishes the op here.
//!
//! B_r is rank r's tensor; every tensor is cut in the same `size` parts (per block, below).
//! Rank r alone reads and writes part r of every tensor: it reduces part r of every B_j in rank
//! order (scaling fused) into part r of its own B_r, then writes that result into part r of
//! every peer's B_j. No other rank reads or writes part r, so the parts need no
//! synchronization between them: after the exchange that showed every tensor in its heap (the
//! slot path's first block, or the cross-memory attach path's pre-sync), each rank goes through
//! its parts alone, then publishes `Consumed` and waits for everyone's (zero_copy.rs): only then
//! is every rank's tensor complete.
//!
//! Per rank this moves N bytes read and N written (N/n of them to its own tensor, in cache),
//! against 3N when each rank gathered the reduced parts itself after a synchronization per
//! block, and 5N through the slots. The writes into the peers' tensors are copy-outs (streaming
//! stores from the group's limit, par.rs). Every element is reduced once, on its part's owner,
//! in rank order: every rank ends with the same bits as on the slot path.
//!
//! The parts go in blocks (`block_bytes`: one slot's size of every tensor, cut in `size` parts
//! as the blocked slot path cuts a block), each block one hand-off to the rank's threads: each
//! thread reduces a piece of part r and copies it to the peers while it is still in its cache.

use super::blocks::{block_count, block_range};
use super::zero_copy::{count_zero_copy, peer_views};
use crate::algorithms::split::split_range;
use crate::error::Result;
use crate::op::Op;
use crate::par::Par;
use crate::transport::OpCtx;
use crate::transport::shm::{Counter, ShmGroup};

/// The all-reduce itself, once every rank said, with the op's block `first`, that its tensor
/// lies in its heap; marks all the op's blocks (up to `last`) done.
pub fn push(shm: &mut ShmGroup, par: &Par, ctx: &OpCtx, op: &Op, first: u64, last: u64) -> Result<()> {
    let buf = op.outputs[0];
    let g = first;
    let (rank, size) = (shm.rank(), shm.size());
    let mut bufs = Vec::with_capacity(size);
    for r in 0..size {
        bufs.push(if r == rank { buf } else { peer_views(shm, g, r, 1, buf.len())?[0] });
    }
    count_zero_copy(shm, ctx.seq);
    let esz = op.dtype.size();
    let piece = block_bytes(shm.slot_bytes(), esz);
    let reduction = op.reduction(size);
    let (mut srcs, mut replicas) = (Vec::with_capacity(size), Vec::with_capacity(size - 1));
    for b in 0..block_count(buf.len(), piece) {
        let (start, len) = block_range(buf.len(), piece, b);
        let (s, l) = split_range(len / esz, size, rank);
        let (my_start, my_len) = (start + s * esz, l * esz);
        if my_len == 0 {
            continue;
        }
        srcs.clear();
        srcs.extend(bufs.iter().map(|t| t.sub(my_start, my_len).ptr() as *const u8));
        replicas.clear();
        replicas.extend((0..size).filter(|&r| r != rank).map(|r| bufs[r].sub(my_start, my_len).ptr()));
        // SAFETY: every rank's tensor holds its input (all published Produced for g after
        // their input was ready) and has `buf.len()` bytes (the descriptions matched, and
        // peer_views bounded each range by its heap); the destination, my part of my own
        // tensor, is exactly srcs[rank]; each replica, my part of a peer's tensor, is exactly
        // that peer's src and lies in another tensor than the destination and the other
        // replicas; no other rank reads or writes my part of any tensor (module comment), and
        // no rank returns, letting its caller touch its tensor, before all published Consumed.
        unsafe {
            par.reduce_and_replicate(&reduction, buf.sub(my_start, my_len).ptr(), &srcs, &replicas, my_len / esz, esz, buf.len())
        };
    }
    shm.publish(Counter::Reduced, last);
    shm.publish(Counter::Consumed, last);
    shm.wait_all(Counter::Consumed, last, ctx)
}

/// Bytes of every tensor that one block covers, whole elements: the slot size, which every
/// rank agrees on (it is part of the op's description). Blocks much larger than a slot would
/// leave the cache before their replicas are written (docs/perf.md measures the sizes).
fn block_bytes(chunk: usize, esz: usize) -> usize {
    chunk / esz * esz
}

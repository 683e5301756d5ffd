//! Broadcast over shared memory: the root copies each block of its tensor into its slot; the
//! others copy it out of the root's slot straight into their tensors. Slots alternate, so the
//! root fills block g + 1 while the others read block g.
//!
//! When the root's tensor lies in its heap (an op of at least `ZERO_COPY_MIN_BYTES`), the
//! root says so with the first block instead of filling its slot, and the others copy the
//! whole tensor from the root's heap (broadcast_zero_copy.rs). That costs no synchronization
//! more than the slot path: the others learn it from the first block's description.

use super::blocks::{block_count, block_range, exchange_produced, finish_block, wait_slot_free};
use super::{broadcast_zero_copy, zero_copy};
use crate::error::Result;
use crate::op::Op;
use crate::transport::OpCtx;
use crate::transport::shm::{Desc, ShmGroup};

pub fn run(shm: &mut ShmGroup, ctx: &OpCtx, op: &Op, desc: Desc) -> Result<()> {
    let rank = shm.rank();
    let root = op.root as usize;
    let buf = op.outputs[0];
    let piece = shm.chunk();
    let blocks = block_count(buf.len(), piece);
    let g0 = shm.begin_op(blocks as u64);
    let tries_zero_copy = zero_copy::tries(shm, buf.len());
    for b in 0..blocks {
        let g = g0 + b as u64;
        let (start, len) = block_range(buf.len(), piece, b);
        wait_slot_free(shm, g, ctx)?;
        let in_place = b == 0 && tries_zero_copy && {
            // Every rank writes its answer (only the root's is read), so no stale one remains.
            shm.describe_heap(g, if rank == root { &op.outputs[..1] } else { &[] });
            shm.in_heap(g, root)
        };
        if rank == root && !in_place {
            shm.par().copy(buf.sub(start, len), shm.slot(rank, g).sub(0, len));
        }
        exchange_produced(shm, g, (b == 0).then_some(desc), ctx)?;
        // The root's description is checked now, so its heap answer is that of this op.
        if b == 0 && tries_zero_copy && shm.in_heap(g, root) {
            return broadcast_zero_copy::finish(shm, ctx, op, g, g0 + blocks as u64 - 1);
        }
        if rank != root {
            shm.par().copy_out(shm.slot(root, g).sub(0, len), buf.sub(start, len), buf.len());
        }
        finish_block(shm, g);
    }
    Ok(())
}

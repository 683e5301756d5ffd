//! Broadcast over shared memory: the root copies each block of its tensor into its slot; the
//! others copy it out of the root's slot straight into their tensors. Slots alternate, so the
//! root fills block g + 1 while the others read block g.

use super::blocks::{block_count, block_range, exchange_produced, finish_block, wait_slot_free};
use crate::error::Result;
use crate::op::Op;
use crate::transport::shm::{Desc, ShmGroup};
use crate::transport::OpCtx;

pub fn run(shm: &mut ShmGroup, ctx: &OpCtx, op: &Op, desc: Desc) -> Result<()> {
    let rank = shm.rank();
    let root = op.root as usize;
    let buf = op.outputs[0];
    let piece = shm.chunk();
    let blocks = block_count(buf.len(), piece);
    let g0 = shm.begin_op(blocks as u64);
    for b in 0..blocks {
        let g = g0 + b as u64;
        let (start, len) = block_range(buf.len(), piece, b);
        wait_slot_free(shm, g, ctx)?;
        if rank == root {
            shm.par().copy(buf.sub(start, len), shm.slot(rank, g).sub(0, len));
        }
        exchange_produced(shm, g, (b == 0).then_some(desc), ctx)?;
        if rank != root {
            shm.par().copy(shm.slot(root, g).sub(0, len), buf.sub(start, len));
        }
        finish_block(shm, g);
    }
    Ok(())
}

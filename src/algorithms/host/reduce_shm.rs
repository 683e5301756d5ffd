//! Reduce over shared memory: the blocked all-reduce's first two steps (every rank reduces its
//! part of each block into its slot), then only the root copies the parts into its tensor.
//! Other ranks' tensors are left unchanged.

use super::blocks::{block_count, block_range, copy_reduced_parts, finish_block, part, reduce_own_part};
use crate::error::Result;
use crate::op::Op;
use crate::transport::shm::{Counter, Desc, ShmGroup};
use crate::transport::OpCtx;

pub fn run(shm: &mut ShmGroup, ctx: &OpCtx, op: &Op, desc: Desc) -> Result<()> {
    let (rank, size) = (shm.rank(), shm.size());
    let root = op.root as usize;
    let buf = op.outputs[0];
    let esz = op.dtype.size();
    let piece = shm.chunk() / esz * esz;
    let blocks = block_count(buf.len(), piece);
    let g0 = shm.begin_op(blocks as u64);
    let reduction = op.reduction(size);
    for b in 0..blocks {
        let g = g0 + b as u64;
        let (start, len) = block_range(buf.len(), piece, b);
        let block = buf.sub(start, len);
        reduce_own_part(shm, ctx, g, block, (b == 0).then_some(desc), &reduction, esz)?;
        if rank == root {
            shm.wait_all(Counter::Reduced, g, ctx)?;
            copy_reduced_parts(shm, g, block, |r| part(len, esz, size, r));
        }
        finish_block(shm, g);
    }
    Ok(())
}

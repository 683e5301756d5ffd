//! Reduce over shared memory: the blocked all-reduce's first two steps (every rank reduces its
//! part of each block into its slot), then only the root copies the parts into its tensor.
//! Other ranks' tensors are left unchanged.

use super::blocks::{block_count, block_range, copy_reduced_parts, exchange_produced, finish_block, wait_slot_free};
use crate::algorithms::split::split_range;
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
        let part = |r: usize| {
            let (s, l) = split_range(len / esz, size, r);
            (s * esz, l * esz)
        };
        wait_slot_free(shm, g, ctx)?;
        let mine = shm.slot(rank, g);
        let (my_start, my_len) = part(rank);
        let after = my_start + my_len;
        shm.par().copy_all(&[
            (block.sub(0, my_start), mine.sub(0, my_start)),
            (block.sub(after, len - after), mine.sub(after, len - after)),
        ]);
        exchange_produced(shm, g, (b == 0).then_some(desc), ctx)?;
        let srcs: Vec<*const u8> = (0..size)
            .map(|r| if r == rank { block.sub(my_start, my_len).ptr() } else { shm.slot(r, g).sub(my_start, my_len).ptr() } as *const u8)
            .collect();
        if my_len > 0 {
            // SAFETY: as in allreduce_shm: peers' slots hold my part of their inputs, my part
            // comes from my tensor, and the destination (my slot's part) is disjoint from both.
            unsafe { shm.par().reduce(&reduction, mine.sub(my_start, my_len).ptr(), &srcs, my_len / esz, esz) };
        }
        shm.publish(Counter::Reduced, g);
        if rank == root {
            shm.wait_all(Counter::Reduced, g, ctx)?;
            copy_reduced_parts(shm, g, block, part);
        }
        finish_block(shm, g);
    }
    Ok(())
}

//! Reduce-scatter over shared memory: each rank's slot is cut into `size` *lanes*; per block
//! each rank copies the next piece of its input view for rank k into lane k; once all have,
//! each rank reduces its own lane from every peer's slot (its own piece from its input view,
//! in rank order, scaling fused) straight into its output.

use super::blocks::{block_count, block_range, exchange_produced, finish_block, wait_slot_free};
use crate::error::Result;
use crate::op::Op;
use crate::transport::OpCtx;
use crate::transport::shm::{Desc, ShmGroup};

pub fn run(shm: &mut ShmGroup, ctx: &OpCtx, op: &Op, desc: Desc) -> Result<()> {
    let (rank, size) = (shm.rank(), shm.size());
    let output = op.outputs[0];
    let esz = op.dtype.size();
    let lane = shm.chunk() / size / 64 * 64 / esz * esz;
    let blocks = block_count(output.len(), lane);
    let g0 = shm.begin_op(blocks as u64);
    let reduction = op.reduction(size);
    for b in 0..blocks {
        let g = g0 + b as u64;
        let (start, len) = block_range(output.len(), lane, b);
        wait_slot_free(shm, g, ctx)?;
        let slot = shm.slot(rank, g);
        let copies: Vec<_> =
            (0..size).filter(|&p| p != rank).map(|peer| (op.inputs[peer].sub(start, len), slot.sub(peer * lane, len))).collect();
        shm.par().copy_all(&copies);
        exchange_produced(shm, g, (b == 0).then_some(desc), ctx)?;
        let srcs: Vec<*const u8> = (0..size)
            .map(
                |r| if r == rank { op.inputs[rank].sub(start, len).ptr() } else { shm.slot(r, g).sub(rank * lane, len).ptr() } as *const u8,
            )
            .collect();
        if len > 0 {
            // SAFETY: peers' lanes for this rank hold `len` bytes of their inputs (published
            // Produced for g); the destination is this rank's output, which c10d guarantees is
            // not one of its input views, and is disjoint from every slot.
            unsafe { shm.par().reduce(&reduction, output.sub(start, len).ptr(), &srcs, len / esz, esz) };
        }
        finish_block(shm, g);
    }
    Ok(())
}

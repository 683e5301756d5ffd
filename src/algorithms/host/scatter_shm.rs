//! Scatter over shared memory: the root's slot is cut into `size` *lanes*; per block the root
//! copies the next piece of each rank's input view into that rank's lane, and each rank copies
//! its lane out into its output.

use super::blocks::{block_count, block_range, exchange_produced, finish_block, wait_slot_free};
use crate::error::Result;
use crate::op::Op;
use crate::transport::OpCtx;
use crate::transport::shm::{Desc, ShmGroup};

pub fn run(shm: &mut ShmGroup, ctx: &OpCtx, op: &Op, desc: Desc) -> Result<()> {
    let (rank, size) = (shm.rank(), shm.size());
    let root = op.root as usize;
    let output = op.outputs[0];
    let lane = shm.chunk() / size / 64 * 64;
    let blocks = block_count(output.len(), lane);
    let g0 = shm.begin_op(blocks as u64);
    for b in 0..blocks {
        let g = g0 + b as u64;
        let (start, len) = block_range(output.len(), lane, b);
        wait_slot_free(shm, g, ctx)?;
        if rank == root {
            let slot = shm.slot(rank, g);
            let copies: Vec<_> =
                (0..size).filter(|&p| p != rank).map(|peer| (op.inputs[peer].sub(start, len), slot.sub(peer * lane, len))).collect();
            shm.par().copy_all(&copies);
        }
        exchange_produced(shm, g, (b == 0).then_some(desc), ctx)?;
        if rank != root {
            shm.par().copy(shm.slot(root, g).sub(rank * lane, len), output.sub(start, len));
        }
        finish_block(shm, g);
    }
    if rank == root {
        shm.par().copy(op.inputs[rank], output);
    }
    Ok(())
}

//! Scatter over shared memory: the root's slot is cut into `size` *lanes*; per block the root
//! copies the next piece of each rank's input view into that rank's lane, and each rank copies
//! its lane out into its output.

use super::blocks::{Block, each_block, exchange_produced, finish_block};
use crate::error::Result;
use crate::op::Op;
use crate::par::Par;
use crate::transport::OpCtx;
use crate::transport::shm::{Desc, ShmGroup};

pub fn run(shm: &mut ShmGroup, par: &Par, ctx: &OpCtx, op: &Op, desc: Desc) -> Result<()> {
    let (rank, size) = (shm.rank(), shm.size());
    let root = op.root as usize;
    let output = op.outputs[0];
    let lane = shm.slot_bytes() / size / 64 * 64;
    each_block(shm, ctx, output.len(), lane, |shm, Block { index: b, g, start, len, .. }| {
        if rank == root {
            let slot = shm.slot(rank, g);
            let copies: Vec<_> =
                (0..size).filter(|&p| p != rank).map(|peer| (op.inputs[peer].sub(start, len), slot.sub(peer * lane, len))).collect();
            par.copy_all(&copies);
        }
        exchange_produced(shm, g, (b == 0).then_some(desc), ctx)?;
        if rank != root {
            par.copy(shm.slot(root, g).sub(rank * lane, len), output.sub(start, len));
        }
        finish_block(shm, g);
        Ok(())
    })?;
    if rank == root {
        par.copy(op.inputs[rank], output);
    }
    Ok(())
}

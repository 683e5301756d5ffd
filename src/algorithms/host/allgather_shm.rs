//! All-gather over shared memory: each rank copies a block of its input into its slot; once
//! all have, each *reader* copies every peer's block out of that peer's slot into the peer's
//! output view. Every rank reads; a gather (gather_shm.rs) is the same with only the root.

use super::blocks::{block_count, block_range, exchange_produced, finish_block, wait_slot_free};
use crate::error::Result;
use crate::op::Op;
use crate::transport::OpCtx;
use crate::transport::shm::{Desc, ShmGroup};

pub fn run(shm: &mut ShmGroup, ctx: &OpCtx, op: &Op, desc: Desc) -> Result<()> {
    gather_to(shm, ctx, op, desc, None)
}

/// `reader`: None for all-gather (everyone reads), Some(root) for gather.
pub fn gather_to(shm: &mut ShmGroup, ctx: &OpCtx, op: &Op, desc: Desc, reader: Option<usize>) -> Result<()> {
    let (rank, size) = (shm.rank(), shm.size());
    let input = op.inputs[0];
    let piece = shm.chunk();
    let blocks = block_count(input.len(), piece);
    let g0 = shm.begin_op(blocks as u64);
    let reads = reader.is_none_or(|root| root == rank);
    for b in 0..blocks {
        let g = g0 + b as u64;
        let (start, len) = block_range(input.len(), piece, b);
        wait_slot_free(shm, g, ctx)?;
        shm.par().copy(input.sub(start, len), shm.slot(rank, g).sub(0, len));
        exchange_produced(shm, g, (b == 0).then_some(desc), ctx)?;
        if reads {
            let copies: Vec<_> =
                (0..size).filter(|&p| p != rank).map(|peer| (shm.slot(peer, g).sub(0, len), op.outputs[peer].sub(start, len))).collect();
            shm.par().copy_all_out(&copies, input.len() * size);
        }
        finish_block(shm, g);
    }
    if reads {
        shm.par().copy_out(input, op.outputs[rank], input.len() * size);
    }
    Ok(())
}

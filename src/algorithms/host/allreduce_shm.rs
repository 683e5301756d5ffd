//! All-reduce over shared memory.
//!
//! Small tensors (up to `XCCL_RS_SHM_ONESHOT_BYTES`) take the *one-shot* path: every rank
//! copies its input into its slot, and once all have, every rank reduces the whole tensor from
//! all slots in rank order straight into its output. One synchronization; every rank computes
//! the same bits.
//!
//! Larger tensors go in *blocks* of one slot. Within a block each rank owns a *part* (the
//! block split in `size` near-equal ranges). Per block: each rank copies the parts its peers
//! own into its slot (its own part it reads from its tensor directly); once all have, each rank
//! reduces its part from its tensor and the peers' slots into its own slot (scaling fused);
//! once all have, each rank copies every part from its owner's slot into its output. Slots
//! alternate, so the next block's copy overlaps peers' reading of this one.

use super::blocks::{block_count, block_range, copy_reduced_parts, exchange_produced, finish_block, part, reduce_own_part, wait_slot_free};
use crate::error::Result;
use crate::op::Op;
use crate::reduce::reduce_raw;
use crate::transport::shm::{Counter, Desc, ShmGroup};
use crate::transport::OpCtx;

pub fn run(shm: &mut ShmGroup, ctx: &OpCtx, op: &Op, desc: Desc, oneshot_bytes: usize) -> Result<()> {
    let buf = op.outputs[0];
    if buf.len() <= oneshot_bytes.min(shm.chunk()) {
        one_shot(shm, ctx, op, desc)
    } else {
        blocked(shm, ctx, op, desc)
    }
}

fn one_shot(shm: &mut ShmGroup, ctx: &OpCtx, op: &Op, desc: Desc) -> Result<()> {
    let (rank, size) = (shm.rank(), shm.size());
    let buf = op.outputs[0];
    let esz = op.dtype.size();
    let g = shm.begin_op(1);
    wait_slot_free(shm, g, ctx)?;
    buf.copy_to(shm.slot(rank, g).sub(0, buf.len()));
    exchange_produced(shm, g, Some(desc), ctx)?;
    let srcs: Vec<*const u8> = (0..size).map(|r| shm.slot(r, g).ptr() as *const u8).collect();
    if !buf.is_empty() {
        // SAFETY: every slot holds `buf.len()` bytes of its rank's input (all published
        // Produced for g after copying, and the descriptions — hence the sizes — match); the
        // destination is this rank's tensor, disjoint from every slot; reduction validated.
        unsafe { reduce_raw(&op.reduction(size), buf.ptr(), &srcs, buf.len() / esz, true) };
    }
    finish_block(shm, g);
    Ok(())
}

fn blocked(shm: &mut ShmGroup, ctx: &OpCtx, op: &Op, desc: Desc) -> Result<()> {
    let size = shm.size();
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
        shm.wait_all(Counter::Reduced, g, ctx)?;
        copy_reduced_parts(shm, g, block, |r| part(len, esz, size, r));
        finish_block(shm, g);
    }
    Ok(())
}

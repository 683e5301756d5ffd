//! All-reduce over shared memory, one-shot (for small tensors: select.rs's `takes_one_shot`):
//! every rank copies its input into its slot, and once all have, every rank reduces the whole
//! tensor from all slots in rank order straight into its output. One synchronization; every
//! rank computes the same bits.

use super::blocks::{exchange_produced, finish_block, wait_slot_free};
use crate::error::Result;
use crate::op::Op;
use crate::reduce::reduce_raw;
use crate::transport::OpCtx;
use crate::transport::shm::{Desc, ShmGroup};

pub fn run(shm: &mut ShmGroup, ctx: &OpCtx, op: &Op, desc: Desc) -> Result<()> {
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

//! Barrier over shared memory: every rank publishes one block's `Produced` and waits for all.

use super::blocks::{exchange_produced, finish_block, wait_slot_free};
use crate::error::Result;
use crate::transport::OpCtx;
use crate::transport::shm::{Desc, ShmGroup};

pub fn run(shm: &mut ShmGroup, ctx: &OpCtx, desc: Desc) -> Result<()> {
    let g = shm.begin_op(1);
    wait_slot_free(shm, g, ctx)?;
    exchange_produced(shm, g, Some(desc), ctx)?;
    finish_block(shm, g);
    Ok(())
}

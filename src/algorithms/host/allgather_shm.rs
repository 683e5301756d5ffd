//! All-gather over shared memory: the gather of slots.rs, in which every rank reads (each
//! copies every peer's block out of that peer's slot into the peer's output view).

use super::slots;
use crate::error::Result;
use crate::op::Op;
use crate::par::Par;
use crate::transport::OpCtx;
use crate::transport::shm::{Desc, ShmGroup};

pub fn run(shm: &mut ShmGroup, par: &Par, ctx: &OpCtx, op: &Op, desc: Desc) -> Result<()> {
    slots::gather(shm, par, ctx, op, desc, None)
}

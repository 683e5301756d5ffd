//! Gather over shared memory: the gather of slots.rs in which only the root reads the peers'
//! slots; the others only fill theirs.

use super::slots;
use crate::error::Result;
use crate::op::Op;
use crate::par::Par;
use crate::transport::OpCtx;
use crate::transport::shm::{Desc, ShmGroup};

pub fn run(shm: &mut ShmGroup, par: &Par, ctx: &OpCtx, op: &Op, desc: Desc) -> Result<()> {
    slots::gather(shm, par, ctx, op, desc, Some(op.root as usize))
}

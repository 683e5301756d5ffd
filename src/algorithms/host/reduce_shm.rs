//! Reduce over shared memory: the blocked reduction of slots.rs (every rank reduces its part of
//! each block into its slot), in which only the root copies the parts into its tensor. Other
//! ranks' tensors are left unchanged.

use super::slots;
use crate::error::Result;
use crate::op::Op;
use crate::par::Par;
use crate::transport::OpCtx;
use crate::transport::shm::{Desc, ShmGroup};

pub fn run(shm: &mut ShmGroup, par: &Par, ctx: &OpCtx, op: &Op, desc: Desc) -> Result<()> {
    slots::reduce(shm, par, ctx, op, desc, Some(op.root as usize), false).map(drop)
}

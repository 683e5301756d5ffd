//! Reduce-scatter over shared memory: the reduce-scatter of slots.rs (each rank's slot cut into
//! one lane per rank; each rank reduces its own lane from every peer's slot into its output).

use super::slots;
use crate::error::Result;
use crate::op::Op;
use crate::par::Par;
use crate::transport::OpCtx;
use crate::transport::shm::{Desc, ShmGroup};

pub fn run(shm: &mut ShmGroup, par: &Par, ctx: &OpCtx, op: &Op, desc: Desc) -> Result<()> {
    slots::reduce_scatter(shm, par, ctx, op, desc)
}

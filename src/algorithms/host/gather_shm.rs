//! Gather over shared memory: the all-gather of allgather_shm.rs in which only the root reads
//! the peers' slots; the others only fill theirs.

use super::allgather_shm::gather_to;
use crate::error::Result;
use crate::op::Op;
use crate::transport::OpCtx;
use crate::transport::shm::{Desc, ShmGroup};

pub fn run(shm: &mut ShmGroup, ctx: &OpCtx, op: &Op, desc: Desc) -> Result<()> {
    gather_to(shm, ctx, op, desc, Some(op.root as usize))
}

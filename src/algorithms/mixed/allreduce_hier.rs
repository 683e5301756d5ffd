//! Hierarchical all-reduce (terms in mod.rs): each host reduces into its leader's tensor over
//! shared memory (reduce_shm.rs, the first level: SUM for AVG and PREMUL_SUM); the leaders
//! all-reduce those partial results over TCP (allreduce_direct.rs, the second level, scaling
//! once with the whole group's size); each leader broadcasts the result to its host over
//! shared memory. Every rank ends with the leaders' bits, which are identical. The steps are
//! mod.rs's [`all_reduce_via_leaders`], which the rail-aligned all-reduce also runs on its tail.

use super::all_reduce_via_leaders;
use crate::algorithms::Step;
use crate::error::Result;
use crate::fabric::Mixed;
use crate::op::Op;

pub fn run(step: &mut Step<'_>, mixed: &mut Mixed, op: &Op) -> Result<()> {
    all_reduce_via_leaders(step, mixed, op)
}

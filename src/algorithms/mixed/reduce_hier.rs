//! Hierarchical reduce (terms in mod.rs): each host reduces to its representative over shared
//! memory (reduce_shm.rs, the first level), then the representatives reduce to the root over
//! TCP (reduce_direct.rs, the second level, scaling once). A representative that is not the
//! root reduces into scratch (a copy of its input), not its tensor: as in a direct reduce,
//! every tensor but the root's is left unchanged. The steps are mod.rs's
//! [`reduce_via_representatives`], which the rail-aligned reduce also runs on its tail.

use super::reduce_via_representatives;
use crate::algorithms::Step;
use crate::error::Result;
use crate::fabric::Mixed;
use crate::op::Op;

pub fn run(step: &mut Step<'_>, mixed: &mut Mixed, op: &Op) -> Result<()> {
    reduce_via_representatives(step, mixed, op)
}

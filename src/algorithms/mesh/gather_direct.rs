//! Direct gather: every rank sends its input to the root, which receives each straight into
//! that rank's output view and copies its own.

use super::rooted::{self, Flow};
use crate::algorithms::Step;
use crate::error::Result;
use crate::op::Op;

pub fn run(step: &mut Step<'_>, op: &Op) -> Result<()> {
    let (rank, root) = (step.rank(), op.root as usize);
    let input = op.inputs[0];
    rooted::exchange(step, root, Flow::ToRoot, input, |peer| op.outputs[peer])?;
    if rank == root {
        input.copy_to(op.outputs[rank]);
    }
    Ok(())
}

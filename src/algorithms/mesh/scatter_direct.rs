//! Direct scatter: the root sends view j of its input to rank j and copies its own view; every
//! other rank receives straight into its output.

use super::rooted::{self, Flow};
use crate::algorithms::Step;
use crate::error::Result;
use crate::op::Op;

pub fn run(step: &mut Step<'_>, op: &Op) -> Result<()> {
    let (rank, root) = (step.rank(), op.root as usize);
    let output = op.outputs[0];
    rooted::exchange(step, root, Flow::FromRoot, output, |peer| op.inputs[peer])?;
    if rank == root {
        op.inputs[rank].copy_to(output);
    }
    Ok(())
}

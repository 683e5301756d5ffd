//! Direct gather: every rank sends its input to the root, which receives each straight into
//! that rank's output view and copies its own.

use crate::algorithms::Step;
use crate::error::Result;
use crate::op::Op;

pub fn run(step: &mut Step<'_>, op: &Op) -> Result<()> {
    let (rank, size) = (step.rank(), step.size());
    let root = op.root as usize;
    let input = op.inputs[0];
    let mut phase = step.phase();
    if rank == root {
        for peer in (0..size).filter(|&p| p != rank) {
            phase.recv(peer, op.outputs[peer], step.identity.count);
        }
    } else {
        phase.send(root, input, step.identity.count);
    }
    step.run(phase)?;
    let others: Vec<usize> = (0..size).filter(|&p| p != root).collect();
    if rank == root {
        step.confirm(&others, &[])?;
        input.copy_to(op.outputs[rank]);
        Ok(())
    } else {
        step.confirm(&[], &[root])
    }
}

//! Direct scatter: the root sends view j of its input to rank j and copies its own view; every
//! other rank receives straight into its output.

use crate::algorithms::Step;
use crate::error::Result;
use crate::op::Op;

pub fn run(step: &mut Step<'_>, op: &Op) -> Result<()> {
    let (rank, size) = (step.rank(), step.size());
    let root = op.root as usize;
    let output = op.outputs[0];
    let mut phase = step.phase();
    if rank == root {
        for peer in (0..size).filter(|&p| p != rank) {
            phase.send(peer, op.inputs[peer], step.identity.count);
        }
    } else {
        phase.recv(root, output, step.identity.count);
    }
    step.run(phase)?;
    let others: Vec<usize> = (0..size).filter(|&p| p != root).collect();
    if rank == root {
        step.confirm(&[], &others)?;
        op.inputs[rank].copy_to(output);
        Ok(())
    } else {
        step.confirm(&[root], &[])
    }
}

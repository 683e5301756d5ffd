//! Direct all-gather: every rank sends its input to every peer and receives each peer's input
//! straight into that peer's output view; its own input is copied into its own view (skipped
//! when the input already is that view, as in an in-place all_gather_into_tensor).

use crate::algorithms::Step;
use crate::error::Result;
use crate::op::Op;

pub fn run(step: &mut Step<'_>, op: &Op) -> Result<()> {
    let (rank, size) = (step.rank(), step.size());
    let input = op.inputs[0];
    let mut phase = step.phase();
    for peer in (0..size).filter(|&p| p != rank) {
        phase.send(peer, input, step.identity.count);
        phase.recv(peer, op.outputs[peer], step.identity.count);
    }
    step.run(phase)?;
    input.copy_to(op.outputs[rank]);
    Ok(())
}

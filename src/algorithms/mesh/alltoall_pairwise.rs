//! All-to-all: rank r sends `inputs[j]` to rank j and receives rank j's message into
//! `outputs[j]`, with all pairs in flight at once. The frame's count is the pair's own element
//! count, so unequal split sizes are checked pair by pair.

use crate::algorithms::Step;
use crate::error::Result;
use crate::op::Op;

pub fn run(step: &mut Step<'_>, op: &Op) -> Result<()> {
    let (rank, size) = (step.rank(), step.size());
    let esz = op.dtype.size() as u64;
    let mut phase = step.phase();
    for peer in (0..size).filter(|&p| p != rank) {
        phase.send(peer, op.inputs[peer], op.inputs[peer].len() as u64 / esz);
        phase.recv(peer, op.outputs[peer], op.outputs[peer].len() as u64 / esz);
    }
    step.run(phase)?;
    op.inputs[rank].copy_to(op.outputs[rank]);
    Ok(())
}

//! Direct broadcast: the root sends its tensor to every peer at once (the transport interleaves
//! the sockets); each peer receives straight into its tensor, no staging, then confirms (so a
//! root learns of a peer that rejected the data).

use crate::algorithms::Step;
use crate::error::Result;
use crate::op::Op;

pub fn run(step: &mut Step<'_>, op: &Op) -> Result<()> {
    let (rank, size) = (step.rank(), step.size());
    let root = op.root as usize;
    let buf = op.outputs[0];
    let mut phase = step.phase();
    if rank == root {
        for peer in (0..size).filter(|&p| p != rank) {
            phase.send(peer, buf, step.identity.count);
        }
    } else {
        phase.recv(root, buf, step.identity.count);
    }
    step.run(phase)?;
    let others: Vec<usize> = (0..size).filter(|&p| p != root).collect();
    if rank == root { step.confirm(&[], &others) } else { step.confirm(&[root], &[]) }
}

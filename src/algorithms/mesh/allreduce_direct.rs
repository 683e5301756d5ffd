//! Direct all-reduce = direct reduce-scatter + direct all-gather. The tensor of `n` elements is
//! cut into `size` near-equal *shares*; rank r owns share r. First every rank reduces its share
//! from all ranks' inputs (reduce_scatter_direct.rs, scaling fused), then sends the finished
//! share to every peer and receives theirs in place. Each byte crosses the network twice, as in
//! a ring, but in two steps of latency instead of 2(size-1); each share's value is computed on
//! one rank only, so every rank ends with identical bits.

use super::reduce_scatter_direct::reduce_contributions;
use crate::algorithms::split::share;
use crate::algorithms::Step;
use crate::error::Result;
use crate::op::Op;

pub fn run(step: &mut Step<'_>, op: &Op) -> Result<()> {
    let (rank, size) = (step.rank(), step.size());
    let esz = op.dtype.size();
    let buf = op.outputs[0];
    let n = buf.len() / esz;
    let shares: Vec<_> = (0..size).map(|i| share(buf, n, size, i, esz)).collect();
    reduce_contributions(step, &step.reduction(op), &shares, shares[rank])?;

    let mut phase = step.phase();
    for peer in (0..size).filter(|&p| p != rank) {
        phase.send(peer, shares[rank], step.identity.count);
        phase.recv(peer, shares[peer], step.identity.count);
    }
    step.run(phase)
}

//! Barrier: an empty frame to and from every peer. No rank leaves before every rank has entered.

use crate::algorithms::Step;
use crate::error::Result;
use crate::transport::RawBuf;

pub fn run(step: &mut Step<'_>) -> Result<()> {
    let (rank, size) = (step.rank(), step.size());
    let empty = RawBuf::from_slice(&mut []);
    let mut phase = step.phase();
    for peer in (0..size).filter(|&p| p != rank) {
        phase.send(peer, empty, 0);
        phase.recv(peer, empty, 0);
    }
    step.run(phase)
}

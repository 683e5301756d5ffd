//! The one step of the direct rooted collectives (broadcast, gather, scatter): the root
//! exchanges one buffer with every peer at once, each peer exchanges one buffer with the root,
//! then every receiver confirms to its sender (`Step::confirm`), so that a rank that only sent
//! still learns of a receiver that rejected its data. Not an algorithm: the shared part of
//! three.

use crate::algorithms::Step;
use crate::error::Result;
use crate::transport::RawBuf;

/// Which way a rooted step moves data.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    /// The root sends, every peer receives (broadcast, scatter).
    FromRoot,
    /// Every peer sends, the root receives (gather).
    ToRoot,
}

/// Runs the step: the root moves `at_root(peer)` to or from each peer, a peer moves `own` from
/// or to the root; then the confirmation.
pub fn exchange(step: &mut Step<'_>, root: usize, flow: Flow, own: RawBuf, at_root: impl Fn(usize) -> RawBuf) -> Result<()> {
    let (rank, size) = (step.rank(), step.size());
    let others: Vec<usize> = (0..size).filter(|&p| p != root).collect();
    let partners: &[usize] = if rank == root { &others } else { std::slice::from_ref(&root) };
    let sends = (rank == root) == (flow == Flow::FromRoot);
    let mut phase = step.phase();
    for &peer in partners {
        let buf = if rank == root { at_root(peer) } else { own };
        if sends {
            phase.send(peer, buf, step.identity.count);
        } else {
            phase.recv(peer, buf, step.identity.count);
        }
    }
    step.run(phase)?;
    if sends { step.confirm(&[], partners) } else { step.confirm(partners, &[]) }
}

//! Hierarchical broadcast (terms in hier.rs): the root sends its tensor over TCP to every other
//! host's leader (broadcast_direct.rs among the representatives), then each representative —
//! the root on its host, the leader elsewhere — broadcasts it to its host over shared memory.

use super::hier::{among, hosts, rooted};
use super::{Step, broadcast_direct, broadcast_shm};
use crate::error::Result;
use crate::op::Op;
use crate::transport::shm::Desc;

pub fn run(step: &mut Step<'_>, op: &Op, desc: Desc) -> Result<()> {
    let hosts = hosts(step);
    let root = op.root as usize;
    let reps = hosts.representatives(root);
    let my_rep = reps[hosts.host_of(step.rank())];
    let root_host = hosts.host_of(root);
    let local_root = hosts.local_index(my_rep);
    let ctx = step.ctx;
    if my_rep == step.rank() {
        among(step, &reps, |s| broadcast_direct::run(s, &rooted(op, root_host)))?;
    }
    if let Some(shm) = step.shm.as_deref_mut() {
        broadcast_shm::run(shm, ctx, &rooted(op, local_root), desc)?;
    }
    Ok(())
}

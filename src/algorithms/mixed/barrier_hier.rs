//! Hierarchical barrier (terms in mod.rs): a shared-memory barrier on each host (its leader
//! knows every local rank has entered), a TCP barrier among the leaders (every rank of the
//! group has entered), and a second shared-memory barrier that releases the local ranks.

use super::{among, behind_remote, leaders, on_host};
use crate::algorithms::Step;
use crate::algorithms::host::barrier_shm;
use crate::algorithms::mesh::barrier_direct;
use crate::error::Result;
use crate::fabric::Mixed;

pub fn run(step: &mut Step<'_>, mixed: &mut Mixed) -> Result<()> {
    let hosts = &mixed.hosts;
    let leaders = leaders(hosts);
    let is_leader = hosts.leader(hosts.host_of(step.rank())) == step.rank();
    let ctx = step.ctx;
    if let Some((shm, desc)) = on_host(&mut mixed.shm, step) {
        barrier_shm::run(shm, ctx, desc)?;
    }
    if is_leader {
        among(mixed.shm.as_ref(), step, &leaders, barrier_direct::run)?;
    }
    if let Some((shm, desc)) = on_host(&mut mixed.shm, step) {
        barrier_shm::run(shm, &behind_remote(ctx), desc)?;
    }
    Ok(())
}

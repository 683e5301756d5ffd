//! Hierarchical barrier (terms in hier.rs): a shared-memory barrier on each host (its leader
//! knows every local rank has entered), a TCP barrier among the leaders (every rank of the
//! group has entered), and a second shared-memory barrier that releases the local ranks.

use super::hier::{among, hosts, leaders};
use super::{Step, barrier_all, barrier_shm};
use crate::error::Result;
use crate::transport::shm::Desc;

pub fn run(step: &mut Step<'_>, desc: Desc) -> Result<()> {
    let hosts = hosts(step);
    let leaders = leaders(hosts);
    let is_leader = hosts.leader(hosts.host_of(step.rank())) == step.rank();
    let ctx = step.ctx;
    if let Some(shm) = step.shm.as_deref_mut() {
        barrier_shm::run(shm, ctx, desc)?;
    }
    if is_leader {
        among(step, &leaders, barrier_all::run)?;
    }
    if let Some(shm) = step.shm.as_deref_mut() {
        barrier_shm::run(shm, ctx, desc)?;
    }
    Ok(())
}

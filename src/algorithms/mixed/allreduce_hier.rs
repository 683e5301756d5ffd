//! Hierarchical all-reduce (terms in mod.rs): each host reduces into its leader's tensor over
//! shared memory (reduce_shm.rs, the first level: SUM for AVG and PREMUL_SUM); the leaders
//! all-reduce those partial results over TCP (allreduce_direct.rs, the second level, scaling
//! once with the whole group's size); each leader broadcasts the result to its host over
//! shared memory. Every rank ends with the leaders' bits, which are identical.

use super::{among, behind_remote, broadcast_on_host, leaders, local_op, on_host, rooted};
use crate::algorithms::Step;
use crate::algorithms::host::reduce_shm;
use crate::algorithms::mesh::allreduce_direct;
use crate::error::Result;
use crate::fabric::Mixed;
use crate::op::Op;

pub fn run(step: &mut Step<'_>, mixed: &mut Mixed, op: &Op) -> Result<()> {
    let hosts = &mixed.hosts;
    let leaders = leaders(hosts);
    let is_leader = hosts.leader(hosts.host_of(step.rank())) == step.rank();
    let ctx = step.ctx;
    if let Some((shm, desc)) = on_host(&mut mixed.shm, step) {
        let first = Op { reduce_op: local_op(op.reduce_op), ..rooted(op, 0) };
        reduce_shm::run(shm, step.par, ctx, &first, desc)?;
    }
    if is_leader {
        among(mixed.shm.as_ref(), step, &leaders, |s| allreduce_direct::run(s, op))?;
    }
    if let Some((shm, desc)) = on_host(&mut mixed.shm, step) {
        broadcast_on_host(shm, step.par, &behind_remote(ctx), &rooted(op, 0), desc)?;
    }
    Ok(())
}

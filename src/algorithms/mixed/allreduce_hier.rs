//! Hierarchical all-reduce (terms in mod.rs): each host reduces into its leader's tensor over
//! shared memory (reduce_shm.rs, the first level: SUM for AVG and PREMUL_SUM); the leaders
//! all-reduce those partial results over TCP (allreduce_direct.rs, the second level, scaling
//! once with the whole group's size); each leader broadcasts the result to its host over
//! shared memory. Every rank ends with the leaders' bits, which are identical.

use super::{among, behind_remote, broadcast_on_host, leaders, local_op, rooted};
use crate::algorithms::Step;
use crate::algorithms::host::reduce_shm;
use crate::algorithms::mesh::allreduce_direct;
use crate::error::Result;
use crate::fabric::Mixed;
use crate::op::Op;
use crate::transport::shm::Desc;

pub fn run(step: &mut Step<'_>, mixed: &mut Mixed, op: &Op, desc: Desc) -> Result<()> {
    let hosts = &mixed.hosts;
    let leaders = leaders(hosts);
    let is_leader = hosts.leader(hosts.host_of(step.rank())) == step.rank();
    let ctx = step.ctx;
    let oneshot = step.shm_oneshot_bytes;
    if let Some(shm) = mixed.shm.as_mut() {
        let first = Op { reduce_op: local_op(op.reduce_op), ..rooted(op, 0) };
        reduce_shm::run(shm, ctx, &first, desc)?;
    }
    if is_leader {
        among(mixed.shm.as_ref(), step, &leaders, |s| allreduce_direct::run(s, op))?;
    }
    if let Some(shm) = mixed.shm.as_mut() {
        broadcast_on_host(shm, oneshot, &behind_remote(ctx), &rooted(op, 0), desc)?;
    }
    Ok(())
}

//! Hierarchical all-gather (terms in mod.rs): each host all-gathers its ranks' inputs into
//! their output views over shared memory (allgather_shm.rs); the leaders exchange their hosts'
//! views over TCP, each received straight into its rank's view; each leader then broadcasts
//! the other hosts' views to its host over shared memory, one view after another.

use super::{among, behind_remote, broadcast_on_host, leaders, on_host, rooted};
use crate::algorithms::Step;
use crate::algorithms::host::allgather_shm;
use crate::error::Result;
use crate::fabric::Mixed;
use crate::op::Op;

pub fn run(step: &mut Step<'_>, mixed: &mut Mixed, op: &Op) -> Result<()> {
    let hosts = &mixed.hosts;
    let rank = step.rank();
    let my_host = hosts.host_of(rank);
    let ctx = step.ctx;
    if let Some((shm, desc)) = on_host(&mut mixed.shm, step) {
        let views = hosts.ranks(my_host).iter().map(|&r| op.outputs[r]).collect();
        allgather_shm::run(shm, step.par, ctx, &Op { outputs: views, ..op.clone() }, desc)?;
    } else {
        op.inputs[0].copy_to(op.outputs[rank]);
    }
    if hosts.leader(my_host) == rank {
        among(mixed.shm.as_ref(), step, &leaders(hosts), |s| {
            let mut phase = s.phase();
            for other in (0..hosts.host_count()).filter(|&h| h != my_host) {
                // Both sides list a host's views in rank order: same-peer transfers complete
                // in list order, so each view lands in its own buffer.
                for &r in hosts.ranks(my_host) {
                    phase.send(other, op.outputs[r], s.identity.count);
                }
                for &r in hosts.ranks(other) {
                    phase.recv(other, op.outputs[r], s.identity.count);
                }
            }
            s.run(phase)
        })?;
    }
    if let Some((shm, desc)) = on_host(&mut mixed.shm, step) {
        for r in (0..hosts.world_size()).filter(|&r| hosts.host_of(r) != my_host) {
            broadcast_on_host(shm, step.par, &behind_remote(ctx), &Op { outputs: vec![op.outputs[r]], ..rooted(op, 0) }, desc)?;
        }
    }
    Ok(())
}

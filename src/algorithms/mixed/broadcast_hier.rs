//! Hierarchical broadcast (terms in mod.rs). On the root's host the root first broadcasts its
//! tensor over shared memory; then it sends the tensor over TCP to every other host's leader.
//! Each leader receives it straight into its tensor, broadcasts it to its host over shared
//! memory, and only then confirms to the root. So, as in a direct broadcast, the root learns of
//! any receiver's failure — here also of a failure in another host's shared-memory step (a
//! mismatch on a non-leader) — and fails with it.

use super::{among, behind_remote, broadcast_on_host, on_host, rooted};
use crate::algorithms::Step;
use crate::error::Result;
use crate::fabric::Mixed;
use crate::op::Op;

pub fn run(step: &mut Step<'_>, mixed: &mut Mixed, op: &Op) -> Result<()> {
    let hosts = &mixed.hosts;
    let (rank, root) = (step.rank(), op.root as usize);
    let reps = hosts.representatives(root);
    let my_host = hosts.host_of(rank);
    let (my_rep, root_host) = (reps[my_host], hosts.host_of(root));
    let local = rooted(op, hosts.local_index(my_rep));
    let ctx = step.ctx;
    let buf = op.outputs[0];
    if my_host == root_host {
        if let Some((shm, desc)) = on_host(&mut mixed.shm, step) {
            broadcast_on_host(shm, step.par, ctx, &local, desc)?;
        }
        if rank != root {
            return Ok(());
        }
        // The representatives' indices are host indices.
        let others: Vec<usize> = (0..reps.len()).filter(|&h| h != root_host).collect();
        return among(mixed.shm.as_ref(), step, &reps, |s| {
            let mut phase = s.phase();
            for &h in &others {
                phase.send(h, buf, s.identity.count);
            }
            s.run(phase)?;
            s.confirm(&[], &others)
        });
    }
    if rank == my_rep {
        among(mixed.shm.as_ref(), step, &reps, |s| {
            let mut phase = s.phase();
            phase.recv(root_host, buf, s.identity.count);
            s.run(phase)
        })?;
    }
    if let Some((shm, desc)) = on_host(&mut mixed.shm, step) {
        broadcast_on_host(shm, step.par, &behind_remote(ctx), &local, desc)?;
    }
    if rank == my_rep {
        among(mixed.shm.as_ref(), step, &reps, |s| s.confirm(&[root_host], &[]))?;
    }
    Ok(())
}

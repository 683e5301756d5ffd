//! Rail-aligned reduce (terms in mod.rs), for hosts that each have k ≥ 2 of the group's ranks.
//! The tensor's first `k·s` elements, `s = n / k`, are cut into k equal shares; the rest, fewer
//! than k elements, is the tail.
//!
//! 1. Each host reduce-scatters its ranks' tensors over shared memory (reduce_scatter_shm.rs;
//!    SUM for AVG and PREMUL_SUM): local rank i gets its host's sum of share i, in scratch.
//! 2. Local rank i reduces that partial share with its rail over TCP to the rail's member on the
//!    root's host (reduce_direct.rs, scaling once), all rails at once, so each link carries 1/k
//!    of the tensor, where the leader scheme (reduce_hier.rs) sends all of it through the
//!    representatives'.
//! 3. On the root's host, the root gathers the finished shares into its tensor over shared
//!    memory (gather_shm.rs).
//!
//! The tail goes the leader way ([`reduce_via_representatives`]). Only the root's tensor changes.

use super::{among, behind_remote, local_op, on_host, rail_of, reduce_via_representatives, rooted};
use crate::algorithms::Step;
use crate::algorithms::host::{gather_shm, reduce_scatter_shm};
use crate::algorithms::mesh::reduce_direct;
use crate::error::Result;
use crate::fabric::Mixed;
use crate::op::Op;
use crate::types::OpKind;

pub fn run(step: &mut Step<'_>, mixed: &mut Mixed, op: &Op) -> Result<()> {
    let hosts = &mixed.hosts;
    let k = hosts.uniform().expect("the table picks the rail reduce only for hosts of equal size");
    let (rank, root) = (step.rank(), op.root as usize);
    let (my_host, root_host) = (hosts.host_of(rank), hosts.host_of(root));
    let local_root = hosts.local_index(root);
    let rail = rail_of(hosts, rank);
    let esz = op.dtype.size();
    let buf = op.outputs[0];
    let share_bytes = buf.len() / esz / k * esz;
    let shares: Vec<_> = (0..k).map(|i| buf.sub(i * share_bytes, share_bytes)).collect();
    let partial = mixed.partial(share_bytes);
    let ctx = step.ctx;

    let (shm, desc) = on_host(&mut mixed.shm, step).expect("a host of k ≥ 2 ranks has shared memory");
    let scatter = Op { kind: OpKind::ReduceScatter, reduce_op: local_op(op.reduce_op), inputs: shares.clone(), outputs: vec![partial], ..op.clone() };
    reduce_scatter_shm::run(shm, step.par, ctx, &scatter, desc)?;

    // Rail members are numbered by host, so the root's host is the rail's root.
    among(mixed.shm.as_ref(), step, &rail, |s| reduce_direct::run(s, &Op { outputs: vec![partial], ..rooted(op, root_host) }))?;

    if my_host == root_host {
        let (shm, desc) = on_host(&mut mixed.shm, step).expect("checked above");
        let outputs = if rank == root { shares } else { Vec::new() };
        let gather = Op { kind: OpKind::Gather, inputs: vec![partial], outputs, ..rooted(op, local_root) };
        gather_shm::run(shm, step.par, &behind_remote(ctx), &gather, desc)?;
    }

    let tail = buf.sub(k * share_bytes, buf.len() - k * share_bytes);
    if tail.len() > 0 {
        reduce_via_representatives(step, mixed, &Op { outputs: vec![tail], ..op.clone() })?;
    }
    Ok(())
}

//! Rail-aligned broadcast (terms in mod.rs), for hosts that each have k ≥ 2 of the group's
//! ranks. The tensor is cut into k near-equal shares (split.rs).
//!
//! 1. On the root's host, the root broadcasts its tensor over shared memory.
//! 2. Each local rank i of the root's host broadcasts share i over TCP to local rank i of every
//!    other host, its rail (broadcast_direct.rs: each receiver confirms), all rails at once, so
//!    each link carries 1/k of the tensor, where the leader scheme (broadcast_hier.rs) sends
//!    all of it through the root's.
//! 3. On every other host, each local rank i broadcasts share i to its host over shared memory,
//!    one share after another.

use super::{among, behind_remote, broadcast_on_host, on_host, rail_of, rooted};
use crate::algorithms::Step;
use crate::algorithms::mesh::broadcast_direct;
use crate::algorithms::split::share;
use crate::error::Result;
use crate::fabric::Mixed;
use crate::op::Op;

pub fn run(step: &mut Step<'_>, mixed: &mut Mixed, op: &Op) -> Result<()> {
    let hosts = &mixed.hosts;
    let k = hosts.uniform().expect("the table picks the rail broadcast only for hosts of equal size");
    let (rank, root) = (step.rank(), op.root as usize);
    let (my_host, root_host) = (hosts.host_of(rank), hosts.host_of(root));
    let me = hosts.local_index(rank);
    let rail = rail_of(hosts, rank);
    let esz = op.dtype.size();
    let buf = op.outputs[0];
    let n = buf.len() / esz;
    let shares: Vec<_> = (0..k).map(|i| share(buf, n, k, i, esz)).collect();
    let ctx = step.ctx;

    if my_host == root_host {
        let (shm, desc) = on_host(&mut mixed.shm, step).expect("a host of k ≥ 2 ranks has shared memory");
        broadcast_on_host(shm, step.par, ctx, &rooted(op, hosts.local_index(root)), desc)?;
    }
    // Rail members are numbered by host, so the root's host is the rail's root.
    let from_root_host = Op { outputs: vec![shares[me]], ..rooted(op, root_host) };
    among(mixed.shm.as_ref(), step, &rail, |s| broadcast_direct::run(s, &from_root_host))?;
    if my_host != root_host {
        for (i, &part) in shares.iter().enumerate() {
            let (shm, desc) = on_host(&mut mixed.shm, step).expect("checked above");
            broadcast_on_host(shm, step.par, &behind_remote(ctx), &Op { outputs: vec![part], ..rooted(op, i) }, desc)?;
        }
    }
    Ok(())
}

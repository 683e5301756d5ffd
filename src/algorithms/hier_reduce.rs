//! Hierarchical reduce (terms in hier.rs): each host reduces to its representative over shared
//! memory (reduce_shm.rs, the first level), then the representatives reduce to the root over
//! TCP (reduce_direct.rs, the second level, scaling once). A representative that is not the
//! root reduces into scratch (a copy of its input), not its tensor: as in a direct reduce,
//! every tensor but the root's is left unchanged.

use super::hier::{among, hosts, local_op, rooted};
use super::{Step, reduce_direct, reduce_shm};
use crate::error::Result;
use crate::op::Op;
use crate::transport::shm::Desc;

pub fn run(step: &mut Step<'_>, op: &Op, desc: Desc) -> Result<()> {
    let hosts = hosts(step);
    let (rank, root) = (step.rank(), op.root as usize);
    let reps = hosts.representatives(root);
    let my_rep = reps[hosts.host_of(rank)];
    let root_host = hosts.host_of(root);
    let local_root = hosts.local_index(my_rep);
    let ctx = step.ctx;
    let tensor = op.outputs[0];
    let mut partial = tensor;
    if let Some(shm) = step.shm.as_deref_mut() {
        if rank == my_rep && rank != root {
            partial = step.mixed.as_deref_mut().expect("mixed group").partial(tensor.len());
            tensor.copy_to(partial);
        }
        let first = Op { reduce_op: local_op(op.reduce_op), outputs: vec![partial], ..rooted(op, local_root) };
        reduce_shm::run(shm, ctx, &first, desc)?;
    }
    if rank == my_rep {
        let second = Op { outputs: vec![partial], ..rooted(op, root_host) };
        among(step, &reps, |s| reduce_direct::run(s, &second))?;
    }
    Ok(())
}

//! Hierarchical reduce (terms in mod.rs): each host reduces to its representative over shared
//! memory (reduce_shm.rs, the first level), then the representatives reduce to the root over
//! TCP (reduce_direct.rs, the second level, scaling once). A representative that is not the
//! root reduces into scratch (a copy of its input), not its tensor: as in a direct reduce,
//! every tensor but the root's is left unchanged.

use super::{among, local_op, on_host, rooted};
use crate::algorithms::Step;
use crate::algorithms::host::reduce_shm;
use crate::algorithms::mesh::reduce_direct;
use crate::error::Result;
use crate::fabric::Mixed;
use crate::op::Op;

pub fn run(step: &mut Step<'_>, mixed: &mut Mixed, op: &Op) -> Result<()> {
    let hosts = &mixed.hosts;
    let (rank, root) = (step.rank(), op.root as usize);
    let reps = hosts.representatives(root);
    let my_rep = reps[hosts.host_of(rank)];
    let root_host = hosts.host_of(root);
    let local_root = hosts.local_index(my_rep);
    let ctx = step.ctx;
    let tensor = op.outputs[0];
    let mut partial = tensor;
    if mixed.shm.is_some() && rank == my_rep && rank != root {
        partial = mixed.partial(tensor.len());
        tensor.copy_to(partial);
    }
    if let Some((shm, desc)) = on_host(&mut mixed.shm, step) {
        let first = Op { reduce_op: local_op(op.reduce_op), outputs: vec![partial], ..rooted(op, local_root) };
        reduce_shm::run(shm, step.par, ctx, &first, desc)?;
    }
    if rank == my_rep {
        let second = Op { outputs: vec![partial], ..rooted(op, root_host) };
        among(mixed.shm.as_ref(), step, &reps, |s| reduce_direct::run(s, &second))?;
    }
    Ok(())
}

//! Rail-aligned all-reduce (terms in mod.rs), for hosts that each have k ≥ 2 of the group's
//! ranks. The tensor's first `k·s` elements, `s = n / k`, are cut into k equal *shares*; the
//! rest, fewer than k elements, is the *tail*.
//!
//! 1. Each host reduce-scatters its ranks' tensors over shared memory (reduce_scatter_shm.rs;
//!    SUM for AVG and PREMUL_SUM): local rank i gets its host's sum of share i, in scratch.
//! 2. Local rank i all-reduces that partial share with local rank i of every other host, its
//!    rail, over TCP (`between_hosts`: allreduce_direct.rs, or allreduce_ring.rs at many hosts,
//!    as the table picks; scaling once with the whole group's size). All rails
//!    run at once, so every rank's own link carries 1/k of the tensor, where the leader scheme
//!    (allreduce_hier.rs) sends all of it through the leader's.
//! 3. Each host all-gathers the finished shares into every rank's tensor over shared memory.
//!
//! The three steps run piece by piece, overlapped (overlap.rs): while piece p crosses the
//! rail, the host reduce-scatters piece p + 1 and all-gathers the pieces already back.
//!
//! The tail goes the leader way ([`all_reduce_via_leaders`]). Every element is computed on one
//! rank of its rail and copied from there, so every rank ends with identical bits.

use super::overlap::{overlapped, pieces};
use super::{all_reduce_via_leaders, behind_remote, local_op, on_host, rail_of};
use crate::algorithms::Step;
use crate::algorithms::host::{allgather_shm, reduce_scatter_shm};
use crate::error::Result;
use crate::fabric::Mixed;
use crate::op::Op;
use crate::types::OpKind;

pub fn run(step: &mut Step<'_>, mixed: &mut Mixed, op: &Op, between_hosts: fn(&mut Step<'_>, &Op) -> Result<()>) -> Result<()> {
    let hosts = &mixed.hosts;
    let k = hosts.uniform().expect("the table picks the rail all-reduce only for hosts of equal size");
    let rail = rail_of(hosts, step.rank());
    let esz = op.dtype.size();
    let buf = op.outputs[0];
    let n = buf.len() / esz;
    let share_bytes = n / k * esz;
    let shares: Vec<_> = (0..k).map(|i| buf.sub(i * share_bytes, share_bytes)).collect();
    let partial = mixed.partial(share_bytes);
    let pieces = pieces(share_bytes, esz);
    let (par, ctx) = (step.par, step.ctx);
    let after_ctx = behind_remote(ctx);

    let (shm, desc) = on_host(&mut mixed.shm, step).expect("a host of k ≥ 2 ranks has shared memory");
    overlapped(
        shm,
        step,
        &rail,
        &pieces,
        |shm, (at, len)| {
            let inputs = shares.iter().map(|s| s.sub(at, len)).collect();
            let scatter = Op { kind: OpKind::ReduceScatter, reduce_op: local_op(op.reduce_op), inputs, outputs: vec![partial.sub(at, len)], ..op.clone() };
            reduce_scatter_shm::run(shm, par, ctx, &scatter, desc)
        },
        |s, (at, len)| between_hosts(s, &Op { outputs: vec![partial.sub(at, len)], ..op.clone() }),
        |shm, (at, len)| {
            let outputs = shares.iter().map(|s| s.sub(at, len)).collect();
            let gather = Op { kind: OpKind::AllGather, inputs: vec![partial.sub(at, len)], outputs, ..op.clone() };
            allgather_shm::run(shm, par, &after_ctx, &gather, desc)
        },
    )?;

    let tail = buf.sub(k * share_bytes, buf.len() - k * share_bytes);
    if tail.len() > 0 {
        all_reduce_via_leaders(step, mixed, &Op { outputs: vec![tail], ..op.clone() })?;
    }
    Ok(())
}

//! Rail-aligned reduce-scatter (terms in mod.rs), for hosts that each have k ≥ 2 of the
//! group's ranks, H hosts. Rank g's result is the reduction of every rank's contribution g.
//!
//! 1. For each host j in turn, this host reduce-scatters its ranks' contributions to host j's
//!    ranks over shared memory (reduce_scatter_shm.rs; SUM for AVG and PREMUL_SUM): local rank
//!    i gets, in scratch area j, its host's sum of the contributions to rank i of host j.
//! 2. Local rank i reduce-scatters the H areas with local rank i of every other host, its rail,
//!    over TCP (reduce_scatter_direct.rs, area j to the rail's member on host j, scaling once
//!    with the whole group's size), all rails at once: each rank's link carries (H − 1) results'
//!    worth, where a direct reduce-scatter sends every peer its contribution over the network.
//!
//! The two steps run piece by piece, overlapped (overlap.rs): while piece p crosses the rail,
//! the host reduce-scatters piece p + 1.

use super::overlap::{overlapped, pieces};
use super::{local_op, on_host, rail_of};
use crate::algorithms::Step;
use crate::algorithms::host::reduce_scatter_shm;
use crate::algorithms::mesh::reduce_scatter_direct;
use crate::error::Result;
use crate::fabric::Mixed;
use crate::op::Op;

pub fn run(step: &mut Step<'_>, mixed: &mut Mixed, op: &Op) -> Result<()> {
    let hosts = &mixed.hosts;
    let host_count = hosts.host_count();
    let host_ranks: Vec<Vec<usize>> = (0..host_count).map(|j| hosts.ranks(j).to_vec()).collect();
    let rail = rail_of(hosts, step.rank());
    let out = op.outputs[0];
    let scratch = mixed.partial(host_count * out.len());
    let areas: Vec<_> = (0..host_count).map(|j| scratch.sub(j * out.len(), out.len())).collect();
    let pieces = pieces(out.len(), op.dtype.size());
    let (par, ctx) = (step.par, step.ctx);

    let (shm, desc) = on_host(&mut mixed.shm, step).expect("a host of k ≥ 2 ranks has shared memory");
    overlapped(
        shm,
        step,
        &rail,
        &pieces,
        |shm, (at, len)| {
            for (j, ranks) in host_ranks.iter().enumerate() {
                let inputs = ranks.iter().map(|&g| op.inputs[g].sub(at, len)).collect();
                let first = Op { reduce_op: local_op(op.reduce_op), inputs, outputs: vec![areas[j].sub(at, len)], ..op.clone() };
                reduce_scatter_shm::run(shm, par, ctx, &first, desc)?;
            }
            Ok(())
        },
        |s, (at, len)| {
            let inputs = areas.iter().map(|a| a.sub(at, len)).collect();
            reduce_scatter_direct::run(s, &Op { inputs, outputs: vec![out.sub(at, len)], ..op.clone() })
        },
        |_, _| Ok(()),
    )
}

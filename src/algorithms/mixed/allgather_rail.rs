//! Rail-aligned all-gather (terms in mod.rs), for hosts that each have k ≥ 2 of the group's
//! ranks, H hosts.
//!
//! 1. Local rank i all-gathers its input with local rank i of every other host, its rail, over
//!    TCP (allgather_direct.rs), each piece received straight into its rank's output view; all
//!    rails at once, so each rank's link carries (H − 1) pieces, where the leader scheme
//!    (allgather_hier.rs) sends its whole host's through the leader's.
//! 2. For each host j in turn, this host all-gathers the pieces of host j's ranks over shared
//!    memory (allgather_shm.rs): local rank i holds rank (j, i)'s piece from step 1.
//!
//! The two steps run piece by piece, overlapped (overlap.rs): while piece p + 1 crosses the
//! rail, the host all-gathers piece p.

use super::overlap::{overlapped, pieces};
use super::{behind_remote, on_host, rail_of};
use crate::algorithms::Step;
use crate::algorithms::host::allgather_shm;
use crate::algorithms::mesh::allgather_direct;
use crate::error::Result;
use crate::fabric::Mixed;
use crate::op::Op;

pub fn run(step: &mut Step<'_>, mixed: &mut Mixed, op: &Op) -> Result<()> {
    let hosts = &mixed.hosts;
    let rank = step.rank();
    let host_ranks: Vec<Vec<usize>> = (0..hosts.host_count()).map(|j| hosts.ranks(j).to_vec()).collect();
    let me = hosts.local_index(rank);
    let rail = rail_of(hosts, rank);
    let pieces = pieces(op.inputs[0].len(), op.dtype.size());
    let (par, ctx) = (step.par, step.ctx);
    let after_ctx = behind_remote(ctx);

    let (shm, desc) = on_host(&mut mixed.shm, step).expect("a host of k ≥ 2 ranks has shared memory");
    overlapped(
        shm,
        step,
        &rail,
        &pieces,
        |_, _| Ok(()),
        |s, (at, len)| {
            let outputs = rail.iter().map(|&g| op.outputs[g].sub(at, len)).collect();
            allgather_direct::run(s, &Op { inputs: vec![op.inputs[0].sub(at, len)], outputs, ..op.clone() })
        },
        |shm, (at, len)| {
            for ranks in &host_ranks {
                let views = ranks.iter().map(|&g| op.outputs[g].sub(at, len)).collect();
                let host_step = Op { inputs: vec![op.outputs[ranks[me]].sub(at, len)], outputs: views, ..op.clone() };
                allgather_shm::run(shm, par, &after_ctx, &host_step, desc)?;
            }
            Ok(())
        },
    )
}

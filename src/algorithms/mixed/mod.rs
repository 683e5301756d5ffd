//! The hierarchical algorithms (`*_hier.rs`, `*_rail.rs`) and what they share. They serve a *mixed* group:
//! its ranks span several hosts and some host has two or more of them (hosts.rs). Each gets
//! the fabric's mixed parts (fabric.rs `Mixed`): the host map, and this host's shared-memory
//! group (`Mixed::shm`, local indices 0..k, present when the host has k ≥ 2 ranks). Within a
//! host, ranks talk through that group; between hosts, one rank per host — its *representative*: the
//! leader, or the root on the root's host — talks over TCP on a [`Subset`] of the group's
//! connections ([`among`]), running a `*_direct.rs` algorithm unchanged or phases of its own.
//!
//! The *rail-aligned* algorithms (`*_rail.rs`) serve hosts of equal size k ≥ 2: there local
//! rank i of every host forms *rail* i ([`rail_of`]), and each step between hosts runs among a
//! rail over a `Subset`, every rail at once, each rank carrying its *share* (1/k of the
//! tensor) on its own connection. The selection table picks them for large ops (select.rs
//! `across_hosts`); the leader scheme serves the rest.
//!
//! Reductions run at two levels: each host reduces to its representative, then the
//! representatives reduce across hosts. MIN, MAX, PRODUCT, SUM and the bitwise ops are the same
//! op at both levels (associative and commutative). AVG and PREMUL_SUM scale exactly once, at
//! the second level: the first level is a SUM, and the second level's AVG divides by the whole
//! group's size (`Step::world_size`), PREMUL_SUM multiplies by its factor — so a rank alone on
//! its host, which has no first level, is scaled the same way as everyone else. bf16/fp16
//! accumulate in fp32 at each level and round once per level; an all-reduce's result is then
//! broadcast, so every rank still ends with the same bits.
//!
//! Every local step writes the op's description (the caller's op, not the level's) and checks
//! the host's ranks' descriptions; the TCP step checks every frame's header. A mismatch on any
//! rank therefore fails its host's ranks at once and, through the abort frames that a failing
//! rank sends every peer, the ranks of other hosts in the same op or the next one. A failure on
//! a representative (a peer on another host died) aborts its shared-memory group, so local
//! ranks waiting on it fail within 100 ms (Fabric::abort, ShmGroup::wait_for).

pub mod allgather_hier;
pub mod allgather_rail;
pub mod allreduce_hier;
pub mod allreduce_rail;
pub mod barrier_hier;
pub mod broadcast_hier;
pub mod broadcast_rail;
pub mod overlap;
pub mod reduce_hier;
pub mod reduce_rail;
pub mod reduce_scatter_rail;

use std::time::Duration;

use super::Step;
use super::host::{self, reduce_shm};
use super::mesh::{allreduce_direct, reduce_direct};
use super::select::{self, ShmCaps};
use crate::error::Result;
use crate::fabric::Mixed;
use crate::hosts::HostMap;
use crate::op::Op;
use crate::par::Par;
use crate::transport::OpCtx;
use crate::transport::shm::{Desc, ShmGroup};
use crate::transport::subset::Subset;
use crate::types::ReduceOp;

/// The leaders of every host, in host order.
pub fn leaders(hosts: &HostMap) -> Vec<usize> {
    (0..hosts.host_count()).map(|h| hosts.leader(h)).collect()
}

/// This rank's rail (hosts.rs `HostMap::rail`): the ranks of its local index on every host, in
/// host order, so a rank's index in it is its host's index.
pub fn rail_of(hosts: &HostMap, rank: usize) -> Vec<usize> {
    hosts.rail(hosts.local_index(rank))
}

/// The leader scheme's all-reduce of `op`: a reduce to each host's leader over shared memory,
/// an all-reduce among the leaders over TCP, a broadcast from each leader over shared memory.
pub fn all_reduce_via_leaders(step: &mut Step<'_>, mixed: &mut Mixed, op: &Op) -> Result<()> {
    let hosts = &mixed.hosts;
    let leaders = leaders(hosts);
    let is_leader = hosts.leader(hosts.host_of(step.rank())) == step.rank();
    let ctx = step.ctx;
    if let Some((shm, desc)) = on_host(&mut mixed.shm, step) {
        let first = Op { reduce_op: local_op(op.reduce_op), ..rooted(op, 0) };
        reduce_shm::run(shm, step.par, ctx, &first, desc)?;
    }
    if is_leader {
        among(mixed.shm.as_ref(), step, &leaders, |s| allreduce_direct::run(s, op))?;
    }
    if let Some((shm, desc)) = on_host(&mut mixed.shm, step) {
        broadcast_on_host(shm, step.par, &behind_remote(ctx), &rooted(op, 0), desc)?;
    }
    Ok(())
}

/// The leader scheme's reduce of `op`: a reduce to each host's representative over shared
/// memory, then a reduce among the representatives to the root over TCP. A representative that
/// is not the root reduces into scratch (a copy of its input), so every tensor but the root's
/// is left unchanged.
pub fn reduce_via_representatives(step: &mut Step<'_>, mixed: &mut Mixed, op: &Op) -> Result<()> {
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

/// The first level's operator: AVG and PREMUL_SUM scale only at the second level.
pub fn local_op(op: ReduceOp) -> ReduceOp {
    match op {
        ReduceOp::Avg | ReduceOp::PreMulSum => ReduceOp::Sum,
        other => other,
    }
}

/// `op` with its root replaced (a local index for a shared-memory step, a subset index for a
/// TCP step).
pub fn rooted(op: &Op, root: usize) -> Op {
    Op { root: root as i64, ..op.clone() }
}

/// This host's shared-memory group (`Mixed::shm`), when the host has one, and what each of its
/// ranks writes about the op of `step` in every local step: the caller's op, not the level's.
pub fn on_host<'m>(shm: &'m mut Option<ShmGroup>, step: &Step<'_>) -> Option<(&'m mut ShmGroup, Desc)> {
    let shm = shm.as_mut()?;
    let desc = host::blocks::describe(shm, step.ctx.seq, &step.identity);
    Some((shm, desc))
}

/// A broadcast among this host's ranks on the path the table picks for it (select.rs), as in a
/// group that has only this host.
pub fn broadcast_on_host(shm: &mut ShmGroup, par: &Par, ctx: &OpCtx, op: &Op, desc: Desc) -> Result<()> {
    let path = select::broadcast_on_host(&ShmCaps::of(shm), op.outputs[0].len());
    host::run(path, shm, par, ctx, op, desc, None)
}

/// How much later than its representative a rank gives up on a shared-memory step that follows
/// the representatives' TCP step (waiting for the result its representative brings back).
pub const BEHIND_REMOTE_GRACE: Duration = Duration::from_secs(1);

/// The context of a shared-memory step that waits for a TCP step among the representatives:
/// its deadline `BEHIND_REMOTE_GRACE` later. Without it, a rank waiting for its host's
/// representative would time out at the same instant as the representative waiting for a
/// remote rank, and could be first to abort the group, blaming its representative; with it,
/// the representative's timeout, which names the remote rank that did not answer, reaches the
/// host first (its abort flag is seen within 100 ms).
pub fn behind_remote(ctx: &OpCtx) -> OpCtx {
    OpCtx { deadline: ctx.deadline + BEHIND_REMOTE_GRACE, ..ctx.clone() }
}

/// Runs `f` on a step among `members` (ranks of the group, this rank among them), over the
/// group's TCP connections; frames keep the op's header fields (sequence number, count, root as
/// the group numbers it), so the members check each other's exactly as in a direct step.
/// Meanwhile this rank is marked in its host's shared memory (`shm`) as waiting on a remote
/// step, so that a local rank waiting for it gives it time to report whom it waits for
/// (ShmGroup::in_remote_step).
pub fn among<R>(shm: Option<&ShmGroup>, step: &mut Step<'_>, members: &[usize], f: impl FnOnce(&mut Step<'_>) -> Result<R>) -> Result<R> {
    match shm {
        Some(g) => g.in_remote_step(|| among_over_tcp(step, members, f)),
        None => among_over_tcp(step, members, f),
    }
}

fn among_over_tcp<R>(step: &mut Step<'_>, members: &[usize], f: impl FnOnce(&mut Step<'_>) -> Result<R>) -> Result<R> {
    let me = members.iter().position(|&m| m == step.rank()).expect("this rank takes part in the TCP step");
    let mut sub = Subset::new(&mut *step.transport, members, me);
    let mut inner = Step {
        transport: &mut sub,
        ctx: step.ctx,
        par: step.par,
        identity: step.identity,
        round_bytes: step.round_bytes,
        scratch: &mut *step.scratch,
        world_size: step.world_size,
        direct_output: None, // the TCP step's buffers are the host's, never a staged output's
    };
    f(&mut inner)
}

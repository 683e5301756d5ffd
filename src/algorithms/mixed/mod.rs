//! The hierarchical algorithms (`*_hier.rs`) and what they share. They serve a *mixed* group:
//! its ranks span several hosts and some host has two or more of them (hosts.rs). Each gets
//! the fabric's mixed parts (fabric.rs `Mixed`): the host map, and this host's shared-memory
//! group (`Mixed::shm`, local indices 0..k, present when the host has k ≥ 2 ranks). Within a
//! host, ranks talk through that group; between hosts, one rank per host — its *representative*: the
//! leader, or the root on the root's host — talks over TCP on a [`Subset`] of the group's
//! connections ([`among`]), running a `*_direct.rs` algorithm unchanged or phases of its own.
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
pub mod allreduce_hier;
pub mod barrier_hier;
pub mod broadcast_hier;
pub mod reduce_hier;

use std::time::Duration;

use super::Step;
use super::host;
use super::select::{self, ShmCaps};
use crate::error::Result;
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
    host::run(path, shm, par, ctx, op, desc)
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
    };
    f(&mut inner)
}

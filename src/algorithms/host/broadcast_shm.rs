//! Broadcast over shared memory: the root copies each block of its tensor into its slot; the
//! others copy it out of the root's slot straight into their tensors. Slots alternate, so the
//! root fills block g + 1 while the others read block g.
//!
//! On a group with heaps, from select.rs's zero-copy size ([`run_asking_root_heap`]), every rank
//! says with the first block whether its tensor lies in its heap (only the root's answer is
//! read), and a root whose does fills no slot. Then, decided during the op once the first
//! block's exchange shows the root's answer, the others copy the whole tensor from the root's
//! heap, where it is (zero_copy.rs): one copy per receiver, against two through the slots, and
//! the root copies nothing. That costs no synchronization more than the slot path.

use std::ops::ControlFlow;

use super::blocks::{Block, each_block_until, exchange_produced, finish_block};
use super::zero_copy::{count_zero_copy, describe_views, in_heap, peer_views};
use crate::error::Result;
use crate::op::Op;
use crate::par::Par;
use crate::transport::OpCtx;
use crate::transport::shm::{Counter, Desc, ShmGroup};

/// Through the slots.
pub fn run(shm: &mut ShmGroup, par: &Par, ctx: &OpCtx, op: &Op, desc: Desc) -> Result<()> {
    through_slots(shm, par, ctx, op, desc, false)
}

/// Through the slots, or from the root's heap when its tensor lies there (module comment).
pub fn run_asking_root_heap(shm: &mut ShmGroup, par: &Par, ctx: &OpCtx, op: &Op, desc: Desc) -> Result<()> {
    through_slots(shm, par, ctx, op, desc, true)
}

fn through_slots(shm: &mut ShmGroup, par: &Par, ctx: &OpCtx, op: &Op, desc: Desc, ask_root_heap: bool) -> Result<()> {
    let (rank, root) = (shm.rank(), op.root as usize);
    let buf = op.outputs[0];
    let block_bytes = shm.slot_bytes();
    let from_heap = each_block_until(shm, ctx, buf.len(), block_bytes, |shm, Block { index: b, g, last, start, len }| {
        let in_place = b == 0 && ask_root_heap && {
            // Every rank writes its answer (only the root's is read), so no stale one remains.
            describe_views(shm, g, if rank == root { &op.outputs[..1] } else { &[] });
            in_heap(shm, g, root)
        };
        if rank == root && !in_place {
            par.copy(buf.sub(start, len), shm.slot(rank, g).sub(0, len));
        }
        exchange_produced(shm, g, (b == 0).then_some(desc), ctx)?;
        // The root's description is checked now, so its heap answer is that of this op.
        if b == 0 && ask_root_heap && in_heap(shm, g, root) {
            return Ok(ControlFlow::Break((g, last)));
        }
        if rank != root {
            par.copy_out(shm.slot(root, g).sub(0, len), buf.sub(start, len), buf.len());
        }
        finish_block(shm, g);
        Ok(ControlFlow::Continue(()))
    })?;
    match from_heap {
        Some((first, last)) => from_root_heap(shm, par, ctx, op, first, last),
        None => Ok(()),
    }
}

/// After the exchange of the op's first block `first`, whose answer from the root was "in my
/// heap": every other rank copies the tensor, where it is, into its own and publishes
/// `Consumed` for the op's last block `last`; the root returns once all have.
fn from_root_heap(shm: &mut ShmGroup, par: &Par, ctx: &OpCtx, op: &Op, first: u64, last: u64) -> Result<()> {
    let (rank, root) = (shm.rank(), op.root as usize);
    let buf = op.outputs[0];
    count_zero_copy(shm, ctx.seq);
    if rank != root {
        par.copy_out(peer_views(shm, first, root, 1, buf.len())?[0], buf, buf.len());
    }
    shm.publish(Counter::Reduced, last);
    shm.publish(Counter::Consumed, last);
    if rank == root { shm.wait_all(Counter::Consumed, last, ctx) } else { Ok(()) }
}

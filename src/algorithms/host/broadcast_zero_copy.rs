//! Broadcast, zero-copy (zero_copy.rs): the root's tensor lies in its heap, and it said so with
//! the op's first block (broadcast_shm.rs). Every other rank copies the tensor, where it is,
//! into its own and publishes `Consumed` for the op's last block; the root returns once all
//! have. One copy per receiver, against two through the slots (and the root copies nothing).

use super::zero_copy::peer_views;
use crate::error::Result;
use crate::op::Op;
use crate::transport::OpCtx;
use crate::transport::shm::{Counter, ShmGroup};

/// After the exchange of the op's first block `first`, whose answer from the root was "in my
/// heap": finishes the op, marking all its blocks (up to `last`) done.
pub fn finish(shm: &mut ShmGroup, ctx: &OpCtx, op: &Op, first: u64, last: u64) -> Result<()> {
    let (rank, root) = (shm.rank(), op.root as usize);
    let buf = op.outputs[0];
    shm.count_zero_copy_op(ctx.seq);
    if rank != root {
        shm.par().copy_out(peer_views(shm, first, root, 1, buf.len())?[0], buf, buf.len());
    }
    shm.publish(Counter::Reduced, last);
    shm.publish(Counter::Consumed, last);
    if rank == root { shm.wait_all(Counter::Consumed, last, ctx) } else { Ok(()) }
}

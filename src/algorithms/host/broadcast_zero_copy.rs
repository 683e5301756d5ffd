//! Broadcast, zero-copy (zero_copy.rs): the root's tensor lies in its heap. After the pre-sync
//! every other rank copies it, where it is, into its own tensor and publishes `Consumed`; the
//! root returns once all have. One copy per receiver, against two through the slots (and the
//! root copies nothing).

use super::blocks::finish_block;
use super::broadcast_shm;
use super::zero_copy::{peer_views, presync};
use crate::error::Result;
use crate::op::Op;
use crate::transport::OpCtx;
use crate::transport::shm::{Counter, Desc, ShmGroup};

pub fn run(shm: &mut ShmGroup, ctx: &OpCtx, op: &Op, desc: Desc) -> Result<()> {
    let rank = shm.rank();
    let root = op.root as usize;
    let buf = op.outputs[0];
    let g = presync(shm, ctx, desc, if rank == root { &op.outputs[..1] } else { &[] })?;
    if !shm.in_heap(g, root) {
        finish_block(shm, g);
        return broadcast_shm::run(shm, ctx, op, desc);
    }
    shm.count_zero_copy_op();
    if rank != root {
        shm.par().copy(peer_views(shm, g, root, 1, buf.len())?[0], buf);
    }
    shm.publish(Counter::Reduced, g);
    shm.publish(Counter::Consumed, g);
    if rank == root { shm.wait_all(Counter::Consumed, g, ctx) } else { Ok(()) }
}

//! All-gather, zero-copy (zero_copy.rs): every rank's input lies in its heap. After the
//! pre-sync each rank copies every peer's input, where it is, into that peer's output view
//! (and its own input into its own view, unless it is that view: an in-place all-gather), then
//! publishes `Consumed` and waits for everyone's. One copy per byte received, against two
//! through the slots.
//!
//! Whether every rank's input is in its heap is decided during the op, from the pre-sync's
//! answers; when not, the op goes on through the slots (slots.rs's gather).
//!
//! A rank whose input overlaps one of the output views it writes (not its own) says it is not
//! in its heap: peers read that input while it writes, so that op takes the slot path.

use super::blocks::finish_block;
use super::slots;
use super::zero_copy::{all_in_heap, count_zero_copy, overlap, peer_views, presync};
use crate::error::Result;
use crate::op::Op;
use crate::par::Par;
use crate::transport::OpCtx;
use crate::transport::shm::{Counter, Desc, ShmGroup};

pub fn run(shm: &mut ShmGroup, par: &Par, ctx: &OpCtx, op: &Op, desc: Desc) -> Result<()> {
    let (rank, size) = (shm.rank(), shm.size());
    let input = op.inputs[0];
    let safe = !(0..size).any(|r| r != rank && overlap(input, op.outputs[r]));
    let g = presync(shm, ctx, desc, if safe { &op.inputs[..1] } else { &[] })?;
    if !all_in_heap(shm, g) {
        finish_block(shm, g);
        return slots::gather(shm, par, ctx, op, desc, None);
    }
    count_zero_copy(shm, ctx.seq);
    let mut copies = Vec::with_capacity(size);
    for r in (0..size).filter(|&r| r != rank) {
        copies.push((peer_views(shm, g, r, 1, input.len())?[0], op.outputs[r]));
    }
    if input.ptr() != op.outputs[rank].ptr() {
        copies.push((input, op.outputs[rank]));
    }
    par.copy_all_out(&copies, input.len() * size);
    shm.publish(Counter::Reduced, g);
    shm.publish(Counter::Consumed, g);
    shm.wait_all(Counter::Consumed, g, ctx)
}

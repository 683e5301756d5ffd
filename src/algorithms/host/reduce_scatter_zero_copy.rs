//! Reduce-scatter, zero-copy (zero_copy.rs): every rank's input views lie in its heap, evenly
//! spaced (one tensor cut in `size` views, as `reduce_scatter_tensor` gives). After the
//! pre-sync each rank reduces view `rank` of every rank's input, where it is, in rank order
//! (scaling fused), straight into its output, then publishes `Consumed` and waits for
//! everyone's. Per rank: N/n·n bytes read and N/n written, against a copy of its whole input
//! into the slots first.
//!
//! Whether every rank's views are in its heap is decided during the op, from the pre-sync's
//! answers; when not, the op goes on through the slots (slots.rs's reduce-scatter).
//!
//! A rank whose output overlaps its input other than exactly as its own view says it is not in
//! its heap (peers read those bytes while it writes them), and that op takes the slot path.

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
    let output = op.outputs[0];
    let len = output.len();
    let safe = !(0..size).any(|r| overlap(output, op.inputs[r]) && !(r == rank && output.ptr() == op.inputs[r].ptr()));
    let g = presync(shm, ctx, desc, if safe { &op.inputs } else { &[] })?;
    if !all_in_heap(shm, g) {
        finish_block(shm, g);
        return slots::reduce_scatter(shm, par, ctx, op, desc);
    }
    count_zero_copy(shm, ctx.seq);
    let mut srcs: Vec<*const u8> = Vec::with_capacity(size);
    for r in 0..size {
        let view = if r == rank { op.inputs[rank] } else { peer_views(shm, g, r, size, len)?[rank] };
        srcs.push(view.ptr() as *const u8);
    }
    if len > 0 {
        let esz = op.dtype.size();
        // SAFETY: every rank's view `rank` holds `len` bytes of its input (all published
        // Produced after their inputs were ready; peer_views bounded each range by its heap);
        // the output is either exactly this rank's own view `rank` or overlaps none of its
        // views (checked above), and no peer's (other processes' memory); no one writes an
        // input before every rank has published Consumed.
        unsafe { par.reduce(&op.reduction(size), output.ptr(), &srcs, len / esz, esz) };
    }
    shm.publish(Counter::Reduced, g);
    shm.publish(Counter::Consumed, g);
    shm.wait_all(Counter::Consumed, g, ctx)
}

//! All-reduce over shared memory, through the slots: the blocked reduction of slots.rs, in which
//! every rank copies the reduced parts out. select.rs sends here the tensors past the one-shot
//! limit (allreduce_one_shot.rs) that do not read by cross-memory attach (allreduce_cma.rs).
//!
//! On a group with heaps ([`run_asking_heap`]) each rank says with the first block whether its
//! tensor lies in its heap, and then copies nothing into its slot if it does. What follows is
//! decided during the op, once the first block's exchange shows every rank's answer: all yes,
//! and the op finishes zero-copy (push.rs); some yes (rare: a tensor in the heap on some ranks
//! only), and the slots of the ranks that said yes are empty, so the op starts over through the
//! slots; none, and it goes on through the slots. Asking costs ordinary tensors nothing.

use super::push::push;
use super::slots::{self, HeapAnswers};
use crate::error::Result;
use crate::op::Op;
use crate::par::Par;
use crate::transport::OpCtx;
use crate::transport::shm::{Counter, Desc, ShmGroup};

/// Through the slots, on a group without heaps.
pub fn run(shm: &mut ShmGroup, par: &Par, ctx: &OpCtx, op: &Op, desc: Desc) -> Result<()> {
    slots::reduce(shm, par, ctx, op, desc, None, false).map(drop)
}

/// Through the slots, or zero-copy when every rank's tensor lies in its heap (module comment).
pub fn run_asking_heap(shm: &mut ShmGroup, par: &Par, ctx: &OpCtx, op: &Op, desc: Desc) -> Result<()> {
    match slots::reduce(shm, par, ctx, op, desc, None, true)? {
        HeapAnswers::NoneInHeap => Ok(()),
        HeapAnswers::AllInHeap { first, last } => push(shm, par, ctx, op, first, last),
        HeapAnswers::SomeInHeap { last } => {
            // Mark this op's blocks done (nobody read a slot of it) and start over through the
            // slots, without asking.
            shm.publish(Counter::Reduced, last);
            shm.publish(Counter::Consumed, last);
            run(shm, par, ctx, op, desc)
        }
    }
}

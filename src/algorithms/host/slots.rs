//! The slot loops that more than one algorithm runs: the blocked reduction (all-reduce past its
//! one-shot limit, reduce), the gather (all-gather, gather) and the reduce-scatter (also where
//! a zero-copy op finds a buffer outside its heap). Each is described here; the algorithm files
//! say which of them they run and with which reader.
//!
//! *Blocked reduction*: tensors go in *blocks* of one slot. Within a block each rank owns a
//! *part* (the block split in `size` near-equal ranges). Per block: each rank copies the parts
//! its peers own into its slot (its own part it reads from its tensor directly); once all have,
//! each rank reduces its part from its tensor and the peers' slots into its own slot (scaling
//! fused); once all have, each *reader* copies every part from its owner's slot into its
//! output. Slots alternate, so the next block's copy overlaps peers' reading of this one.
//!
//! *Gather*: each rank copies a block of its input into its slot; once all have, each reader
//! copies every peer's block out of that peer's slot into the peer's output view.
//!
//! *Reduce-scatter*: each rank's slot is cut into `size` *lanes*; per block each rank copies
//! the next piece of its input view for rank k into lane k; once all have, each rank reduces
//! its own lane from every peer's slot (its own piece from its input view, in rank order,
//! scaling fused) straight into its output.

use std::ops::ControlFlow;

use super::blocks::{Block, copy_reduced_parts, each_block, each_block_until, exchange_produced, finish_block};
use super::zero_copy::{describe_views, in_heap};
use crate::algorithms::split::split_range;
use crate::error::Result;
use crate::op::Op;
use crate::par::Par;
use crate::transport::OpCtx;
use crate::transport::shm::{Counter, Desc, ShmGroup};

/// What the first block of a blocked reduction that asked about heaps showed (`ask_heap`).
pub enum HeapAnswers {
    /// Not asked, or no rank's tensor is in its heap: the op ran through the slots.
    NoneInHeap,
    /// Every rank's tensor is in its heap: the op stopped after exchanging block `first`, having
    /// reserved blocks up to `last`; the caller finishes it in place.
    AllInHeap { first: u64, last: u64 },
    /// Some ranks' tensors are in their heaps and their slots are empty: the op stopped after
    /// the first block, having reserved blocks up to `last`; the caller starts it over.
    SomeInHeap { last: u64 },
}

/// The blocked reduction of `op.outputs[0]`; `reader`: None when every rank copies the result
/// out (all-reduce), Some(root) when only the root does (reduce). With `ask_heap`, the first
/// block also says whether this rank's tensor lies in its heap (then it fills no slot), and the
/// op stops after that block unless no rank's does.
pub fn reduce(shm: &mut ShmGroup, par: &Par, ctx: &OpCtx, op: &Op, desc: Desc, reader: Option<usize>, ask_heap: bool) -> Result<HeapAnswers> {
    let (rank, size) = (shm.rank(), shm.size());
    let buf = op.outputs[0];
    let esz = op.dtype.size();
    let reduction = op.reduction(size);
    let block_bytes = shm.slot_bytes() / esz * esz;
    let stopped = each_block_until(shm, ctx, buf.len(), block_bytes, |shm, Block { index: b, g, last, start, len }| {
        let block = buf.sub(start, len);
        let part = |r: usize| {
            let (s, l) = split_range(len / esz, size, r);
            (s * esz, l * esz)
        };
        let in_my_heap = b == 0 && ask_heap && {
            describe_views(shm, g, &[buf], false);
            in_heap(shm, g, rank)
        };
        let mine = shm.slot(rank, g);
        let (my_start, my_len) = part(rank);
        if !in_my_heap {
            // Peers own everything but my part: copy what lies before and after it.
            let after = my_start + my_len;
            par.copy_all(&[(block.sub(0, my_start), mine.sub(0, my_start)), (block.sub(after, len - after), mine.sub(after, len - after))]);
        }
        exchange_produced(shm, g, (b == 0).then_some(desc), ctx)?;
        // Every rank's description is checked now, so every heap answer is that of this op.
        if b == 0 && ask_heap {
            let answered_yes = (0..size).filter(|&r| in_heap(shm, g, r)).count();
            if answered_yes == size {
                return Ok(ControlFlow::Break(HeapAnswers::AllInHeap { first: g, last }));
            }
            if answered_yes > 0 {
                return Ok(ControlFlow::Break(HeapAnswers::SomeInHeap { last }));
            }
        }

        let srcs: Vec<*const u8> = (0..size)
            .map(|r| if r == rank { block.sub(my_start, my_len).ptr() } else { shm.slot(r, g).sub(my_start, my_len).ptr() } as *const u8)
            .collect();
        if my_len > 0 {
            // SAFETY: peers' slots hold their inputs for my part (they published Produced for g
            // after copying); my own part is read from my tensor; the destination, my slot's
            // part, is disjoint from all of these (I never copied my own part into it).
            unsafe { par.reduce(&reduction, mine.sub(my_start, my_len).ptr(), &srcs, my_len / esz, esz) };
        }
        shm.publish(Counter::Reduced, g);
        if reader.is_none_or(|root| root == rank) {
            shm.wait_all(Counter::Reduced, g, ctx)?;
            copy_reduced_parts(shm, par, g, block, part, buf.len());
        }
        finish_block(shm, g);
        Ok(ControlFlow::Continue(()))
    })?;
    Ok(stopped.unwrap_or(HeapAnswers::NoneInHeap))
}

/// The gather of every rank's `op.inputs[0]` into `op.outputs[rank]`; `reader`: None when
/// every rank reads (all-gather), Some(root) when only the root does (gather).
pub fn gather(shm: &mut ShmGroup, par: &Par, ctx: &OpCtx, op: &Op, desc: Desc, reader: Option<usize>) -> Result<()> {
    let (rank, size) = (shm.rank(), shm.size());
    let input = op.inputs[0];
    let reads = reader.is_none_or(|root| root == rank);
    let block_bytes = shm.slot_bytes();
    each_block(shm, ctx, input.len(), block_bytes, |shm, Block { index: b, g, start, len, .. }| {
        par.copy(input.sub(start, len), shm.slot(rank, g).sub(0, len));
        exchange_produced(shm, g, (b == 0).then_some(desc), ctx)?;
        if reads {
            let copies: Vec<_> =
                (0..size).filter(|&p| p != rank).map(|peer| (shm.slot(peer, g).sub(0, len), op.outputs[peer].sub(start, len))).collect();
            par.copy_all_out(&copies, input.len() * size);
        }
        finish_block(shm, g);
        Ok(())
    })?;
    // A rail-aligned all-gather (mixed/allgather_rail.rs) hands a rank its own output view as
    // its input: that piece is in place already.
    if reads && input.ptr() != op.outputs[rank].ptr() {
        par.copy_out(input, op.outputs[rank], input.len() * size);
    }
    Ok(())
}

/// The reduce-scatter of the input views `op.inputs` into `op.outputs[0]`.
pub fn reduce_scatter(shm: &mut ShmGroup, par: &Par, ctx: &OpCtx, op: &Op, desc: Desc) -> Result<()> {
    let (rank, size) = (shm.rank(), shm.size());
    let output = op.outputs[0];
    let esz = op.dtype.size();
    let reduction = op.reduction(size);
    let lane = shm.slot_bytes() / size / 64 * 64 / esz * esz;
    each_block(shm, ctx, output.len(), lane, |shm, Block { index: b, g, start, len, .. }| {
        let slot = shm.slot(rank, g);
        let copies: Vec<_> =
            (0..size).filter(|&p| p != rank).map(|peer| (op.inputs[peer].sub(start, len), slot.sub(peer * lane, len))).collect();
        par.copy_all(&copies);
        exchange_produced(shm, g, (b == 0).then_some(desc), ctx)?;
        let srcs: Vec<*const u8> = (0..size)
            .map(
                |r| if r == rank { op.inputs[rank].sub(start, len).ptr() } else { shm.slot(r, g).sub(rank * lane, len).ptr() } as *const u8,
            )
            .collect();
        if len > 0 {
            // SAFETY: peers' lanes for this rank hold `len` bytes of their inputs (published
            // Produced for g); the destination is this rank's output, which c10d guarantees is
            // not one of its input views, and is disjoint from every slot.
            unsafe { par.reduce(&reduction, output.sub(start, len).ptr(), &srcs, len / esz, esz) };
        }
        finish_block(shm, g);
        Ok(())
    })
}

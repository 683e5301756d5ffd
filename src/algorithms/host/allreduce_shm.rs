//! All-reduce over shared memory.
//!
//! Small tensors take the *one-shot* path (while a rank's reads from its peers, `(size - 1) ×`
//! the tensor, stay within `XCCL_RS_SHM_ONESHOT_BYTES`: [`takes_one_shot`]): every rank
//! copies its input into its slot, and once all have, every rank reduces the whole tensor from
//! all slots in rank order straight into its output. One synchronization; every rank computes
//! the same bits.
//!
//! Larger tensors go in *blocks* of one slot. Within a block each rank owns a *part* (the
//! block split in `size` near-equal ranges). Per block: each rank copies the parts its peers
//! own into its slot (its own part it reads from its tensor directly); once all have, each rank
//! reduces its part from its tensor and the peers' slots into its own slot (scaling fused);
//! once all have, each rank copies every part from its owner's slot into its output. Slots
//! alternate, so the next block's copy overlaps peers' reading of this one. A reduce
//! (reduce_shm.rs) is the same with only the root copying the parts out.
//!
//! Tensors that every rank allocated in its heap skip the slots altogether
//! (allreduce_zero_copy.rs). On a group with heaps each rank says with the first block whether
//! its tensor lies in its heap, and then copies nothing into its slot if it does; once the
//! first block's exchange shows every rank's answer, all go zero-copy, or all go on through the
//! slots. That costs ordinary tensors nothing, so the zero-copy path runs at every size past
//! the one-shot limit. When the answers differ (rare: a tensor in the heap on some ranks only),
//! the slots of the ranks that said yes are empty, and the op starts over through the slots.
//! Where cross-memory attach is on, large tensors take allreduce_zero_copy.rs's pre-sync
//! instead, which picks between the two and the slots (allreduce_cma.rs).

use super::blocks::{block_count, block_range, copy_reduced_parts, exchange_produced, finish_block, wait_slot_free};
use crate::algorithms::split::split_range;
use crate::error::Result;
use crate::op::Op;
use crate::reduce::reduce_raw;
use crate::transport::OpCtx;
use crate::transport::shm::{Counter, Desc, ShmGroup};

/// Whether an all-reduce of `bytes` takes the one-shot path: there each rank reads every other
/// rank's slot whole, `(size - 1) × bytes`, which must stay within `oneshot_bytes` (and the
/// tensor within one slot). So the limit shrinks as the group grows: each rank's reads grow with
/// the group, while the blocked path's grow with the tensor alone.
pub fn takes_one_shot(bytes: usize, size: usize, oneshot_bytes: usize, chunk: usize) -> bool {
    bytes <= chunk && bytes.saturating_mul(size.saturating_sub(1).max(1)) <= oneshot_bytes
}

pub fn run(shm: &mut ShmGroup, ctx: &OpCtx, op: &Op, desc: Desc, oneshot_bytes: usize) -> Result<()> {
    let buf = op.outputs[0];
    if takes_one_shot(buf.len(), shm.size(), oneshot_bytes, shm.chunk()) {
        one_shot(shm, ctx, op, desc)
    } else if super::allreduce_cma::tries(shm, buf.len()) {
        super::allreduce_zero_copy::run(shm, ctx, op, desc)
    } else {
        let announce = shm.zero_copy();
        through_slots(shm, ctx, op, desc, None, announce)
    }
}

fn one_shot(shm: &mut ShmGroup, ctx: &OpCtx, op: &Op, desc: Desc) -> Result<()> {
    let (rank, size) = (shm.rank(), shm.size());
    let buf = op.outputs[0];
    let esz = op.dtype.size();
    let g = shm.begin_op(1);
    wait_slot_free(shm, g, ctx)?;
    buf.copy_to(shm.slot(rank, g).sub(0, buf.len()));
    exchange_produced(shm, g, Some(desc), ctx)?;
    let srcs: Vec<*const u8> = (0..size).map(|r| shm.slot(r, g).ptr() as *const u8).collect();
    if !buf.is_empty() {
        // SAFETY: every slot holds `buf.len()` bytes of its rank's input (all published
        // Produced for g after copying, and the descriptions — hence the sizes — match); the
        // destination is this rank's tensor, disjoint from every slot; reduction validated.
        unsafe { reduce_raw(&op.reduction(size), buf.ptr(), &srcs, buf.len() / esz, true) };
    }
    finish_block(shm, g);
    Ok(())
}

/// The blocked path; `reader`: None for all-reduce (everyone copies the result out), Some(root)
/// for reduce.
pub fn blocked(shm: &mut ShmGroup, ctx: &OpCtx, op: &Op, desc: Desc, reader: Option<usize>) -> Result<()> {
    through_slots(shm, ctx, op, desc, reader, false)
}

/// The blocked path; with `announce` (an all-reduce on a group with heaps), the first block also
/// says whether this rank's tensor lies in its heap, and the op goes zero-copy when every
/// rank's does (module comment).
fn through_slots(shm: &mut ShmGroup, ctx: &OpCtx, op: &Op, desc: Desc, reader: Option<usize>, announce: bool) -> Result<()> {
    let (rank, size) = (shm.rank(), shm.size());
    let buf = op.outputs[0];
    let esz = op.dtype.size();
    let piece = shm.chunk() / esz * esz;
    let blocks = block_count(buf.len(), piece);
    let g0 = shm.begin_op(blocks as u64);
    let reduction = op.reduction(size);
    for b in 0..blocks {
        let g = g0 + b as u64;
        let (start, len) = block_range(buf.len(), piece, b);
        let block = buf.sub(start, len);
        let part = |r: usize| {
            let (s, l) = split_range(len / esz, size, r);
            (s * esz, l * esz)
        };
        wait_slot_free(shm, g, ctx)?;
        let in_my_heap = b == 0 && announce && {
            shm.describe_heap(g, &[buf]);
            shm.in_heap(g, rank)
        };
        let mine = shm.slot(rank, g);
        let (my_start, my_len) = part(rank);
        if !in_my_heap {
            // Peers own everything but my part: copy what lies before and after it.
            let after = my_start + my_len;
            shm.par()
                .copy_all(&[(block.sub(0, my_start), mine.sub(0, my_start)), (block.sub(after, len - after), mine.sub(after, len - after))]);
        }
        exchange_produced(shm, g, (b == 0).then_some(desc), ctx)?;
        // Every rank's description is checked now, so every heap answer is that of this op.
        if b == 0 && announce {
            let last = g0 + blocks as u64 - 1;
            let in_heap = (0..size).filter(|&r| shm.in_heap(g, r)).count();
            if in_heap == size {
                return super::allreduce_zero_copy::push(shm, ctx, op, g, last);
            }
            if in_heap > 0 {
                // Those ranks' slots are empty: mark this op's blocks done (nobody read a slot
                // of it) and start over through the slots, without asking.
                shm.publish(Counter::Reduced, last);
                shm.publish(Counter::Consumed, last);
                return through_slots(shm, ctx, op, desc, reader, false);
            }
        }

        let srcs: Vec<*const u8> = (0..size)
            .map(|r| if r == rank { block.sub(my_start, my_len).ptr() } else { shm.slot(r, g).sub(my_start, my_len).ptr() } as *const u8)
            .collect();
        if my_len > 0 {
            // SAFETY: peers' slots hold their inputs for my part (they published Produced for g
            // after copying); my own part is read from my tensor; the destination, my slot's
            // part, is disjoint from all of these (I never copied my own part into it).
            unsafe { shm.par().reduce(&reduction, mine.sub(my_start, my_len).ptr(), &srcs, my_len / esz, esz) };
        }
        shm.publish(Counter::Reduced, g);
        if reader.is_none_or(|root| root == rank) {
            shm.wait_all(Counter::Reduced, g, ctx)?;
            copy_reduced_parts(shm, g, block, part, buf.len());
        }
        finish_block(shm, g);
    }
    Ok(())
}

#[cfg(test)]
mod one_shot_limit {
    use super::takes_one_shot;

    #[test]
    fn the_limit_is_on_what_a_rank_reads_from_its_peers() {
        let (limit, chunk) = (64 << 10, 4 << 20);
        assert!(takes_one_shot(64 << 10, 2, limit, chunk) && !takes_one_shot((64 << 10) + 1, 2, limit, chunk));
        assert!(takes_one_shot(9362, 8, limit, chunk) && !takes_one_shot(9363, 8, limit, chunk));
        assert!(takes_one_shot(4369, 16, limit, chunk) && !takes_one_shot(4370, 16, limit, chunk));
        assert!(takes_one_shot(100, 1, limit, chunk), "a group of one");
        assert!(!takes_one_shot(8 << 10, 2, 1 << 20, 4 << 10), "never more than one slot");
        assert!(takes_one_shot(0, 8, 0, chunk) && !takes_one_shot(1, 8, 0, chunk), "0 turns it off but for empty tensors");
    }
}

//! Direct reduce-scatter. Terms: `blocks[j]` is this rank's contribution to rank j's result;
//! `out` is where this rank's own result goes. The work runs in *rounds*: in round k every rank
//! sends segment k of each `blocks[j]` to rank j and receives segment k of its own block from
//! every peer into scratch (one slot per peer), then reduces all ranks' segments — its own from
//! `blocks[rank]`, the others from scratch — in rank order, in one pass, with AVG/PREMUL_SUM's
//! scaling fused into that pass. A segment is `XCCL_RS_SEGMENT_BYTES`, so scratch stays at
//! `(size - 1) * segment` whatever the tensor size. There is always at least one round, so even
//! an empty op exchanges headers and a size mismatch is caught.

use crate::algorithms::Step;
use crate::error::Result;
use crate::op::Op;
use crate::reduce::{Reduction, reduce_raw};
use crate::transport::RawBuf;
use crate::types::ReduceOp;

pub fn run(step: &mut Step<'_>, op: &Op) -> Result<()> {
    let out = op.outputs[0];
    reduce_blocks(step, &step.reduction(op), &op.inputs, out)
}

/// Reduces `blocks` across ranks into `out` (see the module docs). `out` may be exactly
/// `blocks[rank]` (in place).
pub fn reduce_blocks(step: &mut Step<'_>, reduction: &Reduction, blocks: &[RawBuf], out: RawBuf) -> Result<()> {
    let (rank, size) = (step.rank(), step.size());
    let esz = reduction.dtype.size();
    let seg = step.segment_elems(reduction.dtype);
    let longest = blocks.iter().map(|b| b.len() / esz).max().unwrap_or(0);
    let rounds = longest.div_ceil(seg).max(1);
    let needs_finish = matches!(reduction.op, ReduceOp::Avg | ReduceOp::PreMulSum);
    let scratch = step.scratch((size - 1) * seg * esz);
    let slot = |peer: usize| if peer < rank { peer } else { peer - 1 };

    for k in 0..rounds {
        let segment_of = |len_elems: usize| {
            let start = (k * seg).min(len_elems);
            (start, (len_elems - start).min(seg))
        };
        let (my_start, my_len) = segment_of(out.len() / esz);
        let mut phase = step.phase();
        for peer in (0..size).filter(|&p| p != rank) {
            let (s, l) = segment_of(blocks[peer].len() / esz);
            phase.send(peer, blocks[peer].sub(s * esz, l * esz), step.identity.count);
            phase.recv(peer, scratch.sub(slot(peer) * seg * esz, my_len * esz), step.identity.count);
        }
        step.run(phase)?;

        let dst = out.sub(my_start * esz, my_len * esz);
        let own = blocks[rank].sub(my_start * esz, my_len * esz);
        if size == 1 && !needs_finish {
            own.copy_to(dst);
            continue;
        }
        let srcs: Vec<*const u8> = (0..size)
            .map(|p| if p == rank { own.ptr() as *const u8 } else { scratch.sub(slot(p) * seg * esz, my_len * esz).ptr() as *const u8 })
            .collect();
        if my_len > 0 {
            // SAFETY: every src holds `my_len` elements: `own` is a sub-range of the caller's
            // block and each scratch slot was just filled by a receive of exactly that length.
            // `dst` is either exactly `own` (in place) or disjoint from all srcs (the output of
            // a reduce-scatter, or scratch-free memory); the op's reduction was validated.
            unsafe { reduce_raw(reduction, dst.ptr(), &srcs, my_len, true) };
        }
    }
    Ok(())
}

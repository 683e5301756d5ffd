//! Direct reduce-scatter. Terms: `contributions[j]` is this rank's contribution to rank j's
//! result; `out` is where this rank's own result goes. The work runs in *rounds*: in round k
//! every rank sends round k's part of each `contributions[j]` to rank j and receives round k's
//! part of its own result's inputs from every peer into scratch (one area per peer), then
//! reduces all ranks' parts — its own from `contributions[rank]`, the others from scratch — in
//! rank order, in one pass, with AVG/PREMUL_SUM's scaling fused into that pass. A round moves
//! `XCCL_RS_SEGMENT_BYTES` per peer, so scratch stays at `(size - 1)` rounds whatever the tensor
//! size. There is always at least one round, so even
//! an empty op exchanges headers and a size mismatch is caught.

use crate::algorithms::Step;
use crate::error::Result;
use crate::op::Op;
use crate::reduce::{Reduction, reduce_raw};
use crate::transport::RawBuf;
use crate::types::ReduceOp;

pub fn run(step: &mut Step<'_>, op: &Op) -> Result<()> {
    let out = op.outputs[0];
    reduce_contributions(step, &step.reduction(op), &op.inputs, out)
}

/// Reduces `contributions` across ranks into `out` (see the module docs). `out` may be exactly
/// `contributions[rank]` (in place).
pub fn reduce_contributions(step: &mut Step<'_>, reduction: &Reduction, contributions: &[RawBuf], out: RawBuf) -> Result<()> {
    let (rank, size) = (step.rank(), step.size());
    let esz = reduction.dtype.size();
    let per_round = step.round_elems(reduction.dtype);
    let longest = contributions.iter().map(|b| b.len() / esz).max().unwrap_or(0);
    let rounds = longest.div_ceil(per_round).max(1);
    let needs_finish = matches!(reduction.op, ReduceOp::Avg | ReduceOp::PreMulSum);
    let scratch = step.scratch((size - 1) * per_round * esz);
    let area = |peer: usize| if peer < rank { peer } else { peer - 1 };

    for k in 0..rounds {
        let round_range = |len_elems: usize| {
            let start = (k * per_round).min(len_elems);
            (start, (len_elems - start).min(per_round))
        };
        let (my_start, my_len) = round_range(out.len() / esz);
        let mut phase = step.phase();
        for peer in (0..size).filter(|&p| p != rank) {
            let (s, l) = round_range(contributions[peer].len() / esz);
            phase.send(peer, contributions[peer].sub(s * esz, l * esz), step.identity.count);
            phase.recv(peer, scratch.sub(area(peer) * per_round * esz, my_len * esz), step.identity.count);
        }
        step.run(phase)?;

        let dst = out.sub(my_start * esz, my_len * esz);
        let own = contributions[rank].sub(my_start * esz, my_len * esz);
        if size == 1 && !needs_finish {
            own.copy_to(dst);
            continue;
        }
        let srcs: Vec<*const u8> = (0..size)
            .map(|p| if p == rank { own.ptr() as *const u8 } else { scratch.sub(area(p) * per_round * esz, my_len * esz).ptr() as *const u8 })
            .collect();
        if my_len > 0 {
            // SAFETY: every src holds `my_len` elements: `own` is a sub-range of the caller's
            // contribution and each scratch area was just filled by a receive of exactly that length.
            // `dst` is either exactly `own` (in place) or disjoint from all srcs (the output of
            // a reduce-scatter, or scratch-free memory); the op's reduction was validated.
            unsafe { reduce_raw(reduction, dst.ptr(), &srcs, my_len, true) };
        }
    }
    Ok(())
}

//! Ring all-reduce: rank r receives only from r − 1 and sends only to r + 1, so a rank needs two
//! connections whatever the group's size (the direct all-reduce needs one to every peer). The
//! tensor is cut into `size` near-equal shares (split.rs).
//!
//! - Reduce-scatter, `size − 1` steps: in step s rank r sends its *partial* of share
//!   (r − s) mod size to r + 1 and receives r − 1's partial of share (r − s − 1) mod size into
//!   scratch, then combines it with its own input of that share, in place. A partial of share j
//!   after step s holds the inputs of ranks j, j + 1, …, j + s + 1 combined in that order; the
//!   last step completes share (r + 1) mod size on rank r and applies AVG's or PREMUL_SUM's
//!   scaling there, once.
//! - All-gather, `size − 1` steps: in step s rank r sends the finished share
//!   (r + 1 − s) mod size to r + 1 and receives share (r − s) mod size in place from r − 1.
//!
//! Each step moves its share in rounds of `XCCL_RS_SEGMENT_BYTES`, so scratch stays one round.
//! Every share is finished on one rank and copied from there: every rank ends with identical
//! bits. Unlike the direct all-reduce, a bf16 or float16 partial is rounded at every step, as in
//! NCCL's ring: each hop sends the tensor's dtype.

use crate::algorithms::Step;
use crate::algorithms::split::{share, split_range};
use crate::error::Result;
use crate::op::Op;
use crate::reduce::{Reduction, reduce_raw};
use crate::transport::RawBuf;
use crate::types::ReduceOp;

pub fn run(step: &mut Step<'_>, op: &Op) -> Result<()> {
    let (rank, size) = (step.rank(), step.size());
    let esz = op.dtype.size();
    let buf = op.outputs[0];
    let n = buf.len() / esz;
    let shares: Vec<RawBuf> = (0..size).map(|i| share(buf, n, size, i, esz)).collect();
    let (next, prev) = ((rank + 1) % size, (rank + size - 1) % size);
    let share_at = |offset: usize| shares[(rank + size * 2 - offset % size) % size];
    let last = step.reduction(op);
    // Intermediate steps combine without scaling: AVG and PREMUL_SUM are sums until the last.
    let partial = match op.reduce_op {
        ReduceOp::Avg | ReduceOp::PreMulSum => Reduction { op: ReduceOp::Sum, ..last },
        _ => last,
    };
    let per_round = step.round_elems(op.dtype);
    // From the largest share (split.rs: the first), so that both ends of a link agree on how
    // many rounds each step has.
    let rounds = split_range(n, size, 0).1.div_ceil(per_round).max(1);

    for s in 0..size.saturating_sub(1) {
        let (outgoing, incoming) = (share_at(s), share_at(s + 1));
        let reduction = if s + 2 == size { last } else { partial };
        for k in 0..rounds {
            let (out_part, in_part) = (round(outgoing, k, per_round, esz), round(incoming, k, per_round, esz));
            let scratch = step.scratch(in_part.len());
            let mut phase = step.phase();
            phase.send(next, out_part, step.identity.count);
            phase.recv(prev, scratch, step.identity.count);
            step.run(phase)?;
            if in_part.len() > 0 {
                let srcs = [scratch.ptr() as *const u8, in_part.ptr() as *const u8];
                // SAFETY: `scratch` was just filled by a receive of exactly `in_part.len()`
                // bytes and `in_part` is a range of this rank's tensor of that length; `dst` is
                // exactly `in_part` (in place) and disjoint from scratch; the op's reduction was
                // validated at submission.
                unsafe { reduce_raw(&reduction, in_part.ptr(), &srcs, in_part.len() / esz, s + 2 == size) };
            }
        }
    }
    for s in 0..size.saturating_sub(1) {
        let (outgoing, incoming) = (share_at(s + size - 1), share_at(s));
        for k in 0..rounds {
            let mut phase = step.phase();
            phase.send(next, round(outgoing, k, per_round, esz), step.identity.count);
            phase.recv(prev, round(incoming, k, per_round, esz), step.identity.count);
            step.run(phase)?;
        }
    }
    Ok(())
}

/// Round `k` of `part`: at most `per_round` elements of `esz` bytes (empty past its end).
fn round(part: RawBuf, k: usize, per_round: usize, esz: usize) -> RawBuf {
    let n = part.len() / esz;
    let start = (k * per_round).min(n);
    part.sub(start * esz, (n - start).min(per_round) * esz)
}

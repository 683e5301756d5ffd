//! Direct reduce: every rank streams its whole tensor to the root in rounds; the root, round by
//! round, receives each peer's part into scratch and reduces all ranks' parts in rank order
//! into its own tensor (scaling fused). Other ranks' tensors are left unchanged.

use crate::algorithms::Step;
use crate::error::Result;
use crate::op::Op;
use crate::reduce::reduce_raw;

pub fn run(step: &mut Step<'_>, op: &Op) -> Result<()> {
    let (rank, size) = (step.rank(), step.size());
    let root = op.root as usize;
    let esz = op.dtype.size();
    let buf = op.outputs[0];
    let n = buf.len() / esz;
    let per_round = step.round_elems(op.dtype);
    let rounds = n.div_ceil(per_round).max(1);
    let round_range = |k: usize| {
        let start = (k * per_round).min(n);
        (start * esz, (n - start).min(per_round) * esz)
    };

    if rank != root {
        let mut phase = step.phase();
        for k in 0..rounds {
            let (off, len) = round_range(k);
            phase.send(root, buf.sub(off, len), step.identity.count);
        }
        step.run(phase)?;
        return step.confirm(&[], &[root]);
    }

    let reduction = step.reduction(op);
    let scratch = step.scratch((size - 1) * per_round * esz);
    let area = |peer: usize| if peer < rank { peer } else { peer - 1 };
    for k in 0..rounds {
        let (off, len) = round_range(k);
        let mut phase = step.phase();
        for peer in (0..size).filter(|&p| p != rank) {
            phase.recv(peer, scratch.sub(area(peer) * per_round * esz, len), step.identity.count);
        }
        step.run(phase)?;
        let own = buf.sub(off, len);
        let srcs: Vec<*const u8> = (0..size)
            .map(|p| if p == rank { own.ptr() as *const u8 } else { scratch.sub(area(p) * per_round * esz, len).ptr() as *const u8 })
            .collect();
        if len > 0 && (size > 1 || matches!(op.reduce_op, crate::types::ReduceOp::Avg | crate::types::ReduceOp::PreMulSum)) {
            // SAFETY: each scratch area holds `len` bytes just received; `own` is the root's own
            // part and also the destination (exact alias, allowed); reduction validated.
            unsafe { reduce_raw(&reduction, own.ptr(), &srcs, len / esz, true) };
        }
    }
    let others: Vec<usize> = (0..size).filter(|&p| p != rank).collect();
    step.confirm(&others, &[])
}

//! Direct reduce: every rank streams its whole tensor to the root in segments; the root, round
//! by round, receives one segment from each peer into scratch and reduces all ranks' segments
//! in rank order into its own tensor (scaling fused). Other ranks' tensors are left unchanged.

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
    let seg = step.segment_elems(op.dtype);
    let rounds = n.div_ceil(seg).max(1);
    let segment = |k: usize| {
        let start = (k * seg).min(n);
        (start * esz, (n - start).min(seg) * esz)
    };

    if rank != root {
        let mut phase = step.phase();
        for k in 0..rounds {
            let (off, len) = segment(k);
            phase.send(root, buf.sub(off, len), step.identity.count);
        }
        step.run(phase)?;
        return step.confirm(&[], &[root]);
    }

    let reduction = step.reduction(op);
    let scratch = step.scratch((size - 1) * seg * esz);
    let slot = |peer: usize| if peer < rank { peer } else { peer - 1 };
    for k in 0..rounds {
        let (off, len) = segment(k);
        let mut phase = step.phase();
        for peer in (0..size).filter(|&p| p != rank) {
            phase.recv(peer, scratch.sub(slot(peer) * seg * esz, len), step.identity.count);
        }
        step.run(phase)?;
        let own = buf.sub(off, len);
        let srcs: Vec<*const u8> = (0..size)
            .map(|p| if p == rank { own.ptr() as *const u8 } else { scratch.sub(slot(p) * seg * esz, len).ptr() as *const u8 })
            .collect();
        if len > 0 && (size > 1 || matches!(op.reduce_op, crate::types::ReduceOp::Avg | crate::types::ReduceOp::PreMulSum)) {
            // SAFETY: each scratch slot holds `len` bytes just received; `own` is the root's own
            // segment and also the destination (exact alias, allowed); reduction validated.
            unsafe { reduce_raw(&reduction, own.ptr(), &srcs, len / esz, true) };
        }
    }
    let others: Vec<usize> = (0..size).filter(|&p| p != rank).collect();
    step.confirm(&others, &[])
}

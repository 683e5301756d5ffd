//! The selection table: which algorithm serves an op of each kind on each shape of fabric
//! (fabric.rs). It is the one place that says so; `run_collective` (mod.rs) only runs what it
//! picks. A row's algorithm is of the fabric's own family (`*Shm` on `Host`, `*Hier` on
//! `Mixed`) or of the mesh, which every fabric has: all-to-all goes over the mesh everywhere
//! (pairs exchange distinct data, which shared-memory slots would only copy once more), and
//! so do the collectives that have no hierarchical version yet.

use std::collections::HashSet;

use crate::fabric::Shape;
use crate::types::OpKind;

/// Every algorithm, named `<Collective><Algorithm>` like its file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Algorithm {
    AllReduceDirect,
    BroadcastDirect,
    ReduceDirect,
    AllGatherDirect,
    GatherDirect,
    ScatterDirect,
    ReduceScatterDirect,
    AllToAllPairwise,
    BarrierDirect,
    AllReduceShm,
    BroadcastShm,
    ReduceShm,
    AllGatherShm,
    GatherShm,
    ScatterShm,
    ReduceScatterShm,
    BarrierShm,
    AllReduceHier,
    BroadcastHier,
    ReduceHier,
    AllGatherHier,
    BarrierHier,
    /// Sends and receives: the worker runs them in batches over the mesh (mesh/p2p.rs).
    PointToPoint,
}

/// The algorithm that runs `op` on a fabric of shape `shape`.
pub fn select(op: OpKind, shape: Shape) -> Algorithm {
    use Algorithm::*;
    use OpKind::*;
    // One row per op: its algorithm on a Mesh, on a Host, on a Mixed fabric.
    let row = |on_mesh, on_host, on_mixed| match shape {
        Shape::Mesh => on_mesh,
        Shape::Host => on_host,
        Shape::Mixed => on_mixed,
    };
    match op {
        AllReduce => row(AllReduceDirect, AllReduceShm, AllReduceHier),
        Broadcast => row(BroadcastDirect, BroadcastShm, BroadcastHier),
        Reduce => row(ReduceDirect, ReduceShm, ReduceHier),
        AllGather => row(AllGatherDirect, AllGatherShm, AllGatherHier),
        Gather => row(GatherDirect, GatherShm, GatherDirect),
        Scatter => row(ScatterDirect, ScatterShm, ScatterDirect),
        ReduceScatter => row(ReduceScatterDirect, ReduceScatterShm, ReduceScatterDirect),
        AllToAll => AllToAllPairwise,
        Barrier => row(BarrierDirect, BarrierShm, BarrierHier),
        Send | Recv | RecvAnySource => PointToPoint,
    }
}

/// What a group has run, so that `XCCL_RS_LOG=debug` names each choice of the table once.
#[derive(Default)]
pub struct FirstUses(HashSet<(OpKind, Algorithm, u32)>);

impl FirstUses {
    /// Logs, at debug level, the algorithm chosen for `op` on a fabric of `shape` the first time
    /// the group runs that op with a per-rank piece of `bytes` in its size class (the powers of
    /// two); free when debug logging is off.
    pub fn note(&mut self, op: OpKind, shape: Shape, bytes: usize, rank: usize) {
        if !tracing::enabled!(tracing::Level::DEBUG) {
            return;
        }
        let algorithm = select(op, shape);
        let class = usize::BITS - bytes.leading_zeros(); // bytes < 2^class
        if self.0.insert((op, algorithm, class)) {
            let up_to = if class >= usize::BITS { "any size".to_string() } else { format!("< {} B", 1usize << class) };
            tracing::debug!(rank, ?op, ?shape, ?algorithm, size = %up_to, "xccl_rs: first use of a path");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::failures::Failures;

    /// The expectation, by the rules architecture.md states: on one host every collective but
    /// all-to-all runs over shared memory; a mixed group runs five collectives hierarchically
    /// and the rest direct; a mesh runs everything direct; sends and receives are
    /// point-to-point everywhere. Names say the rest: `<OpKind><family>`.
    fn expected(kind: OpKind, shape: Shape) -> String {
        use OpKind::*;
        let hierarchical = matches!(kind, AllReduce | Broadcast | Reduce | AllGather | Barrier);
        let family = match (kind, shape) {
            (Send | Recv | RecvAnySource, _) => return "PointToPoint".into(),
            (AllToAll, _) => return "AllToAllPairwise".into(),
            (_, Shape::Host) => "Shm",
            (_, Shape::Mixed) if hierarchical => "Hier",
            _ => "Direct",
        };
        format!("{kind:?}{family}")
    }

    #[test]
    fn every_op_on_every_fabric() {
        let mut failures = Failures::new();
        for kind in (0..).map_while(OpKind::from_code) {
            for shape in Shape::ALL {
                failures.eq(format!("{:?}", select(kind, shape)), expected(kind, shape), format_args!("{} on {shape:?}", kind.name()));
            }
        }
        failures.finish("select");
    }
}

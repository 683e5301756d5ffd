//! The selection table: which algorithm serves an op of each kind on each shape of fabric
//! (fabric.rs). It is the one place that says so; `run_collective` (mod.rs) only runs what it
//! picks. A row's algorithm is of the fabric's own family (`*Shm` on `Host`, `*Hier` on
//! `Mixed`) or of the mesh, which every fabric has: all-to-all goes over the mesh everywhere
//! (pairs exchange distinct data, which shared-memory slots would only copy once more), and
//! so do the collectives that have no hierarchical version yet.

use crate::fabric::Shape;
use crate::types::OpKind;

/// Every algorithm, named `<Collective><Algorithm>` like its file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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

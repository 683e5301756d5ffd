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
    match (op, shape) {
        (AllReduce, Shape::Host) => AllReduceShm,
        (AllReduce, Shape::Mixed) => AllReduceHier,
        (AllReduce, Shape::Mesh) => AllReduceDirect,
        (Broadcast, Shape::Host) => BroadcastShm,
        (Broadcast, Shape::Mixed) => BroadcastHier,
        (Broadcast, Shape::Mesh) => BroadcastDirect,
        (Reduce, Shape::Host) => ReduceShm,
        (Reduce, Shape::Mixed) => ReduceHier,
        (Reduce, Shape::Mesh) => ReduceDirect,
        (AllGather, Shape::Host) => AllGatherShm,
        (AllGather, Shape::Mixed) => AllGatherHier,
        (AllGather, Shape::Mesh) => AllGatherDirect,
        (Gather, Shape::Host) => GatherShm,
        (Gather, Shape::Mixed | Shape::Mesh) => GatherDirect,
        (Scatter, Shape::Host) => ScatterShm,
        (Scatter, Shape::Mixed | Shape::Mesh) => ScatterDirect,
        (ReduceScatter, Shape::Host) => ReduceScatterShm,
        (ReduceScatter, Shape::Mixed | Shape::Mesh) => ReduceScatterDirect,
        (AllToAll, _) => AllToAllPairwise,
        (Barrier, Shape::Host) => BarrierShm,
        (Barrier, Shape::Mixed) => BarrierHier,
        (Barrier, Shape::Mesh) => BarrierDirect,
        (Send | Recv | RecvAnySource, _) => PointToPoint,
    }
}

#[cfg(test)]
mod tests {
    use super::Algorithm::*;
    use super::*;
    use crate::failures::Failures;

    /// The expectation, written out as the architecture document describes it: columns are
    /// Mesh, Host, Mixed.
    const EXPECTED: [(OpKind, [Algorithm; 3]); 12] = [
        (OpKind::AllReduce, [AllReduceDirect, AllReduceShm, AllReduceHier]),
        (OpKind::Broadcast, [BroadcastDirect, BroadcastShm, BroadcastHier]),
        (OpKind::Reduce, [ReduceDirect, ReduceShm, ReduceHier]),
        (OpKind::AllGather, [AllGatherDirect, AllGatherShm, AllGatherHier]),
        (OpKind::Gather, [GatherDirect, GatherShm, GatherDirect]),
        (OpKind::Scatter, [ScatterDirect, ScatterShm, ScatterDirect]),
        (OpKind::ReduceScatter, [ReduceScatterDirect, ReduceScatterShm, ReduceScatterDirect]),
        (OpKind::AllToAll, [AllToAllPairwise, AllToAllPairwise, AllToAllPairwise]),
        (OpKind::Barrier, [BarrierDirect, BarrierShm, BarrierHier]),
        (OpKind::Send, [PointToPoint, PointToPoint, PointToPoint]),
        (OpKind::Recv, [PointToPoint, PointToPoint, PointToPoint]),
        (OpKind::RecvAnySource, [PointToPoint, PointToPoint, PointToPoint]),
    ];

    #[test]
    fn every_op_on_every_fabric() {
        let kinds: Vec<OpKind> = (0..).map_while(OpKind::from_code).collect();
        assert_eq!(kinds, EXPECTED.map(|(k, _)| k), "the expectation lists every OpKind once, in code order");
        let mut failures = Failures::new();
        for (kind, row) in EXPECTED {
            for (shape, want) in Shape::ALL.into_iter().zip(row) {
                failures.eq(select(kind, shape), want, format_args!("{} on {shape:?}", kind.name()));
            }
        }
        failures.finish("select");
    }

    /// What makes `run_collective`'s last arm unreachable: an algorithm of another family
    /// than the mesh's is picked only on its own fabric.
    #[test]
    fn families_match_fabrics() {
        for kind in (0..).map_while(OpKind::from_code) {
            for shape in Shape::ALL {
                let name = format!("{:?}", select(kind, shape));
                let family = if name.ends_with("Shm") { Shape::Host } else if name.ends_with("Hier") { Shape::Mixed } else { Shape::Mesh };
                assert!(family == Shape::Mesh || family == shape, "{name} picked on {shape:?}");
            }
        }
    }
}

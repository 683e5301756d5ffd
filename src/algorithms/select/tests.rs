//! The table's choices, against expectations written out here by the rules that
//! architecture.md and the path docs state, not computed by the functions under test.

use super::*;
use crate::failures::Failures;
use crate::transport::RawBuf;
use crate::types::DType;

/// The expected row, by the rules architecture.md states: on one host every collective but
/// all-to-all runs over shared memory; a mixed group runs five collectives hierarchically
/// and the rest direct; a mesh runs everything direct; sends and receives are point-to-point
/// everywhere. Names say the rest: `<OpKind><family>`.
fn expected_row(kind: OpKind, shape: Shape) -> String {
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
            failures.eq(format!("{:?}", algorithm(kind, shape)), expected_row(kind, shape), format_args!("{} on {shape:?}", kind.name()));
        }
    }
    failures.finish("algorithm");
}

#[test]
fn away_from_one_host_every_algorithm_has_one_path() {
    let mut failures = Failures::new();
    let uneven = FabricCaps::Mixed(MixedCaps { ranks: 5, hosts: 3, rails: None });
    for kind in (0..).map_while(OpKind::from_code) {
        for fabric in [FabricCaps::Mesh(4), uneven] {
            for bytes in [0, 1 << 20, 1 << 30] {
                let want = expected_row(kind, fabric.shape());
                failures.eq(select(kind, &fabric, bytes).to_string(), want, format_args!("{} of {bytes} B on {fabric:?}", kind.name()));
            }
        }
    }
    failures.finish("select away from one host");
}

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

/// Four ranks, 4 MiB slots, the default one-shot limit of 64 KiB.
/// `cma`: ordinary tensors read by cross-memory attach too (`XCCL_RS_CMA=1`).
fn host(heaps: bool, cma: bool) -> ShmCaps {
    ShmCaps { ranks: 4, slot_bytes: 4 * MIB, oneshot_bytes: 64 * KIB, heaps, cma, cma_ordinary: cma }
}

/// Cross-memory attach for staged broadcasts only (the default).
fn staged_cma(heaps: bool) -> ShmCaps {
    ShmCaps { cma: true, cma_ordinary: false, ..host(heaps, false) }
}

/// Every threshold: (what, capabilities, op, the largest size below it, the path there, the
/// path one byte above).
fn thresholds() -> Vec<(&'static str, ShmCaps, OpKind, usize, &'static str, &'static str)> {
    use OpKind::*;
    let plain = host(false, false);
    let heaps = host(true, false);
    let both = host(true, true);
    vec![
        // One-shot: 3 peers' reads of 21845 B are 65535 B, within 64 KiB; of 21846 B, not.
        ("one-shot", plain, AllReduce, 21845, "AllReduceOneShot", "AllReduceSlots"),
        ("one-shot, heaps", heaps, AllReduce, 21845, "AllReduceOneShot", "AllReduceSlotsOrZeroCopy"),
        ("one-shot, heaps and cma", both, AllReduce, 21845, "AllReduceOneShot", "AllReduceSlotsOrZeroCopy"),
        // Two ranks read one peer: the limit is the setting itself; a group of one too.
        ("one-shot, two ranks", ShmCaps { ranks: 2, ..plain }, AllReduce, 64 * KIB, "AllReduceOneShot", "AllReduceSlots"),
        ("one-shot, one rank", ShmCaps { ranks: 1, ..plain }, AllReduce, 64 * KIB, "AllReduceOneShot", "AllReduceSlots"),
        // Never more than one slot, whatever the setting; 0 turns it off but for empty tensors.
        ("one-shot, one slot", ShmCaps { oneshot_bytes: 1 << 40, ..plain }, AllReduce, 4 * MIB, "AllReduceOneShot", "AllReduceSlots"),
        ("one-shot off", ShmCaps { oneshot_bytes: 0, ..plain }, AllReduce, 0, "AllReduceOneShot", "AllReduceSlots"),
        // Cross-memory attach from 1 MiB.
        ("cma", host(false, true), AllReduce, MIB - 1, "AllReduceSlots", "AllReduceCmaOrZeroCopy"),
        ("cma, heaps", both, AllReduce, MIB - 1, "AllReduceSlotsOrZeroCopy", "AllReduceCmaOrZeroCopy"),
        ("cma", host(false, true), Broadcast, MIB - 1, "BroadcastSlots", "BroadcastCmaOrZeroCopy"),
        ("cma, heaps", both, Broadcast, MIB - 1, "BroadcastSlots", "BroadcastCmaOrZeroCopy"),
        ("staged cma", staged_cma(false), Broadcast, MIB - 1, "BroadcastSlots", "BroadcastCmaOrZeroCopy"),
        ("staged cma, heaps", staged_cma(true), Broadcast, MIB - 1, "BroadcastSlots", "BroadcastCmaOrZeroCopy"),
        // Zero-copy tried, or asked about, from 1 MiB.
        ("zero-copy", heaps, Broadcast, MIB - 1, "BroadcastSlots", "BroadcastSlotsOrZeroCopy"),
        ("zero-copy", heaps, AllGather, MIB - 1, "AllGatherSlots", "AllGatherZeroCopy"),
        ("zero-copy", both, ReduceScatter, MIB - 1, "ReduceScatterSlots", "ReduceScatterZeroCopy"),
    ]
}

#[test]
fn on_one_host_each_side_of_every_threshold() {
    let mut failures = Failures::new();
    for (what, caps, kind, below, want_below, want_above) in thresholds() {
        for (bytes, want) in [(below, want_below), (below + 1, want_above)] {
            let got = select(kind, &FabricCaps::Host(caps), bytes).to_string();
            failures.eq(got, want.to_string(), format_args!("{what}: {} of {bytes} B on {caps:?}", kind.name()));
        }
    }
    failures.finish("select's thresholds on one host");
}

#[test]
fn on_one_host_paths_that_no_size_changes() {
    use OpKind::*;
    let (plain, heaps_only, cma_only) = (host(false, false), host(true, false), host(false, true));
    let mut failures = Failures::new();
    let cases = [
        (plain, AllReduce, "AllReduceSlots"),
        (heaps_only, AllReduce, "AllReduceSlotsOrZeroCopy"),
        (staged_cma(false), AllReduce, "AllReduceSlots"),
        (staged_cma(true), AllReduce, "AllReduceSlotsOrZeroCopy"),
        (cma_only, AllGather, "AllGatherSlots"),
        (cma_only, ReduceScatter, "ReduceScatterSlots"),
    ];
    for (caps, kind, want) in cases {
        let got = select(kind, &FabricCaps::Host(caps), 1 << 30).to_string();
        failures.eq(got, want.to_string(), format_args!("{} of 1 GiB on {caps:?}", kind.name()));
    }
    // Without its capability a threshold never applies; the other algorithms have one path at
    // every size: the row's.
    for kind in [Reduce, Gather, Scatter, Barrier, AllToAll] {
        for bytes in [0, 1 << 30] {
            let got = select(kind, &FabricCaps::Host(host(true, true)), bytes).to_string();
            failures.eq(got, expected_row(kind, Shape::Host), format_args!("{} of {bytes} B", kind.name()));
        }
    }
    failures.finish("select on one host");
}

#[test]
fn thresholds_count_the_largest_buffer_set() {
    let (mut a, mut b) = (vec![0u8; 3], vec![0u8; 12]);
    let (piece, whole) = (RawBuf::from_slice(&mut a), RawBuf::from_slice(&mut b));
    let op = |kind, inputs: Vec<RawBuf>, outputs: Vec<RawBuf>| Op { inputs, outputs, ..Op::new(kind, DType::UInt8) };
    let views = || (0..4).map(|r| whole.sub(3 * r, 3)).collect::<Vec<_>>();
    assert_eq!(op_bytes(&op(OpKind::AllGather, vec![piece], views()), 4), 12);
    assert_eq!(op_bytes(&op(OpKind::ReduceScatter, views(), vec![piece]), 4), 12);
    assert_eq!(op_bytes(&op(OpKind::AllReduce, vec![whole], vec![whole]), 4), 12);
    assert_eq!(op_bytes(&op(OpKind::Broadcast, vec![], vec![piece]), 4), 3);
    assert_eq!(op_bytes(&op(OpKind::Barrier, vec![], vec![]), 4), 0);
}

/// The expected algorithm of a mixed group whose hosts each have two ranks: by the rule
/// architecture.md states, all-reduce, broadcast, reduce, all-gather and reduce-scatter of 256 KiB
/// or more run rail-aligned; the rest keep their row.
fn expected_on_rails(kind: OpKind, bytes: usize) -> String {
    use OpKind::*;
    match kind {
        AllReduce | Broadcast | Reduce | AllGather | ReduceScatter if bytes >= 256 * KIB => format!("{kind:?}Rail"),
        _ => expected_row(kind, Shape::Mixed),
    }
}

#[test]
fn rails_from_their_threshold_on_hosts_of_equal_size() {
    let mut failures = Failures::new();
    let rails = FabricCaps::Mixed(MixedCaps { ranks: 4, hosts: 2, rails: Some(2) });
    for kind in (0..).map_while(OpKind::from_code) {
        for bytes in [0, 8, 256 * KIB - 1, 256 * KIB, 1 << 30] {
            failures.eq(select(kind, &rails, bytes).to_string(), expected_on_rails(kind, bytes), format_args!("{} of {bytes} B on 2x2 hosts", kind.name()));
            failures.eq(format!("{:?}", algorithm_of(kind, &rails, bytes)), expected_on_rails(kind, bytes), format_args!("statistics' name of {} of {bytes} B", kind.name()));
        }
    }
    failures.finish("select on rails");
}

/// Nine or more members all-reduce 256 KiB or more in a ring: a mesh of ranks, or the hosts of
/// a rail-aligned all-reduce; fewer, or smaller ops, go direct.
#[test]
fn rings_from_nine_members_and_256_kib() {
    let mut failures = Failures::new();
    for (members, bytes, ring) in [(8, 1 << 30, false), (9, 256 * KIB - 1, false), (9, 256 * KIB, true), (64, 8, false), (64, 1 << 30, true)] {
        let mesh = if ring { "AllReduceRing" } else { "AllReduceDirect" };
        failures.eq(select(OpKind::AllReduce, &FabricCaps::Mesh(members), bytes).to_string(), mesh.to_string(), format_args!("{members} ranks, {bytes} B"));
        let rails = FabricCaps::Mixed(MixedCaps { ranks: 2 * members, hosts: members, rails: Some(2) });
        let mixed = match (ring, bytes >= 256 * KIB) {
            (true, _) => "AllReduceRailRing",
            (false, true) => "AllReduceRail",
            (false, false) => "AllReduceHier",
        };
        failures.eq(select(OpKind::AllReduce, &rails, bytes).to_string(), mixed.to_string(), format_args!("{members} hosts x 2, {bytes} B"));
        failures.eq(format!("{:?}", algorithm_of(OpKind::AllReduce, &FabricCaps::Mesh(members), bytes)), mesh.to_string(), "statistics' name on a mesh");
    }
    failures.finish("rings");
}

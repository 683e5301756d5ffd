//! Zero-copy all-reduce (algorithms/host/push.rs): tensors allocated from the
//! ranks' shared-memory heaps are reduced in place, with results checked against sums computed
//! here in f64; a group where some rank's tensor is not in its heap takes the slot path and is
//! just as right. Which path ran is read from the communicator's zero-copy counter.

mod common;
use common::*;
use std::time::Duration;
use xccl_rs::{Communicator, OpKind, ReduceOp};

const LIMIT: Duration = Duration::from_secs(60);

/// A 64 MiB heap per rank, ample for these tensors: the ranks are threads of this process, and
/// each maps every peer's heap, so the default 16 GiB would reserve 4 x 4 x 16 GiB of address
/// space, more than valgrind (scripts/memcheck.sh) can give. Slots of 256 KiB, so that the
/// zero-copy all-reduce, which goes in blocks of one slot's size, runs several blocks.
fn heap_config() -> xccl_rs::Config {
    xccl_rs::Config { shm_heap_bytes: 64 << 20, shm_slot_bytes: 256 << 10, ..config(Duration::from_secs(20), 1 << 20) }
}

/// What each rank does with its tensor.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Placement {
    /// Every rank allocates from its heap.
    AllInHeap,
    /// Rank 0 uses an ordinary Vec, the others their heaps.
    RankZeroOutside,
}

fn want(rop: ReduceOp, size: usize, i: usize) -> f64 {
    let vals: Vec<f64> = (0..size).map(|r| value(r, i) as f64).collect();
    match rop {
        ReduceOp::Sum => vals.iter().sum(),
        ReduceOp::Avg => vals.iter().sum::<f64>() / size as f64,
        ReduceOp::Max => vals.iter().cloned().fold(f64::MIN, f64::max),
        ReduceOp::Min => vals.iter().cloned().fold(f64::MAX, f64::min),
        _ => unreachable!(),
    }
}

/// Rounds of the same all-reduce per group: the second one checks that the first left the
/// group's block counters where the next op expects them (its blocks are its own).
const ROUNDS: usize = 2;

/// `ROUNDS` all-reduces of `n` float32 per rank, each on a fresh copy of the input; returns
/// each round's result and the zero-copy ops run.
fn all_reduce(comm: &Communicator, rank: usize, n: usize, rop: ReduceOp, placement: Placement) -> (Vec<Vec<f32>>, u64) {
    let input = f32_bytes(&(0..n).map(|i| value(rank, i)).collect::<Vec<_>>());
    let outside = placement == Placement::RankZeroOutside && rank == 0;
    let mut plain = vec![0u8; input.len()];
    let block;
    let data = if outside {
        buf(&mut plain)
    } else {
        block = comm.alloc_shared(input.len()).expect("heap allocation");
        block.buf().sub(0, input.len())
    };
    let mut rounds = Vec::with_capacity(ROUNDS);
    for _ in 0..ROUNDS {
        // SAFETY: `data` is this rank's live tensor (the Vec or the heap block), input.len() bytes.
        unsafe { std::ptr::copy_nonoverlapping(input.as_ptr(), data.ptr(), input.len()) };
        let mut o = reduce_op(OpKind::AllReduce, rop);
        o.outputs = vec![data];
        run(comm, vec![o]).expect("all_reduce");
        // SAFETY: as above.
        rounds.push(bytes_f32(unsafe { std::slice::from_raw_parts(data.ptr(), input.len()) }));
    }
    let _ = &plain;
    (rounds, comm.zero_copy_ops())
}

#[test]
fn zero_copy_all_reduce_is_exact_and_falls_back_when_a_tensor_is_outside() {
    let mut f = Failures::new();
    for size in [2, 3, 4] {
        // 4 blocks; 4 and a last one of 1 element (empty parts); 12 and a last one of 5 elements.
        for n in [262_144, 262_145, 786_437] {
            for rop in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
                for placement in [Placement::AllInHeap, Placement::RankZeroOutside] {
                    let what = format!("{size} ranks, {n} float32, {rop:?}, {placement:?}");
                    let results =
                        try_spawn_ranks(size, heap_config(), LIMIT, move |rank, comm, _| all_reduce(&comm, rank, n, rop, placement));
                    for (rank, r) in f.ranks(results, &what).into_iter().enumerate() {
                        let Some((rounds, zero_copy_ops)) = r else { continue };
                        let expected_ops = if placement == Placement::AllInHeap { ROUNDS as u64 } else { 0 };
                        f.check(zero_copy_ops == expected_ops, || {
                            format!("{what} rank {rank}: {zero_copy_ops} zero-copy ops, expected {expected_ops}")
                        });
                        for (round, got) in rounds.iter().enumerate() {
                            let bad = each_element(n, |i| {
                                let w = want(rop, size, i);
                                ((got[i] as f64 - w).abs() > 1e-4 * w.abs().max(1.0)).then(|| format!("[{i}]: {} != {w}", got[i]))
                            });
                            f.result(bad, format!("{what} rank {rank} round {round}"));
                        }
                    }
                }
            }
        }
    }
    f.finish("zero-copy all_reduce");
}

#[test]
fn a_heap_tensor_outlives_its_group_and_its_memory_goes_back() {
    let blocks = spawn_ranks(2, heap_config(), LIMIT, |_, comm, _| {
        let block = comm.alloc_shared(3 << 20).unwrap();
        drop(comm);
        // SAFETY: the block is 3 MiB of this rank's heap, alive after its group.
        unsafe { std::ptr::write_bytes(block.buf().ptr(), 1, block.len()) };
        block.len()
    });
    assert_eq!(blocks, vec![3 << 20; 2]);
}

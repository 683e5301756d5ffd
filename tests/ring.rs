//! The ring all-reduce (algorithms/mesh/allreduce_ring.rs), which the selection table picks for
//! 256 KiB or more among nine or more members: a TCP group of 9 and 10 ranks, and the step
//! between 9 hosts of a rail-aligned all-reduce. Results are compared with references computed
//! here from every rank's inputs: values whose sums are exact in any order, and for bf16 the
//! ring's own order of combination, rounding at every hop (written out here from the ring's
//! definition: share j starts on rank j and picks up ranks j + 1, j + 2, … in turn). Every rank
//! must end with identical bits, and the group's statistics must name the ring.

#[macro_use]
mod common;
use common::*;
use std::time::Duration;
use xccl_rs::{Communicator, Config, MemoryStore, ReduceOp};

use ReduceOp::*;

const SEGMENT: usize = 16 << 10;
const LIMIT: Duration = Duration::from_secs(120);
const RING_BYTES: usize = 256 << 10;

fn tcp_cfg() -> Config {
    Config { pipeline_chunk_bytes: 1 << 20, ..net_config(Net::Tcp, Duration::from_secs(30), SEGMENT) }
}

/// The share (start, len) of element range `0..n` that ring member `j` of `size` owns: the
/// first `n mod size` shares one element longer.
fn share_of(n: usize, size: usize, j: usize) -> (usize, usize) {
    let (base, extra) = (n / size, n % size);
    (j * base + j.min(extra), base + usize::from(j < extra))
}

/// The ring's bf16 result at element `i` among `size` ranks: the share's owner's input first,
/// then each next rank's, rounding to bf16 after each, the last hop scaled (AVG, PREMUL_SUM).
fn bf16_ring(n: usize, size: usize, i: usize, salt: u64, op: ReduceOp) -> bf16 {
    let j = (0..size).find(|&j| {
        let (s, l) = share_of(n, size, j);
        (s..s + l).contains(&i)
    });
    let j = j.expect("every element is in a share");
    let mut acc = bf16::input(j, i, salt, op);
    for t in 1..size {
        let x = bf16::input((j + t) % size, i, salt, op).to_f32();
        let sum = acc.to_f32() + x;
        acc = bf16::from_f32(match op {
            Avg if t == size - 1 => sum / size as f32,
            PreMulSum if t == size - 1 => sum * FACTOR as f32,
            _ => sum,
        });
    }
    acc
}

fn ring_ranks(size: usize, what: &'static str, check: impl Fn(usize, &Communicator, &mut Failures) -> Result<Vec<u8>, Stop> + Send + Sync + 'static) {
    let mut failures = Failures::new();
    let results = try_spawn_ranks_with(MemoryStore::new(), vec![tcp_cfg(); size], LIMIT, move |rank, comm, _| {
        let mut f = Failures::new();
        let bytes = check(rank, &comm, &mut f);
        let names: Vec<String> = comm.stats().iter().map(|(_, a, _)| format!("{a:?}")).collect();
        f.check(names.iter().any(|n| n == "AllReduceRing"), || format!("rank {rank}: statistics show {names:?}, not AllReduceRing"));
        (f, bytes.ok())
    });
    let mut first: Option<Vec<u8>> = None;
    for (rank, r) in failures.ranks(results, &format!("{what} at {size} ranks")).into_iter().enumerate() {
        let Some((f, bytes)) = r else { continue };
        failures.merge(f);
        if let Some(bytes) = bytes {
            match &first {
                None => first = Some(bytes),
                Some(b) => {
                    failures.check(*b == bytes, || format!("{what}: rank {rank}'s results differ from rank 0's bits"));
                }
            }
        }
    }
    failures.finish(&format!("{what} at {size} ranks"));
}

#[test]
fn ring_allreduce_exact_sums() {
    for size in [9, 10] {
        ring_ranks(size, "ring allreduce", move |rank, comm, f| {
            let mut all = Vec::new();
            for (k, rop) in [Sum, Avg, PreMulSum, Max].into_iter().enumerate() {
                for n in [RING_BYTES / 4, RING_BYTES / 4 + size + 2] {
                    let what = format!("allreduce f32 {rop:?} n {n} size {size} rank {rank}");
                    let salt = (k * 1000 + n) as u64;
                    let bytes = allreduce_point::<f32>(f, comm, rank, n, salt, rop, &what)?;
                    f.result(check_reduced::<f32>(&bytes, size, 0, salt, rop, FACTOR), &what);
                    all.extend(bytes);
                }
            }
            let what = format!("allreduce i32 BXor size {size} rank {rank}");
            let bytes = allreduce_point::<i32>(f, comm, rank, RING_BYTES / 4 + 1, 5, BXor, &what)?;
            f.result(check_reduced::<i32>(&bytes, size, 0, 5, BXor, 1.0), &what);
            all.extend(bytes);
            Ok(all)
        });
    }
}

#[test]
fn ring_allreduce_bf16_rounds_at_each_hop() {
    let size = 9;
    ring_ranks(size, "ring allreduce bf16", move |rank, comm, f| {
        let mut all = Vec::new();
        for (k, rop) in [Sum, Avg, PreMulSum].into_iter().enumerate() {
            let n = RING_BYTES / 2 + 7;
            let what = format!("allreduce bf16 {rop:?} n {n} rank {rank}");
            let salt = (k * 1000 + n) as u64;
            let bytes = allreduce_point::<bf16>(f, comm, rank, n, salt, rop, &what)?;
            let got = bf16::from_bytes(&bytes);
            f.result(
                each_element(n, |i| {
                    let want = bf16_ring(n, size, i, salt, rop);
                    (got[i].to_bits() != want.to_bits()).then(|| format!("element {i} is {:?}, expected {want:?}", got[i]))
                }),
                &what,
            );
            all.extend(bytes);
        }
        Ok(all)
    });
}

/// The bf16 data tell the ring's per-hop rounding from a single rounding, so the reference above
/// is really checked.
#[test]
fn bf16_data_tell_the_ring_from_one_rounding() {
    let n = RING_BYTES / 2 + 7;
    let differ = (0..4000).filter(|&i| bf16_ring(n, 9, i, 3, Sum).to_bits() != expected::<bf16>(9, i, 3, Sum, 1.0).to_bits()).count();
    assert!(differ > 100, "only {differ} of 4000 elements distinguish the roundings");
}

/// Nine hosts of two ranks: the rail-aligned all-reduce whose step between hosts is the ring.
#[test]
fn rail_allreduce_with_a_ring_between_nine_hosts() {
    let size = 18;
    let cfgs: Vec<Config> = (0..size)
        .map(|r| Config { host_id: Some(format!("host{}", r / 2)), pipeline_chunk_bytes: 1 << 20, ..net_config(Net::Shm, Duration::from_secs(30), SEGMENT) })
        .collect();
    let mut failures = Failures::new();
    sweep_ranks_with(&mut failures, "rail ring", MemoryStore::new(), cfgs, LIMIT, move |rank, comm, _, f| {
        for (k, rop) in [Sum, Avg].into_iter().enumerate() {
            for n in [RING_BYTES / 4, RING_BYTES / 4 + 1] {
                let what = format!("allreduce f32 {rop:?} n {n} 9 x 2 rank {rank}");
                let salt = (k * 1000 + n) as u64;
                let bytes = allreduce_point::<f32>(f, &comm, rank, n, salt, rop, &what)?;
                f.result(check_reduced::<f32>(&bytes, size, 0, salt, rop, FACTOR), &what);
            }
        }
        let names: Vec<String> = comm.stats().iter().map(|(_, a, _)| format!("{a:?}")).collect();
        f.check(names.iter().any(|n| n == "AllReduceRail"), || format!("rank {rank}: statistics show {names:?}, not AllReduceRail"));
        Ok(())
    });
    failures.finish("rail-aligned all-reduce with a ring between 9 hosts");
}

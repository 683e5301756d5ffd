//! All-reduce and reduce-scatter across world sizes 1..=5, sizes on both sides of the segment
//! boundary, checked against sums computed here in f64.

mod common;
use common::*;
use std::time::Duration;
use xccl_rs::{DType, OpKind, ReduceOp};

const SEGMENT: usize = 4096; // small, so that several rounds run

fn check_allreduce(size: usize, n: usize, rop: ReduceOp) {
    let results = run_ranks(size, config(Duration::from_secs(20), SEGMENT), move |rank, comm| {
        let mut data = f32_bytes(&(0..n).map(|i| value(rank, i)).collect::<Vec<_>>());
        let mut o = reduce_op(OpKind::AllReduce, rop);
        o.outputs = vec![buf(&mut data)];
        run(comm, vec![o]).expect("allreduce");
        bytes_f32(&data)
    });
    for (rank, got) in results.iter().enumerate() {
        for i in 0..n {
            let vals: Vec<f64> = (0..size).map(|r| value(r, i) as f64).collect();
            let want = match rop {
                ReduceOp::Sum => vals.iter().sum::<f64>(),
                ReduceOp::Avg => vals.iter().sum::<f64>() / size as f64,
                ReduceOp::Max => vals.iter().cloned().fold(f64::MIN, f64::max),
                ReduceOp::Min => vals.iter().cloned().fold(f64::MAX, f64::min),
                _ => unreachable!(),
            };
            assert!((got[i] as f64 - want).abs() <= 1e-4 * want.abs().max(1.0), "size {size} n {n} {rop:?} rank {rank} [{i}]: {} != {want}", got[i]);
        }
    }
}

#[test]
fn allreduce_sizes_and_world_sizes() {
    for size in 1..=5 {
        for n in [0, 1, 7, 1023, 1024, 1025, 5000] {
            check_allreduce(size, n, ReduceOp::Sum);
        }
        check_allreduce(size, 3001, ReduceOp::Avg);
        check_allreduce(size, 3001, ReduceOp::Max);
        check_allreduce(size, 3001, ReduceOp::Min);
    }
}

#[test]
fn reduce_scatter_matches_sums() {
    for size in 1..=4 {
        let per = 1500;
        let results = run_ranks(size, config(Duration::from_secs(20), SEGMENT), move |rank, comm| {
            let mut input = f32_bytes(&(0..per * size).map(|i| value(rank, i)).collect::<Vec<_>>());
            let mut out = vec![0u8; per * 4];
            let mut o = op(OpKind::ReduceScatter, DType::Float32);
            let whole = buf(&mut input);
            o.inputs = (0..size).map(|r| whole.sub(r * per * 4, per * 4)).collect();
            o.outputs = vec![buf(&mut out)];
            run(comm, vec![o]).expect("reduce_scatter");
            bytes_f32(&out)
        });
        for (rank, got) in results.iter().enumerate() {
            for i in 0..per {
                let want: f32 = (0..size).map(|r| value(r, rank * per + i)).sum();
                assert_eq!(got[i], want, "size {size} rank {rank} [{i}]");
            }
        }
    }
}

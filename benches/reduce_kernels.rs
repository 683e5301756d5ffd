//! Throughput of the reduction kernels (`cargo bench --bench reduce_kernels`).
//!
//! Plain `Instant` timing, no harness: for f32 and bf16 SUM/AVG with 2 and 4 sources at 1M and
//! 16M elements, prints the best of several runs as GB/s of memory traffic (every source read
//! once plus dst written once), which is what bounds an allreduce's local reduction.

use std::hint::black_box;
use std::time::{Duration, Instant};

use xccl_rs::reduce::{Reduction, reduce_slices};
use xccl_rs::types::{DType, ReduceOp};

fn bench(dtype: DType, op: ReduceOp, nsrc: usize, count: usize) {
    let bytes = count * dtype.size();
    // Small integers are exact in every float type and keep sums finite.
    let srcs: Vec<Vec<u8>> = (0..nsrc)
        .map(|j| {
            (0..bytes)
                .map(|i| {
                    if i % 2 == 1 {
                        0x3F
                    } else {
                        ((i + j) % 7) as u8
                    }
                })
                .collect()
        })
        .collect();
    let views: Vec<&[u8]> = srcs.iter().map(|s| s.as_slice()).collect();
    let mut dst = vec![0u8; bytes];
    let r = Reduction {
        dtype,
        op,
        world_size: nsrc,
        premul_factor: 1.0,
    };

    // Warm up (page faults on dst), then take the best of enough runs to fill ~0.5 s.
    reduce_slices(&r, &mut dst, &views, true);
    let mut best = Duration::MAX;
    let deadline = Instant::now() + Duration::from_millis(500);
    let mut runs = 0;
    while runs < 3 || (Instant::now() < deadline && runs < 200) {
        let t = Instant::now();
        reduce_slices(&r, black_box(&mut dst), black_box(&views), true);
        best = best.min(t.elapsed());
        runs += 1;
    }
    let traffic = (nsrc + 1) * bytes;
    println!(
        "{:<9} {:<4} srcs={} count={:>5}K  {:>8.3} ms  {:>6.2} GB/s",
        dtype.name(),
        op.name(),
        nsrc,
        count >> 10,
        best.as_secs_f64() * 1e3,
        traffic as f64 / best.as_secs_f64() / 1e9
    );
}

fn main() {
    // `REDUCE_BENCH_DTYPE=bfloat16` runs one dtype only (e.g. under a profiler).
    let only = std::env::var("REDUCE_BENCH_DTYPE").ok();
    for count in [256 << 10, 1 << 20, 16 << 20] {
        for dtype in [DType::Float32, DType::BFloat16, DType::Float16] {
            if only.as_deref().is_some_and(|d| d != dtype.name()) {
                continue;
            }
            for op in [ReduceOp::Sum, ReduceOp::Avg] {
                for nsrc in [2, 8] {
                    bench(dtype, op, nsrc, count);
                }
            }
        }
    }
}

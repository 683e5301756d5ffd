//! All-reduce and broadcast of ordinary tensors (not in the shared-memory heap) by cross-memory
//! attach (algorithms/host/allreduce_cma.rs, host/broadcast_shm.rs). All-reduce: at 2 to 5 ranks, over several dtypes and reduce ops,
//! with element counts that cut the parts and the bounce pieces unevenly and buffers that are
//! misaligned and guarded, every result is compared with a reference computed here from every
//! rank's inputs. The op counter proves which path ran: every all-reduce of 1 MiB or more
//! reads by cross-memory attach, a smaller one does not, and with `cma: false` none does (and
//! the results are the same). Broadcast: from every root, every receiver holds the root's bytes
//! and nothing outside its buffer changed; the counter again names the path. Ranks are threads here, so they read their own process;
//! python_tests/test_shm.py runs the path across processes.

#[macro_use]
mod common;
use common::*;
use std::time::Duration;
use xccl_rs::config::CmaUse;
use xccl_rs::{Config, DType, OpKind, ReduceOp};

use ReduceOp::*;

const LIMIT: Duration = Duration::from_secs(120);
const MIB: usize = 1 << 20;

fn cfg(cma: CmaUse) -> Config {
    // Slots of 64 KiB and two helper threads per rank: the slot path stays multi-block, and
    // the reads and reductions are split across threads. Pipeline chunks of 2 MiB: the 3 MiB
    // tensors run as two ops, one of them under 1 MiB (the slot path).
    Config {
        cma,
        shm_heap_bytes: 0,
        shm_slot_bytes: 64 << 10,
        threads: 3,
        thread_min_bytes: 64 << 10,
        pipeline_chunk_bytes: PIPELINE_CHUNK,
        ..net_config(Net::Shm, Duration::from_secs(30), 4096)
    }
}

/// Element counts of `esz`-byte elements: just over 1 MiB (odd), exactly 1 MiB, a size whose
/// parts end mid-piece, and 3 MiB + 1 element; then one just under 1 MiB (the slot path).
fn counts(esz: usize) -> Vec<usize> {
    vec![MIB / esz + 3, MIB / esz, (5 * (128 << 10) + 4096) / esz * 3 + 1, 3 * MIB / esz + 1, MIB / esz - 1]
}

const PIPELINE_CHUNK: usize = 2 << 20;

/// The pipeline's chunks (pipeline.rs) of an all-reduce of `bytes` that are 1 MiB or more.
fn large_chunks(bytes: usize) -> u64 {
    (bytes / PIPELINE_CHUNK + usize::from(bytes % PIPELINE_CHUNK >= MIB)) as u64
}

/// All-reduces with `XCCL_RS_CMA=1` (`cma`) or `0`.
fn sweep<T: TestElem>(cma: bool, ops: &'static [ReduceOp]) {
    let mut failures = Failures::new();
    for size in 2..=5 {
        let group = format!("cma {cma} allreduce {} size {size}", T::DTYPE);
        let setting = if cma { CmaUse::Everything } else { CmaUse::Never };
        sweep_ranks(&mut failures, &group, size, cfg(setting), LIMIT, move |rank, comm, _, f| {
            let mut large_ops = 0;
            for (k, &rop) in ops.iter().enumerate() {
                for n in counts(T::DTYPE.size()) {
                    let what = format!("cma {cma} allreduce {} {rop:?} size {size} n {n} rank {rank}", T::DTYPE);
                    let salt = (k * 10_000_000 + n) as u64;
                    let mut data = Guarded::new(&T::to_bytes(&inputs::<T>(rank, 0, n, salt, rop)), n % 3);
                    let o = reduction_with(OpKind::AllReduce, T::DTYPE, vec![], vec![data.raw()], rop);
                    f.op(run(&comm, vec![o]), &what)?;
                    large_ops += large_chunks(n * T::DTYPE.size());
                    let got = data.data(f, &what);
                    if f.eq(got.len(), n * T::DTYPE.size(), format!("{what}: result bytes")) {
                        f.result(check_reduced::<T>(got, size, 0, salt, rop, FACTOR), &what);
                    }
                    let want = if cma { large_ops } else { 0 };
                    f.eq(comm.cma_ops(), want, format!("{what}: all-reduces read by cross-memory attach"));
                }
            }
            Ok(())
        });
    }
    failures.finish(&format!("allreduce {} with cma {cma}", T::DTYPE));
}

#[test]
fn float32_every_op() {
    sweep::<f32>(true, &[Sum, Avg, Product, Min, Max, PreMulSum]);
}

#[test]
fn bfloat16_and_int32() {
    sweep::<bf16>(true, &[Sum, Avg]);
    sweep::<i32>(true, &[Sum, BXor]);
}

#[test]
fn without_cma_nothing_reads_by_it() {
    sweep::<f32>(false, &[Sum]);
}

/// Broadcasts of ordinary tensors from every root at 2 to 4 ranks: each receiver ends with the
/// root's bytes and nothing outside its buffer changes. With `XCCL_RS_CMA=1` every chunk of
/// 1 MiB or more is read by cross-memory attach (counted on every rank); by default (only staged
/// broadcasts, tests/pipeline.rs) and with `0`, none is.
fn broadcast_sweep(setting: CmaUse) {
    let mut failures = Failures::new();
    let cma = setting == CmaUse::Everything;
    for size in 2..=4 {
        let group = format!("cma {setting:?} broadcast size {size}");
        sweep_ranks(&mut failures, &group, size, cfg(setting), LIMIT, move |rank, comm, _, f| {
            let mut large_ops = 0;
            for root in 0..size {
                for bytes in [MIB + 5, MIB - 4, 3 * MIB + 7, 4 * MIB] {
                    let what = format!("cma {setting:?}: broadcast of {bytes} B from {root} at {size} ranks, rank {rank}");
                    let salt = (root * 100 + bytes) as u64;
                    let want = pattern(root, salt, bytes);
                    let mine = if rank == root { want.clone() } else { pattern(rank, salt, bytes) };
                    let mut data = Guarded::new(&mine, bytes % 5);
                    f.op(run(&comm, vec![rooted_op(OpKind::Broadcast, DType::UInt8, vec![], vec![data.raw()], root)]), &what)?;
                    let got = same_bytes(data.data(f, &what), &want);
                    f.result(got, &what);
                    large_ops += large_chunks(bytes);
                    f.eq(comm.cma_ops(), if cma { large_ops } else { 0 }, format!("{what}: broadcasts read by cross-memory attach"));
                }
            }
            Ok(())
        });
    }
    failures.finish(&format!("broadcast with cma {setting:?}"));
}

#[test]
fn broadcast_from_every_root() {
    broadcast_sweep(CmaUse::Everything);
}

#[test]
fn broadcast_of_ordinary_tensors_uses_the_slots_by_default_and_without_cma() {
    broadcast_sweep(CmaUse::StagedBroadcasts);
    broadcast_sweep(CmaUse::Never);
}

#[test]
fn the_config_is_what_the_group_uses() {
    // Every rank at `1`: all-reduces read by cross-memory attach. Every rank at `0` or the
    // default, or one rank so: the group agrees not to.
    for off in [vec![], vec![0, 1], vec![1]] {
        for other in [CmaUse::Never, CmaUse::StagedBroadcasts] {
            let cfgs: Vec<Config> = (0..2).map(|r| cfg(if off.contains(&r) { other } else { CmaUse::Everything })).collect();
            let ops = spawn_ranks_with(xccl_rs::MemoryStore::new(), cfgs, LIMIT, |rank, comm, _| {
                let mut data = f32_bytes(&vec![rank as f32; MIB / 4]);
                run(&comm, vec![op_with(OpKind::AllReduce, DType::Float32, vec![], vec![buf(&mut data)])]).unwrap();
                assert!(bytes_f32(&data).iter().all(|&v| v == 1.0), "rank {rank}: wrong sum");
                comm.cma_ops()
            });
            let want = if off.is_empty() { vec![1, 1] } else { vec![0, 0] };
            assert_eq!(ops, want, "ranks {off:?} at {other:?}, the others at 1");
        }
    }
}

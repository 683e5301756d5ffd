//! Mixed groups: ranks posing as several hosts (per-rank `Config::host_id`), so that ranks of
//! one "host" talk through shared memory and hosts through TCP (algorithms/hier_*.rs for
//! all-reduce, broadcast, reduce, all-gather and barrier; direct TCP for the rest). Every
//! collective runs at several layouts — 2 × 2, 3 + 1, 1 + 2 + 2, interleaved hosts — with small
//! shared-memory slots (4 KiB, one-shot up to 1 KiB) and TCP segments (4 KiB) so that
//! multi-block paths run, and every result is compared with a reference computed here from the
//! per-rank inputs. Also: mismatches on a non-leader of another host, dead ranks on either
//! side of a host boundary, and proof that shared memory was really used within hosts. Each
//! test reports every failing point (tests/common/failures.rs), named by its parameters and rank.

#[macro_use]
mod common;
use common::*;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use xccl_rs::{Communicator, Config, DType, MemoryStore, Op, OpKind, ReduceOp};

use ReduceOp::*;

const SEGMENT: usize = 4096;
const LIMIT: Duration = Duration::from_secs(90);

/// Host ids per rank. Hosts are numbered by their lowest rank, so "b" may be host 1 or 2.
const LAYOUTS: [&[&str]; 5] = [
    &["a", "a", "b", "b"],      // 2 × 2
    &["a", "a", "a", "b"],      // 3 + 1
    &["a", "b", "b", "c", "c"], // 1 + 2 + 2
    &["a", "b", "a", "b"],      // interleaved: {0, 2} and {1, 3}
    &["a", "b", "c", "a", "b"], // interleaved with a lone rank: {0, 3}, {1, 4}, {2}
];

/// The configurations of the sweeps: 20 s timeouts.
fn sweep_cfgs(layout: &[&str]) -> Vec<Config> {
    cfgs(layout, Duration::from_secs(20))
}

fn cfgs(layout: &[&str], timeout: Duration) -> Vec<Config> {
    layout
        .iter()
        .map(|h| Config { host_id: Some(h.to_string()), ..net_config(Net::Shm, timeout, SEGMENT) })
        .collect()
}

/// Runs the sweep `f` on every rank of `layout` (a fresh group per layout), adding its failing
/// points to `failures` (see `sweep_ranks`).
fn on_layout(
    failures: &mut Failures,
    what: &str,
    layout: &'static [&'static str],
    configs: Vec<Config>,
    f: impl Fn(usize, &Communicator, &mut Failures) -> Result<(), Stop> + Send + Sync + 'static,
) {
    let what = format!("{what} {layout:?}");
    sweep_ranks_with(failures, &what, MemoryStore::new(), configs, LIMIT, move |rank, comm, _, fl| f(rank, &comm, fl))
}

/// A test of every layout: the sweep `f(layout, rank, comm, failures)` on each (see
/// [`on_layout`]), then the report of `what` over all of them.
fn sweep_layouts(
    what: &str,
    f: impl Fn(&'static [&'static str], usize, &Communicator, &mut Failures) -> Result<(), Stop> + Send + Sync + Clone + 'static,
) {
    sweep_on(&LAYOUTS, sweep_cfgs, what, f)
}

/// [`sweep_layouts`] on `layouts`.
fn sweep_on(
    layouts: &[&'static [&'static str]],
    configs: fn(&[&str]) -> Vec<Config>,
    what: &str,
    f: impl Fn(&'static [&'static str], usize, &Communicator, &mut Failures) -> Result<(), Stop> + Send + Sync + Clone + 'static,
) {
    let mut failures = Failures::new();
    for &layout in layouts {
        let f = f.clone();
        on_layout(&mut failures, what, layout, configs(layout), move |rank, comm, fl| f(layout, rank, comm, fl));
    }
    failures.finish(&format!("{what} over host layouts"));
}

/// Runs `job` on every rank of `layout` and returns each rank's value; a rank without one (it
/// panicked, hung, or its job returned an error) is a failing point named by `what`.
fn ranks_on_layout<T: Send + 'static>(
    failures: &mut Failures,
    what: &str,
    layout: &'static [&'static str],
    configs: Vec<Config>,
    job: impl Fn(usize, &Communicator) -> Result<T, Failures> + Send + Sync + 'static,
) -> Vec<Option<T>> {
    let what = format!("{what} {layout:?}");
    let results = try_spawn_ranks_with(MemoryStore::new(), configs, LIMIT, move |rank, comm, _| job(rank, &comm));
    failures
        .ranks(results, &what)
        .into_iter()
        .map(|r| match r? {
            Ok(v) => Some(v),
            Err(rank_failures) => {
                failures.merge(rank_failures);
                None
            }
        })
        .collect()
}

/// The ranks of each host of `layout`, hosts in order of their lowest rank (written here from
/// the definition, independently of the crate's host map).
fn hosts_of(layout: &[&str]) -> Vec<Vec<usize>> {
    let mut order: Vec<&str> = Vec::new();
    for h in layout {
        if !order.contains(h) {
            order.push(h);
        }
    }
    order.iter().map(|h| (0..layout.len()).filter(|&r| layout[r] == *h).collect()).collect()
}

/// Element counts (f32: 256 = the 1 KiB one-shot limit, 1024 = one 4 KiB slot / segment).
fn counts(esz: usize, size: usize) -> Vec<usize> {
    let (one, seg) = (1024 / esz, SEGMENT / esz);
    let mut v = vec![0, 1, 1001, one - 1, one, one + 1, seg - 1, seg, seg + 1, seg * size + 1, 3 * seg * size + 7];
    v.sort();
    v.dedup();
    v
}

// ---------------------------------------------------------------------------------------------
// The reference of a two-level reduction for bf16: each host's ranks summed (MIN/MAX/...) in
// f32 and rounded to bf16 once, then the hosts' results combined in f32, scaled once (AVG by
// the whole group's size, PREMUL_SUM by its factor) and rounded once.

fn bf16_two_level(layout: &[&str], i: usize, salt: u64, op: ReduceOp) -> bf16 {
    let n = layout.len();
    let level1 = match op {
        Avg | PreMulSum => Sum,
        other => other,
    };
    let partials: Vec<f32> = hosts_of(layout)
        .iter()
        .map(|ranks| {
            let vals: Vec<f32> = ranks.iter().map(|&r| bf16::input(r, i, salt, op).to_f32()).collect();
            bf16::from_f32(f32::reference(level1, &vals, 1.0)).to_f32()
        })
        .collect();
    let combined = match op {
        Avg => f32::reference(Sum, &partials, 1.0) / n as f32,
        other => f32::reference(other, &partials, FACTOR),
    };
    bf16::from_f32(combined)
}

/// Compares the elements of `got` (bytes of T, from index `start`) with the reference of
/// `layout`; Err says how many are wrong, and the first and the last of them.
fn check<T: TestElem>(layout: &[&str], got: &[u8], salt: u64, op: ReduceOp, start: usize) -> Result<(), String> {
    let size = layout.len();
    T::check_bytes(got)?;
    let got = T::from_bytes(got);
    each_element(got.len(), |k| {
        let (i, g) = (start + k, got[k]);
        let want: T = if T::DTYPE == DType::BFloat16 {
            // T is bf16 here: convert through bytes.
            T::from_bytes(&bf16::to_bytes(&[bf16_two_level(layout, i, salt, op)]))[0]
        } else {
            expected(size, i, salt, op, FACTOR)
        };
        (!T::same(g, want)).then(|| format!("element {i} is {g:?}, expected {want:?}"))
    })
}

fn allreduce_layouts<T: TestElem>(ops: &'static [ReduceOp]) {
    allreduce_on::<T>(&LAYOUTS, sweep_cfgs, ops, counts);
}

/// [`allreduce_layouts`] on `layouts` with the element counts `counts(element size, ranks)`.
fn allreduce_on<T: TestElem>(
    layouts: &[&'static [&'static str]],
    configs: fn(&[&str]) -> Vec<Config>,
    ops: &'static [ReduceOp],
    counts: fn(usize, usize) -> Vec<usize>,
) {
    let mut failures = Failures::new();
    for &layout in layouts {
        // Each rank's failing points, and its results (all of them, for the comparison of bits).
        let results = ranks_on_layout(&mut failures, &format!("allreduce {}", T::DTYPE), layout, configs(layout), move |rank, comm| {
            let size = layout.len();
            let mut all = Vec::new();
            let mut f = Failures::new();
            for (k, &rop) in ops.iter().enumerate() {
                for n in counts(T::DTYPE.size(), size) {
                    let what = format!("allreduce {} {rop:?} {layout:?} n {n} rank {rank}", T::DTYPE);
                    let salt = (k * 100_000 + n) as u64;
                    let Ok(bytes) = allreduce_point::<T>(&mut f, comm, rank, n, salt, rop, &what) else { return Err(f) };
                    f.result(check::<T>(layout, &bytes, salt, rop, 0), &what);
                    all.push(bytes);
                }
            }
            Ok((f, all))
        });
        let results: Vec<Option<Vec<Vec<u8>>>> = results
            .into_iter()
            .map(|r| {
                let (rank_failures, all) = r?;
                failures.merge(rank_failures);
                Some(all)
            })
            .collect();
        if let Some(Some(first)) = results.first() {
            for (rank, r) in results.iter().enumerate() {
                if let Some(r) = r {
                    failures.check(r == first, || format!("{layout:?}: rank {rank}'s all-reduce results differ from rank 0's bits"));
                }
            }
        }
    }
    failures.finish(&format!("allreduce {} over host layouts", T::DTYPE));
}

#[test]
fn allreduce_f32() {
    allreduce_layouts::<f32>(&[Sum, Avg, PreMulSum, Max, Min, Product]);
}

#[test]
fn allreduce_bf16() {
    allreduce_layouts::<bf16>(&[Sum, Avg, PreMulSum, Max]);
}

#[test]
fn allreduce_i32() {
    allreduce_layouts::<i32>(&[Sum, Avg, BXor, Min]);
}

/// The bf16 data distinguish the two-level rounding from a single rounding (so the bf16
/// reference above is really checked against the hierarchy, not passed by accident).
#[test]
fn bf16_data_tell_roundings_apart() {
    let layout = LAYOUTS[0];
    let differ = (0..3000)
        .filter(|&i| bf16_two_level(layout, i, 7, Sum).to_bits() != expected::<bf16>(4, i, 7, Sum, 1.0).to_bits())
        .count();
    assert!(differ > 100, "only {differ} of 3000 elements distinguish the roundings");
}

/// Around one segment, and several.
fn reduce_counts(esz: usize) -> Vec<usize> {
    vec![0, 1, 1001, SEGMENT / esz + 1, 3 * SEGMENT / esz + 7]
}

/// At the rail threshold, with and without a tail.
fn rail_reduce_counts(esz: usize) -> Vec<usize> {
    vec![RAIL_BYTES / esz, RAIL_BYTES / esz + 5]
}

#[test]
fn reduce_every_root() {
    sweep_layouts("reduce", |layout, rank, comm, f| {
        for root in 0..layout.len() {
            for (k, &rop) in [Sum, Avg, Max, PreMulSum].iter().enumerate() {
                reduce_case::<f32>(f, layout, comm, rank, root, rop, k, reduce_counts)?;
            }
            reduce_case::<bf16>(f, layout, comm, rank, root, Sum, 9, reduce_counts)?;
            reduce_case::<bf16>(f, layout, comm, rank, root, Avg, 10, reduce_counts)?;
        }
        Ok(())
    });
}

/// Reduces of the element counts `counts(element size)`: the root's result against the
/// reference, every other rank's tensor unchanged.
#[allow(clippy::too_many_arguments)]
fn reduce_case<T: TestElem>(
    f: &mut Failures,
    layout: &[&str],
    comm: &Communicator,
    rank: usize,
    root: usize,
    rop: ReduceOp,
    k: usize,
    counts: fn(usize) -> Vec<usize>,
) -> Result<(), Stop> {
    for n in counts(T::DTYPE.size()) {
        let what = format!("reduce {} {rop:?} {layout:?} root {root} n {n} rank {rank}", T::DTYPE);
        let salt = (root * 1_000_000 + k * 100_000 + n) as u64;
        let mut data = guarded_inputs::<T>(rank, n, salt, rop, n % 2);
        let before = data.bytes().to_vec();
        let mut o = reduction_with(OpKind::Reduce, T::DTYPE, vec![], vec![data.raw()], rop);
        o.root = root as i64;
        f.op(run(comm, vec![o]), &what)?;
        let bytes = data.data(f, &what);
        if rank == root {
            f.result(check::<T>(layout, bytes, salt, rop, 0), &what);
        } else {
            f.result(same_bytes(bytes, &before), format!("{what}: a non-root buffer changed"));
        }
    }
    Ok(())
}

#[test]
fn broadcast_every_root() {
    sweep_layouts("broadcast", |layout, rank, comm, f| {
        for dtype in [DType::Float32, DType::BFloat16, DType::UInt8] {
            for n in [0, 1, 1001, 5000, 100_003] {
                for root in 0..layout.len() {
                    let what = format!("broadcast {dtype} {layout:?} root {root} n {n} rank {rank}");
                    let salt = mix(n as u64 ^ (root as u64) << 32 ^ dtype as u64);
                    broadcast_point(f, comm, rank, dtype, n, root, salt, &what)?;
                }
            }
        }
        Ok(())
    });
}

#[test]
fn allgather_contiguous_in_place_and_separate() {
    sweep_layouts("allgather", |layout, rank, comm, f| {
        let size = layout.len();
        for dtype in [DType::Float32, DType::UInt8] {
            for n in [0, 1, 1001, 5000] {
                for (mode, views) in VIEW_LAYOUTS.into_iter().enumerate() {
                    let what = format!("allgather {dtype} {layout:?} n {n} {views:?} rank {rank}");
                    let salt = mix((n * 10 + mode) as u64 ^ dtype as u64);
                    allgather_point(f, comm, rank, size, dtype, n, views, salt, &what)?;
                }
            }
        }
        Ok(())
    });
}

/// Gather, scatter, reduce-scatter and all-to-all run direct over TCP in a mixed group.
#[test]
fn direct_collectives() {
    sweep_layouts("direct collectives", |layout, rank, comm, f| {
        let size = layout.len();
        for n in [0usize, 1, 1001, 5000] {
            for root in [0, size - 1] {
                let what = format!("gather {layout:?} root {root} n {n} rank {rank}");
                let salt = mix(n as u64 * 3 + root as u64);
                let mut input = pattern(rank, salt, n);
                let mut out = vec![0u8; if rank == root { size * n } else { 0 }];
                let outs = if rank == root { views(&mut out, size, n) } else { vec![] };
                f.op(run(comm, vec![rooted_op(OpKind::Gather, DType::UInt8, vec![buf(&mut input)], outs, root)]), &what)?;
                if rank == root {
                    check_blocks(f, &out, size, salt, n, &what);
                }

                let what = format!("scatter {layout:?} root {root} n {n} rank {rank}");
                let whole = pattern(root, salt ^ 1, size * n);
                let mut input = if rank == root { whole.clone() } else { vec![] };
                let ins = if rank == root { views(&mut input, size, n) } else { vec![] };
                let mut out = vec![0u8; n];
                f.op(run(comm, vec![rooted_op(OpKind::Scatter, DType::UInt8, ins, vec![buf(&mut out)], root)]), &what)?;
                f.result(same_bytes(&out, &whole[rank * n..(rank + 1) * n]), &what);
            }

            for (k, rop) in [Sum, Avg, PreMulSum, Max].into_iter().enumerate() {
                let what = format!("reduce_scatter {rop:?} {layout:?} n {n} rank {rank}");
                let salt = (k * 100_000 + n) as u64 + 555;
                let mut input = f32::to_bytes(&inputs::<f32>(rank, 0, n * size, salt, rop));
                let mut out = vec![0u8; n * 4];
                let o = reduction_with(OpKind::ReduceScatter, DType::Float32, views(&mut input, size, n * 4), vec![buf(&mut out)], rop);
                f.op(run(comm, vec![o]), &what)?;
                f.result(check_reduced::<f32>(&out, size, rank * n, salt, rop, FACTOR), &what);
            }

            let what = format!("alltoall {layout:?} n {n} rank {rank}");
            let len = |src: usize, dst: usize| (n + 7 * src + dst) % (n + 1);
            let msg = |src: usize, dst: usize| pattern(src * 16 + dst, n as u64, len(src, dst));
            let mut ins: Vec<Vec<u8>> = (0..size).map(|dst| msg(rank, dst)).collect();
            let mut outs: Vec<Vec<u8>> = (0..size).map(|src| vec![0u8; len(src, rank)]).collect();
            let o = op_with(OpKind::AllToAll, DType::UInt8, ins.iter_mut().map(|v| buf(v)).collect(), outs.iter_mut().map(|v| buf(v)).collect());
            f.op(run(comm, vec![o]), &what)?;
            for (src, got) in outs.iter().enumerate() {
                f.result(same_bytes(got, &msg(src, rank)), format!("{what}: from rank {src}"));
            }
        }
        Ok(())
    });
}

/// Send/recv between every ordered pair (within and across hosts), as one batch per rank.
#[test]
fn send_recv_every_pair() {
    sweep_layouts("send/recv", |layout, rank, comm, f| {
        let size = layout.len();
        for n in [0usize, 1, 5000] {
            let msg = |src: usize, dst: usize| pattern(src * 16 + dst, 99 + n as u64, n);
            let mut outgoing: Vec<Vec<u8>> = (0..size).map(|dst| msg(rank, dst)).collect();
            let mut incoming: Vec<Vec<u8>> = (0..size).map(|_| vec![0u8; n]).collect();
            let mut ops: Vec<Op> = Vec::new();
            for peer in (0..size).filter(|&p| p != rank) {
                ops.push(send_to(peer, 0, DType::UInt8, buf(&mut outgoing[peer])));
                ops.push(recv_from(peer, 0, DType::UInt8, buf(&mut incoming[peer])));
            }
            f.op(run(comm, ops), format!("send/recv {layout:?} n {n} rank {rank}"))?;
            for peer in (0..size).filter(|&p| p != rank) {
                f.result(same_bytes(&incoming[peer], &msg(peer, rank)), format!("send/recv {layout:?} n {n}: rank {rank} from {peer}"));
            }
        }
        Ok(())
    });
}

/// No rank leaves a barrier before the last one has entered (the late one varies: a leader, a
/// non-leader, a lone rank).
#[test]
fn barrier_waits_for_everyone() {
    let mut failures = Failures::new();
    for layout in LAYOUTS {
        let size = layout.len();
        let log = Arc::new(Mutex::new(Vec::new()));
        let log2 = log.clone();
        on_layout(&mut failures, "barrier", layout, sweep_cfgs(layout), move |rank, comm, f| {
            for it in 0..size {
                if rank == it {
                    std::thread::sleep(Duration::from_millis(40));
                }
                let enter = Instant::now();
                f.op(run(comm, vec![barrier_op()]), format!("{layout:?} barrier {it} rank {rank}"))?;
                log2.lock().unwrap().push((it, enter, Instant::now()));
            }
            Ok(())
        });
        let log = log.lock().unwrap();
        for it in 0..size {
            // Only the ranks that got through the barrier (the others are failing points already).
            let last_enter = log.iter().filter(|e| e.0 == it).map(|e| e.1).max();
            let first_exit = log.iter().filter(|e| e.0 == it).map(|e| e.2).min();
            failures.check(first_exit >= last_enter, || format!("{layout:?} barrier {it}: a rank left before the last one entered"));
        }
    }
    failures.finish("barrier over host layouts");
}

/// The mixed path moves data through shared memory within hosts — and only within hosts: a
/// rank alone on its host has none, and forced TCP has none anywhere.
#[test]
fn shared_memory_is_used_within_hosts() {
    let layout = LAYOUTS[4]; // {0, 3}, {1, 4}, {2}
    let mut failures = Failures::new();
    let used = ranks_on_layout(&mut failures, "shared memory", layout, sweep_cfgs(layout), move |rank, comm| {
        let what = format!("allreduce {layout:?} rank {rank}");
        let mut f = Failures::new();
        let mut data = f32::to_bytes(&inputs::<f32>(rank, 0, 5000, 3, Sum));
        if f.op(run(comm, vec![op_with(OpKind::AllReduce, DType::Float32, vec![], vec![buf(&mut data)])]), &what).is_err() {
            return Err(f);
        }
        f.result(check_reduced::<f32>(&data, 5, 0, 3, Sum, 1.0), &what);
        Ok((f, comm.shm_blocks_used()))
    });
    for (rank, r) in used.into_iter().enumerate() {
        let Some((rank_failures, blocks)) = r else { continue };
        failures.merge(rank_failures);
        if rank == 2 {
            failures.eq(blocks, 0, "rank 2 is alone on its host: no shared memory");
        } else {
            failures.check(blocks >= 10, || format!("rank {rank} shares a host: its all-reduce of 20000 bytes should move 4 KiB blocks through shared memory, used {blocks}"));
        }
    }
    let tcp: Vec<Config> = cfgs(layout, Duration::from_secs(20)).into_iter().map(|c| Config { transport: xccl_rs::config::TransportChoice::Tcp, ..c }).collect();
    let used = try_spawn_ranks_with(MemoryStore::new(), tcp, LIMIT, |rank, comm, _| {
        let mut data = f32::to_bytes(&inputs::<f32>(rank, 0, 5000, 3, Sum));
        run(&comm, vec![op_with(OpKind::AllReduce, DType::Float32, vec![], vec![buf(&mut data)])]).map(|_| comm.shm_blocks_used())
    });
    let what = format!("allreduce over forced TCP {layout:?}");
    for (rank, r) in failures.ranks(used, &what).into_iter().enumerate() {
        let Some(r) = r else { continue };
        if let Ok(blocks) = failures.op(r, format!("{what} rank {rank}")) {
            failures.eq(blocks, 0, format!("rank {rank}: XCCL_RS_TRANSPORT=tcp uses no shared memory"));
        }
    }
    failures.finish("shared memory within hosts");
}

// ---------------------------------------------------------------------------------------------
// Rail-aligned collectives: hosts of equal size, ops of 256 KiB or more (algorithms/select.rs
// RAIL_MIN_BYTES), so that all-reduce, broadcast, all-gather and reduce-scatter run with every
// local rank on the wire (mixed/*_rail.rs); each sweep also checks, in the group's statistics,
// that the rail-aligned algorithm is what ran.

const RAIL_LAYOUTS: [&[&str]; 3] = [
    &["a", "a", "b", "b"],           // 2 × 2
    &["a", "b", "c", "a", "b", "c"], // 3 × 2, interleaved: {0, 3}, {1, 4}, {2, 5}
    &["a", "a", "a", "b", "b", "b"], // 2 × 3
];
const RAIL_BYTES: usize = 256 << 10;

/// The sweeps' configurations with pipeline chunks of 1 MiB: the small chunks of the other
/// tests would cut every op below the rail threshold (the table chooses per chunk).
fn rail_cfgs(layout: &[&str]) -> Vec<Config> {
    sweep_cfgs(layout).into_iter().map(|c| Config { pipeline_chunk_bytes: 1 << 20, ..c }).collect()
}

/// Counts at the rail threshold: exactly, with a tail of one element, and with a tail of
/// `ranks per host − 1` or more (for 2 × 3, 2 elements; n mod k is the tail).
fn rail_counts(esz: usize, _size: usize) -> Vec<usize> {
    let n = RAIL_BYTES / esz;
    vec![n, n + 1, n + 2, n + 5]
}

/// Whether `comm`'s statistics show `want` (an algorithm's name) among what it ran.
fn ran(f: &mut Failures, comm: &Communicator, want: &str, what: &str) {
    let names: Vec<String> = comm.stats().iter().map(|(_, a, _)| format!("{a:?}")).collect();
    f.check(names.iter().any(|n| n == want), || format!("{what}: statistics show {names:?}, not {want}"));
}

#[test]
fn rail_allreduce_f32() {
    allreduce_on::<f32>(&RAIL_LAYOUTS, rail_cfgs, &[Sum, Avg, PreMulSum, Max, Min], rail_counts);
}

#[test]
fn rail_allreduce_bf16_and_i32() {
    allreduce_on::<bf16>(&RAIL_LAYOUTS, rail_cfgs, &[Sum, Avg, PreMulSum], rail_counts);
    allreduce_on::<i32>(&RAIL_LAYOUTS, rail_cfgs, &[Sum, BXor], rail_counts);
}

/// Ops large enough that the rail all-reduce runs its steps in several pieces, overlapped
/// (mixed/overlap.rs): shares of 2 to 3 MiB, with a tail, in one pipeline chunk.
fn piece_cfgs(layout: &[&str]) -> Vec<Config> {
    sweep_cfgs(layout).into_iter().map(|c| Config { pipeline_chunk_bytes: 16 << 20, ..c }).collect()
}

fn piece_counts(esz: usize, _size: usize) -> Vec<usize> {
    vec![(6 << 20) / esz + 5]
}

#[test]
fn rail_allreduce_in_overlapped_pieces() {
    allreduce_on::<f32>(&RAIL_LAYOUTS, piece_cfgs, &[Sum, Avg], piece_counts);
    allreduce_on::<bf16>(&RAIL_LAYOUTS[..1], piece_cfgs, &[PreMulSum], piece_counts);
}

/// A rank dies during a rail all-reduce in several pieces, overlapped (a non-leader, then a
/// leader, of the second host of 2 × 2): every other rank fails well before the timeout, its
/// host's peer through the rail thread's or the shared-memory step's error.
#[test]
fn dead_rank_fails_an_overlapped_rail_allreduce() {
    let mut failures = Failures::new();
    for dead in [3, 2] {
        let what = format!("rank {dead} dies");
        let cfgs = |layout: &[&str]| err_cfgs(layout).into_iter().map(|c| Config { pipeline_chunk_bytes: 16 << 20, ..c }).collect();
        sweep_ranks_with(&mut failures, &what, MemoryStore::new(), cfgs(LAYOUTS[0]), LIMIT, move |rank, comm, barrier, f| {
            let what = format!("rank {rank} (rank {dead} dies)");
            if rank == dead {
                std::thread::sleep(Duration::from_millis(150));
                drop(comm);
            } else {
                let mut data = f32::to_bytes(&vec![1.0; (16 << 20) / 4]);
                let o = op_with(OpKind::AllReduce, DType::Float32, vec![], vec![buf(&mut data)]);
                fails_within_then_next_job(f, &comm, vec![o], &[&format!("rank {dead}")], Duration::from_millis(1500), &what);
            }
            barrier.wait();
            Ok(())
        });
    }
    failures.finish("dead rank fails an overlapped rail all-reduce");
}

#[test]
fn rail_allreduce_is_what_runs() {
    sweep_on(&RAIL_LAYOUTS, rail_cfgs, "rail allreduce", |layout, rank, comm, f| {
        let what = format!("allreduce {layout:?} rank {rank}");
        let bytes = allreduce_point::<f32>(f, comm, rank, RAIL_BYTES / 4, 1, Sum, &what)?;
        f.result(check::<f32>(layout, &bytes, 1, Sum, 0), &what);
        ran(f, comm, "AllReduceRail", &what);
        Ok(())
    });
}

#[test]
fn rail_broadcast_every_root() {
    sweep_on(&RAIL_LAYOUTS, rail_cfgs, "rail broadcast", |layout, rank, comm, f| {
        for (dtype, n) in [(DType::Float32, RAIL_BYTES / 4 + 3), (DType::UInt8, RAIL_BYTES + 1)] {
            for root in 0..layout.len() {
                let what = format!("broadcast {dtype} {layout:?} root {root} n {n} rank {rank}");
                let salt = mix(n as u64 ^ (root as u64) << 32 ^ dtype as u64);
                broadcast_point(f, comm, rank, dtype, n, root, salt, &what)?;
            }
        }
        ran(f, comm, "BroadcastRail", &format!("broadcast {layout:?} rank {rank}"));
        Ok(())
    });
}

#[test]
fn rail_reduce_every_root() {
    sweep_on(&RAIL_LAYOUTS, rail_cfgs, "rail reduce", |layout, rank, comm, f| {
        for root in 0..layout.len() {
            for (k, &rop) in [Sum, Avg, PreMulSum].iter().enumerate() {
                reduce_case::<f32>(f, layout, comm, rank, root, rop, k, rail_reduce_counts)?;
            }
            reduce_case::<bf16>(f, layout, comm, rank, root, Avg, 9, rail_reduce_counts)?;
        }
        ran(f, comm, "ReduceRail", &format!("reduce {layout:?} rank {rank}"));
        Ok(())
    });
}

#[test]
fn rail_allgather_every_view_layout() {
    sweep_on(&RAIL_LAYOUTS, rail_cfgs, "rail allgather", |layout, rank, comm, f| {
        let size = layout.len();
        for (dtype, n) in [(DType::UInt8, RAIL_BYTES / size + 5), (DType::Float32, RAIL_BYTES / (4 * size) + 1)] {
            for (mode, views) in VIEW_LAYOUTS.into_iter().enumerate() {
                let what = format!("allgather {dtype} {layout:?} n {n} {views:?} rank {rank}");
                let salt = mix((n * 10 + mode) as u64 ^ dtype as u64);
                allgather_point(f, comm, rank, size, dtype, n, views, salt, &what)?;
            }
        }
        ran(f, comm, "AllGatherRail", &format!("allgather {layout:?} rank {rank}"));
        Ok(())
    });
}

/// Inputs of 2 MiB and more: the rail all-gather runs in overlapped pieces (mixed/overlap.rs).
#[test]
fn rail_allgather_in_overlapped_pieces() {
    sweep_on(&[RAIL_LAYOUTS[0], RAIL_LAYOUTS[2]], piece_cfgs, "rail allgather in pieces", |layout, rank, comm, f| {
        let size = layout.len();
        let n = (2 << 20) / 4 + 3;
        for (mode, views) in VIEW_LAYOUTS.into_iter().enumerate() {
            let what = format!("allgather float32 {layout:?} n {n} {views:?} rank {rank}");
            allgather_point(f, comm, rank, size, DType::Float32, n, views, mix((n * 10 + mode) as u64), &what)?;
        }
        ran(f, comm, "AllGatherRail", &format!("allgather {layout:?} rank {rank}"));
        Ok(())
    });
}

#[test]
fn rail_reduce_scatter() {
    sweep_on(&RAIL_LAYOUTS, rail_cfgs, "rail reduce_scatter", |layout, rank, comm, f| {
        let n = |esz: usize| RAIL_BYTES / (esz * layout.len()) + 3;
        for (k, rop) in [Sum, Avg, PreMulSum, Max].into_iter().enumerate() {
            reduce_scatter_case::<f32>(f, layout, comm, rank, rop, k, n(4))?;
        }
        reduce_scatter_case::<bf16>(f, layout, comm, rank, Avg, 9, n(2))?;
        ran(f, comm, "ReduceScatterRail", &format!("reduce_scatter {layout:?} rank {rank}"));
        Ok(())
    });
}

/// Results of 2 MiB and more: the rail reduce-scatter runs in overlapped pieces (mixed/overlap.rs).
#[test]
fn rail_reduce_scatter_in_overlapped_pieces() {
    sweep_on(&[RAIL_LAYOUTS[0], RAIL_LAYOUTS[2]], piece_cfgs, "rail reduce_scatter in pieces", |layout, rank, comm, f| {
        reduce_scatter_case::<f32>(f, layout, comm, rank, Avg, 0, (2 << 20) / 4 + 3)?;
        reduce_scatter_case::<bf16>(f, layout, comm, rank, Sum, 1, (4 << 20) / 2 + 1)?;
        ran(f, comm, "ReduceScatterRail", &format!("reduce_scatter {layout:?} rank {rank}"));
        Ok(())
    });
}

fn reduce_scatter_case<T: TestElem>(f: &mut Failures, layout: &[&str], comm: &Communicator, rank: usize, rop: ReduceOp, k: usize, n: usize) -> Result<(), Stop> {
    let size = layout.len();
    let esz = T::DTYPE.size();
    let what = format!("reduce_scatter {} {rop:?} {layout:?} n {n} rank {rank}", T::DTYPE);
    let salt = (k * 100_000 + n) as u64 + 777;
    let mut input = T::to_bytes(&inputs::<T>(rank, 0, n * size, salt, rop));
    let mut out = vec![0u8; n * esz];
    let o = reduction_with(OpKind::ReduceScatter, T::DTYPE, views(&mut input, size, n * esz), vec![buf(&mut out)], rop);
    f.op(run(comm, vec![o]), &what)?;
    f.result(check::<T>(layout, &out, salt, rop, rank * n), &what);
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Failures.

fn err_cfgs(layout: &[&str]) -> Vec<Config> {
    cfgs(layout, Duration::from_secs(3))
}

/// Runs the failure case `f` on every rank of `layout` (short timeouts), adding its failing
/// points to `failures`.
fn failing_on_layout(
    failures: &mut Failures,
    what: &str,
    layout: &'static [&'static str],
    f: impl Fn(usize, Communicator, &RankBarrier, &mut Failures) -> Result<(), Stop> + Send + Sync + 'static,
) {
    sweep_ranks_with(failures, &format!("{what} {layout:?}"), MemoryStore::new(), err_cfgs(layout), LIMIT, f)
}

/// Rank 3, a non-leader on the second host, disagrees about an all-reduce's size (or dtype),
/// on each of `layouts`: every rank fails promptly and names the mismatch.
fn mismatch_on_remote_non_leader(layouts: [&'static [&'static str]; 2], dtype_mismatch: bool) {
    let what = if dtype_mismatch { "dtype mismatch" } else { "size mismatch" };
    let mut failures = Failures::new();
    for layout in layouts {
        failing_on_layout(&mut failures, "mismatch", layout, move |rank, comm, barrier, f| {
            let n = if rank == 3 && !dtype_mismatch { 5001 } else { 5000 };
            let dtype = if rank == 3 && dtype_mismatch { DType::Int32 } else { DType::Float32 };
            let mut data = f32::to_bytes(&vec![1.0; n]);
            let o = op_with(OpKind::AllReduce, dtype, vec![], vec![buf(&mut data)]);
            fails_within_then_next_job(f, &comm, vec![o], &[what], Duration::from_secs(1), &format!("{layout:?} rank {rank}"));
            barrier.wait();
            Ok(())
        });
    }
    failures.finish(&format!("{what} on a remote non-leader"));
}

#[test]
fn size_mismatch_on_a_remote_non_leader() {
    mismatch_on_remote_non_leader([LAYOUTS[0], LAYOUTS[3]], false);
}

#[test]
fn dtype_mismatch_on_a_remote_non_leader() {
    mismatch_on_remote_non_leader([LAYOUTS[0], LAYOUTS[2]], true);
}

/// The two hosts disagree about the reduce op (every rank of the second host uses MAX): the
/// leaders' TCP step carries the op in its frames, so every rank fails naming it.
#[test]
fn reduce_op_mismatch_between_hosts() {
    let mut failures = Failures::new();
    for layout in [LAYOUTS[0], LAYOUTS[3]] {
        failing_on_layout(&mut failures, "reduce op mismatch", layout, move |rank, comm, barrier, f| {
            let what = format!("{layout:?} rank {rank}");
            let mut data = f32::to_bytes(&vec![1.0; 5000]);
            let mut o = op_with(OpKind::AllReduce, DType::Float32, vec![], vec![buf(&mut data)]);
            o.reduce_op = if layout[rank] == layout[0] { Sum } else { Max };
            fails_within(f, &comm, vec![o], &["reduce op mismatch"], Duration::from_secs(1), &what);
            barrier.wait();
            Ok(())
        });
    }
    failures.finish("reduce op mismatch between hosts");
}

/// A rank dies (drops its communicator) during an all-reduce — a non-leader, then a leader, of
/// the second host of 2 × 2: every other rank, on both hosts, fails well before the timeout.
#[test]
fn dead_rank_fails_every_host_promptly() {
    let mut failures = Failures::new();
    for dead in [3, 2] {
        failing_on_layout(&mut failures, &format!("rank {dead} dies"), LAYOUTS[0], move |rank, comm, barrier, f| {
            let what = format!("rank {rank} (rank {dead} dies)");
            peer_dies_during_allreduce(f, rank, dead, comm, barrier, &[&format!("rank {dead}")], &what)
        });
    }
    failures.finish("dead rank fails every host promptly");
}

/// A broadcast whose receiver on another host (rank 3, a non-leader) disagrees about the size:
/// that host's ranks fail in the broadcast (their shared-memory step compares descriptions),
/// and so does the root, whose receivers confirm only after their host's step. The root's
/// local peer may have finished its part, as a receiver of a direct broadcast does, and then
/// fails at its next operation, naming the mismatch. Nobody hangs, nobody continues silently.
#[test]
fn broadcast_mismatch_on_a_remote_non_leader() {
    let mut failures = Failures::new();
    failing_on_layout(&mut failures, "broadcast size mismatch", LAYOUTS[0], move |rank, comm, barrier, f| {
        let what = format!("rank {rank}");
        let n = if rank == 3 { 5001 } else { 5000 };
        let mut data = vec![rank as u8; n];
        let mut o = op_with(OpKind::Broadcast, DType::UInt8, vec![], vec![buf(&mut data)]);
        o.root = 0;
        let (r, took) = timed(&comm, vec![o]);
        f.check(took < Duration::from_secs(1), || format!("{what}: broadcast took {took:?}"));
        let e = match r {
            Err(e) => Some(e),
            Ok(_) => {
                if f.check(rank == 1, || format!("{what}: the root and the mismatching host must fail in the broadcast")) {
                    let mut x = f32::to_bytes(&[1.0; 10]);
                    let (r, took) = timed(&comm, vec![op_with(OpKind::AllReduce, DType::Float32, vec![], vec![buf(&mut x)])]);
                    f.check(took < Duration::from_secs(1), || format!("{what}: the next op took {took:?}"));
                    expect_err(f, r, &format!("{what}: the op after the mismatched broadcast"))
                } else {
                    None
                }
            }
        };
        if let Some(e) = e {
            mentions(f, &e, &["size mismatch"], &what);
        }
        barrier.wait();
        Ok(())
    });
    failures.finish("broadcast mismatch on a remote non-leader");
}

//! Every collective OpKind (not point-to-point) at world sizes 1..=5: AllReduce over seven dtypes
//! and every valid ReduceOp, Reduce / Broadcast / Gather / Scatter from every root, AllGather,
//! ReduceScatter, AllToAll with unequal and zero-length pairs, Barrier, and a coalesced job.
//! Element counts 0, 1, odd, and around/above the (small) segment / slot size so multi-round
//! paths run. Each test runs over TCP (`::tcp`) and shared memory (`::shm`). Every result is
//! compared with a reference computed here from every rank's inputs. Each sweep reports every
//! failing point (tests/common/failures.rs), each named by its parameters and rank.

#[macro_use]
mod common;
use common::*;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use xccl_rs::{Communicator, Config, DType, OpKind, RawBuf, ReduceOp};

const SEGMENT: usize = 4096;
const LIMIT: Duration = Duration::from_secs(60);

fn cfg(net: Net) -> Config {
    net_config(net, Duration::from_secs(20), SEGMENT)
}

/// Counts for an all-reduce: around the shared-memory one-shot limit (1 KiB of reads from the
/// peers: 1 KiB / (size - 1) of tensor), around one
/// segment / slot (TCP's per-rank chunk, shared memory's block), around `size` segments (TCP's
/// per-rank chunk at a segment), and several segments.
fn allreduce_counts(esz: usize, size: usize) -> Vec<usize> {
    let seg = SEGMENT / esz;
    let one = (1024 / (size - 1).max(1) / esz).max(1);
    let mut v =
        vec![0, 1, 1001, one - 1, one, one + 1, seg - 1, seg, seg + 1, seg * size - 1, seg * size, seg * size + 1, 3 * seg * size + 7];
    v.sort();
    v.dedup();
    v
}

/// Counts for reduce / reduce-scatter blocks: around one segment, and several.
fn segment_counts(esz: usize) -> Vec<usize> {
    let seg = SEGMENT / esz;
    vec![0, 1, 1001, seg - 1, seg, seg + 1, 3 * seg + 7]
}

/// The sweep `f(size, rank, comm, failures)` at world sizes 1..=5 (a fresh group each, see
/// `sweep_ranks`), named `what` and its size; its failing points.
fn sizes_swept(
    net: Net,
    what: &str,
    f: impl Fn(usize, usize, Communicator, &mut Failures) -> Result<(), Stop> + Send + Sync + Clone + 'static,
) -> Failures {
    let mut failures = Failures::new();
    for size in 1..=5 {
        let f = f.clone();
        sweep_ranks(&mut failures, &format!("{what} size {size}"), size, cfg(net), LIMIT, move |rank, comm, _, fl| f(size, rank, comm, fl));
    }
    failures
}

/// A test of [`sizes_swept`]: the report of `what`.
fn sweep_sizes(
    net: Net,
    what: &str,
    f: impl Fn(usize, usize, Communicator, &mut Failures) -> Result<(), Stop> + Send + Sync + Clone + 'static,
) {
    sizes_swept(net, what, f).finish(&format!("{what} over {net:?}"));
}

fn allreduce_all<T: TestElem>(net: Net, ops: &'static [ReduceOp]) {
    sweep_sizes(net, &format!("allreduce {}", T::DTYPE), move |size, rank, comm, f| {
        for (k, &rop) in ops.iter().enumerate() {
            for n in allreduce_counts(T::DTYPE.size(), size) {
                let what = format!("allreduce {} {rop:?} size {size} n {n} rank {rank}", T::DTYPE);
                let salt = (k * 100_000 + n) as u64;
                let got = allreduce_point::<T>(f, &comm, rank, n, salt, rop, &what)?;
                if f.eq(got.len(), n * T::DTYPE.size(), format!("{what}: result bytes")) {
                    f.result(check_reduced::<T>(&got, size, 0, salt, rop, FACTOR), &what);
                }
            }
        }
        Ok(())
    });
}

use ReduceOp::*;

fn allreduce_f32(net: Net) {
    allreduce_all::<f32>(net, &[Sum, Avg, Product, Min, Max, PreMulSum]);
}

fn allreduce_f64(net: Net) {
    allreduce_all::<f64>(net, &[Sum, Avg, Product, Min, Max, PreMulSum]);
}

fn allreduce_bf16(net: Net) {
    allreduce_all::<bf16>(net, &[Sum, Avg, Product, Min, Max, PreMulSum]);
}

fn allreduce_i32(net: Net) {
    allreduce_all::<i32>(net, &[Sum, Avg, Product, Min, Max, BAnd, BOr, BXor]);
}

fn allreduce_i64(net: Net) {
    allreduce_all::<i64>(net, &[Sum, Product, Min, Max, BAnd, BOr, BXor]);
}

fn allreduce_u8(net: Net) {
    allreduce_all::<u8>(net, &[Sum, Product, Min, Max, BAnd, BOr, BXor]);
}

fn allreduce_bool(net: Net) {
    allreduce_all::<bool>(net, &[Sum, Product, Min, Max, BAnd, BOr, BXor]);
}

/// bf16 SUM is the f32-accumulated sum rounded once, which differs from rounding after every
/// addition; the second assertion proves the data tells the two apart.
fn allreduce_bf16_sum_rounds_once(net: Net) {
    let (size, n, salt) = (4, 3000, 77);
    let mut f = Failures::new();
    let what = format!("allreduce bf16 Sum size {size} n {n}");
    let results = try_spawn_ranks(size, cfg(net), LIMIT, move |rank, comm, _| {
        let mut data = bf16::to_bytes(&inputs::<bf16>(rank, 0, n, salt, Sum));
        run(&comm, vec![op_with(OpKind::AllReduce, DType::BFloat16, vec![], vec![buf(&mut data)])]).map(|_| bf16::from_bytes(&data))
    });
    let got: Vec<Option<Vec<bf16>>> =
        f.ranks(results, &what).into_iter().enumerate().map(|(rank, r)| f.op(r?, format!("{what} rank {rank}")).ok()).collect();
    let once_and_stepwise = |i: usize| {
        let vals: Vec<bf16> = (0..size).map(|r| bf16::input(r, i, salt, Sum)).collect();
        let once = bf16::from_f32(vals.iter().map(|v| v.to_f32()).sum::<f32>());
        let stepwise = vals[1..].iter().fold(vals[0], |a, &b| bf16::from_f32(a.to_f32() + b.to_f32()));
        (once, stepwise)
    };
    let differs_from_stepwise = (0..n).filter(|&i| once_and_stepwise(i).0 != once_and_stepwise(i).1).count();
    for (rank, g) in got.iter().enumerate() {
        let Some(g) = g else { continue };
        f.result(
            each_element(n, |i| {
                let (once, stepwise) = once_and_stepwise(i);
                (g[i].to_bits() != once.to_bits()).then(|| format!("[{i}]: {} != {once} (stepwise {stepwise})", g[i]))
            }),
            format!("{what} rank {rank}"),
        );
    }
    f.check(differs_from_stepwise > n / 20, || {
        format!("test data too tame: only {differs_from_stepwise} elements distinguish the roundings")
    });
    f.finish(&format!("bf16 sum rounds once over {net:?}"));
}

/// Float MIN/MAX propagate a NaN from any rank, including the first.
fn allreduce_min_max_propagate_nan(net: Net) {
    let size = 3;
    let nan_at = |rank: usize, i: usize| (rank, i) == (0, 0) || (rank, i) == (1, 3) || (rank, i) == (2, 7);
    let mut f = Failures::new();
    for rop in [Min, Max] {
        let what = format!("allreduce float32 {rop:?} size {size}");
        let results = try_spawn_ranks(size, cfg(net), LIMIT, move |rank, comm, _| {
            let v: Vec<f32> = (0..10).map(|i| if nan_at(rank, i) { f32::NAN } else { f32::input(rank, i, 5, rop) }).collect();
            let mut data = f32::to_bytes(&v);
            let mut o = op_with(OpKind::AllReduce, DType::Float32, vec![], vec![buf(&mut data)]);
            o.reduce_op = rop;
            run(&comm, vec![o]).map(|_| f32::from_bytes(&data))
        });
        for (rank, r) in f.ranks(results, &what).into_iter().enumerate() {
            let Some(Ok(g)) = r.map(|r| f.op(r, format!("{what} rank {rank}"))) else { continue };
            let bad = each_element(10, |i| {
                if [0, 3, 7].contains(&i) {
                    (!g[i].is_nan()).then(|| format!("[{i}]: {} should be NaN", g[i]))
                } else {
                    let want: f32 = expected(size, i, 5, rop, 1.0);
                    (g[i] != want).then(|| format!("[{i}]: {} != {want}", g[i]))
                }
            });
            f.result(bad, format!("{what} rank {rank}"));
        }
    }
    f.finish(&format!("min/max propagate NaN over {net:?}"));
}

fn reduce_all<T: TestElem>(net: Net, ops: &'static [ReduceOp]) {
    sweep_sizes(net, &format!("reduce {}", T::DTYPE), move |size, rank, comm, f| {
        for root in 0..size {
            for (k, &rop) in ops.iter().enumerate() {
                for n in segment_counts(T::DTYPE.size()) {
                    let what = format!("reduce {} {rop:?} size {size} root {root} n {n} rank {rank}", T::DTYPE);
                    let salt = (root * 1_000_000 + k * 100_000 + n) as u64;
                    let before = T::to_bytes(&inputs::<T>(rank, 0, n, salt, rop));
                    let mut data = Guarded::new(&before, n % 2);
                    let mut o = reduction_with(OpKind::Reduce, T::DTYPE, vec![], vec![data.raw()], rop);
                    o.root = root as i64;
                    f.op(run(&comm, vec![o]), &what)?;
                    if rank == root {
                        let bytes = data.data(f, &what);
                        f.result(check_reduced::<T>(bytes, size, 0, salt, rop, FACTOR), &what);
                    } else {
                        let bytes = data.data(f, &what);
                        f.result(same_bytes(bytes, &before), format!("{what}: a non-root buffer changed"));
                    }
                }
            }
        }
        Ok(())
    });
}

fn reduce_every_root_f32(net: Net) {
    reduce_all::<f32>(net, &[Sum, Avg, Max, PreMulSum]);
}

fn reduce_every_root_int_and_bf16(net: Net) {
    reduce_all::<i32>(net, &[Sum, Avg, BXor]);
    reduce_all::<bf16>(net, &[Sum]);
}

fn reduce_scatter_all<T: TestElem>(net: Net, ops: &'static [ReduceOp]) {
    sweep_sizes(net, &format!("reduce_scatter {}", T::DTYPE), move |size, rank, comm, f| {
        for (k, &rop) in ops.iter().enumerate() {
            for per in segment_counts(T::DTYPE.size()) {
                for layout in VIEW_LAYOUTS {
                    let what = format!("reduce_scatter {} {rop:?} size {size} per {per} {layout:?} rank {rank}", T::DTYPE);
                    let salt = (k * 100_000 + per) as u64;
                    let esz = T::DTYPE.size();
                    let whole = T::to_bytes(&inputs::<T>(rank, 0, per * size, salt, rop));
                    let mut input = Guarded::new(&whole, 1);
                    let mut pieces = separate(&whole, size, per * esz);
                    let mut out = Guarded::new(&vec![0xA5u8; per * esz], 2);
                    let blocks = match layout {
                        Layout::Separate => raws(&mut pieces),
                        _ => (0..size).map(|r| input.raw().sub(r * per * esz, per * esz)).collect::<Vec<_>>(),
                    };
                    let output = if layout == Layout::InPlace { blocks[rank] } else { out.raw() };
                    let o = reduction_with(OpKind::ReduceScatter, T::DTYPE, blocks, vec![output], rop);
                    f.op(run(&comm, vec![o]), &what)?;
                    let got = match layout {
                        Layout::InPlace => &input.data(f, &what)[rank * per * esz..(rank + 1) * per * esz],
                        _ => out.data(f, &what),
                    };
                    f.result(check_reduced::<T>(got, size, rank * per, salt, rop, FACTOR), &what);
                    let _ = joined(f, &pieces, &what);
                }
            }
        }
        Ok(())
    });
}

fn reduce_scatter_f32_i32_bf16(net: Net) {
    reduce_scatter_all::<f32>(net, &[Sum, Avg, Max, PreMulSum]);
    reduce_scatter_all::<i32>(net, &[Sum, Avg, BOr]);
    reduce_scatter_all::<bf16>(net, &[Sum]);
}

/// Dtypes for the data-movement collectives: several element sizes, and types that are moved
/// but never reduced.
const MOVE_DTYPES: [DType; 6] = [DType::Float32, DType::BFloat16, DType::Int64, DType::UInt8, DType::Float8E4M3FN, DType::Bytes];
const MOVE_COUNTS: [usize; 4] = [0, 1, 1001, 5000];

fn salt_of(parts: &[usize]) -> u64 {
    parts.iter().fold(0u64, |a, &p| mix(a ^ p as u64))
}

/// A point of a rooted data-movement sweep.
struct Rooted {
    /// The dtype's index in MOVE_DTYPES.
    d: usize,
    dtype: DType,
    n: usize,
    root: usize,
    /// Bytes per rank.
    len: usize,
    /// Whether the root's list of tensors is separate allocations (else views of one).
    separate: bool,
}

/// Every dtype of MOVE_DTYPES × count of `counts` × root of a group of `size`.
fn rooted_points(size: usize, counts: &[usize]) -> Vec<Rooted> {
    let mut points = Vec::new();
    for (d, dtype) in MOVE_DTYPES.into_iter().enumerate() {
        for &n in counts {
            for root in 0..size {
                points.push(Rooted { d, dtype, n, root, len: n * dtype.size(), separate: (n + root) % 2 == 1 });
            }
        }
    }
    points
}

impl Rooted {
    /// The point's name in a group of `size`.
    fn describe(&self, size: usize) -> String {
        format!("{} size {size} root {} n {} separate {}", self.dtype, self.root, self.n, self.separate)
    }

    /// The root's list of `size` tensors over the bytes of `whole`: separate copies (made into
    /// `pieces`) or views of `whole`; none on the other ranks.
    fn root_list(&self, rank: usize, size: usize, whole: &mut Guarded, pieces: &mut Vec<Guarded>) -> Vec<RawBuf> {
        match (rank == self.root, self.separate) {
            (false, _) => vec![],
            (true, true) => {
                *pieces = separate(whole.bytes(), size, self.len);
                raws(pieces)
            }
            (true, false) => (0..size).map(|r| whole.raw().sub(r * self.len, self.len)).collect(),
        }
    }

    /// What the root's list (see [`Rooted::root_list`]) holds now, with the guards checked.
    fn root_list_bytes(&self, f: &mut Failures, whole: &Guarded, pieces: &[Guarded], what: &str) -> Vec<u8> {
        if self.separate { joined(f, pieces, what) } else { whole.data(f, what).to_vec() }
    }
}

fn broadcast_every_root(net: Net) {
    sweep_sizes(net, "broadcast", move |size, rank, comm, f| {
        for Rooted { d, dtype, n, root, .. } in rooted_points(size, &[&MOVE_COUNTS[..], &[100_003]].concat()) {
            let what = format!("broadcast {dtype} size {size} root {root} n {n} rank {rank}");
            broadcast_point(f, &comm, rank, dtype, n, root, salt_of(&[1, d, n, root]), &what)?;
        }
        Ok(())
    });
}

fn allgather_out_of_place_and_in_place(net: Net) {
    sweep_sizes(net, "allgather", move |size, rank, comm, f| {
        for (d, dtype) in MOVE_DTYPES.into_iter().enumerate() {
            for n in MOVE_COUNTS {
                for layout in VIEW_LAYOUTS {
                    let what = format!("allgather {dtype} size {size} n {n} {layout:?} rank {rank}");
                    allgather_point(f, &comm, rank, size, dtype, n, layout, salt_of(&[2, d, n]), &what)?;
                }
            }
        }
        Ok(())
    });
}

fn gather_every_root(net: Net) {
    sweep_sizes(net, "gather", move |size, rank, comm, f| {
        for p in rooted_points(size, &MOVE_COUNTS) {
            let what = format!("gather {} rank {rank}", p.describe(size));
            let salt = salt_of(&[3, p.d, p.n, p.root]);
            let mut input = Guarded::new(&pattern(rank, salt, p.len), 1);
            let mut out = Guarded::new(&vec![0x5Au8; if rank == p.root { size * p.len } else { 0 }], 2);
            let mut pieces = vec![];
            let o = rooted_op(OpKind::Gather, p.dtype, vec![input.raw()], p.root_list(rank, size, &mut out, &mut pieces), p.root);
            f.op(run(&comm, vec![o]), &what)?;
            if rank == p.root {
                let got = p.root_list_bytes(f, &out, &pieces, &what);
                check_blocks(f, &got, size, salt, p.len, &what);
            }
            let bytes = input.data(f, &what);
            f.result(same_bytes(bytes, &pattern(rank, salt, p.len)), format!("{what}: input changed"));
        }
        Ok(())
    });
}

fn scatter_every_root(net: Net) {
    sweep_sizes(net, "scatter", move |size, rank, comm, f| {
        for p in rooted_points(size, &MOVE_COUNTS) {
            let what = format!("scatter {} rank {rank}", p.describe(size));
            let salt = salt_of(&[4, p.d, p.n, p.root]);
            let whole = pattern(p.root, salt, size * p.len);
            let mut input = Guarded::new(if rank == p.root { &whole } else { &[] }, 1);
            let mut out = Guarded::new(&vec![0x5Au8; p.len], 3);
            let mut pieces = vec![];
            let o = rooted_op(OpKind::Scatter, p.dtype, p.root_list(rank, size, &mut input, &mut pieces), vec![out.raw()], p.root);
            f.op(run(&comm, vec![o]), &what)?;
            let bytes = out.data(f, &what);
            f.result(same_bytes(bytes, &whole[rank * p.len..(rank + 1) * p.len]), format!("{what}: wrong block"));
            if rank == p.root {
                let after = p.root_list_bytes(f, &input, &pieces, &what);
                f.result(same_bytes(&after, &whole), format!("{what}: root input changed"));
            }
        }
        Ok(())
    });
}

/// Elements rank `src` sends rank `dst` in all-to-all case `case`.
fn a2a_len(case: usize, src: usize, dst: usize) -> usize {
    match case {
        0 => 0,                                                   // every pair empty
        1 => [0, 1, 37, 1500][(word(src, dst, 11) % 4) as usize], // mixed, zeros included
        2 => [0, 3, 0, 4097][(word(src, dst, 12) % 4) as usize],
        3 => {
            if src == dst {
                0
            } else {
                2000 + 13 * src + dst
            }
        } // only the self pair empty
        _ => {
            if src == dst {
                5
            } else {
                0
            }
        } // only the self pair non-empty
    }
}

fn alltoall_unequal_and_empty_pairs(net: Net) {
    let zero_pairs_seen = Arc::new(Mutex::new(0usize));
    let seen = zero_pairs_seen.clone();
    let mut failures = sizes_swept(net, "alltoall", move |size, rank, comm, f| {
        for dtype in [DType::Float32, DType::UInt8, DType::Int64] {
            for case in 0..5 {
                let what = format!("alltoall {dtype} size {size} case {case} rank {rank}");
                let esz = dtype.size();
                let salt = salt_of(&[5, case, esz]);
                let msg = |src: usize, dst: usize| pattern(src * 16 + dst, salt, a2a_len(case, src, dst) * esz);
                let mut ins: Vec<Vec<u8>> = (0..size).map(|dst| msg(rank, dst)).collect();
                let mut outs: Vec<Vec<u8>> = (0..size).map(|src| vec![0x5Au8; a2a_len(case, src, rank) * esz]).collect();
                let o = op_with(
                    OpKind::AllToAll,
                    dtype,
                    ins.iter_mut().map(|v| buf(v)).collect(),
                    outs.iter_mut().map(|v| buf(v)).collect(),
                );
                f.op(run(&comm, vec![o]), &what)?;
                for (src, got) in outs.iter().enumerate() {
                    f.result(same_bytes(got, &msg(src, rank)), format!("{what}: wrong message from rank {src}"));
                    if src != rank && got.is_empty() && case > 0 {
                        *seen.lock().unwrap() += 1;
                    }
                }
                for (dst, sent) in ins.iter().enumerate() {
                    f.result(same_bytes(sent, &msg(rank, dst)), format!("{what}: input for rank {dst} changed"));
                }
            }
        }
        Ok(())
    });
    failures.check(*zero_pairs_seen.lock().unwrap() > 0, || "no zero-length pair among mixed lengths".into());
    failures.finish(&format!("alltoall over {net:?}"));
}

/// No rank leaves a barrier before the last one has entered it (the last one enters late).
fn barrier_waits_for_everyone(net: Net) {
    let mut failures = Failures::new();
    for size in 1..=5 {
        let log = Arc::new(Mutex::new(Vec::new()));
        let log2 = log.clone();
        sweep_ranks(&mut failures, &format!("barrier size {size}"), size, cfg(net), LIMIT, move |rank, comm, _, f| {
            for it in 0..3 {
                if rank == (size - 1 + it) % size {
                    std::thread::sleep(Duration::from_millis(40));
                }
                let enter = Instant::now();
                f.op(
                    run(&comm, vec![barrier_op()]),
                    format!("barrier size {size} barrier {it} rank {rank}"),
                )?;
                log2.lock().unwrap().push((it, enter, Instant::now()));
            }
            Ok(())
        });
        let log = log.lock().unwrap();
        for it in 0..3 {
            // Only the ranks that got through the barrier (the others are failing points already).
            let last_enter = log.iter().filter(|e| e.0 == it).map(|e| e.1).max();
            let first_exit = log.iter().filter(|e| e.0 == it).map(|e| e.2).min();
            failures.check(first_exit >= last_enter, || format!("size {size} barrier {it}: a rank left before the last one entered"));
        }
    }
    failures.finish(&format!("barrier over {net:?}"));
}

/// One job with several collectives runs them in order; each takes a sequence number.
fn coalesced_job_of_collectives(net: Net) {
    sweep_sizes(net, "coalesced", move |size, rank, comm, f| {
        let what = format!("coalesced size {size} rank {rank}");
        let n = 1001;
        let mut ar = f32::to_bytes(&inputs::<f32>(rank, 0, n, 21, Sum));
        let root = size - 1;
        let mut bc = if rank == root { pattern(root, 22, 300) } else { vec![0; 300] };
        let mut ag_in = pattern(rank, 23, 64);
        let mut ag_out = vec![0u8; 64 * size];
        let mut rs_in = i32::to_bytes(&inputs::<i32>(rank, 0, 10 * size, 24, Sum));
        let mut rs_out = vec![0u8; 40];

        let mut o_ar = op_with(OpKind::AllReduce, DType::Float32, vec![], vec![buf(&mut ar)]);
        o_ar.reduce_op = Sum;
        let mut o_bc = op_with(OpKind::Broadcast, DType::UInt8, vec![], vec![buf(&mut bc)]);
        o_bc.root = root as i64;
        let o_ag = op_with(OpKind::AllGather, DType::UInt8, vec![buf(&mut ag_in)], views(&mut ag_out, size, 64));
        let o_b = barrier_op();
        let o_rs = op_with(OpKind::ReduceScatter, DType::Int32, views(&mut rs_in, size, 40), vec![buf(&mut rs_out)]);
        f.eq(comm.next_seq(), 0, format!("{what}: sequence number before"));
        f.op(run(&comm, vec![o_ar, o_bc, o_ag, o_b, o_rs]), &what)?;
        f.eq(comm.next_seq(), 5, format!("{what}: five collectives submitted"));

        f.result(check_reduced::<f32>(&ar, size, 0, 21, Sum, 1.0), format!("{what}: allreduce"));
        f.result(same_bytes(&bc, &pattern(root, 22, 300)), format!("{what}: broadcast"));
        check_blocks(f, &ag_out, size, 23, 64, &format!("{what}: allgather"));
        f.result(check_reduced::<i32>(&rs_out, size, rank * 10, 24, Sum, 1.0), format!("{what}: reduce_scatter"));
        Ok(())
    });
}

both_nets!(
    allreduce_f32,
    allreduce_f64,
    allreduce_bf16,
    allreduce_i32,
    allreduce_i64,
    allreduce_u8,
    allreduce_bool,
    allreduce_bf16_sum_rounds_once,
    allreduce_min_max_propagate_nan,
    reduce_every_root_f32,
    reduce_every_root_int_and_bf16,
    reduce_scatter_f32_i32_bf16,
    broadcast_every_root,
    allgather_out_of_place_and_in_place,
    gather_every_root,
    scatter_every_root,
    alltoall_unequal_and_empty_pairs,
    barrier_waits_for_everyone,
    coalesced_job_of_collectives,
);

//! Concurrency: two groups (two MemoryStores, different rank orders) driven from the same
//! threads with jobs interleaved and submitted in opposite orders on alternate threads (one
//! shared progress queue would deadlock); hundreds of async jobs submitted back-to-back, whose
//! completions must arrive in submission order; world size 5 in two groups at once, with many
//! more threads than this machine's cores. Each runs over TCP (`::tcp`) and shared memory (`::shm`),
//! and reports every failing check (tests/common/failures.rs), named by thread or rank and iteration.

#[macro_use]
mod common;
use common::*;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use xccl_rs::{CommError, Communicator, Completion, Config, DType, MemoryStore, Op, OpKind, ReduceOp};

const LIMIT: Duration = Duration::from_secs(60);

fn cfg(net: Net) -> Config {
    net_config(net, Duration::from_secs(20), 4096)
}

fn allreduce<T: TestElem>(data: &mut [u8], rop: ReduceOp) -> Op {
    let mut o = op_with(OpKind::AllReduce, T::DTYPE, vec![], vec![buf(data)]);
    o.reduce_op = rop;
    o
}

/// Waits for a job's completion: an error, or none within 30 s (a hang), stops the sweep.
fn wait(f: &mut Failures, rx: mpsc::Receiver<Result<Completion, CommError>>, what: &str) -> Result<(), Stop> {
    let r = rx.recv_timeout(Duration::from_secs(30)).unwrap_or_else(|_| Err(CommError::io("no completion (hang)")));
    f.op(r, what)?;
    Ok(())
}

/// A test on `size` threads, each in two groups (two stores): thread t is rank t of group A and
/// rank `rank_in_b(t)` of group B. Runs `f(t, a, b, rank in b, failures)` on each thread, then
/// reports every failing point under `what`.
fn on_two_groups(
    net: Net,
    what: &str,
    size: usize,
    rank_in_b: fn(usize, usize) -> usize,
    f: impl Fn(usize, &Communicator, &Communicator, usize, &mut Failures) -> Result<(), Stop> + Send + Sync + 'static,
) {
    let (store_a, store_b) = (MemoryStore::new(), MemoryStore::new());
    let mut failures = Failures::new();
    sweep_threads(&mut failures, what, size, LIMIT, move |t, _, fl| {
        let a = fl.op(Communicator::new(&store_a, t, size, cfg(net)), format!("thread {t}: group A"))?;
        let rb = rank_in_b(t, size);
        let b = fl.op(Communicator::new(&store_b, rb, size, cfg(net)), format!("thread {t}: group B"))?;
        f(t, &a, &b, rb, fl)
    });
    failures.finish(&format!("{what} over {net:?}"));
}

/// Group A has thread t as rank t, group B as rank size-1-t. Each iteration submits two jobs
/// to each group without waiting; even threads submit A's first, odd threads B's first.
fn two_groups_from_the_same_threads(net: Net) {
    let size = 4;
    on_two_groups(net, "two groups from the same threads", size, |t, size| size - 1 - t, move |t, a, b, rb, f| {
        for it in 0..12 {
            let what = format!("thread {t} iteration {it}");
            let (n, salt, root) = (20_000 + 37 * it, it as u64, it % size);
            let mut a_red = f32::to_bytes(&inputs::<f32>(t, 0, n, salt, ReduceOp::Sum));
            let mut a_bc = if t == root { pattern(root, salt, 30_000) } else { vec![0u8; 30_000] };
            let mut b_in = pattern(rb, salt, 5000);
            let mut b_out = vec![0u8; 5000 * size];
            let mut b_red = i32::to_bytes(&inputs::<i32>(rb, 0, 3001, salt, ReduceOp::Max));

            let mut bc = op_with(OpKind::Broadcast, DType::UInt8, vec![], vec![buf(&mut a_bc)]);
            bc.root = root as i64;
            let a_ops = [allreduce::<f32>(&mut a_red, ReduceOp::Sum), bc];
            let ag = op_with(OpKind::AllGather, DType::UInt8, vec![buf(&mut b_in)], views(&mut b_out, size, 5000));
            let b_ops = [ag, allreduce::<i32>(&mut b_red, ReduceOp::Max)];
            let jobs = |c: &Communicator, ops: &[Op; 2]| (submit_async(c, vec![ops[0].clone()]), submit_async(c, vec![ops[1].clone()]));
            let (ra, rb_) = if t % 2 == 0 {
                let ra = jobs(a, &a_ops);
                (ra, jobs(b, &b_ops))
            } else {
                let rb_ = jobs(b, &b_ops);
                (jobs(a, &a_ops), rb_)
            };
            wait(f, ra.0, &format!("{what}: A allreduce"))?;
            wait(f, ra.1, &format!("{what}: A broadcast"))?;
            wait(f, rb_.0, &format!("{what}: B allgather"))?;
            wait(f, rb_.1, &format!("{what}: B allreduce"))?;

            f.result(check_reduced::<f32>(&a_red, size, 0, salt, ReduceOp::Sum, 1.0), format!("{what}: A allreduce"));
            f.result(same_bytes(&a_bc, &pattern(root, salt, 30_000)), format!("{what}: A broadcast"));
            check_blocks(f, &b_out, size, salt, 5000, &format!("{what}: B allgather"));
            f.result(check_reduced::<i32>(&b_red, size, 0, salt, ReduceOp::Max, 1.0), format!("{what}: B allreduce"));
        }
        Ok(())
    });
}

/// 300 small jobs submitted without waiting: completions arrive in submission order and every
/// result is right.
fn many_async_jobs_complete_in_order(net: Net) {
    const JOBS: usize = 300;
    let size = 3;
    let mut failures = Failures::new();
    sweep_ranks(&mut failures, "async jobs", size, cfg(net), LIMIT, move |rank, comm, _, f| {
        let kind = |j: usize| if j % 10 == 9 { OpKind::Broadcast } else { OpKind::AllReduce };
        let rop = |j: usize| if j % 2 == 1 { ReduceOp::Max } else { ReduceOp::Sum };
        let n = |j: usize| 1 + j % 8;
        let root = |j: usize| j % size;
        let mut bufs: Vec<Vec<u8>> = (0..JOBS)
            .map(|j| match kind(j) {
                OpKind::Broadcast if rank == root(j) => pattern(rank, j as u64, 100),
                OpKind::Broadcast => vec![0u8; 100],
                _ => f32::to_bytes(&inputs::<f32>(rank, 0, n(j), j as u64, rop(j))),
            })
            .collect();
        let order = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = mpsc::channel();
        for (j, b) in bufs.iter_mut().enumerate() {
            let o = if kind(j) == OpKind::Broadcast {
                let mut o = op_with(OpKind::Broadcast, DType::UInt8, vec![], vec![buf(b)]);
                o.root = root(j) as i64;
                o
            } else {
                allreduce::<f32>(b, rop(j))
            };
            let (order, tx) = (order.clone(), tx.clone());
            let submitted = comm.submit(
                vec![o],
                Box::new(move |r| {
                    order.lock().unwrap().push(j);
                    let _ = tx.send((j, r));
                }),
            );
            f.op(submitted, format!("rank {rank} job {j}: submit"))?;
        }
        f.eq(comm.next_seq(), JOBS as u64, format!("rank {rank}: sequence number after submitting"));
        for k in 0..JOBS {
            let Ok((j, r)) = rx.recv_timeout(Duration::from_secs(30)) else {
                f.fail(format!("rank {rank}: completion {k} did not arrive within 30 s (hang)"));
                return Err(Stop);
            };
            f.op(r, format!("rank {rank} job {j}"))?;
        }
        f.eq(&*order.lock().unwrap(), &(0..JOBS).collect::<Vec<_>>(), format!("rank {rank}: completion order"));
        for (j, b) in bufs.iter().enumerate() {
            let what = format!("rank {rank} job {j}");
            if kind(j) == OpKind::Broadcast {
                f.result(same_bytes(b, &pattern(root(j), j as u64, 100)), format!("{what}: broadcast"));
            } else {
                f.result(check_reduced::<f32>(b, size, 0, j as u64, rop(j), 1.0), &what);
            }
        }
        Ok(())
    });
    failures.finish(&format!("many async jobs over {net:?}"));
}

/// Five ranks in two groups at once (10 communicators, 10 progress threads and 5 test threads
/// on a 2-core machine): all-reduce, reduce-scatter, all-to-all and barriers stay correct.
fn world_size_5_oversubscribed(net: Net) {
    on_two_groups(net, "world size 5 oversubscribed", 5, |t, size| (t + 2) % size, move |t, a, b, rb, f| {
        let size = 5;
        for it in 0..8 {
            let what = format!("thread {t} iteration {it}");
            let salt = 1000 + it as u64;
            let n = 10_007;
            let per = 2_003;
            let mut a_red = i64::to_bytes(&inputs::<i64>(t, 0, n, salt, ReduceOp::Sum));
            let mut b_in = f32::to_bytes(&inputs::<f32>(rb, 0, per * size, salt, ReduceOp::Avg));
            let mut b_out = vec![0u8; per * 4];
            let ra = submit_async(a, vec![allreduce::<i64>(&mut a_red, ReduceOp::Sum)]);
            let rs = op_with(OpKind::ReduceScatter, DType::Float32, views(&mut b_in, size, per * 4), vec![buf(&mut b_out)]);
            let rs = {
                let mut rs = rs;
                rs.reduce_op = ReduceOp::Avg;
                rs
            };
            let rbj = submit_async(b, vec![rs]);
            wait(f, ra, &format!("{what}: A allreduce"))?;
            wait(f, rbj, &format!("{what}: B reduce_scatter"))?;
            f.result(check_reduced::<i64>(&a_red, size, 0, salt, ReduceOp::Sum, 1.0), format!("{what}: A allreduce"));
            f.result(check_reduced::<f32>(&b_out, size, rb * per, salt, ReduceOp::Avg, 1.0), format!("{what}: B reduce_scatter"));

            // All-to-all on B (pair lengths vary with the iteration) while A runs a barrier.
            let len = |src: usize, dst: usize| (src * 3 + dst * 5 + it) % 4 * 500;
            let mut ins: Vec<Vec<u8>> = (0..size).map(|d| pattern(rb * 8 + d, salt, len(rb, d))).collect();
            let mut outs: Vec<Vec<u8>> = (0..size).map(|s| vec![0u8; len(s, rb)]).collect();
            let a2a = op_with(OpKind::AllToAll, DType::UInt8, ins.iter_mut().map(|v| buf(v)).collect(), outs.iter_mut().map(|v| buf(v)).collect());
            let rbj = submit_async(b, vec![a2a]);
            f.op(run(a, vec![barrier_op()]), format!("{what}: A barrier"))?;
            wait(f, rbj, &format!("{what}: B alltoall"))?;
            for (s, got) in outs.iter().enumerate() {
                f.result(same_bytes(got, &pattern(s * 8 + rb, salt, len(s, rb))), format!("{what}: B alltoall from rank {s}"));
            }
        }
        Ok(())
    });
}

both_nets!(
    two_groups_from_the_same_threads,
    many_async_jobs_complete_in_order,
    world_size_5_oversubscribed,
);

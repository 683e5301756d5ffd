//! Failures: size and dtype mismatches, different collectives, an absent rank (timeout), a dead
//! rank (dropped communicator), `Communicator::abort`, a rank that never joins the group, and
//! layout validation in `submit`. Each must give an Err on every rank, promptly (elapsed times
//! are asserted), never a hang or wrong data; and the next job on a failed communicator must
//! fail at once, naming the first error. Tests of collectives run over TCP (`::tcp`) and
//! shared memory (`::shm`). Every failing check is reported (tests/common/failures.rs), each
//! named by its case and rank; a loop over cases reports every failing case.

#[macro_use]
mod common;
use common::*;
use std::time::Duration;
use xccl_rs::{Communicator, Config, DType, ErrorKind, MemoryStore, Op, OpKind, ReduceOp};

const LIMIT: Duration = Duration::from_secs(30);

fn cfg(net: Net, timeout_s: u64) -> Config {
    net_config(net, Duration::from_secs(timeout_s), 4096)
}

fn allreduce(dtype: DType, data: &mut [u8]) -> Op {
    op_with(OpKind::AllReduce, dtype, vec![], vec![buf(data)])
}

/// Runs the failure case `f` on `size` ranks, adding its failing points to `failures`; `case`
/// names it (and prefixes a rank that panics or hangs).
fn case_on_ranks(
    failures: &mut Failures,
    case: &str,
    size: usize,
    cfg: Config,
    f: impl Fn(usize, Communicator, &RankBarrier, &mut Failures) -> Result<(), Stop> + Send + Sync + 'static,
) {
    sweep_ranks(failures, case, size, cfg, LIMIT, f)
}

/// A test of one case: [`case_on_ranks`], then the report of `test`.
fn one_case(
    test: &str,
    case: &str,
    size: usize,
    cfg: Config,
    f: impl Fn(usize, Communicator, &RankBarrier, &mut Failures) -> Result<(), Stop> + Send + Sync + 'static,
) {
    let mut failures = Failures::new();
    case_on_ranks(&mut failures, case, size, cfg, f);
    failures.finish(test);
}

const SECOND: Duration = Duration::from_secs(1);

/// A test of one case on 4 ranks with a 2 s timeout in which rank `away` takes no part:
/// `f(rank, comm, timeout, failures)` runs on the others, then every rank meets at the thread
/// barrier.
fn without_rank(net: Net, test: &str, case: &str, away: usize, f: impl Fn(usize, &Communicator, Duration, &mut Failures) + Send + Sync + 'static) {
    let timeout = Duration::from_secs(2);
    one_case(test, case, 4, net_config(net, timeout, 4096), move |rank, comm, barrier, fl| {
        if rank != away {
            f(rank, &comm, timeout, fl);
        }
        barrier.wait();
        Ok(())
    });
}

fn allreduce_size_mismatch(net: Net) {
    let mut failures = Failures::new();
    for size in [2, 3] {
        case_on_ranks(&mut failures, &format!("size {size}"), size, cfg(net, 3), move |rank, comm, barrier, f| {
            let what = format!("size {size} rank {rank}");
            let n = if rank == 1 { 5001 } else { 5000 };
            let mut data = f32::to_bytes(&vec![1.0; n]);
            let (r, took) = timed(&comm, vec![allreduce(DType::Float32, &mut data)]);
            if let Some(e) = expect_err(f, r, &what) {
                f.check(e.message.contains("size mismatch") || e.message.contains("elements"), || format!("{what}: {}", e.message));
                next_job_fails_at_once(f, &comm, &e, &what);
            }
            within(f, took, SECOND, &what);
            barrier.wait();
            Ok(())
        });
    }
    failures.finish(&format!("allreduce size mismatch over {net:?}"));
}

fn allreduce_dtype_mismatch(net: Net) {
    let mut failures = Failures::new();
    for size in [2, 3] {
        case_on_ranks(&mut failures, &format!("size {size}"), size, cfg(net, 3), move |rank, comm, barrier, f| {
            let what = format!("size {size} rank {rank}");
            // The same 4000 bytes: 1000 float32, or 500 float64 on rank 1.
            let mut data = f32::to_bytes(&vec![1.0; 1000]);
            let dtype = if rank == 1 { DType::Float64 } else { DType::Float32 };
            fails_within_then_next_job(f, &comm, vec![allreduce(dtype, &mut data)], &["dtype"], SECOND, &what);
            barrier.wait();
            Ok(())
        });
    }
    failures.finish(&format!("allreduce dtype mismatch over {net:?}"));
}

/// Rank 1 reduces with MAX where the others use SUM (all-reduce, reduce, reduce-scatter):
/// every rank fails naming the reduce op, instead of each computing its own thing.
fn reduce_op_mismatch(net: Net) {
    let mut failures = Failures::new();
    for (kind, size) in [(OpKind::AllReduce, 2), (OpKind::AllReduce, 3), (OpKind::Reduce, 3), (OpKind::ReduceScatter, 3)] {
        case_on_ranks(&mut failures, &format!("{kind:?} size {size}"), size, cfg(net, 3), move |rank, comm, barrier, f| {
            let what = format!("{kind:?} size {size} rank {rank}");
            let mut data = f32::to_bytes(&vec![1.0; 3000]);
            let mut out = f32::to_bytes(&vec![0.0; 1000]);
            let mut o = match kind {
                OpKind::ReduceScatter => op_with(kind, DType::Float32, views(&mut data, size, 4000), vec![buf(&mut out)]),
                _ => op_with(kind, DType::Float32, vec![], vec![buf(&mut data)]),
            };
            o.reduce_op = if rank == 1 { ReduceOp::Max } else { ReduceOp::Sum };
            fails_within(f, &comm, vec![o], &["reduce op"], 2 * SECOND, &what);
            barrier.wait();
            Ok(())
        });
    }
    failures.finish(&format!("reduce op mismatch over {net:?}"));
}

/// Collectives that do not match: rank 0's broadcast of the 64 bytes `data` from `root`, or
/// another rank's all-gather of 64 bytes each into `gathered` (64 bytes per rank).
fn broadcast_on_rank_0(rank: usize, root: usize, data: &mut [u8], gathered: &mut [u8]) -> Op {
    if rank == 0 {
        rooted_op(OpKind::Broadcast, DType::UInt8, vec![], vec![buf(data)], root)
    } else {
        let ranks = gathered.len() / 64;
        op_with(OpKind::AllGather, DType::UInt8, vec![buf(data)], views(gathered, ranks, 64))
    }
}

/// Rank 0 in a broadcast it receives in (root 1), rank 1 in an all-gather: both fail, naming
/// both collectives.
fn different_collectives_on_different_ranks(net: Net) {
    let test = format!("different collectives on different ranks over {net:?}");
    one_case(&test, "broadcast vs allgather", 2, cfg(net, 3), move |rank, comm, barrier, f| {
        let (mut a, mut b) = ([0u8; 64], [0u8; 128]);
        let o = broadcast_on_rank_0(rank, 1, &mut a, &mut b);
        fails_within_then_next_job(f, &comm, vec![o], &["broadcast", "allgather"], SECOND, &format!("rank {rank}"));
        barrier.wait();
        Ok(())
    });
}

/// Rank 0 is the broadcast root (it only sends), ranks 1 and 2 are in an all-gather. The root's
/// small sends may complete before anyone looks at them, so its broadcast may return Ok; it must
/// learn of the failure no later than its next job. Ranks 1 and 2 fail at once.
fn different_collectives_sending_root(net: Net) {
    let test = format!("different collectives, sending root, over {net:?}");
    one_case(&test, "sending root vs allgather", 3, cfg(net, 3), move |rank, comm, barrier, f| {
        let (mut a, mut b) = ([0u8; 64], [0u8; 192]);
        let o = broadcast_on_rank_0(rank, 0, &mut a, &mut b);
        let what = format!("rank {rank}");
        let (r, took) = timed(&comm, vec![o]);
        within(f, took, SECOND, &what);
        if rank != 0 {
            expect_err_mentioning(f, r, &["broadcast", "allgather"], &what);
        }
        fails_within(f, &comm, vec![barrier_op()], &[], SECOND, &format!("{what}: barrier after mismatched collectives"));
        barrier.wait();
        Ok(())
    });
}

/// A broadcast root still sending a large tensor learns of a receiver's size mismatch at once.
fn large_broadcast_root_learns_of_receiver_failure(net: Net) {
    let test = format!("large broadcast root learns of receiver failure over {net:?}");
    one_case(&test, "large broadcast", 2, cfg(net, 3), move |rank, comm, barrier, f| {
        let n = if rank == 0 { 8 << 20 } else { (8 << 20) + 1 };
        let mut a = vec![7u8; n];
        let o = op_with(OpKind::Broadcast, DType::UInt8, vec![], vec![buf(&mut a)]);
        fails_within(f, &comm, vec![o], &["size mismatch"], SECOND, &format!("rank {rank}"));
        barrier.wait();
        Ok(())
    });
}

/// Rank 2 never calls the all-reduce: the others time out naming it, and their next job fails
/// at once. (Ranks 0, 1, 3 may report their own timeout or a peer's abort quoting it.)
fn absent_rank_times_out_naming_it(net: Net) {
    let test = format!("absent rank times out naming it over {net:?}");
    without_rank(net, &test, "rank 2 absent", 2, |rank, comm, timeout, f| {
        let what = format!("rank {rank}");
        let mut data = f32::to_bytes(&[1.0; 100]);
        let (r, took) = timed(comm, vec![allreduce(DType::Float32, &mut data)]);
        if let Some(e) = expect_err_mentioning(f, r, &["timed out", "not heard from: [2]"], &what) {
            next_job_fails_at_once(f, comm, &e, &what);
        }
        f.check(took >= timeout - Duration::from_millis(100), || format!("{what}: gave up after {took:?}, before the timeout"));
        within(f, took, timeout + Duration::from_millis(1500), &what);
    });
}

/// Rank 3 is stuck (alive, but it never calls the reduce); the root, rank 0, waits for it in the
/// reduce, and ranks 1 and 2, whose part of the reduce was only to send, wait for the root in the
/// next broadcast. The root started late, so ranks 1 and 2 time out first, on the root; still,
/// every rank must name rank 3, the stuck one, not the root (TCP: the timeout round; shared
/// memory: the root is seen to wait for rank 3).
fn stuck_rank_named_by_ranks_waiting_for_its_waiter(net: Net) {
    let test = format!("stuck rank named by ranks waiting for its waiter over {net:?}");
    without_rank(net, &test, "rank 3 stuck", 3, |rank, comm, timeout, f| {
        if rank == 0 {
            std::thread::sleep(Duration::from_millis(400));
        }
        let mut a = f32::to_bytes(&[1.0; 100]);
        let mut b = f32::to_bytes(&[2.0; 100]);
        let reduce = op_with(OpKind::Reduce, DType::Float32, vec![], vec![buf(&mut a)]);
        let broadcast = op_with(OpKind::Broadcast, DType::Float32, vec![], vec![buf(&mut b)]);
        let (r, took) = timed(comm, vec![reduce]);
        let r = if r.is_ok() { timed(comm, vec![broadcast]).0 } else { r };
        let what = format!("rank {rank}");
        expect_err_mentioning(f, r, &["timed out", "[3]"], &what);
        within(f, took, timeout + Duration::from_millis(2500), &what);
    });
}

/// `set_timeout` applies to the next operations.
fn set_timeout_shortens_the_wait(net: Net) {
    one_case(&format!("set_timeout shortens the wait over {net:?}"), "set_timeout", 2, cfg(net, 20), move |rank, comm, barrier, f| {
        if rank == 0 {
            comm.set_timeout(Duration::from_millis(700));
            let (r, took) = timed(&comm, vec![barrier_op()]);
            expect_err_mentioning(f, r, &["timed out", "700 ms", "not heard from: [1]"], "rank 0: set_timeout, barrier alone");
            f.check(took >= Duration::from_millis(650) && took < Duration::from_millis(2500), || {
                format!("rank 0: set_timeout: took {took:?}")
            });
        }
        barrier.wait();
        Ok(())
    });
}

/// Rank 2 dies (drops its communicator) while ranks 0 and 1 are in an all-reduce: they fail
/// with "closed" long before the timeout, and so does their next job.
fn dead_rank_during_allreduce(net: Net) {
    one_case(&format!("dead rank during allreduce over {net:?}"), "rank 2 dies", 3, cfg(net, 3), move |rank, comm, barrier, f| {
        peer_dies_during_allreduce(f, rank, 2, comm, barrier, &["closed"], &format!("rank {rank}"))
    });
}

/// Rank 2 died before the all-reduce was even submitted (ranks 0 and 1 first exchange a
/// message, during which rank 2 is only watched): the first job that needs it fails at once.
fn dead_rank_before_allreduce(net: Net) {
    one_case(&format!("dead rank before allreduce over {net:?}"), "rank 2 dead", 3, cfg(net, 3), move |rank, comm, barrier, f| {
        if rank == 2 {
            drop(comm);
            barrier.wait();
            return Ok(());
        }
        barrier.wait();
        std::thread::sleep(Duration::from_millis(50));
        let what = format!("rank {rank}");
        let mut m = vec![rank as u8; 1000];
        f.op(run(&comm, vec![zero_to_one(rank, 0, 0, DType::UInt8, buf(&mut m))]), format!("{what}: a message between live ranks"))?;
        f.result(same_bytes(&m, &[0u8; 1000]), format!("{what}: message"));
        let mut data = f32::to_bytes(&[1.0; 10]);
        fails_within(f, &comm, vec![allreduce(DType::Float32, &mut data)], &["closed"], SECOND, &what);
        Ok(())
    });
}

/// `abort` on rank 1 while ranks 0 and 2 are in an all-gather: they fail with its message well
/// before the timeout; rank 1's own next job fails with it too.
fn abort_reaches_peers_quickly(net: Net) {
    one_case(&format!("abort reaches peers quickly over {net:?}"), "rank 1 aborts", 3, cfg(net, 3), move |rank, comm, barrier, f| {
        let what = format!("rank {rank}");
        if rank == 1 {
            std::thread::sleep(Duration::from_millis(100));
            comm.abort(OpKind::AllGather, "local problem xyz");
            fails_within(f, &comm, vec![barrier_op()], &["xyz"], Duration::from_millis(500), &what);
        } else {
            let mut a = pattern(rank, 1, 256);
            let mut b = vec![0u8; 3 * 256];
            let o = op_with(OpKind::AllGather, DType::UInt8, vec![buf(&mut a)], views(&mut b, 3, 256));
            fails_within_then_next_job(f, &comm, vec![o], &["xyz"], SECOND, &what);
        }
        barrier.wait();
        Ok(())
    });
}

/// A rank that never creates its communicator: the others' `Communicator::new` fails within the
/// timeout, naming it.
#[test]
fn rank_that_never_joins() {
    let store = MemoryStore::new();
    let timeout = Duration::from_millis(1000);
    let handles: Vec<_> = (0..2)
        .map(|rank| {
            let store = store.clone();
            std::thread::spawn(move || {
                let t = std::time::Instant::now();
                let r = Communicator::new(&store, rank, 3, config(timeout, 4096));
                (r.err().map(|e| e.message), t.elapsed())
            })
        })
        .collect();
    let mut failures = Failures::new();
    for (rank, h) in handles.into_iter().enumerate() {
        let (e, took) = h.join().unwrap();
        match e {
            None => failures.fail(format!("rank {rank}: joined a group whose rank 2 never came")),
            Some(e) => {
                failures.check(e.contains('2') && e.contains("timed out"), || format!("rank {rank}: {e}"));
            }
        }
        failures.check(took < timeout + Duration::from_millis(1500), || format!("rank {rank}: took {took:?}"));
    }
    failures.finish("a rank that never joins");
}

/// Layout errors come back from `submit` itself, as InvalidArgument with a message naming the
/// rank, the op and the problem; nothing is queued and the communicator stays usable.
#[test]
fn submit_validates_layout() {
    one_case("submit validates layout", "layout errors", 2, config(Duration::from_secs(5), 4096), move |rank, comm, _, f| {
        let mut x = vec![0u8; 16];
        let mut y = vec![0u8; 16];
        let mut z = vec![0u8; 12];
        let (bx, by, bz) = (buf(&mut x), buf(&mut y), buf(&mut z));
        let f32op = |kind, inputs, outputs| op_with(kind, DType::Float32, inputs, outputs);
        let with = |mut o: Op, f: &dyn Fn(&mut Op)| {
            f(&mut o);
            o
        };
        let red = |dtype, r: ReduceOp| with(op_with(OpKind::AllReduce, dtype, vec![], vec![bx]), &|o| o.reduce_op = r);
        let peer = 1 - rank as i64;
        let cases: Vec<(Op, &[&str])> = vec![
            (f32op(OpKind::AllReduce, vec![], vec![]), &["allreduce", "expected 0 input and 1 output buffers, got 0 and 0"]),
            (f32op(OpKind::AllReduce, vec![], vec![bx, by]), &["allreduce", "expected 0 input and 1 output", "got 0 and 2"]),
            (f32op(OpKind::AllGather, vec![bx], vec![by]), &["allgather", "expected 1 input and 2 output"]),
            (f32op(OpKind::AllGather, vec![bx], vec![by, bz]), &["allgather", "output for rank 1 has 3 elements, expected 4"]),
            (f32op(OpKind::ReduceScatter, vec![bx, bz], vec![by]), &["reduce_scatter", "input for rank 1 has 3 elements"]),
            (f32op(OpKind::AllToAll, vec![bx], vec![by, bz]), &["alltoall", "expected 2 input and 2 output"]),
            (
                f32op(
                    OpKind::AllToAll,
                    if rank == 0 { vec![bx, by] } else { vec![by, bx] },
                    if rank == 0 { vec![bz, by] } else { vec![by, bz] },
                ),
                &["alltoall", "sends itself 4 elements but expects 3"],
            ),
            (f32op(OpKind::Barrier, vec![bx], vec![]), &["barrier", "expected 0 input and 0 output"]),
            (with(f32op(OpKind::Gather, vec![bx], vec![by, by]), &|o| o.root = peer), &["gather", "expected 1 input and 0 output"]),
            (with(f32op(OpKind::Scatter, vec![bx], vec![by]), &|o| o.root = rank as i64), &["scatter", "expected 2 input and 1 output"]),
            (with(f32op(OpKind::Broadcast, vec![], vec![bx]), &|o| o.root = 2), &["broadcast", "root 2 is not a rank of this group of 2"]),
            (with(f32op(OpKind::Reduce, vec![], vec![bx]), &|o| o.root = -1), &["reduce", "root -1"]),
            (with(f32op(OpKind::Send, vec![bx], vec![]), &|o| o.root = rank as i64), &["send", "itself"]),
            (with(f32op(OpKind::Recv, vec![], vec![bx]), &|o| o.root = rank as i64), &["recv", "itself"]),
            (with(f32op(OpKind::Send, vec![bx], vec![]), &|o| o.root = 5), &["send", "peer 5 is not a rank"]),
            (with(f32op(OpKind::Send, vec![], vec![bx]), &|o| o.root = peer), &["send", "expected 1 input and 0 output"]),
            (f32op(OpKind::RecvAnySource, vec![], vec![]), &["recv (any source)", "expected 0 input and 1 output"]),
            (red(DType::Float32, ReduceOp::BAnd), &["allreduce", "BAND", "float32"]),
            (red(DType::BFloat16, ReduceOp::BXor), &["BXOR", "bfloat16"]),
            (red(DType::Float8E4M3FN, ReduceOp::Sum), &["allreduce", "float8_e4m3fn", "not supported"]),
            (red(DType::Float8E5M2, ReduceOp::Max), &["float8_e5m2", "not supported"]),
            (
                with(op_with(OpKind::Reduce, DType::Float8E4M3FNUZ, vec![], vec![bx]), &|o| o.root = 0),
                &["reduce", "float8_e4m3fnuz", "not supported"],
            ),
            (op_with(OpKind::ReduceScatter, DType::Float8E5M2FNUZ, vec![bx, bx], vec![bx]), &["reduce_scatter", "float8_e5m2fnuz"]),
            (red(DType::Bytes, ReduceOp::Sum), &["bytes", "not supported"]),
            (red(DType::Bool, ReduceOp::Avg), &["AVG", "bool"]),
            (red(DType::Int32, ReduceOp::PreMulSum), &["PREMUL_SUM", "int32"]),
            (f32op(OpKind::AllReduce, vec![], vec![buf(&mut [0u8; 6])]), &["allreduce", "6 bytes", "not a whole number"]),
        ];
        for (i, (o, needles)) in cases.into_iter().enumerate() {
            let desc = format!("case {i} ({:?} {} {:?} root {}, expecting {needles:?}) rank {rank}", o.kind, o.dtype, o.reduce_op, o.root);
            let Some(e) = expect_err(f, run(&comm, vec![o]), &desc) else { continue };
            f.check(e.kind == ErrorKind::InvalidArgument, || format!("{desc}: kind {:?}, expected InvalidArgument: {}", e.kind, e.message));
            f.check(e.to_string().starts_with(&format!("xccl_rs: rank {rank}: ")), || {
                format!("{desc}: the message should start by naming the rank: {e}")
            });
            mentions(f, &e, needles, &desc);
        }
        // A job with one bad op is refused whole.
        let good = f32op(OpKind::Barrier, vec![], vec![]);
        let bad = f32op(OpKind::AllReduce, vec![], vec![]);
        expect_err(f, run(&comm, vec![good, bad]), &format!("job with a bad op, rank {rank}"));
        f.eq(comm.next_seq(), 0, format!("rank {rank}: rejected jobs must not take sequence numbers"));

        // Nothing was queued: a real collective still works and sees sequence number 0 on both.
        let mut v = f32::to_bytes(&[rank as f32 + 1.0; 4]);
        let what = format!("allreduce after layout errors, rank {rank}");
        f.op(run(&comm, vec![allreduce(DType::Float32, &mut v)]), &what)?;
        f.eq(f32::from_bytes(&v), vec![3.0; 4], &what);
        f.eq(comm.next_seq(), 1, format!("{what}: sequence number after"));
        Ok(())
    });
}

both_nets!(
    allreduce_size_mismatch,
    allreduce_dtype_mismatch,
    reduce_op_mismatch,
    different_collectives_on_different_ranks,
    different_collectives_sending_root,
    large_broadcast_root_learns_of_receiver_failure,
    absent_rank_times_out_naming_it,
    stuck_rank_named_by_ranks_waiting_for_its_waiter,
    set_timeout_shortens_the_wait,
    dead_rank_during_allreduce,
    dead_rank_before_allreduce,
    abort_reaches_peers_quickly,
);

/// A rank whose part of an operation only sends (a broadcast root, a point-to-point sender)
/// must still see an error in that operation when a receiver rejects its data, as
/// docs/usage.md promises for point-to-point ("or both fail") and as every other rank does.
fn sender_fails_with_its_receiver(net: Net, what: Which) {
    let test = format!("sender fails with its receiver ({what:?}) over {net:?}");
    one_case(&test, &format!("{what:?}"), 2, cfg(net, 3), move |rank, comm, barrier, f| {
        let (mut a, mut b) = ([0u8; 64], [0u8; 128]);
        let o = match what {
            Which::BroadcastRoot => broadcast_on_rank_0(rank, 0, &mut a, &mut b),
        };
        let (r, took) = timed(&comm, vec![o]);
        barrier.wait();
        let what = format!("{what:?}: rank {rank}");
        expect_err(f, r, &what);
        within(f, took, SECOND, &what);
        Ok(())
    });
}

#[derive(Clone, Copy, Debug)]
enum Which {
    /// Rank 0 is the root of a small broadcast, rank 1 is in an all-gather.
    BroadcastRoot,
}

/// A small send completes once handed to the connection (like gloo); when the receiver rejects
/// it (tag mismatch), the receiver fails at once and the sender at its next operation, quoting
/// the receiver's error.
#[test]
fn sender_of_mismatched_p2p_message_fails_at_its_next_op() {
    let test = "sender of a mismatched p2p message fails at its next op";
    one_case(test, "tag mismatch", 2, cfg(Net::Tcp, 3), move |rank, comm, barrier, f| {
        let mut a = vec![0u8; 64];
        let r = run(&comm, vec![zero_to_one(rank, 5, 6, DType::UInt8, buf(&mut a))]);
        if rank == 1 {
            expect_err_mentioning(f, r, &["tag"], "rank 1: the receiver of a tag mismatch");
        }
        barrier.wait();
        let what = format!("rank {rank}: the operation after a rejected message");
        let next = op_with(OpKind::Barrier, DType::UInt8, vec![], vec![]);
        if let Some(e) = fails_within(f, &comm, vec![next], &[], SECOND, &what)
            && rank == 0
        {
            mentions(f, &e, &["tag"], &format!("{what}: the receiver's error"));
        }
        Ok(())
    });
}

#[test]
fn broadcast_root_fails_when_peer_is_in_another_collective_tcp() {
    sender_fails_with_its_receiver(Net::Tcp, Which::BroadcastRoot);
}

#[test]
fn broadcast_root_fails_when_peer_is_in_another_collective_shm() {
    sender_fails_with_its_receiver(Net::Shm, Which::BroadcastRoot);
}

/// Ranks disagree about a broadcast's root (each names itself): every rank must fail. Over TCP
/// each rank only sends, so no rank notices; the data silently stays unbroadcast.
fn broadcast_root_mismatch(net: Net) {
    one_case(&format!("broadcast root mismatch over {net:?}"), "root mismatch", 2, cfg(net, 3), move |rank, comm, barrier, f| {
        let mut a = vec![rank as u8; 64];
        let mut o = op_with(OpKind::Broadcast, DType::UInt8, vec![], vec![buf(&mut a)]);
        o.root = rank as i64;
        let (r, took) = timed(&comm, vec![o]);
        barrier.wait();
        let what = format!("rank {rank}: broadcast naming itself root");
        expect_err_mentioning(f, r, &["root"], &what);
        within(f, took, SECOND, &what);
        Ok(())
    });
}

#[test]

fn broadcast_root_mismatch_tcp() {
    broadcast_root_mismatch(Net::Tcp);
}

#[test]
fn broadcast_root_mismatch_shm() {
    broadcast_root_mismatch(Net::Shm);
}

/// Creating a communicator with a rank outside the group fails at once.
#[test]
fn bad_rank_or_size_in_new() {
    let store = MemoryStore::new();
    let mut failures = Failures::new();
    for (rank, size) in [(3, 3), (0, 0), (7, 2)] {
        let what = format!("rank {rank} of a group of {size}");
        let Some(e) = Communicator::new(&store, rank, size, config(Duration::from_secs(1), 4096)).err() else {
            failures.fail(format!("{what}: expected an error, got a communicator"));
            continue;
        };
        failures
            .check(e.kind == ErrorKind::InvalidArgument, || format!("{what}: kind {:?}, expected InvalidArgument: {}", e.kind, e.message));
        failures.check(e.message.contains(&format!("rank {rank}")), || format!("{what}: the error should name the rank: {}", e.message));
    }
    failures.finish("bad rank or size in Communicator::new");
}

/// After `shutdown`, `submit` fails instead of queueing work nobody will run.
#[test]
fn submit_after_shutdown_fails() {
    one_case("submit after shutdown fails", "shutdown", 2, config(Duration::from_secs(3), 4096), move |rank, comm, barrier, f| {
        barrier.wait();
        comm.shutdown();
        comm.shutdown();
        expect_err_mentioning(f, run(&comm, vec![barrier_op()]), &["shut down"], &format!("rank {rank}: submit after shutdown"));
        Ok(())
    });
}

//! Test harness: N ranks as threads, connected through one in-memory store, each with its own
//! communicator over real loopback TCP.
//!
//! Sweeps report every failing point, not only the first: checks record into a [`Failures`]
//! (failures.rs), ranks run through [`sweep_ranks`] (each rank's points gathered in rank order;
//! a rank that panics or hangs is a point too), and the test ends with `failures.finish(..)`.

#![allow(dead_code)]

use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

mod failures;
pub use failures::*;
mod points;
#[allow(unused_imports)] // only the data-movement sweeps use them
pub use points::*;

use xccl_rs::config::TransportChoice;
use xccl_rs::{CommError, Communicator, Completion, Config, DType, MemoryStore, Op, OpKind, RawBuf, ReduceOp};

pub fn config(timeout: Duration, round_bytes: usize) -> Config {
    Config { round_bytes, socket_host: Some("127.0.0.1".into()), ..Config::with_timeout(timeout) }
}

/// Submits one job and waits for it.
pub fn run(comm: &Communicator, ops: Vec<Op>) -> Result<Completion, CommError> {
    let (tx, rx) = mpsc::channel();
    comm.submit(
        ops,
        Box::new(move |r| {
            let _ = tx.send(r);
        }),
    )?;
    rx.recv().expect("completion callback dropped")
}

pub fn buf(v: &mut [u8]) -> RawBuf {
    RawBuf::from_slice(v)
}

pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

pub fn bytes_f32(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

/// Deterministic test data for (rank, index): small integers so f32 sums are exact.
pub fn value(rank: usize, i: usize) -> f32 {
    (((rank * 7919 + i * 104729) % 97) as f32) - 48.0
}

pub fn op(kind: OpKind, dtype: DType) -> Op {
    Op::new(kind, dtype)
}

pub fn reduce_op(kind: OpKind, r: ReduceOp) -> Op {
    let mut o = Op::new(kind, DType::Float32);
    o.reduce_op = r;
    o
}

// ---------------------------------------------------------------------------------------------
// Harness with a hang guard, a shared barrier and an owned communicator.

use std::sync::{Condvar, Mutex, PoisonError};
use std::time::Instant;

/// A plain thread barrier of all ranks that fails instead of hanging: once a rank has finished
/// (returned or panicked), every rank waiting at a barrier, or arriving at one, panics naming
/// it, since that barrier can never complete.
pub struct RankBarrier {
    size: usize,
    state: Mutex<BarrierState>,
    cv: Condvar,
}

struct BarrierState {
    arrived: usize,
    generation: u64,
    finished: Vec<usize>,
}

impl RankBarrier {
    pub fn new(size: usize) -> RankBarrier {
        RankBarrier { size, state: Mutex::new(BarrierState { arrived: 0, generation: 0, finished: Vec::new() }), cv: Condvar::new() }
    }

    /// Blocks until every rank has called `wait` as often as this one.
    pub fn wait(&self) {
        let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let generation = s.generation;
        s.arrived += 1;
        if s.arrived == self.size {
            s.arrived = 0;
            s.generation += 1;
            self.cv.notify_all();
            return;
        }
        // The generation first: a rank that passed this barrier and then finished does not fail it.
        while s.generation == generation {
            if !s.finished.is_empty() {
                let finished = s.finished.clone();
                drop(s);
                panic!("thread barrier: rank(s) {finished:?} finished without reaching it (see their failures)");
            }
            s = self.cv.wait(s).unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Rank `rank`'s thread is done: it will never wait again.
    fn finished(&self, rank: usize) {
        self.state.lock().unwrap_or_else(PoisonError::into_inner).finished.push(rank);
        self.cv.notify_all();
    }
}

/// Runs `f(rank, comm, barrier)` on `size` threads, each with its own communicator (owned, so a
/// rank can drop it to simulate its death); `barrier` is a thread barrier of all ranks.
/// Panics (naming the ranks) if any rank is still running after `limit`: a hang is a failure,
/// never a stuck test. Every rank's panic is re-raised here, with its message.
pub fn spawn_ranks<T: Send + 'static>(
    size: usize,
    cfg: Config,
    limit: Duration,
    f: impl Fn(usize, Communicator, &RankBarrier) -> T + Send + Sync + 'static,
) -> Vec<T> {
    spawn_ranks_in(MemoryStore::new(), size, cfg, limit, f)
}

/// [`spawn_ranks`] over a given store.
pub fn spawn_ranks_in<T: Send + 'static>(
    store: Arc<MemoryStore>,
    size: usize,
    cfg: Config,
    limit: Duration,
    f: impl Fn(usize, Communicator, &RankBarrier) -> T + Send + Sync + 'static,
) -> Vec<T> {
    spawn_ranks_with(store, vec![cfg; size], limit, f)
}

/// [`spawn_ranks`] over a given store, with one config per rank (e.g. per-rank `host_id`).
pub fn spawn_ranks_with<T: Send + 'static>(
    store: Arc<MemoryStore>,
    cfgs: Vec<Config>,
    limit: Duration,
    f: impl Fn(usize, Communicator, &RankBarrier) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let size = cfgs.len();
    collect_ranks(launch_ranks(store, cfgs, f), size, limit)
}

/// [`spawn_ranks`] that never panics: each rank's result, or why it has none (it panicked, or
/// did not finish within `limit`).
pub fn try_spawn_ranks<T: Send + 'static>(
    size: usize,
    cfg: Config,
    limit: Duration,
    f: impl Fn(usize, Communicator, &RankBarrier) -> T + Send + Sync + 'static,
) -> Vec<Result<T, String>> {
    try_spawn_ranks_with(MemoryStore::new(), vec![cfg; size], limit, f)
}

/// [`try_spawn_ranks`] over a given store, with one config per rank.
pub fn try_spawn_ranks_with<T: Send + 'static>(
    store: Arc<MemoryStore>,
    cfgs: Vec<Config>,
    limit: Duration,
    f: impl Fn(usize, Communicator, &RankBarrier) -> T + Send + Sync + 'static,
) -> Vec<Result<T, String>> {
    let size = cfgs.len();
    gather_ranks(launch_ranks(store, cfgs, f), size, limit)
}

/// Runs a sweep on `size` ranks: `f(rank, comm, barrier, failures)` records that rank's failing
/// points (a [`Stop`] ends its sweep early, which drops its communicator, so that the other
/// ranks' operations fail instead of waiting for it). Every rank's points are added to
/// `failures` in rank order; a rank that panics or does not finish within `limit` is a failing
/// point too, named by `what` and its rank.
pub fn sweep_ranks(
    failures: &mut Failures,
    what: &str,
    size: usize,
    cfg: Config,
    limit: Duration,
    f: impl Fn(usize, Communicator, &RankBarrier, &mut Failures) -> Result<(), Stop> + Send + Sync + 'static,
) {
    sweep_ranks_with(failures, what, MemoryStore::new(), vec![cfg; size], limit, f)
}

/// [`sweep_ranks`] over a given store, with one config per rank.
pub fn sweep_ranks_with(
    failures: &mut Failures,
    what: &str,
    store: Arc<MemoryStore>,
    cfgs: Vec<Config>,
    limit: Duration,
    f: impl Fn(usize, Communicator, &RankBarrier, &mut Failures) -> Result<(), Stop> + Send + Sync + 'static,
) {
    let results = {
        let what = what.to_string();
        try_spawn_ranks_with(store, cfgs, limit, move |rank, comm, barrier| {
            sweep(format!("{what} rank {rank}"), |fl| f(rank, comm, barrier, fl))
        })
    };
    for rank_failures in failures.ranks(results, what).into_iter().flatten() {
        failures.merge(rank_failures);
    }
}

/// Starts one thread per config; each sends `(rank, f's result or its panic message)`, and
/// marks itself finished on the barrier first.
fn launch_ranks<T: Send + 'static>(
    store: Arc<MemoryStore>,
    cfgs: Vec<Config>,
    f: impl Fn(usize, Communicator, &RankBarrier) -> T + Send + Sync + 'static,
) -> mpsc::Receiver<(usize, Result<T, String>)> {
    let size = cfgs.len();
    let f = Arc::new(f);
    let barrier = Arc::new(RankBarrier::new(size));
    let (tx, rx) = mpsc::channel();
    for (rank, cfg) in cfgs.into_iter().enumerate() {
        let (store, f, barrier, tx) = (store.clone(), f.clone(), barrier.clone(), tx.clone());
        std::thread::Builder::new()
            .name(format!("test-rank-{rank}"))
            .spawn(move || {
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    let comm = Communicator::new(&store, rank, size, cfg).expect("communicator");
                    f(rank, comm, &barrier)
                }));
                barrier.finished(rank);
                let _ = tx.send((rank, r.map_err(|p| format!("panicked: {}", panic_text(p)))));
            })
            .expect("spawn rank thread");
    }
    rx
}

/// Receives `(rank, result)` from `size` threads within `limit`, in rank order; a rank that did
/// not report by then has `Err` saying so (a hang). Never panics.
pub fn gather_ranks<T>(rx: mpsc::Receiver<(usize, Result<T, String>)>, size: usize, limit: Duration) -> Vec<Result<T, String>> {
    let deadline = Instant::now() + limit;
    let mut out: Vec<Option<Result<T, String>>> = (0..size).map(|_| None).collect();
    for _ in 0..size {
        match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok((rank, r)) => out[rank] = Some(r),
            Err(_) => break,
        }
    }
    out.into_iter().map(|r| r.unwrap_or_else(|| Err(format!("did not finish within {limit:?} (hang)")))).collect()
}

/// [`gather_ranks`], then a panic listing every rank that panicked or hung, if any did.
pub fn collect_ranks<T>(rx: mpsc::Receiver<(usize, Result<T, String>)>, size: usize, limit: Duration) -> Vec<T> {
    let results = gather_ranks(rx, size, limit);
    let failed: Vec<String> = results.iter().enumerate().filter_map(|(r, x)| x.as_ref().err().map(|e| format!("rank {r} {e}"))).collect();
    assert!(failed.is_empty(), "{} of {size} ranks failed:\n  {}", failed.len(), failed.join("\n  "));
    results.into_iter().map(|r| r.ok().unwrap()).collect()
}

/// Submits one job without waiting; the receiver yields its result.
pub fn submit_async(comm: &Communicator, ops: Vec<Op>) -> mpsc::Receiver<Result<Completion, CommError>> {
    let (tx, rx) = mpsc::channel();
    comm.submit(
        ops,
        Box::new(move |r| {
            let _ = tx.send(r);
        }),
    )
    .expect("submit");
    rx
}

/// Runs one job and returns its result with the time it took.
pub fn timed(comm: &Communicator, ops: Vec<Op>) -> (Result<Completion, CommError>, Duration) {
    let t = Instant::now();
    let r = run(comm, ops);
    (r, t.elapsed())
}

/// The error of a job that must fail; an Ok is a failing point (named by `what`), and None.
pub fn expect_err(f: &mut Failures, r: Result<Completion, CommError>, what: &str) -> Option<CommError> {
    match r {
        Ok(c) => {
            f.fail(format!("{what}: expected an error, got Ok({c:?})"));
            None
        }
        Err(e) => Some(e),
    }
}

/// Checks that `e`'s message mentions every needle (one failing point listing the missing ones).
pub fn mentions(f: &mut Failures, e: &CommError, needles: &[&str], what: &str) -> bool {
    let missing: Vec<&&str> = needles.iter().filter(|n| !e.message.contains(**n)).collect();
    f.check(missing.is_empty(), || format!("{what}: the error should mention {missing:?}: {}", e.message))
}

/// [`expect_err`], then [`mentions`]: whether `r` failed with a message mentioning every needle.
pub fn expect_err_mentioning(f: &mut Failures, r: Result<Completion, CommError>, needles: &[&str], what: &str) -> Option<CommError> {
    let e = expect_err(f, r, what)?;
    mentions(f, &e, needles, what);
    Some(e)
}

/// An op that only synchronizes.
pub fn barrier_op() -> Op {
    op_with(OpKind::Barrier, DType::Float32, vec![], vec![])
}

/// A send of `b` to `peer` with `tag`.
pub fn send_to(peer: usize, tag: i64, dtype: DType, b: RawBuf) -> Op {
    let mut o = op_with(OpKind::Send, dtype, vec![b], vec![]);
    o.root = peer as i64;
    o.tag = tag;
    o
}

/// A receive into `b` from `peer` with `tag`.
pub fn recv_from(peer: usize, tag: i64, dtype: DType, b: RawBuf) -> Op {
    let mut o = op_with(OpKind::Recv, dtype, vec![], vec![b]);
    o.root = peer as i64;
    o.tag = tag;
    o
}

/// Rank 0's half of one message from rank 0 to rank 1 (a send with `send_tag`), or rank 1's (a
/// receive with `recv_tag`), over `b`.
pub fn zero_to_one(rank: usize, send_tag: i64, recv_tag: i64, dtype: DType, b: RawBuf) -> Op {
    if rank == 0 { send_to(1, send_tag, dtype, b) } else { recv_from(0, recv_tag, dtype, b) }
}

/// Checks that something that took `took` took less than `limit` (a failing point named by
/// `what` if not).
pub fn within(f: &mut Failures, took: Duration, limit: Duration, what: &str) -> bool {
    f.check(took < limit, || format!("{what}: took {took:?}"))
}

/// Runs the job `ops`, which must fail within `limit` with an error mentioning every needle;
/// the error, if it failed.
pub fn fails_within(
    f: &mut Failures,
    comm: &Communicator,
    ops: Vec<Op>,
    needles: &[&str],
    limit: Duration,
    what: &str,
) -> Option<CommError> {
    let (r, took) = timed(comm, ops);
    within(f, took, limit, what);
    expect_err_mentioning(f, r, needles, what)
}

/// The job after a failure (`first`) must fail at once, quoting the first error.
pub fn next_job_fails_at_once(f: &mut Failures, comm: &Communicator, first: &CommError, what: &str) {
    let (r, took) = timed(comm, vec![barrier_op()]);
    if let Some(e) = expect_err(f, r, &format!("{what}: the job after a failure")) {
        f.check(e.message.contains(&first.message), || format!("{what}: {:?} should quote the first error {:?}", e.message, first.message));
    }
    f.check(took < Duration::from_millis(500), || format!("{what}: the job after a failure took {took:?}"));
}

/// [`fails_within`], then [`next_job_fails_at_once`].
pub fn fails_within_then_next_job(f: &mut Failures, comm: &Communicator, ops: Vec<Op>, needles: &[&str], limit: Duration, what: &str) {
    if let Some(e) = fails_within(f, comm, ops, needles, limit, what) {
        next_job_fails_at_once(f, comm, &e, what);
    }
}

/// A dead-peer case: rank `dead` drops its communicator (closing its connections) shortly after
/// the others entered an all-reduce, which must fail for them within 1.5 s mentioning every
/// needle, and so must their next job; then every rank meets at the thread barrier.
pub fn peer_dies_during_allreduce(
    f: &mut Failures,
    rank: usize,
    dead: usize,
    comm: Communicator,
    barrier: &RankBarrier,
    needles: &[&str],
    what: &str,
) -> Result<(), Stop> {
    if rank == dead {
        std::thread::sleep(Duration::from_millis(150));
        drop(comm);
    } else {
        let mut data = f32_bytes(&vec![1.0; 100_000]);
        let o = op_with(OpKind::AllReduce, DType::Float32, vec![], vec![buf(&mut data)]);
        fails_within_then_next_job(f, &comm, vec![o], needles, Duration::from_millis(1500), what);
    }
    barrier.wait();
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Deterministic inputs.

/// splitmix64 finalizer.
pub fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A pseudo-random word for (rank, index, salt).
pub fn word(rank: usize, i: usize, salt: u64) -> u64 {
    mix(mix(salt.wrapping_mul(0x1_0000_0001) ^ rank as u64) ^ (i as u64).wrapping_mul(0xD6E8_FEB8_6659_FD93))
}

/// `len` deterministic bytes that differ between ranks and salts.
pub fn pattern(rank: usize, salt: u64, len: usize) -> Vec<u8> {
    (0..len).map(|i| word(rank, i, salt) as u8).collect()
}

/// An op of `kind` and `dtype` with the given inputs and outputs.
pub fn op_with(kind: OpKind, dtype: DType, inputs: Vec<RawBuf>, outputs: Vec<RawBuf>) -> Op {
    let mut o = Op::new(kind, dtype);
    o.inputs = inputs;
    o.outputs = outputs;
    o
}

/// [`op_with`] for a rooted collective (broadcast, reduce, gather, scatter) with root `root`.
pub fn rooted_op(kind: OpKind, dtype: DType, inputs: Vec<RawBuf>, outputs: Vec<RawBuf>, root: usize) -> Op {
    let mut o = op_with(kind, dtype, inputs, outputs);
    o.root = root as i64;
    o
}

/// The PREMUL_SUM factor of the reduction tests (references use the same).
pub const FACTOR: f64 = 0.25;

/// A reduction op of `kind` and `dtype` with reduce op `rop` (and FACTOR for PREMUL_SUM).
pub fn reduction_with(kind: OpKind, dtype: DType, inputs: Vec<RawBuf>, outputs: Vec<RawBuf>, rop: ReduceOp) -> Op {
    let mut o = op_with(kind, dtype, inputs, outputs);
    o.reduce_op = rop;
    o.premul_factor = FACTOR;
    o
}

/// `parts` consecutive views of `len` bytes each over `b`.
pub fn views(b: &mut [u8], parts: usize, len: usize) -> Vec<RawBuf> {
    assert_eq!(b.len(), parts * len);
    let whole = buf(b);
    (0..parts).map(|p| whole.sub(p * len, len)).collect()
}

// ---------------------------------------------------------------------------------------------
// Element types with reference reductions (written from the torch/NCCL definitions, not from
// the crate's kernels).

pub use half::bf16;

pub trait TestElem: Copy + PartialEq + std::fmt::Debug + Send + Sync + 'static {
    const DTYPE: DType;
    /// Rank `rank`'s input at index `i`. Float values are chosen so that the reference result
    /// is exact whatever the order of combination (few significant bits, narrow exponent range).
    fn input(rank: usize, i: usize, salt: u64, op: ReduceOp) -> Self;
    fn to_bytes(v: &[Self]) -> Vec<u8>;
    /// The values of `b` (whole elements; [`TestElem::check_bytes`] says whether they are valid).
    fn from_bytes(b: &[u8]) -> Vec<Self>;
    /// Ok if every element of `b` is a valid encoding (only bool has invalid ones).
    fn check_bytes(_b: &[u8]) -> Result<(), String> {
        Ok(())
    }
    /// The reduction of `vals` (one per rank, in rank order) under `op`; `factor` is PREMUL_SUM's.
    fn reference(op: ReduceOp, vals: &[Self], factor: f64) -> Self;
    /// Equality of results: bitwise for floats.
    fn same(a: Self, b: Self) -> bool;
}

macro_rules! float_elem {
    ($t:ty, $dt:expr) => {
        impl TestElem for $t {
            const DTYPE: DType = $dt;
            fn input(rank: usize, i: usize, salt: u64, op: ReduceOp) -> $t {
                let w = word(rank, i, salt);
                if op == ReduceOp::Product {
                    // ±(1 + m/4)·2^e, e in -1..=1: a product of five has at most 15 significant bits.
                    let m = 1.0 + (w % 4) as $t / 4.0;
                    let e = [0.5, 1.0, 2.0][((w >> 8) % 3) as usize] as $t;
                    if (w >> 16) & 1 == 1 { -m * e } else { m * e }
                } else {
                    // Quarters in [-100, 100): sums of any order are exact.
                    ((w % 800) as i64 - 400) as $t / 4.0
                }
            }
            fn to_bytes(v: &[$t]) -> Vec<u8> {
                v.iter().flat_map(|x| x.to_le_bytes()).collect()
            }
            fn from_bytes(b: &[u8]) -> Vec<$t> {
                b.chunks_exact(size_of::<$t>()).map(|c| <$t>::from_le_bytes(c.try_into().unwrap())).collect()
            }
            fn reference(op: ReduceOp, vals: &[$t], factor: f64) -> $t {
                let sum = || vals.iter().copied().fold(0.0 as $t, |a, b| a + b);
                match op {
                    ReduceOp::Sum => sum(),
                    ReduceOp::Avg => sum() / vals.len() as $t,
                    ReduceOp::Product => vals.iter().copied().fold(1.0 as $t, |a, b| a * b),
                    ReduceOp::Min => vals.iter().copied().fold(<$t>::INFINITY, <$t>::min),
                    ReduceOp::Max => vals.iter().copied().fold(<$t>::NEG_INFINITY, <$t>::max),
                    // torch: every input is multiplied by the factor, then summed.
                    ReduceOp::PreMulSum => vals.iter().map(|&v| v * factor as $t).fold(0.0 as $t, |a, b| a + b),
                    other => panic!("{other:?} is not defined for floats"),
                }
            }
            fn same(a: $t, b: $t) -> bool {
                a.to_bits() == b.to_bits()
            }
        }
    };
}
float_elem!(f32, DType::Float32);
float_elem!(f64, DType::Float64);

impl TestElem for bf16 {
    const DTYPE: DType = DType::BFloat16;
    fn input(rank: usize, i: usize, salt: u64, op: ReduceOp) -> bf16 {
        let w = word(rank, i, salt);
        if op == ReduceOp::Product {
            bf16::from_f32(f32::input(rank, i, salt, op))
        } else {
            // Eighths in [-128, 128) rounded to bf16's 8 bits: every f32 sum of five is exact,
            // but most need more than 8 bits, so rounding once differs from rounding per step.
            bf16::from_f32(((w % 2048) as i64 - 1024) as f32 / 8.0)
        }
    }
    fn to_bytes(v: &[bf16]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect()
    }
    fn from_bytes(b: &[u8]) -> Vec<bf16> {
        b.chunks_exact(2).map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]]))).collect()
    }
    fn reference(op: ReduceOp, vals: &[bf16], factor: f64) -> bf16 {
        // Accumulate in f32 (exact here), round to bf16 once.
        let f: Vec<f32> = vals.iter().map(|v| v.to_f32()).collect();
        bf16::from_f32(f32::reference(op, &f, factor))
    }
    fn same(a: bf16, b: bf16) -> bool {
        a.to_bits() == b.to_bits()
    }
}

macro_rules! int_elem {
    ($t:ty, $dt:expr) => {
        impl TestElem for $t {
            const DTYPE: DType = $dt;
            fn input(rank: usize, i: usize, salt: u64, _op: ReduceOp) -> $t {
                // The full range: sums and products wrap, AVG sees negative odd sums.
                word(rank, i, salt) as $t
            }
            fn to_bytes(v: &[$t]) -> Vec<u8> {
                v.iter().flat_map(|x| x.to_le_bytes()).collect()
            }
            fn from_bytes(b: &[u8]) -> Vec<$t> {
                b.chunks_exact(size_of::<$t>()).map(|c| <$t>::from_le_bytes(c.try_into().unwrap())).collect()
            }
            fn reference(op: ReduceOp, vals: &[$t], _factor: f64) -> $t {
                let sum = || vals.iter().fold(0 as $t, |a, &b| a.wrapping_add(b));
                match op {
                    ReduceOp::Sum => sum(),
                    // NCCL: the wrapped sum divided by the world size, truncating toward zero.
                    ReduceOp::Avg => (sum() as i128 / vals.len() as i128) as $t,
                    ReduceOp::Product => vals.iter().fold(1 as $t, |a, &b| a.wrapping_mul(b)),
                    ReduceOp::Min => *vals.iter().min().unwrap(),
                    ReduceOp::Max => *vals.iter().max().unwrap(),
                    ReduceOp::BAnd => vals.iter().fold(!0, |a, &b| a & b),
                    ReduceOp::BOr => vals.iter().fold(0, |a, &b| a | b),
                    ReduceOp::BXor => vals.iter().fold(0, |a, &b| a ^ b),
                    ReduceOp::PreMulSum => panic!("PREMUL_SUM is not defined for integers"),
                }
            }
            fn same(a: $t, b: $t) -> bool {
                a == b
            }
        }
    };
}
int_elem!(i32, DType::Int32);
int_elem!(i64, DType::Int64);
int_elem!(u8, DType::UInt8);

impl TestElem for bool {
    const DTYPE: DType = DType::Bool;
    fn input(rank: usize, i: usize, salt: u64, _op: ReduceOp) -> bool {
        // Mostly true, so that AND over five ranks is often true as well.
        word(rank, i, salt) % 5 != 0
    }
    fn to_bytes(v: &[bool]) -> Vec<u8> {
        v.iter().map(|&x| x as u8).collect()
    }
    fn from_bytes(b: &[u8]) -> Vec<bool> {
        b.iter().map(|&x| x != 0).collect()
    }
    fn check_bytes(b: &[u8]) -> Result<(), String> {
        each_of(b.len(), "bool result bytes", |k| (b[k] > 1).then(|| format!("byte {k} is {}, not 0 or 1", b[k])))
    }
    fn reference(op: ReduceOp, vals: &[bool], _factor: f64) -> bool {
        match op {
            ReduceOp::Sum | ReduceOp::Max | ReduceOp::BOr => vals.iter().any(|&v| v),
            ReduceOp::Product | ReduceOp::Min | ReduceOp::BAnd => vals.iter().all(|&v| v),
            ReduceOp::BXor => vals.iter().filter(|&&v| v).count() % 2 == 1,
            other => panic!("{other:?} is not defined for bool"),
        }
    }
    fn same(a: bool, b: bool) -> bool {
        a == b
    }
}

/// Rank `rank`'s inputs `[start, start + n)` for a reduction case.
pub fn inputs<T: TestElem>(rank: usize, start: usize, n: usize, salt: u64, op: ReduceOp) -> Vec<T> {
    (start..start + n).map(|i| T::input(rank, i, salt, op)).collect()
}

/// The expected reduction at index `i` over ranks `0..size`.
pub fn expected<T: TestElem>(size: usize, i: usize, salt: u64, op: ReduceOp, factor: f64) -> T {
    let vals: Vec<T> = (0..size).map(|r| T::input(r, i, salt, op)).collect();
    T::reference(op, &vals, factor)
}

/// Rank `rank`'s `n` inputs of a reduction case, as a guarded buffer `misalign` bytes off.
pub fn guarded_inputs<T: TestElem>(rank: usize, n: usize, salt: u64, op: ReduceOp, misalign: usize) -> Guarded {
    Guarded::new(&T::to_bytes(&inputs::<T>(rank, 0, n, salt, op)), misalign)
}

/// Checks that `got` holds every rank's `len`-byte block in rank order, block r being
/// `pattern(r, salt, len)` (a failing point per wrong block, named by `what` and its rank).
pub fn check_blocks(f: &mut Failures, got: &[u8], size: usize, salt: u64, len: usize, what: &str) {
    for r in 0..size {
        f.result(same_bytes(&got[r * len..(r + 1) * len], &pattern(r, salt, len)), format!("{what}: wrong block from rank {r}"));
    }
}

/// Compares the elements of `got` (bytes of T) with `expected(index start + k)` for every k;
/// Err says how many are wrong, and the first and the last of them.
pub fn check_reduced<T: TestElem>(got: &[u8], size: usize, start: usize, salt: u64, op: ReduceOp, factor: f64) -> Result<(), String> {
    T::check_bytes(got)?;
    let got = T::from_bytes(got);
    each_element(got.len(), |k| {
        let want: T = expected(size, start + k, salt, op, factor);
        (!T::same(got[k], want)).then(|| format!("element {} is {:?}, expected {want:?}", start + k, got[k]))
    })
}

/// Runs `f(thread, barrier)` on `size` plain threads (they create their own communicators),
/// with the hang guard of [`spawn_ranks`].
pub fn spawn_threads<T: Send + 'static>(
    size: usize,
    limit: Duration,
    f: impl Fn(usize, &RankBarrier) -> T + Send + Sync + 'static,
) -> Vec<T> {
    collect_ranks(launch_threads(size, f), size, limit)
}

/// [`sweep_ranks`] on plain threads: `f(thread, barrier, failures)` creates its own
/// communicators; a thread that panics or does not finish is a failing point named by `what`.
pub fn sweep_threads(
    failures: &mut Failures,
    what: &str,
    size: usize,
    limit: Duration,
    f: impl Fn(usize, &RankBarrier, &mut Failures) -> Result<(), Stop> + Send + Sync + 'static,
) {
    let name = what.to_string();
    let results =
        gather_ranks(launch_threads(size, move |t, barrier| sweep(format!("{name} thread {t}"), |fl| f(t, barrier, fl))), size, limit);
    for thread_failures in failures.ranks(results, what).into_iter().flatten() {
        failures.merge(thread_failures);
    }
}

fn launch_threads<T: Send + 'static>(
    size: usize,
    f: impl Fn(usize, &RankBarrier) -> T + Send + Sync + 'static,
) -> mpsc::Receiver<(usize, Result<T, String>)> {
    let f = Arc::new(f);
    let barrier = Arc::new(RankBarrier::new(size));
    let (tx, rx) = mpsc::channel();
    for t in 0..size {
        let (f, barrier, tx) = (f.clone(), barrier.clone(), tx.clone());
        std::thread::Builder::new()
            .name(format!("test-thread-{t}"))
            .spawn(move || {
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(t, &barrier)));
                barrier.finished(t);
                let _ = tx.send((t, r.map_err(|p| format!("panicked: {}", panic_text(p)))));
            })
            .expect("spawn thread");
    }
    rx
}

// ---------------------------------------------------------------------------------------------
// Transports: the collective algorithms exist twice (TCP and shared memory), so collective tests
// run over both.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Net {
    /// Forced TCP over loopback, with the given (small) segment size.
    Tcp,
    /// The default choice, which is shared memory when every rank is on this host; small slots
    /// (4 KiB) so that multi-block paths run, and the one-shot all-reduce up to 1 KiB.
    Shm,
}

pub fn net_config(net: Net, timeout: Duration, round_bytes: usize) -> Config {
    let base = config(timeout, round_bytes);
    match net {
        // Pipeline chunks (pipeline.rs) of 32 KiB: the largest test sizes run as several
        // chunks, the smaller ones (every multi-round path of a segment) in one.
        Net::Tcp => Config { transport: TransportChoice::Tcp, pipeline_chunk_bytes: 32 << 10, ..base },
        // Three threads per rank with 64-byte pieces, so that the split copies and reductions
        // of large blocks run on these small blocks too; chunks of two slots. Every copy-out
        // step with streaming stores (stream_copy.rs), which the default keeps for large ones.
        Net::Shm => Config {
            streaming_store_bytes: Some(0),
            transport: TransportChoice::Auto,
            shm_slot_bytes: 4096,
            shm_oneshot_bytes: 1024,
            threads: 3,
            thread_min_bytes: 64,
            pipeline_chunk_bytes: 8192,
            ..base
        },
    }
}

/// `both_nets!(f)` turns `fn f(net: Net)` into the tests `f::tcp` and `f::shm`.
#[allow(unused_macros)]
macro_rules! both_nets {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            #[test]
            fn tcp() {
                super::$name(super::Net::Tcp)
            }
            #[test]
            fn shm() {
                super::$name(super::Net::Shm)
            }
        }
    )*};
}

// ---------------------------------------------------------------------------------------------
// Guarded buffers: separate allocations, optionally misaligned, with guard bytes on both sides
// so that a write outside the buffer is caught.

const GUARD: u8 = 0xE7;
const GUARD_LEN: usize = 16;

pub struct Guarded {
    v: Vec<u8>,
    off: usize,
    len: usize,
}

impl Guarded {
    /// A copy of `data`, starting `misalign` bytes past a 16-byte boundary of its allocation.
    pub fn new(data: &[u8], misalign: usize) -> Guarded {
        let off = GUARD_LEN + misalign;
        let mut v = vec![GUARD; off + data.len() + GUARD_LEN];
        v[off..off + data.len()].copy_from_slice(data);
        Guarded { v, off, len: data.len() }
    }

    pub fn raw(&mut self) -> RawBuf {
        buf(&mut self.v[self.off..self.off + self.len])
    }

    /// The contents, unchecked.
    pub fn bytes(&self) -> &[u8] {
        &self.v[self.off..self.off + self.len]
    }

    /// Ok if no guard byte changed.
    pub fn intact(&self) -> Result<(), String> {
        let (before, rest) = self.v.split_at(self.off);
        let after = &rest[self.len..];
        let ok = before[before.len() - GUARD_LEN..].iter().chain(after).all(|&b| b == GUARD);
        if ok { Ok(()) } else { Err(format!("a write outside a buffer of {} bytes (guard bytes changed)", self.len)) }
    }

    /// The contents, with the guards checked: a changed guard is a failing point named by `what`.
    pub fn data(&self, f: &mut Failures, what: &str) -> &[u8] {
        f.result(self.intact(), what);
        self.bytes()
    }
}

/// `parts` separate guarded buffers holding consecutive `len`-byte pieces of `whole` (a list of
/// tensors, as c10d's list APIs pass them), each misaligned differently.
pub fn separate(whole: &[u8], parts: usize, len: usize) -> Vec<Guarded> {
    assert_eq!(whole.len(), parts * len);
    (0..parts).map(|p| Guarded::new(&whole[p * len..(p + 1) * len], p % 4)).collect()
}

pub fn raws(g: &mut [Guarded]) -> Vec<RawBuf> {
    g.iter_mut().map(|g| g.raw()).collect()
}

/// The pieces joined back together, with each piece's guards checked (see [`Guarded::data`]).
pub fn joined(f: &mut Failures, g: &[Guarded], what: &str) -> Vec<u8> {
    g.iter().enumerate().flat_map(|(p, g)| g.data(f, &format!("{what}: piece {p}")).to_vec()).collect()
}

// ---------------------------------------------------------------------------------------------
// A store for putting something between rank 1 and rank 0 (a proxy recording or altering the
// link, tests/authentication.rs and tests/tls.rs).

/// A store that gives rank 1 a proxy's address in place of rank 0's.
#[allow(dead_code)]
pub struct Redirect {
    pub inner: std::sync::Arc<MemoryStore>,
    pub rank0_via: String,
}

impl xccl_rs::Store for Redirect {
    fn set(&self, key: &str, value: &[u8]) -> xccl_rs::error::Result<()> {
        self.inner.set(key, value)
    }
    fn get(&self, key: &str, timeout: Duration) -> xccl_rs::error::Result<Vec<u8>> {
        if key == xccl_rs::keys::Key::Address(0).text() { Ok(self.rank0_via.clone().into_bytes()) } else { self.inner.get(key, timeout) }
    }
}

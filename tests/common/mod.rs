//! Test harness: N ranks as threads, connected through one in-memory store, each with its own
//! communicator over real loopback TCP.

#![allow(dead_code)]

use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use xccl_rs::{CommError, Communicator, Completion, Config, DType, MemoryStore, Op, OpKind, RawBuf, ReduceOp};

pub fn config(timeout: Duration, segment_bytes: usize) -> Config {
    Config { segment_bytes, socket_host: Some("127.0.0.1".into()), timeout }
}

/// Runs `f(rank, comm)` on `size` threads and returns each rank's result, in rank order.
pub fn run_ranks<T: Send + 'static>(
    size: usize,
    cfg: Config,
    f: impl Fn(usize, &Communicator) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let store = MemoryStore::new();
    let f = Arc::new(f);
    let handles: Vec<_> = (0..size)
        .map(|rank| {
            let (store, f, cfg) = (store.clone(), f.clone(), cfg.clone());
            std::thread::spawn(move || {
                let comm = Communicator::new(&store, rank, size, cfg).expect("communicator");
                f(rank, &comm)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().expect("rank thread panicked")).collect()
}

/// Submits one job and waits for it.
pub fn run(comm: &Communicator, ops: Vec<Op>) -> Result<Completion, CommError> {
    let (tx, rx) = mpsc::channel();
    comm.submit(ops, Box::new(move |r| {
        let _ = tx.send(r);
    }))?;
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

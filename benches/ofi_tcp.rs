//! OFI (libfabric, `FI_PROVIDER`, e.g. `tcp;ofi_rxm`) against our TCP, side by side in one run:
//! 2 ranks as threads, each posing as a host of its own (so that every byte crosses the
//! transport), all-reduce and broadcast of float32 from 1 MiB to 64 MiB. The two groups are
//! built once and the sizes alternate between them; each line is the median of the slowest
//! rank's times. `FI_PROVIDER="tcp;ofi_rxm" cargo bench --bench ofi_tcp`; figures in
//! docs/multihost.md.
//!
//! `-- --wait`: OFI waiting on its completion queue's file descriptor against OFI without one
//! (`XCCL_RS_OFI_WAIT_FD=0`, as on efa: busy-polling), all-reduce from 4 KiB to 16 MiB.

use std::sync::{Arc, Barrier, mpsc};
use std::time::{Duration, Instant};

use xccl_rs::config::TransportChoice;
use xccl_rs::{Communicator, Config, DType, MemoryStore, Op, OpKind, RawBuf};

const SIZES: [usize; 4] = [1 << 20, 4 << 20, 16 << 20, 64 << 20];
const WAIT_SIZES: [usize; 4] = [4 << 10, 64 << 10, 1 << 20, 16 << 20];
const RANKS: usize = 2;

fn run(comm: &Communicator, op: Op) {
    let (tx, rx) = mpsc::channel();
    comm.submit(vec![op], Box::new(move |r| tx.send(r).unwrap())).unwrap();
    rx.recv().unwrap().unwrap();
}

fn op(kind: OpKind, data: &mut [u8]) -> Op {
    let mut o = Op::new(kind, DType::Float32);
    o.outputs = vec![RawBuf::from_slice(data)];
    o
}

fn iterations(bytes: usize) -> usize {
    ((256 << 20) / bytes.max(1)).min(400) + 3
}

/// Times `kind` of `bytes` on every rank of `comms`: per iteration, the slowest rank's time.
fn time(comms: &[Arc<Communicator>], kind: OpKind, bytes: usize) -> Vec<Duration> {
    let n = iterations(bytes);
    let barrier = Arc::new(Barrier::new(comms.len()));
    let handles: Vec<_> = comms
        .iter()
        .map(|c| {
            let (c, barrier) = (c.clone(), barrier.clone());
            std::thread::spawn(move || {
                let mut data = vec![1u8; bytes];
                run(&c, op(kind, &mut data)); // warm-up
                (0..n)
                    .map(|_| {
                        barrier.wait();
                        let t = Instant::now();
                        run(&c, op(kind, &mut data));
                        t.elapsed()
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let per_rank: Vec<Vec<Duration>> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    (0..n).map(|i| per_rank.iter().map(|r| r[i]).max().unwrap()).collect()
}

fn group(transport: TransportChoice, wait_fd: bool) -> Vec<Arc<Communicator>> {
    let store = MemoryStore::new();
    let handles: Vec<_> = (0..RANKS)
        .map(|rank| {
            let store = store.clone();
            std::thread::spawn(move || {
                let cfg = Config {
                    transport,
                    host_id: Some(format!("host{rank}")),
                    socket_host: Some("127.0.0.1".into()),
                    ofi_wait_fd: wait_fd,
                    ..Config::with_timeout(Duration::from_secs(120))
                };
                Arc::new(Communicator::new(&*store, rank, RANKS, cfg).unwrap())
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// `--wait`: OFI with and without the completion queue's file descriptor.
fn compare_waits(provider: &str) {
    let fd = group(TransportChoice::Ofi, true);
    let busy = group(TransportChoice::Ofi, false);
    println!("# 2 ranks as threads, one per fake host; median of the slowest rank; FI_PROVIDER={provider}");
    println!("{:<11} {:>10} {:>14} {:>14} {:>9}", "op", "size", "fd wait (us)", "no fd (us)", "no fd/fd");
    for bytes in WAIT_SIZES {
        // Alternating rounds, so that neither group runs only while the machine is busier.
        let (mut f, mut b) = (Vec::new(), Vec::new());
        for _ in 0..5 {
            f.extend(time(&fd, OpKind::AllReduce, bytes));
            b.extend(time(&busy, OpKind::AllReduce, bytes));
        }
        let (f, b) = (median(f), median(b));
        let (fs, bs) = (f.as_secs_f64(), b.as_secs_f64());
        println!("{:<11} {:>6} KiB {:>14.1} {:>14.1} {:>9.2}", "allreduce", bytes >> 10, fs * 1e6, bs * 1e6, bs / fs);
    }
}

fn main() {
    let provider = std::env::var("FI_PROVIDER").unwrap_or_else(|_| "(best found)".into());
    if std::env::args().any(|a| a == "--wait") {
        return compare_waits(&provider);
    }
    let tcp = group(TransportChoice::Tcp, true);
    let ofi = group(TransportChoice::Ofi, true);
    println!("# 2 ranks as threads, one per fake host; median of the slowest rank; FI_PROVIDER={provider}");
    println!("{:<11} {:>9} {:>12} {:>12} {:>9}", "op", "size", "tcp (us)", "ofi (us)", "ofi/tcp");
    for kind in [OpKind::AllReduce, OpKind::Broadcast] {
        for bytes in SIZES {
            let t = median(time(&tcp, kind, bytes));
            let o = median(time(&ofi, kind, bytes));
            println!(
                "{:<11} {:>6} MiB {:>12.0} {:>12.0} {:>9.2}",
                kind.name(),
                bytes >> 20,
                t.as_secs_f64() * 1e6,
                o.as_secs_f64() * 1e6,
                o.as_secs_f64() / t.as_secs_f64()
            );
        }
    }
}

//! How a group's set-up scales with its size: ranks as threads of this process over one
//! in-memory store, posing as hosts of `per_host` ranks each (`Config::host_id`, what
//! `XCCL_RS_HOST_ID` sets), so the fabric is mixed. For each world size: the set-up time (from a
//! common start to the last rank connected), the descriptors and sockets the group holds per
//! rank after set-up, and the mean time of an 8 B and a 1 MiB float32 all-reduce (rank 0's
//! view, after a warm-up).
//!
//! `cargo bench --bench setup_scale -- [--per-host 8] [--tcp | --ofi] 16 32 64 128`
//! (`--tcp`: `XCCL_RS_TRANSPORT=tcp`, one TCP link per pair; `--ofi`: each size with the default
//! transport and then with `XCCL_RS_TRANSPORT=ofi`, side by side, libfabric's provider as
//! `FI_PROVIDER` says). Figures in docs/perf.md and docs/multihost.md.
//! Only public API is used, so the same file measures any commit.

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use xccl_rs::config::TransportChoice;
use xccl_rs::{Communicator, Config, DType, MemoryStore, Op, OpKind, RawBuf, ReduceOp};

fn descriptors() -> (usize, usize) {
    let targets: Vec<String> = std::fs::read_dir("/proc/self/fd")
        .map(|d| d.filter_map(|e| std::fs::read_link(e.ok()?.path()).ok()).map(|t| t.to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    let sockets = targets.iter().filter(|t| t.starts_with("socket:")).count();
    (targets.len(), sockets)
}

/// Lets this process open as many descriptors as it may (a full mesh of 128 ranks in one
/// process holds 128·127 sockets).
fn raise_fd_limit() {
    // SAFETY: getrlimit/setrlimit read and write the rlimit struct we pass, nothing else.
    unsafe {
        let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

fn allreduce(comm: &Communicator, data: &mut [u8]) -> Duration {
    let mut op = Op::new(OpKind::AllReduce, DType::Float32);
    op.reduce_op = ReduceOp::Sum;
    op.outputs = vec![RawBuf::from_slice(data)];
    let (tx, rx) = std::sync::mpsc::channel();
    let t = Instant::now();
    comm.submit(
        vec![op],
        Box::new(move |r| {
            let _ = tx.send(r);
        }),
    )
    .expect("submit");
    rx.recv().expect("completion").expect("allreduce");
    t.elapsed()
}

fn mean(comm: &Communicator, bytes: usize, iters: usize) -> Duration {
    let mut data = vec![0u8; bytes];
    for _ in 0..3 {
        allreduce(comm, &mut data);
    }
    (0..iters).map(|_| allreduce(comm, &mut data)).sum::<Duration>() / iters as u32
}

struct Row {
    setup: Duration,
    fds: f64,
    sockets: f64,
    small: Duration,
    large: Duration,
}

fn measure(size: usize, per_host: usize, transport: TransportChoice) -> Row {
    let store = MemoryStore::new();
    let (fds0, sockets0) = descriptors();
    let start = Arc::new(Barrier::new(size));
    let connected = Arc::new(Barrier::new(size));
    let counted = Arc::new(Barrier::new(size));
    let origin = Instant::now();
    let ranks: Vec<_> = (0..size)
        .map(|rank| {
            let (store, start, connected, counted) = (store.clone(), start.clone(), connected.clone(), counted.clone());
            std::thread::spawn(move || {
                let cfg = Config {
                    host_id: Some(format!("setup-scale-{}", rank / per_host)),
                    socket_host: Some("127.0.0.1".into()),
                    transport,
                    ..Config::with_timeout(Duration::from_secs(300))
                };
                start.wait();
                let t0 = origin.elapsed();
                let comm = Communicator::new(&store, rank, size, cfg).expect("communicator");
                let done = origin.elapsed();
                connected.wait();
                let fds = if rank == 0 { Some(descriptors()) } else { None };
                counted.wait();
                let small = mean(&comm, 8, 50);
                let large = mean(&comm, 1 << 20, 10);
                (t0, done, fds, small, large)
            })
        })
        .collect();
    let results: Vec<_> = ranks.into_iter().map(|h| h.join().expect("rank thread")).collect();
    let first = results.iter().map(|r| r.0).min().unwrap();
    let last = results.iter().map(|r| r.1).max().unwrap();
    let (fds, sockets) = results[0].2.unwrap();
    Row {
        setup: last - first,
        fds: (fds - fds0) as f64 / size as f64,
        sockets: (sockets - sockets0) as f64 / size as f64,
        small: results[0].3,
        large: results[0].4,
    }
}

fn main() {
    let mut per_host = 8;
    let mut transports = vec![TransportChoice::Auto];
    let mut sizes = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--per-host" => per_host = args.next().and_then(|v| v.parse().ok()).expect("--per-host N"),
            "--tcp" => transports = vec![TransportChoice::Tcp],
            "--ofi" => transports = vec![TransportChoice::Auto, TransportChoice::Ofi],
            "--bench" => {}
            n => sizes.push(n.parse::<usize>().expect("a world size")),
        }
    }
    if sizes.is_empty() {
        sizes = vec![16, 32, 64, 128];
    }
    raise_fd_limit();
    println!("{} ranks per fake host", per_host);
    println!(
        "{:>6} {:>6} {:>9} {:>10} {:>9} {:>12} {:>14} {:>15}",
        "ranks", "hosts", "transport", "set-up ms", "fds/rank", "sockets/rank", "allreduce 8 B", "allreduce 1 MiB"
    );
    for size in sizes {
        for &transport in &transports {
            let r = measure(size, per_host, transport);
            println!(
                "{:>6} {:>6} {:>9} {:>10.1} {:>9.1} {:>12.1} {:>11.1} us {:>12.2} ms",
                size,
                size.div_ceil(per_host),
                transport.name(),
                r.setup.as_secs_f64() * 1e3,
                r.fds,
                r.sockets,
                r.small.as_secs_f64() * 1e6,
                r.large.as_secs_f64() * 1e3
            );
        }
    }
}

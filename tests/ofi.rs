//! The OFI transport (XCCL_RS_TRANSPORT=ofi) over libfabric's tcp provider on loopback: every
//! collective and point-to-point pattern against references computed here, on groups of one
//! rank per (faked) host, where every step crosses libfabric, and of two hosts with two ranks
//! each, where the steps between hosts do; and the set-up and run-time failures: a provider that
//! does not exist, ranks with different settings, a size mismatch, a dead peer.
//!
//! libfabric reads FI_PROVIDER once per process, so each test runs in a child process of this
//! binary with its own environment (`in_child`). Without libfabric.so.1 the tests skip, saying
//! why, unless they run as root: there scripts/setup.sh installs it, and its absence fails them.

mod common;
use common::*;
use std::process::Command;
use std::time::{Duration, Instant};
use xccl_rs::config::TransportChoice;
use xccl_rs::{CommError, Communicator, Config, DType, MemoryStore, Op, OpKind};

const LIMIT: Duration = Duration::from_secs(120);
/// The variable that tells a child process which case to run.
const CASE: &str = "OFI_TEST_CASE";

fn ofi_config(timeout: Duration, host: &str) -> Config {
    Config { transport: TransportChoice::Ofi, host_id: Some(host.into()), pipeline_chunk_bytes: 256 << 10, ..config(timeout, 4096) }
}

/// Whether libfabric can be used here; `None` (after saying why) when the test should skip.
fn libfabric_here() -> Option<()> {
    match xccl_rs::transport::ofi::shim::load() {
        Ok(_) => Some(()),
        // SAFETY: geteuid has no preconditions.
        Err(why) if unsafe { libc::geteuid() } == 0 => panic!("{why} (as root, scripts/setup.sh installs it)"),
        Err(why) => {
            eprintln!("skipped: {why}");
            None
        }
    }
}

/// Runs case `name` in a child process of this test binary with `FI_PROVIDER=provider`;
/// panics with the child's output if it fails.
fn in_child(name: &str, provider: &str) {
    if libfabric_here().is_none() {
        return;
    }
    let exe = std::env::current_exe().expect("the test binary");
    let out = Command::new(exe)
        .args(["child", "--exact", "--ignored", "--nocapture", "--test-threads=1"])
        .env(CASE, name)
        .env("FI_PROVIDER", provider)
        .output()
        .expect("run the child");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && text.contains("case passed"), "case {name} failed:\n{text}");
}

/// The entry point of the child processes (not a test of its own).
#[test]
#[ignore]
fn child() {
    let case = std::env::var(CASE).expect("run through in_child");
    match case.as_str() {
        "collectives_mesh" => collectives(&["h0", "h1", "h2"]),
        "collectives_two_ranks" => collectives(&["h0", "h1"]),
        "collectives_mixed" => collectives(&["a", "a", "b", "b"]),
        "point_to_point" => point_to_point(),
        "send_then_leave" => send_then_leave(),
        "more_messages_than_receives" => more_messages_than_receives(),
        "wrong_provider" => wrong_provider(),
        "different_settings" => different_settings(),
        "size_mismatch" => size_mismatch(),
        "dead_peer" => dead_peer(),
        other => panic!("no case {other}"),
    }
    println!("case passed");
}

fn run_ok(comm: &Communicator, ops: Vec<Op>, what: &str) {
    if let Err(e) = run(comm, ops) {
        panic!("{what}: {e}");
    }
}

/// Small integers (exact in f32 sums) that differ per rank and index.
fn data(rank: usize, n: usize, salt: usize) -> Vec<f32> {
    (0..n).map(|i| ((rank * 31 + i * 7 + salt * 13) % 23) as f32 - 11.0).collect()
}

/// all-reduce, broadcast from every root, all-gather, reduce-scatter and all-to-all, at sizes
/// from empty to several pipeline chunks, on ranks placed on `hosts`.
fn collectives(hosts: &[&'static str]) {
    let size = hosts.len();
    let cfgs = hosts.iter().map(|h| ofi_config(Duration::from_secs(30), h)).collect();
    spawn_ranks_with(MemoryStore::new(), cfgs, LIMIT, move |rank, comm, _| {
        for (salt, n) in [0usize, 1, 1023, 300_000].into_iter().enumerate() {
            // all-reduce: the element-wise sum of every rank's data.
            let mut v = f32_bytes(&data(rank, n, salt));
            run_ok(&comm, vec![op_with(OpKind::AllReduce, DType::Float32, vec![], vec![buf(&mut v)])], "allreduce");
            let every: Vec<Vec<f32>> = (0..size).map(|r| data(r, n, salt)).collect();
            let want: Vec<f32> = (0..n).map(|i| every.iter().map(|d| d[i]).sum()).collect();
            assert_eq!(bytes_f32(&v), want, "allreduce of {n} on rank {rank}");
            for root in 0..size {
                let mut b = f32_bytes(&data(rank, n, salt + root));
                run_ok(&comm, vec![rooted_op(OpKind::Broadcast, DType::Float32, vec![], vec![buf(&mut b)], root)], "broadcast");
                assert_eq!(bytes_f32(&b), data(root, n, salt + root), "broadcast of {n} from {root} on rank {rank}");
            }
            let mut piece = f32_bytes(&data(rank, n, salt));
            let mut all = vec![0u8; n * 4 * size];
            let o = op_with(OpKind::AllGather, DType::Float32, vec![buf(&mut piece)], views(&mut all, size, n * 4));
            run_ok(&comm, vec![o], "allgather");
            let want: Vec<f32> = (0..size).flat_map(|r| data(r, n, salt)).collect();
            assert_eq!(bytes_f32(&all), want, "allgather of {n} on rank {rank}");
            let mut whole = f32_bytes(&data(rank, n * size, salt));
            let mut mine = vec![0u8; n * 4];
            let o = op_with(OpKind::ReduceScatter, DType::Float32, views(&mut whole, size, n * 4), vec![buf(&mut mine)]);
            run_ok(&comm, vec![o], "reduce_scatter");
            let every: Vec<Vec<f32>> = (0..size).map(|r| data(r, n * size, salt)).collect();
            let want: Vec<f32> = (0..n).map(|i| every.iter().map(|d| d[rank * n + i]).sum()).collect();
            assert_eq!(bytes_f32(&mine), want, "reduce_scatter of {n} on rank {rank}");
            // all-to-all with a different length per pair.
            let len = |src: usize, dst: usize| (n + src * 3 + dst) * 4;
            let msg = |src: usize, dst: usize| pattern(src * 16 + dst, salt as u64, len(src, dst));
            let mut ins: Vec<Vec<u8>> = (0..size).map(|d| msg(rank, d)).collect();
            let mut outs: Vec<Vec<u8>> = (0..size).map(|s| vec![0u8; len(s, rank)]).collect();
            let o = op_with(OpKind::AllToAll, DType::Float32, ins.iter_mut().map(|v| buf(v)).collect(), outs.iter_mut().map(|v| buf(v)).collect());
            run_ok(&comm, vec![o], "alltoall");
            for (s, got) in outs.iter().enumerate() {
                assert!(*got == msg(s, rank), "alltoall of {n}: wrong message from rank {s} on rank {rank}");
            }
        }
    });
}

fn recv_any(tag: i64, b: xccl_rs::RawBuf) -> Op {
    let mut o = op_with(OpKind::RecvAnySource, DType::UInt8, vec![], vec![b]);
    o.tag = tag;
    o
}

/// Sends and receives between pairs, and receive-from-any-source picking by tag.
fn point_to_point() {
    let cfgs = (0..3).map(|r| ofi_config(Duration::from_secs(30), ["p", "q", "r"][r])).collect();
    spawn_ranks_with(MemoryStore::new(), cfgs, LIMIT, move |rank, comm, barrier| {
        // A ring of sends: each rank sends to the next, receives from the previous.
        let (next, prev) = ((rank + 1) % 3, (rank + 2) % 3);
        let mut out = pattern(rank, 1, 100_000);
        let mut got = vec![0u8; 100_000];
        run_ok(&comm, vec![send_to(next, 5, DType::UInt8, buf(&mut out)), recv_from(prev, 5, DType::UInt8, buf(&mut got))], "ring");
        assert!(got == pattern(prev, 1, 100_000), "ring on rank {rank}");
        barrier.wait();
        // The same ring with each send issued alone before its receive (`isend` then `irecv`):
        // a send completes once the transport holds its bytes, as over TCP, so the ring cannot
        // deadlock although no rank has posted its receive when it sends.
        for (k, n) in [100_000usize, 1 << 20].into_iter().enumerate() {
            let tag = 20 + k as i64;
            let mut out = pattern(rank, tag as u64, n);
            let mut got = vec![0u8; n];
            run_ok(&comm, vec![send_to(next, tag, DType::UInt8, buf(&mut out))], "send issued alone");
            out.fill(0); // the send's bytes are the transport's once it completed
            run_ok(&comm, vec![recv_from(prev, tag, DType::UInt8, buf(&mut got))], "receive after the send");
            assert!(got == pattern(prev, tag as u64, n), "ring of lone sends of {n} on rank {rank}");
        }
        barrier.wait();
        // Ranks 1 and 2 send to rank 0 with tags 7 and 8; rank 0 asks for tag 8 from any rank first.
        if rank == 0 {
            let mut a = vec![0u8; 64];
            let c = run(&comm, vec![recv_any(8, buf(&mut a))]).expect("recv any tag 8");
            assert_eq!(c.source_rank, 2, "tag 8 comes from rank 2");
            assert!(a == pattern(2, 8, 64));
            let mut b = vec![0u8; 64];
            let c = run(&comm, vec![recv_any(7, buf(&mut b))]).expect("recv any tag 7");
            assert_eq!(c.source_rank, 1);
            assert!(b == pattern(1, 7, 64));
        } else {
            let tag = 6 + rank as i64;
            let mut m = pattern(rank, tag as u64, 64);
            run_ok(&comm, vec![send_to(0, tag, DType::UInt8, buf(&mut m))], "send");
        }
        barrier.wait();
        // Receive-from-any-source while one peer is silent: its look-ahead is withdrawn, and
        // its later message arrives where it is expected.
        if rank == 1 {
            let mut m = pattern(1, 11, 64);
            run_ok(&comm, vec![send_to(0, 11, DType::UInt8, buf(&mut m))], "send to the probe");
        }
        if rank == 0 {
            let mut a = vec![0u8; 64];
            let c = run(&comm, vec![recv_any(11, buf(&mut a))]).expect("recv any with a silent peer");
            assert_eq!(c.source_rank, 1);
        }
        barrier.wait();
        if rank == 2 {
            let mut m = pattern(2, 12, 5000);
            run_ok(&comm, vec![send_to(0, 12, DType::UInt8, buf(&mut m))], "the silent peer's send");
        }
        if rank == 0 {
            let mut b = vec![0u8; 5000];
            run_ok(&comm, vec![recv_from(2, 12, DType::UInt8, buf(&mut b))], "receive from the once silent peer");
            assert!(b == pattern(2, 12, 5000));
        }
        barrier.wait();
        // After the look-ahead, ordinary collectives still line up.
        let mut v = f32_bytes(&[rank as f32; 10]);
        run_ok(&comm, vec![op_with(OpKind::AllReduce, DType::Float32, vec![], vec![buf(&mut v)])], "allreduce after p2p");
        assert_eq!(bytes_f32(&v), vec![3.0; 10]);
    });
}

/// A rank that sends and destroys its group at once still delivers: closing waits for the sends
/// the transport holds, while the receiver takes a second to ask for them.
fn send_then_leave() {
    let cfgs = (0..2).map(|r| ofi_config(Duration::from_secs(30), ["p", "q"][r])).collect();
    spawn_ranks_with(MemoryStore::new(), cfgs, LIMIT, move |rank, comm, _| {
        let n = 1 << 20;
        if rank == 1 {
            let mut out = pattern(1, 3, n);
            run_ok(&comm, vec![send_to(0, 3, DType::UInt8, buf(&mut out))], "send");
            drop(comm);
        } else {
            std::thread::sleep(Duration::from_secs(1));
            let mut got = vec![0u8; n];
            run_ok(&comm, vec![recv_from(1, 3, DType::UInt8, buf(&mut got))], "receive after the sender left");
            assert!(got == pattern(1, 3, n), "the message of a rank that left");
        }
    });
}

/// An all-to-all whose messages are each cut into the most pieces (16 MiB in 16 KiB messages
/// over tcp;ofi_rxm): every rank's phase has more receives than its endpoint holds posted
/// (2048), so some wait for the provider while the rank's sends must still go out.
fn more_messages_than_receives() {
    let cfgs = (0..3).map(|r| Config { pipeline_chunk_bytes: 64 << 20, ..ofi_config(Duration::from_secs(30), ["a", "b", "c"][r]) }).collect();
    spawn_ranks_with(MemoryStore::new(), cfgs, LIMIT, move |rank, comm, _| {
        let len = 16 << 20;
        let mut ins: Vec<Vec<u8>> = (0..3).map(|d| pattern(rank * 16 + d, 7, len)).collect();
        let mut outs: Vec<Vec<u8>> = (0..3).map(|_| vec![0u8; len]).collect();
        let o = op_with(OpKind::AllToAll, DType::UInt8, ins.iter_mut().map(|v| buf(v)).collect(), outs.iter_mut().map(|v| buf(v)).collect());
        run_ok(&comm, vec![o], "alltoall of 16 MiB per pair");
        for (s, got) in outs.iter().enumerate() {
            assert!(*got == pattern(s * 16 + rank, 7, len), "alltoall: wrong message from rank {s} on rank {rank}");
        }
    });
}

/// Every rank's creation result, in rank order.
fn create_all(cfgs: Vec<Config>) -> Vec<Result<(), CommError>> {
    let store = MemoryStore::new();
    let handles: Vec<_> = cfgs
        .into_iter()
        .enumerate()
        .map(|(rank, cfg)| {
            let store = store.clone();
            let size = 3;
            std::thread::spawn(move || Communicator::new(&*store, rank, size, cfg).map(|c| c.shutdown()))
        })
        .collect();
    handles.into_iter().map(|h| h.join().expect("no panic")).collect()
}

/// FI_PROVIDER names no provider: every rank fails at set-up, naming it.
fn wrong_provider() {
    let started = Instant::now();
    let results = create_all((0..3).map(|r| ofi_config(Duration::from_secs(20), ["x", "y", "z"][r])).collect());
    for (rank, r) in results.iter().enumerate() {
        let e = r.as_ref().expect_err("set-up must fail");
        assert!(e.message.contains("FI_PROVIDER=\"no_such_provider\""), "rank {rank}: {}", e.message);
    }
    assert!(started.elapsed() < Duration::from_secs(10), "the failure waited for the timeout");
}

/// Rank 1 asks for TCP while the others ask for OFI: every rank fails, naming both settings.
fn different_settings() {
    let started = Instant::now();
    let cfgs = (0..3)
        .map(|r| Config { transport: if r == 1 { TransportChoice::Tcp } else { TransportChoice::Ofi }, ..ofi_config(Duration::from_secs(20), "h") })
        .collect();
    for (rank, r) in create_all(cfgs).iter().enumerate() {
        let e = r.as_ref().expect_err("set-up must fail");
        assert!(e.message.contains("rank 0 has `ofi`") && e.message.contains("rank 1 has `tcp`"), "rank {rank}: {}", e.message);
    }
    assert!(started.elapsed() < Duration::from_secs(10), "the failure waited for the timeout");
}

/// Rank 1 all-reduces more elements than the others: every rank fails with a size mismatch.
fn size_mismatch() {
    let cfgs = (0..3).map(|r| ofi_config(Duration::from_secs(5), ["x", "y", "z"][r])).collect();
    spawn_ranks_with(MemoryStore::new(), cfgs, LIMIT, move |rank, comm, barrier| {
        let n = if rank == 1 { 5001 } else { 5000 };
        let mut v = f32_bytes(&vec![1.0; n]);
        let started = Instant::now();
        let e = run(&comm, vec![op_with(OpKind::AllReduce, DType::Float32, vec![], vec![buf(&mut v)])]).expect_err("must fail");
        assert!(e.message.contains("mismatch") || e.message.contains("aborted"), "rank {rank}: {}", e.message);
        assert!(started.elapsed() < Duration::from_secs(4), "rank {rank} waited for the timeout: {}", e.message);
        barrier.wait();
    });
}

/// Rank 2 goes away while ranks 0 and 1 all-reduce: both fail, naming rank 2, before the timeout.
fn dead_peer() {
    let cfgs = (0..3).map(|r| ofi_config(Duration::from_secs(20), ["x", "y", "z"][r])).collect();
    spawn_ranks_with(MemoryStore::new(), cfgs, LIMIT, move |rank, comm, barrier| {
        let mut v = f32_bytes(&vec![1.0; 1 << 16]);
        run_ok(&comm, vec![op_with(OpKind::AllReduce, DType::Float32, vec![], vec![buf(&mut v)])], "warm-up");
        barrier.wait();
        if rank == 2 {
            drop(comm);
            return;
        }
        let started = Instant::now();
        let e = run(&comm, vec![op_with(OpKind::AllReduce, DType::Float32, vec![], vec![buf(&mut v)])]).expect_err("must fail");
        assert!(e.message.contains("rank 2"), "rank {rank}: {}", e.message);
        assert!(started.elapsed() < Duration::from_secs(10), "rank {rank} waited for the timeout: {}", e.message);
    });
}

const TCP_RXM: &str = "tcp;ofi_rxm";

#[test]
fn collectives_one_rank_per_host() {
    in_child("collectives_mesh", TCP_RXM);
}

#[test]
fn collectives_two_ranks() {
    in_child("collectives_two_ranks", TCP_RXM);
}

#[test]
fn collectives_two_hosts_of_two_ranks() {
    in_child("collectives_mixed", TCP_RXM);
}

#[test]
fn point_to_point_and_receive_from_any_source() {
    in_child("point_to_point", TCP_RXM);
}

#[test]
fn a_rank_that_sends_and_leaves_still_delivers() {
    in_child("send_then_leave", TCP_RXM);
}

#[test]
fn a_phase_with_more_messages_than_posted_receives() {
    in_child("more_messages_than_receives", "tcp;ofi_rxm");
}

#[test]
fn a_provider_that_does_not_exist_fails_every_rank() {
    in_child("wrong_provider", "no_such_provider");
}

#[test]
fn ranks_with_different_transports_fail_at_set_up() {
    in_child("different_settings", TCP_RXM);
}

#[test]
fn a_size_mismatch_fails_every_rank() {
    in_child("size_mismatch", TCP_RXM);
}

#[test]
fn a_dead_peer_fails_every_rank_naming_it() {
    in_child("dead_peer", TCP_RXM);
}

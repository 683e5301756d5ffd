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

/// A rank's configuration; the OFI settings that a case runs under (the tag width, waiting
/// without a file descriptor) come from the child's environment, as `Config::from_env` reads them.
fn ofi_config(timeout: Duration, host: &str) -> Config {
    let env = Config::from_env(timeout).expect("the child's XCCL_RS_OFI_* settings");
    Config {
        transport: TransportChoice::Ofi,
        host_id: Some(host.into()),
        pipeline_chunk_bytes: 256 << 10,
        ofi_tag_bits: env.ofi_tag_bits,
        ofi_wait_fd: env.ofi_wait_fd,
        ..config(timeout, 4096)
    }
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
    in_child_with(name, provider, &[]);
}

/// [`in_child`] with more variables in the child's environment.
fn in_child_with(name: &str, provider: &str, vars: &[(&str, &str)]) {
    if libfabric_here().is_none() {
        return;
    }
    let exe = std::env::current_exe().expect("the test binary");
    let out = Command::new(exe)
        .args(["child", "--exact", "--ignored", "--nocapture", "--test-threads=1"])
        .env(CASE, name)
        .env("FI_PROVIDER", provider)
        .envs(vars.iter().copied())
        .output()
        .expect("run the child");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && text.contains("case passed"), "case {name} with {vars:?} failed:\n{text}");
}

/// The cases that move data, which the narrow tag layouts and the wait without a file
/// descriptor run again.
const DATA_CASES: [&str; 6] =
    ["collectives_mesh", "collectives_mixed", "point_to_point", "lookahead_patterns", "send_then_leave", "more_messages_than_receives"];

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
        "lookahead_patterns" => lookahead_patterns(),
        "send_then_leave" => send_then_leave(),
        "more_messages_than_receives" => more_messages_than_receives(),
        "wrong_provider" => wrong_provider(),
        "different_settings" => different_settings(),
        "different_tag_widths" => different_tag_widths(),
        "size_mismatch" => size_mismatch(),
        "dead_peer" => dead_peer(),
        "dead_peer_off_the_rails" => dead_peer_off_the_rails(),
        "fault_cycles" => fault_cycles(),
        "send_in_flight_when_its_phase_fails" => send_in_flight_when_its_phase_fails(),
        "endpoints_outlive_their_groups" => endpoints_outlive_their_groups(),
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

/// What a look-ahead (the header receive that a receive-from-any-source leaves posted to each
/// peer that did not match) can meet next: a batch of two receives from that peer, several
/// receives-from-any in a row, a collective, and the group's end.
fn lookahead_patterns() {
    let cfgs = (0..3).map(|r| ofi_config(Duration::from_secs(20), ["p", "q", "r"][r])).collect();
    spawn_ranks_with(MemoryStore::new(), cfgs, LIMIT, move |rank, comm, barrier| {
        // Rank 0 takes tag 8 from rank 1, leaving a look-ahead posted to rank 2; rank 2 then
        // sends two messages in one batch, which rank 0 receives in one batch.
        match rank {
            0 => {
                let mut a = vec![0u8; 64];
                assert_eq!(run(&comm, vec![recv_any(8, buf(&mut a))]).expect("recv any").source_rank, 1);
                let (mut x, mut y) = (vec![0u8; 3000], vec![0u8; 70_000]);
                run_ok(&comm, vec![recv_from(2, 30, DType::UInt8, buf(&mut x)), recv_from(2, 31, DType::UInt8, buf(&mut y))], "two receives from the look-ahead's peer");
                assert!(x == pattern(2, 30, 3000) && y == pattern(2, 31, 70_000), "the batch's messages");
            }
            1 => run_ok(&comm, vec![send_to(0, 8, DType::UInt8, buf(&mut pattern(1, 8, 64)))], "send tag 8"),
            _ => {
                std::thread::sleep(Duration::from_millis(200)); // after rank 0's look-ahead
                let (mut x, mut y) = (pattern(2, 30, 3000), pattern(2, 31, 70_000));
                run_ok(&comm, vec![send_to(0, 30, DType::UInt8, buf(&mut x)), send_to(0, 31, DType::UInt8, buf(&mut y))], "two sends in one batch");
            }
        }
        barrier.wait();
        // Several receives-from-any in a row, each by tag, then a pair from rank 2 alone: the
        // look-aheads each leaves behind serve the next.
        if rank == 0 {
            for (tag, from) in [(40i64, 1usize), (41, 2), (42, 1), (43, 2)] {
                let mut a = vec![0u8; 100];
                let c = run(&comm, vec![recv_any(tag, buf(&mut a))]).expect("recv any in a row");
                assert_eq!(c.source_rank, from as i64, "tag {tag}");
                assert!(a == pattern(from, tag as u64, 100), "tag {tag}");
            }
            let (mut x, mut y) = (vec![0u8; 10], vec![0u8; 20]);
            run_ok(&comm, vec![recv_from(2, 44, DType::UInt8, buf(&mut x)), recv_from(2, 45, DType::UInt8, buf(&mut y))], "a pair after the row");
            assert!(x == pattern(2, 44, 10) && y == pattern(2, 45, 20));
        } else {
            let tags: &[i64] = if rank == 1 { &[40, 42] } else { &[41, 43] };
            for &tag in tags {
                run_ok(&comm, vec![send_to(0, tag, DType::UInt8, buf(&mut pattern(rank, tag as u64, 100)))], "send in a row");
            }
            if rank == 2 {
                run_ok(&comm, vec![send_to(0, 44, DType::UInt8, buf(&mut pattern(2, 44, 10))), send_to(0, 45, DType::UInt8, buf(&mut pattern(2, 45, 20)))], "the pair");
            }
        }
        barrier.wait();
        // A look-ahead left posted to rank 2 when a collective starts (all-to-all: rank 0
        // receives from rank 2 in the same phase as from rank 1).
        if rank == 0 {
            let mut a = vec![0u8; 64];
            assert_eq!(run(&comm, vec![recv_any(50, buf(&mut a))]).expect("recv any before the collective").source_rank, 1);
        } else if rank == 1 {
            run_ok(&comm, vec![send_to(0, 50, DType::UInt8, buf(&mut pattern(1, 50, 64)))], "send before the collective");
        }
        let n = 5000;
        let mut ins: Vec<Vec<u8>> = (0..3).map(|d| pattern(rank * 16 + d, 51, n)).collect();
        let mut outs: Vec<Vec<u8>> = (0..3).map(|_| vec![0u8; n]).collect();
        let o = op_with(OpKind::AllToAll, DType::UInt8, ins.iter_mut().map(|v| buf(v)).collect(), outs.iter_mut().map(|v| buf(v)).collect());
        run_ok(&comm, vec![o], "alltoall with a look-ahead posted");
        for (s, got) in outs.iter().enumerate() {
            assert!(*got == pattern(s * 16 + rank, 51, n), "alltoall: from rank {s} on rank {rank}");
        }
        barrier.wait();
        // The group ends with a look-ahead still posted to rank 2 (closing frees it).
        if rank == 0 {
            let mut a = vec![0u8; 64];
            assert_eq!(run(&comm, vec![recv_any(60, buf(&mut a))]).expect("recv any at the end").source_rank, 1);
        } else if rank == 1 {
            run_ok(&comm, vec![send_to(0, 60, DType::UInt8, buf(&mut pattern(1, 60, 64)))], "the last send");
        }
        barrier.wait();
        drop(comm);
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

/// A send that the provider still holds when its phase fails: rank 0 sends 40 MiB (one
/// message, which `ofi_rxm` moves by rendezvous: the receiver reads it from the sender's
/// memory) to rank 1, which does not ask for it before rank 0's timeout. Before its op returns,
/// rank 0 cancels the send and reads it back, or gives its endpoint up (never read again) if
/// the provider keeps it (`ofi_rxm` 1.17 gives it back); rank 0 then frees the buffer and
/// fills the memory it gets next. Rank 1's receive, posted
/// later, must fail (rank 0's abort), never complete with whatever the freed memory holds, and
/// rank 0's next op must fail naming why.
fn send_in_flight_when_its_phase_fails() {
    let cfgs = (0..2).map(|r| ofi_config(Duration::from_secs(3), ["p", "q"][r])).collect();
    spawn_ranks_with(MemoryStore::new(), cfgs, LIMIT, move |rank, comm, _| {
        let n = 40 << 20;
        if rank == 0 {
            let mut out = pattern(0, 5, n);
            let e = run(&comm, vec![send_to(1, 5, DType::UInt8, buf(&mut out))]).expect_err("rank 1 does not receive in time");
            assert!(e.message.contains("rank 1") || e.message.contains("timed out"), "rank 0: {}", e.message);
            drop(out);
            let refill = vec![0xEEu8; n];
            let mut again = vec![0u8; 8];
            let e = run(&comm, vec![send_to(1, 6, DType::UInt8, buf(&mut again))]).expect_err("the group failed");
            assert!(!e.message.is_empty(), "rank 0's next op");
            drop(refill);
        } else {
            std::thread::sleep(Duration::from_secs(7)); // well past rank 0's timeout and its reclaim
            let mut got = vec![0u8; n];
            let r = run(&comm, vec![recv_from(0, 5, DType::UInt8, buf(&mut got))]);
            assert!(r.is_err(), "rank 1 received a message whose sender had given it up");
            assert!(!got.contains(&0xEE), "rank 1's buffer holds rank 0's freed memory");
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

/// Control links are made where the fabric's algorithms need them (the rails: rank 0 with 2,
/// 1 with 3), and with any other peer a rank waits for on first use: rank 0 waits for rank 3,
/// which never sends and then goes away; rank 0 fails naming it, before the timeout, through
/// the link its wait made. Rank 1 goes away without ever being waited for by rank 0.
fn dead_peer_off_the_rails() {
    let cfgs = (0..4).map(|r| ofi_config(Duration::from_secs(20), ["a", "a", "b", "b"][r])).collect();
    spawn_ranks_with(MemoryStore::new(), cfgs, LIMIT, move |rank, comm, barrier| {
        let mut v = f32_bytes(&vec![1.0; 1 << 10]);
        run_ok(&comm, vec![op_with(OpKind::AllReduce, DType::Float32, vec![], vec![buf(&mut v)])], "warm-up");
        barrier.wait();
        match rank {
            0 => {
                let started = Instant::now();
                let mut got = vec![0u8; 100];
                let e = run(&comm, vec![recv_from(3, 1, DType::UInt8, buf(&mut got))]).expect_err("rank 3 never sends");
                assert!(e.message.contains("rank 3"), "rank 0: {}", e.message);
                assert!(started.elapsed() < Duration::from_secs(10), "rank 0 waited for the timeout: {}", e.message);
            }
            3 => {
                std::thread::sleep(Duration::from_millis(1500)); // rank 0 is asleep in its wait
                drop(comm);
            }
            _ => {}
        }
    });
}

/// Groups in a row reuse their ranks' endpoints (a generation later each time), and a message
/// that one group sent but never received does not reach the next group on the same
/// endpoints: rank 1 sends rank 0 a message that rank 0 never asks for, both end the group,
/// and the next group's message with the same tag and sequence number arrives, not the old.
fn endpoints_outlive_their_groups() {
    use xccl_rs::transport::ofi::pool;
    pool::release_idle();
    for (round, expect_idle) in [(0u64, vec![0, 0]), (1, vec![1, 1]), (2, vec![2, 2])] {
        let cfgs = (0..2).map(|r| ofi_config(Duration::from_secs(20), ["p", "q"][r])).collect();
        spawn_ranks_with(MemoryStore::new(), cfgs, LIMIT, move |rank, comm, barrier| {
            if rank == 1 {
                run_ok(&comm, vec![send_to(0, 7, DType::UInt8, buf(&mut pattern(1, 100 + round, 300)))], "the message");
            } else {
                let mut got = vec![0u8; 300];
                run_ok(&comm, vec![recv_from(1, 7, DType::UInt8, buf(&mut got))], "receive");
                assert!(got == pattern(1, 100 + round, 300), "round {round}: rank 0 received another group's message");
            }
            // A second message that rank 0 never receives, left in its endpoint's queue.
            if rank == 1 {
                run_ok(&comm, vec![send_to(0, 7, DType::UInt8, buf(&mut pattern(1, 999, 300)))], "the stray message");
            }
            barrier.wait();
        });
        let mut idle = pool::idle_generations();
        idle.sort_unstable();
        assert_eq!(idle, expect_idle, "round {round}: the idle endpoints' generations");
    }
    pool::release_idle();
}

/// This process's open descriptors, threads and resident memory (bytes), after the allocator
/// has given back what it keeps of freed memory.
fn process_usage() -> (usize, usize, usize) {
    // SAFETY: malloc_trim only returns free heap memory to the system.
    unsafe { libc::malloc_trim(0) };
    let count = |dir: &str| std::fs::read_dir(dir).map(|d| d.count()).unwrap_or(0);
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: usize = statm.split_whitespace().nth(1).and_then(|v| v.parse().ok()).unwrap_or(0);
    (count("/proc/self/fd"), count("/proc/self/task"), pages * 4096)
}

/// Groups that fail, over and over: 3 ranks build a group, rank 2 leaves while ranks 0 and 1
/// all-reduce with it (its endpoint and links close mid-phase), and the others destroy theirs.
/// `OFI_TEST_CYCLES` cycles (default 30); the descriptors, threads and memory of the process
/// (every rank's) must not grow after the first few.
fn fault_cycles() {
    let cycles: usize = std::env::var("OFI_TEST_CYCLES").ok().and_then(|v| v.parse().ok()).unwrap_or(30);
    let mut usage = Vec::new();
    let threads_before = process_usage().1;
    for cycle in 0..cycles {
        let cfgs = (0..3).map(|r| ofi_config(Duration::from_secs(10), ["x", "y", "z"][r])).collect();
        spawn_ranks_with(MemoryStore::new(), cfgs, LIMIT, move |rank, comm, barrier| {
            let mut v = f32_bytes(&vec![1.0; 1 << 16]);
            run_ok(&comm, vec![op_with(OpKind::AllReduce, DType::Float32, vec![], vec![buf(&mut v)])], "warm-up");
            barrier.wait();
            if rank == 2 {
                std::thread::sleep(Duration::from_millis(50)); // the others are in their all-reduce
                drop(comm);
                return;
            }
            let e = run(&comm, vec![op_with(OpKind::AllReduce, DType::Float32, vec![], vec![buf(&mut v)])]).expect_err("rank 2 left");
            assert!(e.message.contains("rank 2"), "cycle {cycle}, rank {rank}: {}", e.message);
        });
        // The threads of the ranks' groups end as the groups do, but not all at once: give
        // them a second to go before counting.
        let until = Instant::now() + Duration::from_secs(1);
        while process_usage().1 > threads_before && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(10));
        }
        usage.push(process_usage());
        if cycle % 10 == 9 {
            let (fds, threads, rss) = usage[cycle];
            println!("cycle {:>4}: {fds} descriptors, {threads} threads, {:.1} MiB resident", cycle + 1, rss as f64 / (1 << 20) as f64);
        }
    }
    // Allocators and libfabric's caches settle in the first cycles: the last third against the
    // second. Descriptors and threads by their most (an endpoint leaked per cycle adds its
    // sockets every cycle); memory by its median, with a margin of one endpoint's buffers
    // (about 33 MiB): the process keeps up to 4 idle endpoints and the allocator sometimes keeps
    // a freed one's buffers past the trim, while a leak per cycle adds that much every cycle.
    let third = cycles / 3;
    let most = |w: &[(usize, usize, usize)]| w.iter().fold((0, 0), |m, u| (m.0.max(u.0), m.1.max(u.1)));
    let median_rss = |w: &[(usize, usize, usize)]| {
        let mut v: Vec<usize> = w.iter().map(|u| u.2).collect();
        v.sort_unstable();
        v[v.len() / 2]
    };
    let (before, after) = (&usage[third..2 * third], &usage[2 * third..]);
    assert!(most(after).0 <= most(before).0, "descriptors grew from {} to {}", most(before).0, most(after).0);
    assert!(most(after).1 <= most(before).1, "threads grew from {} to {}", most(before).1, most(after).1);
    let (rss_before, rss_after) = (median_rss(before), median_rss(after));
    assert!(rss_after <= rss_before + (40 << 20), "resident memory grew from {rss_before} to {rss_after} bytes (medians)");
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
fn lookaheads_left_by_receives_from_any_source() {
    in_child("lookahead_patterns", TCP_RXM);
}

#[test]
fn a_rank_that_sends_and_leaves_still_delivers() {
    in_child("send_then_leave", TCP_RXM);
}

#[test]
fn a_phase_with_more_messages_than_posted_receives() {
    in_child("more_messages_than_receives", "tcp;ofi_rxm");
}

/// Every data case with 48-bit tags (cxi's width) and 20-bit ones (what MPICH gives CXI): the
/// shim refuses any post whose tag has a bit outside the width (shim.c `XOFI_EBADTAG`).
#[test]
fn every_data_case_with_narrow_tags() {
    for bits in ["48", "20"] {
        for case in DATA_CASES {
            in_child_with(case, TCP_RXM, &[("XCCL_RS_OFI_TAG_BITS", bits)]);
        }
    }
}

/// Every data case without the completion queue's file descriptor, as on efa: the ranks
/// busy-poll.
#[test]
fn every_data_case_without_a_wait_descriptor() {
    for case in DATA_CASES {
        in_child_with(case, TCP_RXM, &[("XCCL_RS_OFI_WAIT_FD", "0")]);
    }
}

/// Ranks whose tag widths differ fail at set-up, every one naming both layouts.
fn different_tag_widths() {
    let started = Instant::now();
    let cfgs = (0..3).map(|r| Config { ofi_tag_bits: Some(if r == 2 { 20 } else { 48 }), ..ofi_config(Duration::from_secs(20), ["x", "y", "z"][r]) }).collect();
    for (rank, r) in create_all(cfgs).iter().enumerate() {
        let e = r.as_ref().expect_err("set-up must fail");
        assert!(e.message.contains("lay libfabric tags out differently") && e.message.contains("XCCL_RS_OFI_TAG_BITS"), "rank {rank}: {}", e.message);
    }
    assert!(started.elapsed() < Duration::from_secs(10), "the failure waited for the timeout");
}

#[test]
fn ranks_with_different_tag_widths_fail_at_set_up() {
    in_child("different_tag_widths", TCP_RXM);
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

#[test]
fn endpoints_outlive_their_groups_and_no_message_crosses_to_the_next() {
    in_child("endpoints_outlive_their_groups", TCP_RXM);
    in_child_with("endpoints_outlive_their_groups", TCP_RXM, &[("XCCL_RS_OFI_TAG_BITS", "20")]);
}

#[test]
fn a_send_the_provider_still_holds_when_its_phase_fails_is_never_read_after() {
    in_child("send_in_flight_when_its_phase_fails", TCP_RXM);
}

#[test]
fn groups_that_fail_mid_phase_leave_nothing_behind() {
    in_child("fault_cycles", TCP_RXM);
}

#[test]
fn a_dead_peer_off_the_rails_fails_its_waiter_through_a_link_made_on_first_use() {
    in_child("dead_peer_off_the_rails", TCP_RXM);
}

//! Links on demand (transport/tcp/linker.rs, peers.rs): set-up opens only the fabric's eager
//! links, the rest come on first use, one per pair even when both ranks dial at once, and a
//! failure still reaches every rank through the links there are.
//!
//! Links are counted as the process's sockets (/proc/self/fd): the ranks are threads of this
//! process, so a link is two sockets and every rank has one listener. The tests of this file
//! hold one lock, so that no other group's sockets are counted.

mod common;
use common::*;

use std::sync::Mutex;
use std::time::{Duration, Instant};

use xccl_rs::config::TransportChoice;
use xccl_rs::{Config, DType, MemoryStore, OpKind, ReduceOp};

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn sockets() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .expect("/proc/self/fd")
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|t| t.to_string_lossy().starts_with("socket:"))
        .count()
}

/// `hosts` fake hosts of `per_host` ranks each (rank r on host r / per_host).
fn mixed(hosts: usize, per_host: usize, timeout: Duration) -> Vec<Config> {
    (0..hosts * per_host).map(|r| Config { host_id: Some(format!("fake-{}", r / per_host)), ..net_config(Net::Shm, timeout, 4096) }).collect()
}

/// Runs `size` ranks; after set-up and again after `f`, rank 0 counts the sockets the group
/// added. Returns (after set-up, after `f`).
fn count_links(cfgs: Vec<Config>, f: impl Fn(usize, &xccl_rs::Communicator) + Send + Sync + 'static) -> (usize, usize) {
    let size = cfgs.len();
    let before = sockets();
    let counts = spawn_ranks_with(MemoryStore::new(), cfgs, Duration::from_secs(120), move |rank, comm, barrier| {
        barrier.wait();
        let at_setup = if rank == 0 { sockets() } else { 0 };
        barrier.wait();
        f(rank, &comm);
        barrier.wait();
        let after = if rank == 0 { sockets() } else { 0 };
        barrier.wait();
        (at_setup, after)
    });
    let (at_setup, after) = counts[0];
    assert!(at_setup >= before + size, "{size} listeners at least");
    (at_setup - before, after - before)
}

/// The sockets of `size` ranks with `links` links among them.
fn sockets_of(size: usize, links: usize) -> usize {
    size + 2 * links
}

fn allreduce_check(rank: usize, size: usize, comm: &xccl_rs::Communicator, n: usize) {
    let mut data = f32_bytes(&(0..n).map(|i| value(rank, i)).collect::<Vec<_>>());
    let mut o = reduce_op(OpKind::AllReduce, ReduceOp::Sum);
    o.outputs = vec![buf(&mut data)];
    run(comm, vec![o]).unwrap_or_else(|e| panic!("rank {rank}: allreduce of {n}: {e}"));
    for (i, v) in bytes_f32(&data).into_iter().enumerate() {
        let want: f32 = (0..size).map(|r| value(r, i)).sum();
        assert_eq!(v, want, "rank {rank} element {i} of {n}");
    }
}

/// A mixed group links each rank to its rail peers only (one per other host), at 16 and at 64
/// ranks; all-reduces are exact; an all-to-all then links the pairs it needs on first use.
#[test]
fn a_mixed_group_links_rail_peers_at_set_up_and_the_rest_on_first_use() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    for (hosts, per_host) in [(4usize, 4usize), (8, 8)] {
        let size = hosts * per_host;
        let (at_setup, after) = count_links(mixed(hosts, per_host, Duration::from_secs(60)), move |rank, comm| {
            allreduce_check(rank, size, comm, 2);
            allreduce_check(rank, size, comm, 70_000);
            let len = |src: usize, dst: usize| 1 + (src * 3 + dst) % 5;
            let msg = |src: usize, dst: usize| pattern(src * 1000 + dst, 7, len(src, dst));
            let mut ins: Vec<Vec<u8>> = (0..size).map(|dst| msg(rank, dst)).collect();
            let mut outs: Vec<Vec<u8>> = (0..size).map(|src| vec![0u8; len(src, rank)]).collect();
            let o = op_with(OpKind::AllToAll, DType::UInt8, ins.iter_mut().map(|v| buf(v)).collect(), outs.iter_mut().map(|v| buf(v)).collect());
            run(comm, vec![o]).unwrap_or_else(|e| panic!("rank {rank}: alltoall: {e}"));
            for (src, got) in outs.iter().enumerate() {
                assert_eq!(got, &msg(src, rank), "rank {rank}: all-to-all from rank {src}");
            }
        });
        let rails = size * (hosts - 1) / 2;
        assert_eq!(at_setup, sockets_of(size, rails), "{size} ranks on {hosts} hosts: one listener and the rail links");
        assert!(after > at_setup, "{size} ranks: the all-to-all made links on first use");
        assert!(after <= sockets_of(size, size * (size - 1) / 2), "{size} ranks: at most one link per pair");
    }
}

/// One host: no link at set-up. A ring of send/recv (each rank dials its successor while its
/// predecessor dials it: every pair's dials cross) makes exactly one link per pair and moves
/// the right bytes; a receive from any source takes a message from a rank that had no link.
#[test]
fn first_use_makes_one_link_per_pair_even_when_dials_cross() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let size = 6;
    let cfg = net_config(Net::Shm, Duration::from_secs(30), 4096);
    let (at_setup, after) = count_links(vec![cfg; size], move |rank, comm| {
        let (next, prev) = ((rank + 1) % size, (rank + size - 1) % size);
        for round in 0..3u64 {
            let mut out = pattern(rank, round, 3000);
            let mut got = vec![0u8; 3000];
            let ops = vec![send_to(next, 5, DType::UInt8, buf(&mut out)), recv_from(prev, 5, DType::UInt8, buf(&mut got))];
            run(comm, ops).unwrap_or_else(|e| panic!("rank {rank}: ring round {round}: {e}"));
            assert_eq!(got, pattern(prev, round, 3000), "rank {rank}: ring round {round}");
        }
        // Rank 3 has no link to rank 0 (0 is linked to 1 and 5).
        if rank == 0 {
            let mut got = vec![0u8; 100];
            let mut o = op_with(OpKind::RecvAnySource, DType::UInt8, vec![], vec![buf(&mut got)]);
            o.tag = 9;
            let c = run(comm, vec![o]).unwrap_or_else(|e| panic!("rank 0: recv any: {e}"));
            assert_eq!((c.source_rank, got), (3, pattern(3, 9, 100)), "rank 0: the message of rank 3");
        } else if rank == 3 {
            let mut out = pattern(3, 9, 100);
            run(comm, vec![send_to(0, 9, DType::UInt8, buf(&mut out))]).unwrap_or_else(|e| panic!("rank 3: send: {e}"));
        }
    });
    assert_eq!(at_setup, sockets_of(size, 0), "one host: only the listeners");
    assert_eq!(after, sockets_of(size, size + 1), "the ring's links and one more (3 to 0)");
}

/// Rank 5 of a mixed group (4 hosts of 2) aborts while every other rank is in an all-reduce;
/// only its rail peers and its host peer hear it directly, yet every rank fails within a few
/// seconds (the timeout is 60 s) with rank 5's message, passed on from rank to rank.
#[test]
fn a_failure_floods_the_link_graph() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let size = 8;
    let results = try_spawn_ranks_with(MemoryStore::new(), mixed(4, 2, Duration::from_secs(60)), Duration::from_secs(90), move |rank, comm, barrier| {
        allreduce_check(rank, size, &comm, 10);
        barrier.wait();
        let start = Instant::now();
        if rank == 5 {
            std::thread::sleep(Duration::from_millis(300));
            comm.abort(OpKind::AllReduce, "local problem 43 on rank 5");
            return (Duration::ZERO, String::new());
        }
        let mut data = f32_bytes(&[1.0; 1000]);
        let mut o = reduce_op(OpKind::AllReduce, ReduceOp::Sum);
        o.outputs = vec![buf(&mut data)];
        let e = run(&comm, vec![o]).err().map(|e| e.to_string()).unwrap_or_default();
        (start.elapsed(), e)
    });
    for (rank, r) in results.into_iter().enumerate().filter(|(r, _)| *r != 5) {
        let (took, e) = r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        assert!(e.contains("local problem 43 on rank 5"), "rank {rank}: {e:?}");
        assert!(took < Duration::from_secs(10), "rank {rank} failed after {took:?}: {e}");
    }
}

/// With every rank eager (`XCCL_RS_TRANSPORT=tcp`), set-up still makes the full mesh.
#[test]
fn a_tcp_only_group_is_a_full_mesh() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let size = 5;
    let cfg = Config { transport: TransportChoice::Tcp, ..config(Duration::from_secs(30), 4096) };
    let (at_setup, after) = count_links(vec![cfg; size], move |rank, comm| allreduce_check(rank, size, comm, 1000));
    assert_eq!(at_setup, sockets_of(size, size * (size - 1) / 2));
    assert_eq!(after, at_setup);
}

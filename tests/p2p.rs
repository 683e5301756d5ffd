//! Point-to-point: Send/Recv between every ordered pair; a batched ring of 4 MiB messages (one
//! job, deadlocks unless its sends and receives run together); message order to one peer within
//! and across jobs; tag matching; RecvAnySource (source rank, data, tag filter, order).

mod common;
use common::*;
use std::time::Duration;
use xccl_rs::{Communicator, Config, DType, Op, OpKind, RawBuf, ReduceOp};

const LIMIT: Duration = Duration::from_secs(60);

fn cfg() -> Config {
    config(Duration::from_secs(10), 4096)
}

fn send(peer: usize, tag: i64, dtype: DType, b: RawBuf) -> Op {
    let mut o = op_with(OpKind::Send, dtype, vec![b], vec![]);
    o.root = peer as i64;
    o.tag = tag;
    o
}

fn recv(peer: usize, tag: i64, dtype: DType, b: RawBuf) -> Op {
    let mut o = op_with(OpKind::Recv, dtype, vec![], vec![b]);
    o.root = peer as i64;
    o.tag = tag;
    o
}

fn recv_any(tag: i64, dtype: DType, b: RawBuf) -> Op {
    let mut o = op_with(OpKind::RecvAnySource, dtype, vec![], vec![b]);
    o.tag = tag;
    o
}

fn comm_barrier(comm: &Communicator) {
    run(comm, vec![op_with(OpKind::Barrier, DType::Float32, vec![], vec![])]).expect("barrier");
}

/// Every ordered pair in turn (the others idle), several sizes and dtypes; afterwards the
/// collectives still line up although ranks ran different numbers of p2p ops.
#[test]
fn send_recv_every_pair() {
    for size in 2..=5 {
        spawn_ranks(size, cfg(), LIMIT, move |rank, comm, _| {
            for (k, (dtype, n)) in [(DType::UInt8, 0), (DType::Float32, 1), (DType::Int64, 1001), (DType::BFloat16, 150_001)]
                .into_iter()
                .enumerate()
            {
                let len = n * dtype.size();
                for a in 0..size {
                    for b in (0..size).filter(|&b| b != a) {
                        let what = format!("size {size} {a}->{b} {dtype} n {n} rank {rank}");
                        let salt = salt3(k, a, b);
                        let tag = (a * 10 + b) as i64;
                        if rank == a {
                            let mut data = pattern(a, salt, len);
                            let c = run(&comm, vec![send(b, tag, dtype, buf(&mut data))]).unwrap_or_else(|e| panic!("{what}: {e}"));
                            assert_eq!(c.source_rank, -1, "{what}");
                        } else if rank == b {
                            let mut data = vec![0x5Au8; len];
                            let c = run(&comm, vec![recv(a, tag, dtype, buf(&mut data))]).unwrap_or_else(|e| panic!("{what}: {e}"));
                            assert_eq!(c.source_rank, -1, "{what}: a receive from a known peer reports no source");
                            assert!(data == pattern(a, salt, len), "{what}: wrong data");
                        }
                    }
                }
            }
            assert_eq!(comm.next_seq(), 0, "point-to-point ops take no collective sequence number");
            let mut x = f32::to_bytes(&inputs::<f32>(rank, 0, 100, 3, ReduceOp::Sum));
            run(&comm, vec![op_with(OpKind::AllReduce, DType::Float32, vec![], vec![buf(&mut x)])]).expect("allreduce after p2p");
            check_reduced(&f32::from_bytes(&x), size, 0, 3, ReduceOp::Sum, 1.0, "allreduce after p2p");
        });
    }
}

fn salt3(a: usize, b: usize, c: usize) -> u64 {
    mix(mix(mix(a as u64) ^ b as u64) ^ c as u64)
}

/// One job per rank: send 4 MiB to the next rank, receive 4 MiB from the previous one. Run one
/// op after the other, every rank would block in its send with nobody receiving.
#[test]
fn batched_ring_of_large_messages() {
    const LEN: usize = (4 << 20) + 3;
    for size in 2..=4 {
        spawn_ranks(size, cfg(), LIMIT, move |rank, comm, _| {
            let (next, prev) = ((rank + 1) % size, (rank + size - 1) % size);
            let mut out = pattern(rank, 40, LEN);
            let mut inp = vec![0u8; LEN];
            run(&comm, vec![send(next, 1, DType::UInt8, buf(&mut out)), recv(prev, 1, DType::UInt8, buf(&mut inp))])
                .unwrap_or_else(|e| panic!("size {size} rank {rank}: {e}"));
            assert!(inp == pattern(prev, 40, LEN), "size {size} rank {rank}: wrong data from rank {prev}");
        });
    }
}

/// Messages to one peer arrive in the order they were submitted, within a job and across jobs,
/// also when interleaved with messages to another peer and when they are large.
#[test]
fn messages_to_one_peer_keep_their_order() {
    let size = 3;
    let lens = [1000usize, 1000, 1 << 20, 1 << 20, 7, 0, 1000];
    spawn_ranks(size, cfg(), LIMIT, move |rank, comm, _| {
        let msg = |dst: usize, k: usize| pattern(dst * 100 + k, 50, lens[k]);
        if rank == 0 {
            let mut bufs: Vec<Vec<u8>> = (0..lens.len()).flat_map(|k| [msg(1, k), msg(2, k)]).collect();
            let mut ops: Vec<Op> = bufs.iter_mut().enumerate().map(|(j, b)| send(1 + j % 2, 8, DType::UInt8, buf(b))).collect();
            // The last two messages to each peer go in a second job, submitted before the first
            // finishes.
            let tail = ops.split_off(ops.len() - 4);
            let first = submit_async(&comm, ops);
            let second = submit_async(&comm, tail);
            first.recv().unwrap().expect("first job");
            second.recv().unwrap().expect("second job");
        } else {
            let mut bufs: Vec<Vec<u8>> = lens.iter().map(|&l| vec![0x5Au8; l]).collect();
            let ops = bufs.iter_mut().map(|b| recv(0, 8, DType::UInt8, buf(b))).collect();
            run(&comm, ops).unwrap_or_else(|e| panic!("rank {rank}: {e}"));
            for (k, b) in bufs.iter().enumerate() {
                assert!(*b == msg(rank, k), "rank {rank}: message {k} out of order or corrupt");
            }
        }
    });
}

/// Matching tags (any value) work; a receive with another tag than the send fails with a
/// message about the tag, and both ranks' next jobs fail.
#[test]
fn tags_must_match() {
    spawn_ranks(2, config(Duration::from_secs(3), 4096), LIMIT, move |rank, comm, _| {
        for tag in [0i64, 7, -3, i64::MAX] {
            let mut d = if rank == 0 { pattern(0, tag as u64, 64) } else { vec![0; 64] };
            let o = if rank == 0 { send(1, tag, DType::UInt8, buf(&mut d)) } else { recv(0, tag, DType::UInt8, buf(&mut d)) };
            run(&comm, vec![o]).unwrap_or_else(|e| panic!("tag {tag} rank {rank}: {e}"));
            assert!(d == pattern(0, tag as u64, 64), "tag {tag}: wrong data");
        }
        let mut d = vec![1u8; 64];
        let o = if rank == 0 { send(1, 5, DType::UInt8, buf(&mut d)) } else { recv(0, 6, DType::UInt8, buf(&mut d)) };
        let r = run(&comm, vec![o]);
        if rank == 1 {
            let e = expect_err(r, "recv with tag 6 from a send with tag 5");
            assert_mentions(&e, &["tag", "5", "6"], "tag mismatch");
            assert!(d == vec![1u8; 64], "a mismatched message must not be written");
        }
        // The sender may have finished its send before the receiver looked; its next job
        // learns of the failure at once.
        let (r, took) = timed(&comm, vec![op_with(OpKind::Barrier, DType::Float32, vec![], vec![])]);
        let e = expect_err(r, &format!("barrier after a tag mismatch on rank {rank}"));
        assert_mentions(&e, &["tag"], "barrier after a tag mismatch");
        assert!(took < Duration::from_secs(1), "rank {rank}: the failure took {took:?} to arrive");
    });
}

/// A receive whose length differs from the send's fails, naming the size mismatch.
#[test]
fn recv_length_must_match_send() {
    spawn_ranks(2, config(Duration::from_secs(3), 4096), LIMIT, move |rank, comm, _| {
        let mut d = vec![0u8; if rank == 0 { 40 } else { 44 }];
        let o = if rank == 0 { send(1, 0, DType::Int32, buf(&mut d)) } else { recv(0, 0, DType::Int32, buf(&mut d)) };
        let r = run(&comm, vec![o]);
        if rank == 1 {
            assert_mentions(&expect_err(r, "recv of 11 elements from a send of 10"), &["size mismatch", "10", "11"], "p2p size");
        }
    });
}

/// RecvAnySource: the completion names the sender, the data is that sender's; a tag picks the
/// matching sender even when another message arrived first; two messages from one sender come
/// in order; large messages work.
#[test]
fn recv_any_source() {
    let size = 4;
    spawn_ranks(size, cfg(), LIMIT, move |rank, comm, barrier| {
        // 1. Every other rank sends one message with the same tag.
        let len = 1000;
        if rank == 0 {
            let mut seen = vec![];
            for _ in 1..size {
                let mut d = vec![0u8; len];
                let c = run(&comm, vec![recv_any(9, DType::Float32, buf(&mut d))]).expect("recv any");
                let s = c.source_rank;
                assert!((1..size as i64).contains(&s), "source_rank {s}");
                assert!(d == pattern(s as usize, 60, len), "data is not rank {s}'s");
                seen.push(s);
            }
            seen.sort();
            assert_eq!(seen, vec![1, 2, 3]);
        } else {
            let mut d = pattern(rank, 60, len);
            run(&comm, vec![send(0, 9, DType::Float32, buf(&mut d))]).expect("send");
        }
        barrier.wait();

        // 2. Rank 1's tag-1 message is in rank 0's socket before rank 2 sends with tag 2; a
        //    receive for tag 2 must take rank 2's, then tag 1 gets rank 1's.
        if rank == 1 {
            let mut d = pattern(1, 61, 64);
            run(&comm, vec![send(0, 1, DType::UInt8, buf(&mut d))]).expect("send");
        }
        barrier.wait();
        if rank == 2 {
            let mut d = pattern(2, 61, 64);
            run(&comm, vec![send(0, 2, DType::UInt8, buf(&mut d))]).expect("send");
        }
        if rank == 0 {
            for tag in [2i64, 1] {
                let mut d = vec![0u8; 64];
                let c = run(&comm, vec![recv_any(tag, DType::UInt8, buf(&mut d))]).expect("recv any");
                assert_eq!(c.source_rank, tag, "tag {tag} must come from rank {tag}");
                assert!(d == pattern(tag as usize, 61, 64), "tag {tag}: wrong data");
            }
        }
        barrier.wait();

        // 3. An empty message.
        if rank == 3 {
            run(&comm, vec![send(0, 0, DType::Float32, buf(&mut []))]).expect("send");
        }
        if rank == 0 {
            let c = run(&comm, vec![recv_any(0, DType::Float32, buf(&mut []))]).expect("recv any");
            assert_eq!(c.source_rank, 3, "empty message");
        }
        barrier.wait();

        // 4. Two messages from rank 3 (the second large), received by any-source, in order;
        //    then a plain Recv from rank 3 continues the same numbering.
        let lens = [100usize, 1 << 20, 33];
        if rank == 3 {
            let mut bufs: Vec<Vec<u8>> = lens.iter().enumerate().map(|(k, &l)| pattern(30 + k, 62, l)).collect();
            let ops = bufs.iter_mut().map(|b| send(0, 4, DType::UInt8, buf(b))).collect();
            run(&comm, ops).expect("sends");
        }
        if rank == 0 {
            for (k, &l) in lens.iter().enumerate() {
                let mut d = vec![0u8; l];
                let o = if k < 2 { recv_any(4, DType::UInt8, buf(&mut d)) } else { recv(3, 4, DType::UInt8, buf(&mut d)) };
                let c = run(&comm, vec![o]).expect("recv");
                assert_eq!(c.source_rank, if k < 2 { 3 } else { -1 }, "message {k}");
                assert!(d == pattern(30 + k, 62, l), "message {k} out of order or corrupt");
            }
        }
        comm_barrier(&comm);
    });
}

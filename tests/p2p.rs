//! Point-to-point: Send/Recv between every ordered pair; a batched ring of 4 MiB messages (one
//! job, deadlocks unless its sends and receives run together); message order to one peer within
//! and across jobs; tag matching; RecvAnySource (source rank, data, tag filter, order). Each test
//! reports every failing point (tests/common/failures.rs), named by its parameters and rank.

mod common;
use common::*;
use std::time::Duration;
use xccl_rs::{Communicator, Config, DType, Op, OpKind, RawBuf, ReduceOp};

const LIMIT: Duration = Duration::from_secs(60);

fn cfg() -> Config {
    config(Duration::from_secs(10), 4096)
}

fn recv_any(tag: i64, dtype: DType, b: RawBuf) -> Op {
    let mut o = op_with(OpKind::RecvAnySource, dtype, vec![], vec![b]);
    o.tag = tag;
    o
}

fn comm_barrier(f: &mut Failures, comm: &Communicator, what: &str) -> Result<(), Stop> {
    f.op(run(comm, vec![barrier_op()]), format!("{what}: barrier"))?;
    Ok(())
}

/// A test of one sweep on ranks 0 and 1 with a short timeout, for failures: `f(rank, comm,
/// failures)`, then the report of `what`.
fn failing_pair(what: &str, f: impl Fn(usize, Communicator, &mut Failures) -> Result<(), Stop> + Send + Sync + 'static) {
    let mut failures = Failures::new();
    sweep_ranks(&mut failures, what, 2, config(Duration::from_secs(3), 4096), LIMIT, move |rank, comm, _, fl| f(rank, comm, fl));
    failures.finish(what);
}

/// Every ordered pair in turn (the others idle), several sizes and dtypes; afterwards the
/// collectives still line up although ranks ran different numbers of p2p ops.
#[test]
fn send_recv_every_pair() {
    let mut failures = Failures::new();
    for size in 2..=5 {
        sweep_ranks(&mut failures, &format!("send/recv size {size}"), size, cfg(), LIMIT, move |rank, comm, _, f| {
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
                            let c = f.op(run(&comm, vec![send_to(b, tag, dtype, buf(&mut data))]), &what)?;
                            f.eq(c.source_rank, -1, format!("{what}: source rank"));
                        } else if rank == b {
                            let mut data = vec![0x5Au8; len];
                            let c = f.op(run(&comm, vec![recv_from(a, tag, dtype, buf(&mut data))]), &what)?;
                            f.eq(c.source_rank, -1, format!("{what}: a receive from a known peer reports no source"));
                            f.result(same_bytes(&data, &pattern(a, salt, len)), format!("{what}: wrong data"));
                        }
                    }
                }
            }
            let what = format!("size {size} rank {rank}");
            f.eq(comm.next_seq(), 0, format!("{what}: point-to-point ops take no collective sequence number"));
            let mut x = f32::to_bytes(&inputs::<f32>(rank, 0, 100, 3, ReduceOp::Sum));
            let what = format!("{what}: allreduce after p2p");
            f.op(run(&comm, vec![op_with(OpKind::AllReduce, DType::Float32, vec![], vec![buf(&mut x)])]), &what)?;
            f.result(check_reduced::<f32>(&x, size, 0, 3, ReduceOp::Sum, 1.0), &what);
            Ok(())
        });
    }
    failures.finish("send/recv between every pair");
}

fn salt3(a: usize, b: usize, c: usize) -> u64 {
    mix(mix(mix(a as u64) ^ b as u64) ^ c as u64)
}

/// One job per rank: send 4 MiB to the next rank, receive 4 MiB from the previous one. Run one
/// op after the other, every rank would block in its send with nobody receiving.
#[test]
fn batched_ring_of_large_messages() {
    const LEN: usize = (4 << 20) + 3;
    let mut failures = Failures::new();
    for size in 2..=4 {
        sweep_ranks(&mut failures, &format!("ring size {size}"), size, cfg(), LIMIT, move |rank, comm, _, f| {
            let (next, prev) = ((rank + 1) % size, (rank + size - 1) % size);
            let mut out = pattern(rank, 40, LEN);
            let mut inp = vec![0u8; LEN];
            let what = format!("size {size} rank {rank}");
            f.op(run(&comm, vec![send_to(next, 1, DType::UInt8, buf(&mut out)), recv_from(prev, 1, DType::UInt8, buf(&mut inp))]), &what)?;
            f.result(same_bytes(&inp, &pattern(prev, 40, LEN)), format!("{what}: wrong data from rank {prev}"));
            Ok(())
        });
    }
    failures.finish("batched ring of large messages");
}

/// Messages to one peer arrive in the order they were submitted, within a job and across jobs,
/// also when interleaved with messages to another peer and when they are large.
#[test]
fn messages_to_one_peer_keep_their_order() {
    let size = 3;
    let lens = [1000usize, 1000, 1 << 20, 1 << 20, 7, 0, 1000];
    let mut failures = Failures::new();
    sweep_ranks(&mut failures, "messages to one peer", size, cfg(), LIMIT, move |rank, comm, _, f| {
        let msg = |dst: usize, k: usize| pattern(dst * 100 + k, 50, lens[k]);
        if rank == 0 {
            let mut bufs: Vec<Vec<u8>> = (0..lens.len()).flat_map(|k| [msg(1, k), msg(2, k)]).collect();
            let mut ops: Vec<Op> = bufs.iter_mut().enumerate().map(|(j, b)| send_to(1 + j % 2, 8, DType::UInt8, buf(b))).collect();
            // The last two messages to each peer go in a second job, submitted before the first
            // finishes.
            let tail = ops.split_off(ops.len() - 4);
            let first = submit_async(&comm, ops);
            let second = submit_async(&comm, tail);
            f.op(first.recv().unwrap(), "rank 0: first job")?;
            f.op(second.recv().unwrap(), "rank 0: second job")?;
        } else {
            let mut bufs: Vec<Vec<u8>> = lens.iter().map(|&l| vec![0x5Au8; l]).collect();
            let ops = bufs.iter_mut().map(|b| recv_from(0, 8, DType::UInt8, buf(b))).collect();
            f.op(run(&comm, ops), format!("rank {rank}"))?;
            for (k, b) in bufs.iter().enumerate() {
                f.result(same_bytes(b, &msg(rank, k)), format!("rank {rank}: message {k} (length {}) out of order or corrupt", lens[k]));
            }
        }
        Ok(())
    });
    failures.finish("messages to one peer keep their order");
}

/// Matching tags (any value) work; a receive with another tag than the send fails with a
/// message about the tag, and both ranks' next jobs fail.
#[test]
fn tags_must_match() {
    failing_pair("tags must match", |rank, comm, f| {
        for tag in [0i64, 7, -3, i64::MAX] {
            let mut d = if rank == 0 { pattern(0, tag as u64, 64) } else { vec![0; 64] };
            f.op(run(&comm, vec![zero_to_one(rank, tag, tag, DType::UInt8, buf(&mut d))]), format!("tag {tag} rank {rank}"))?;
            f.result(same_bytes(&d, &pattern(0, tag as u64, 64)), format!("tag {tag} rank {rank}: wrong data"));
        }
        let mut d = vec![1u8; 64];
        let r = run(&comm, vec![zero_to_one(rank, 5, 6, DType::UInt8, buf(&mut d))]);
        if rank == 1 {
            expect_err_mentioning(f, r, &["tag", "5", "6"], "rank 1: recv with tag 6 from a send with tag 5");
            f.result(same_bytes(&d, &[1u8; 64]), "rank 1: a mismatched message must not be written");
        }
        // The sender may have finished its send before the receiver looked; its next job
        // learns of the failure at once.
        fails_within(f, &comm, vec![barrier_op()], &["tag"], Duration::from_secs(1), &format!("barrier after a tag mismatch on rank {rank}"));
        Ok(())
    });
}

/// A receive whose length differs from the send's fails, naming the size mismatch.
#[test]
fn recv_length_must_match_send() {
    failing_pair("recv length must match send", |rank, comm, f| {
        let mut d = vec![0u8; if rank == 0 { 40 } else { 44 }];
        let r = run(&comm, vec![zero_to_one(rank, 0, 0, DType::Int32, buf(&mut d))]);
        if rank == 1 {
            expect_err_mentioning(f, r, &["size mismatch", "10", "11"], "rank 1: recv of 11 elements from a send of 10");
        }
        Ok(())
    });
}

/// RecvAnySource: the completion names the sender, the data is that sender's; a tag picks the
/// matching sender even when another message arrived first; two messages from one sender come
/// in order; large messages work.
#[test]
fn recv_any_source() {
    let size = 4;
    let mut failures = Failures::new();
    sweep_ranks(&mut failures, "recv any source", size, cfg(), LIMIT, move |rank, comm, barrier, f| {
        // 1. Every other rank sends one message with the same tag.
        let len = 1000;
        let what = format!("1. one message from every rank, rank {rank}");
        if rank == 0 {
            let mut seen = vec![];
            for k in 1..size {
                let mut d = vec![0u8; len];
                let c = f.op(run(&comm, vec![recv_any(9, DType::Float32, buf(&mut d))]), format!("{what}: recv any {k}"))?;
                let s = c.source_rank;
                if f.check((1..size as i64).contains(&s), || format!("{what}: recv any {k}: source_rank {s}")) {
                    f.result(same_bytes(&d, &pattern(s as usize, 60, len)), format!("{what}: recv any {k}: data is not rank {s}'s"));
                }
                seen.push(s);
            }
            seen.sort();
            f.eq(seen, vec![1, 2, 3], format!("{what}: the sources seen"));
        } else {
            let mut d = pattern(rank, 60, len);
            f.op(run(&comm, vec![send_to(0, 9, DType::Float32, buf(&mut d))]), format!("{what}: send"))?;
        }
        barrier.wait();

        // 2. Rank 1's tag-1 message is in rank 0's socket before rank 2 sends with tag 2; a
        //    receive for tag 2 must take rank 2's, then tag 1 gets rank 1's.
        let what = format!("2. tag filter, rank {rank}");
        if rank == 1 {
            let mut d = pattern(1, 61, 64);
            f.op(run(&comm, vec![send_to(0, 1, DType::UInt8, buf(&mut d))]), format!("{what}: send"))?;
        }
        barrier.wait();
        if rank == 2 {
            let mut d = pattern(2, 61, 64);
            f.op(run(&comm, vec![send_to(0, 2, DType::UInt8, buf(&mut d))]), format!("{what}: send"))?;
        }
        if rank == 0 {
            for tag in [2i64, 1] {
                let mut d = vec![0u8; 64];
                let c = f.op(run(&comm, vec![recv_any(tag, DType::UInt8, buf(&mut d))]), format!("{what}: recv any tag {tag}"))?;
                f.eq(c.source_rank, tag, format!("{what}: tag {tag} must come from rank {tag}"));
                f.result(same_bytes(&d, &pattern(tag as usize, 61, 64)), format!("{what}: tag {tag}: wrong data"));
            }
        }
        barrier.wait();

        // 3. An empty message.
        let what = format!("3. empty message, rank {rank}");
        if rank == 3 {
            f.op(run(&comm, vec![send_to(0, 0, DType::Float32, buf(&mut []))]), format!("{what}: send"))?;
        }
        if rank == 0 {
            let c = f.op(run(&comm, vec![recv_any(0, DType::Float32, buf(&mut []))]), format!("{what}: recv any"))?;
            f.eq(c.source_rank, 3, format!("{what}: source rank"));
        }
        barrier.wait();

        // 4. Two messages from rank 3 (the second large), received by any-source, in order;
        //    then a plain Recv from rank 3 continues the same numbering.
        let what = format!("4. order from one sender, rank {rank}");
        let lens = [100usize, 1 << 20, 33];
        if rank == 3 {
            let mut bufs: Vec<Vec<u8>> = lens.iter().enumerate().map(|(k, &l)| pattern(30 + k, 62, l)).collect();
            let ops = bufs.iter_mut().map(|b| send_to(0, 4, DType::UInt8, buf(b))).collect();
            f.op(run(&comm, ops), format!("{what}: sends"))?;
        }
        if rank == 0 {
            for (k, &l) in lens.iter().enumerate() {
                let mut d = vec![0u8; l];
                let o = if k < 2 { recv_any(4, DType::UInt8, buf(&mut d)) } else { recv_from(3, 4, DType::UInt8, buf(&mut d)) };
                let c = f.op(run(&comm, vec![o]), format!("{what}: recv of message {k}"))?;
                f.eq(c.source_rank, if k < 2 { 3 } else { -1 }, format!("{what}: message {k}: source rank"));
                f.result(same_bytes(&d, &pattern(30 + k, 62, l)), format!("{what}: message {k} out of order or corrupt"));
            }
        }
        comm_barrier(f, &comm, &what)
    });
    failures.finish("recv any source");
}

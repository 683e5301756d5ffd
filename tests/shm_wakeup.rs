//! The shared-memory wait protocol when ranks arrive far apart: with no spin at all, every rank
//! that waits sleeps on the group futex, and the publish of the last rank to arrive must wake
//! it at once (a lost wake-up would only end at the sleeper's 100 ms nap). Ranks arrive in
//! reverse order, so a waiter sees its peers done one by one (the wait re-polls only the first
//! rank still lagging: a skipped rank would let it read data not yet there). Every result is
//! checked against sums computed here in f64, on the one-shot and the blocked all-reduce.

mod common;
use common::*;
use std::time::{Duration, Instant};
use xccl_rs::config::TransportChoice;
use xccl_rs::{OpKind, ReduceOp};

const RANKS: usize = 4;
const ROUNDS: usize = 12;
/// Rank r starts each round r × STAGGER after rank 0.
const STAGGER: Duration = Duration::from_millis(3);
/// Far below the sleeper's 100 ms nap, far above a prompt wake-up.
const LATE: Duration = Duration::from_millis(60);

fn staggered_allreduce(n: usize) -> (Vec<String>, usize) {
    let mut cfg = config(Duration::from_secs(20), 4096);
    cfg.transport = TransportChoice::Auto;
    cfg.spin = Duration::ZERO;
    cfg.shm_slot_bytes = 4096; // n above 1024 floats runs the blocked path, in several blocks
    let results = spawn_ranks(RANKS, cfg, Duration::from_secs(120), move |rank, comm, barrier| {
        let mut wrong = Vec::new();
        let mut late = 0;
        for round in 0..ROUNDS {
            barrier.wait();
            std::thread::sleep(STAGGER * (RANKS - 1 - rank) as u32);
            let t0 = Instant::now();
            let mut data = f32_bytes(&(0..n).map(|i| value(rank + round, i)).collect::<Vec<_>>());
            let mut o = reduce_op(OpKind::AllReduce, ReduceOp::Sum);
            o.outputs = vec![buf(&mut data)];
            if let Err(e) = run(&comm, vec![o]) {
                wrong.push(format!("rank {rank} round {round}: {e}"));
                break;
            }
            // The last rank arrives (RANKS - 1 - rank) × STAGGER after this one.
            if t0.elapsed() > STAGGER * (RANKS - 1 - rank) as u32 + LATE {
                late += 1;
            }
            let got = bytes_f32(&data);
            if let Some(i) = (0..n).find(|&i| got[i] as f64 != (0..RANKS).map(|r| value(r + round, i) as f64).sum::<f64>()) {
                wrong.push(format!("rank {rank} round {round} n {n}: element {i} is {}", got[i]));
            }
        }
        if comm.shm_blocks_used() == 0 {
            wrong.push(format!("rank {rank}: the ops did not run through shared memory"));
        }
        (wrong, late)
    });
    let late = results.iter().map(|(_, l)| *l).sum();
    (results.into_iter().flat_map(|(w, _)| w).collect(), late)
}

fn check(n: usize) {
    let (wrong, late) = staggered_allreduce(n);
    assert!(wrong.is_empty(), "wrong results: {wrong:?}");
    // A loaded machine may be late now and then; a lost wake-up is late on nearly every round.
    assert!(late <= ROUNDS / 4, "{late} of {} waits ended more than {LATE:?} after the last rank arrived", ROUNDS * RANKS);
}

#[test]
fn sleeping_waiters_wake_at_once_one_shot() {
    check(100);
}

#[test]
fn sleeping_waiters_wake_at_once_blocked() {
    check(3000);
}

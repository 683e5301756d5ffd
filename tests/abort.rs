//! Aborting a group and failures nobody waits for (src/abort.rs): `abort_now` from another
//! thread stops a blocked op at once and fails the peers blocked with it; a timed-out op is
//! reported to the failure listeners within the timeout, with no waiter; the first error stays
//! the group's error and every later op quotes it.

#[macro_use]
mod common;
use common::*;
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};
use xccl_rs::{CommError, DType, ErrorKind, OpKind, ReduceOp};

const LIMIT: Duration = Duration::from_secs(60);

fn all_reduce(host: &mut [u8]) -> xccl_rs::Op {
    let mut o = op_with(OpKind::AllReduce, DType::Float32, vec![], vec![buf(host)]);
    o.reduce_op = ReduceOp::Sum;
    o
}

/// Ranks 0 and 1 wait in an all-reduce that rank 2 never joins; rank 0 is aborted from another
/// thread half a second in. Rank 0's op fails at once with the abort, rank 1's as soon as it
/// hears (well before the 20 s timeout), and rank 2's next op quotes rank 0's abort. The
/// listeners of all three hear one failure each (on their own thread, just after it).
fn abort_stops_blocked_ops_on_every_rank(net: Net) {
    let mut failures = Failures::new();
    sweep_ranks(&mut failures, "abort", 3, net_config(net, Duration::from_secs(20), 4096), LIMIT, move |rank, comm, barrier, f| {
        let comm = Arc::new(comm);
        let heard = Arc::new(Mutex::new(Vec::<ErrorKind>::new()));
        let h = heard.clone();
        comm.on_failure(Arc::new(move |e: &CommError| h.lock().unwrap().push(e.kind)));
        let mut host = vec![0u8; 4096];
        let started = Instant::now();
        let what = format!("rank {rank}");
        if rank < 2 {
            let aborter = (rank == 0).then(|| {
                let comm = comm.clone();
                std::thread::spawn(move || {
                    std::thread::sleep(Duration::from_millis(500));
                    comm.abort_now("abort() was called");
                })
            });
            let needle = if rank == 0 { "aborted: abort() was called" } else { "rank 0" };
            expect_err_mentioning(f, run(&comm, vec![all_reduce(&mut host)]), &[needle], &what);
            f.check(started.elapsed() < Duration::from_secs(3), || format!("{what}: failed after {:?}, expected about 0.5 s", started.elapsed()));
            if let Some(t) = aborter {
                t.join().unwrap();
            }
            barrier.wait();
        } else {
            barrier.wait(); // the others have failed
            expect_err_mentioning(f, run(&comm, vec![all_reduce(&mut host)]), &["abort() was called"], &what);
        }
        let again = run(&comm, vec![all_reduce(&mut host)]);
        expect_err_mentioning(f, again, &["failed earlier", "abort() was called"], &format!("{what}: the next op"));
        // The listeners run on a thread of their own, just after the failure.
        let deadline = Instant::now() + Duration::from_secs(2);
        while heard.lock().unwrap().is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        f.eq(heard.lock().unwrap().len(), 1, format!("{what}: failures heard"));
        f.check(comm.error().is_some(), || format!("{what}: error() is None after the failure"));
        Ok(())
    });
    failures.finish(&format!("abort over {net:?}"));
}

/// An async all-reduce that rank 1 never joins: with no waiter, rank 0's listener hears a
/// timeout within the timeout plus one second, error() says Timeout, and the next op fails
/// quoting "timed out". Rank 1 stays idle meanwhile and then sees the failure too.
fn timeout_is_reported_without_a_waiter(net: Net) {
    let timeout = Duration::from_millis(1500);
    let mut failures = Failures::new();
    sweep_ranks(&mut failures, "timeout without waiter", 2, net_config(net, timeout, 4096), LIMIT, move |rank, comm, barrier, f| {
        let (tx, rx) = mpsc::channel();
        let tx = Mutex::new(tx);
        comm.on_failure(Arc::new(move |e: &CommError| {
            let _ = tx.lock().unwrap().send((e.kind, Instant::now()));
        }));
        let mut host = vec![0u8; 4096];
        let what = format!("rank {rank}");
        if rank == 0 {
            let started = Instant::now();
            let _pending = submit_async(&comm, vec![all_reduce(&mut host)]); // nobody waits on it
            match rx.recv_timeout(timeout + Duration::from_secs(5)) {
                Ok((kind, at)) => {
                    f.eq(kind, ErrorKind::Timeout, format!("{what}: the kind heard"));
                    let after = at - started;
                    f.check(after >= timeout && after < timeout + Duration::from_secs(1), || format!("{what}: heard after {after:?}, timeout {timeout:?}"));
                }
                Err(_) => f.fail(format!("{what}: no failure heard within the timeout plus 5 s")),
            }
            f.eq(comm.error().map(|e| e.kind), Some(ErrorKind::Timeout), format!("{what}: error()"));
            expect_err_mentioning(f, run(&comm, vec![all_reduce(&mut host)]), &["timed out"], &format!("{what}: the next op"));
        }
        barrier.wait();
        Ok(())
    });
    failures.finish(&format!("timeout without a waiter over {net:?}"));
}

both_nets!(abort_stops_blocked_ops_on_every_rank, timeout_is_reported_without_a_waiter);

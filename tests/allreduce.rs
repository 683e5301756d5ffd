//! All-reduce and reduce-scatter across world sizes 1..=5, sizes on both sides of the segment
//! boundary, checked against sums computed here in f64. Every failing point is reported, named
//! by world size, count, reduce op and rank.

mod common;
use common::*;
use std::time::Duration;
use xccl_rs::{CommError, Communicator, DType, OpKind, ReduceOp};

const SEGMENT: usize = 4096; // small, so that several rounds run
const LIMIT: Duration = Duration::from_secs(60);

/// Runs one job of `size` ranks, each returning its result or its operation's error; every rank
/// without a result is a failing point named by `what`.
fn ranks_of<T: Send + 'static>(
    f: &mut Failures,
    what: &str,
    size: usize,
    job: impl Fn(usize, &Communicator) -> Result<T, CommError> + Send + Sync + 'static,
) -> Vec<Option<T>> {
    let results = try_spawn_ranks(size, config(Duration::from_secs(20), SEGMENT), LIMIT, move |rank, comm, _| job(rank, &comm));
    f.ranks(results, what).into_iter().enumerate().map(|(rank, r)| f.op(r?, format!("{what} rank {rank}")).ok()).collect()
}

fn check_allreduce(f: &mut Failures, size: usize, n: usize, rop: ReduceOp) {
    let what = format!("size {size} n {n} {rop:?}");
    let results = ranks_of(f, &what, size, move |rank, comm| {
        let mut data = f32_bytes(&(0..n).map(|i| value(rank, i)).collect::<Vec<_>>());
        let mut o = reduce_op(OpKind::AllReduce, rop);
        o.outputs = vec![buf(&mut data)];
        run(comm, vec![o]).map(|_| bytes_f32(&data))
    });
    for (rank, got) in results.iter().enumerate() {
        let Some(got) = got else { continue };
        let bad = each_element(n, |i| {
            let vals: Vec<f64> = (0..size).map(|r| value(r, i) as f64).collect();
            let want = match rop {
                ReduceOp::Sum => vals.iter().sum::<f64>(),
                ReduceOp::Avg => vals.iter().sum::<f64>() / size as f64,
                ReduceOp::Max => vals.iter().cloned().fold(f64::MIN, f64::max),
                ReduceOp::Min => vals.iter().cloned().fold(f64::MAX, f64::min),
                _ => unreachable!(),
            };
            ((got[i] as f64 - want).abs() > 1e-4 * want.abs().max(1.0)).then(|| format!("[{i}]: {} != {want}", got[i]))
        });
        f.result(bad, format!("{what} rank {rank}"));
    }
}

#[test]
fn allreduce_sizes_and_world_sizes() {
    let mut f = Failures::new();
    for size in 1..=5 {
        for n in [0, 1, 7, 1023, 1024, 1025, 5000] {
            check_allreduce(&mut f, size, n, ReduceOp::Sum);
        }
        check_allreduce(&mut f, size, 3001, ReduceOp::Avg);
        check_allreduce(&mut f, size, 3001, ReduceOp::Max);
        check_allreduce(&mut f, size, 3001, ReduceOp::Min);
    }
    f.finish("allreduce over world sizes 1..=5");
}

#[test]
fn reduce_scatter_matches_sums() {
    let mut f = Failures::new();
    for size in 1..=4 {
        let per = 1500;
        let what = format!("reduce_scatter size {size} per {per}");
        let results = ranks_of(&mut f, &what, size, move |rank, comm| {
            let mut input = f32_bytes(&(0..per * size).map(|i| value(rank, i)).collect::<Vec<_>>());
            let mut out = vec![0u8; per * 4];
            let mut o = op(OpKind::ReduceScatter, DType::Float32);
            let whole = buf(&mut input);
            o.inputs = (0..size).map(|r| whole.sub(r * per * 4, per * 4)).collect();
            o.outputs = vec![buf(&mut out)];
            run(comm, vec![o]).map(|_| bytes_f32(&out))
        });
        for (rank, got) in results.iter().enumerate() {
            let Some(got) = got else { continue };
            let bad = each_element(per, |i| {
                let want: f32 = (0..size).map(|r| value(r, rank * per + i)).sum();
                (got[i] != want).then(|| format!("[{i}]: {} != {want}", got[i]))
            });
            f.result(bad, format!("{what} rank {rank}"));
        }
    }
    f.finish("reduce_scatter over world sizes 1..=4");
}

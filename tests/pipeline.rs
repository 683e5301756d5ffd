//! The chunk pipeline (src/pipeline.rs) through its staging hooks, as the bridge uses them for
//! accelerator tensors: a fake device copies each chunk into the host buffers only when the
//! core asks for it (`inputs_ready`) and takes each chunk out only when the core says it is
//! final (`outputs_done`). A core that read a chunk before asking, or reported it before it was
//! final, would compute on (or return) the poison the host buffers start with. As the bridge
//! does, the fake can also describe the op's buffers by placeholder addresses and hand out the
//! host memory behind them only in `host_buffers` (on the thread that runs the job). Each test
//! reports every failing point (tests/common/failures.rs), named by its parameters and rank.

#[macro_use]
mod common;
use common::*;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use xccl_rs::pipeline::{Relocation, Staging};
use xccl_rs::{CommError, Config, DType, OpKind, RawBuf, ReduceOp};

const LIMIT: Duration = Duration::from_secs(60);
const POISON: u8 = 0xFF; // all-ones f32 is a NaN: it would show in every sum

fn cfg(net: Net) -> Config {
    net_config(net, Duration::from_secs(20), 4096)
}

/// One buffer as the fake device holds it: `host` is what the core sees.
struct Staged {
    host: RawBuf,
    device: Arc<Mutex<Vec<u8>>>,
}

/// The staged buffers of one op, and its chunk size.
struct StagedOp {
    chunk: usize,
    inputs: Vec<Staged>,
    outputs: Vec<Staged>,
}

struct FakeDevice {
    ops: Vec<StagedOp>,
    /// (op, chunk, 'i' or 'o') in the order the core called.
    log: Arc<Mutex<Vec<(usize, usize, char)>>>,
    /// Fail `inputs_ready` of this (op, chunk) with "device lost".
    fail_at: Option<(usize, usize)>,
    /// What `host_buffers` returns (placeholder ranges of the op's buffers); None: fail it.
    bindings: Option<Vec<Relocation>>,
    /// Keep each chunk in a window of chunk-sized buffers instead (the op's buffers are
    /// placeholders that `host_buffers` does not bind), as the bridge does.
    window: Option<Window>,
}

impl FakeDevice {
    /// A fake device for `ops` that fails nothing, binds no whole buffers and keeps no window.
    fn new(ops: Vec<StagedOp>) -> FakeDevice {
        FakeDevice { ops, log: Arc::new(Mutex::new(Vec::new())), fail_at: None, bindings: Some(Vec::new()), window: None }
    }
}

/// Submits `ops` staged through `fake` and waits for the job's result.
fn run_staged(comm: &xccl_rs::Communicator, ops: Vec<xccl_rs::Op>, fake: FakeDevice) -> Result<xccl_rs::Completion, CommError> {
    let (tx, rx) = std::sync::mpsc::channel();
    comm.submit_with(ops, Some(Box::new(fake)), Box::new(move |r| drop(tx.send(r))), false)?;
    rx.recv().unwrap()
}

/// A window of chunk-sized host buffers: the job's g-th chunk uses set g % SETS, one slot per
/// distinct buffer of its op; a set is poisoned before each use.
struct Window {
    slots: Vec<Vec<u8>>,
    per_set: usize,
    chunks_seen: usize,
    current: usize, // the set of the chunk in flight
    /// Describe each chunk's range one byte short (a staging bug the core must refuse).
    short: bool,
}

const SETS: usize = 3;

impl Window {
    fn new(per_set: usize, slot_bytes: usize) -> Window {
        Window { slots: vec![vec![POISON; slot_bytes]; SETS * per_set], per_set, chunks_seen: 0, current: 0, short: false }
    }
}

/// The distinct buffers of an op (an in-place buffer is both an input and an output).
fn distinct(o: &StagedOp) -> Vec<RawBuf> {
    let mut seen: Vec<RawBuf> = Vec::new();
    for s in o.inputs.iter().chain(&o.outputs) {
        if !seen.iter().any(|b| b.ptr() == s.host.ptr()) {
            seen.push(s.host);
        }
    }
    seen
}

/// How a job's op buffers point at the host buffers: directly, or (`deferred`) through
/// placeholder ranges that only `host_buffers` binds to them, as the bridge does.
struct Addresses {
    deferred: bool,
    table: Vec<Relocation>,
    next: usize,
}

impl Addresses {
    fn new(deferred: bool) -> Addresses {
        Addresses { deferred, table: Vec::new(), next: 1 << 60 }
    }

    /// The op's view of `real`; with `parts`, `parts` equal consecutive views of it.
    fn of(&mut self, real: RawBuf, parts: usize) -> Vec<RawBuf> {
        let each = real.len() / parts;
        if !self.deferred {
            return (0..parts).map(|p| real.sub(p * each, each)).collect();
        }
        let placeholder = self.next;
        self.next += real.len() + 64;
        self.table.push(Relocation { placeholder, bytes: real.len(), host: real.ptr() as usize });
        // SAFETY: placeholders, never dereferenced: the core moves them to `real` first.
        (0..parts).map(|p| unsafe { RawBuf::new((placeholder + p * each) as *mut u8, each) }).collect()
    }
}

fn chunk_of(b: &RawBuf, chunk: usize, k: usize) -> (usize, usize) {
    let start = (k * chunk).min(b.len());
    (start, (b.len() - start).min(chunk))
}

impl Staging for FakeDevice {
    fn host_buffers(&mut self) -> Result<Vec<Relocation>, CommError> {
        self.log.lock().unwrap().push((0, 0, 'h'));
        self.bindings.clone().ok_or_else(|| CommError::io("out of pinned memory"))
    }

    fn inputs_ready(&mut self, op: usize, k: usize) -> Result<Vec<Relocation>, CommError> {
        self.log.lock().unwrap().push((op, k, 'i'));
        if self.fail_at == Some((op, k)) {
            return Err(CommError::io("device lost"));
        }
        let o = &self.ops[op];
        if let Some(w) = self.window.as_mut() {
            let set = w.chunks_seen % SETS;
            w.chunks_seen += 1;
            w.current = set;
            let mut table = Vec::new();
            for (j, b) in distinct(o).iter().enumerate() {
                let slot = &mut w.slots[set * w.per_set + j];
                slot.fill(POISON);
                let (start, len) = chunk_of(b, o.chunk, k);
                if let Some(s) = o.inputs.iter().find(|s| s.host.ptr() == b.ptr()) {
                    slot[..len].copy_from_slice(&s.device.lock().unwrap()[start..start + len]);
                }
                let bytes = if w.short { len - 1 } else { len };
                table.push(Relocation { placeholder: b.ptr() as usize + start, bytes, host: slot.as_mut_ptr() as usize });
            }
            return Ok(table);
        }
        for s in &o.inputs {
            let (start, len) = chunk_of(&s.host, o.chunk, k);
            let mut dev = s.device.lock().unwrap();
            RawBuf::from_slice(&mut dev[start..start + len]).copy_to(s.host.sub(start, len));
        }
        Ok(Vec::new())
    }

    fn outputs_done(&mut self, op: usize, k: usize) -> Result<(), CommError> {
        self.log.lock().unwrap().push((op, k, 'o'));
        let o = &self.ops[op];
        if let Some(w) = self.window.as_ref() {
            let buffers = distinct(o);
            for s in &o.outputs {
                let (start, len) = chunk_of(&s.host, o.chunk, k);
                let j = buffers.iter().position(|b| b.ptr() == s.host.ptr()).unwrap();
                let slot = &w.slots[w.current * w.per_set + j];
                s.device.lock().unwrap()[start..start + len].copy_from_slice(&slot[..len]);
            }
            return Ok(());
        }
        for s in &o.outputs {
            let (start, len) = chunk_of(&s.host, o.chunk, k);
            let mut dev = s.device.lock().unwrap();
            s.host.sub(start, len).copy_to(RawBuf::from_slice(&mut dev[start..start + len]));
        }
        Ok(())
    }
}

fn device(bytes: Vec<u8>) -> Arc<Mutex<Vec<u8>>> {
    Arc::new(Mutex::new(bytes))
}

/// How the staged job's buffers reach the host.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    /// The op's buffers are the host buffers.
    Direct,
    /// Placeholders, bound to whole host buffers in host_buffers.
    Deferred,
    /// Placeholders, each chunk moved into a window of chunk-sized buffers in inputs_ready.
    Windowed,
}

/// A job of an in-place all-reduce (several chunks), an all-gather (several chunks) and a
/// small broadcast (one chunk), every buffer staged; results compared with references.
fn staged_job_with(net: Net, mode: Mode) {
    let c = match net {
        Net::Tcp => 32 << 10,
        Net::Shm => 8192,
    };
    let mut failures = Failures::new();
    for size in [1usize, 2, 3] {
        let chunk = c;
        sweep_ranks(&mut failures, &format!("staged job size {size} ({mode:?})"), size, cfg(net), LIMIT, move |rank, comm, _, f| {
            let what = format!("size {size} rank {rank} ({mode:?})");
            f.eq(comm.pipeline_chunk_bytes(), chunk, format!("{what}: chunk bytes"));
            let n = 3 * chunk / 4 + 5; // f32 elements: 3 chunks and 20 bytes: 4 chunks
            let ar_in: Vec<f32> = (0..n).map(|i| value(rank, i)).collect();
            let ag_len = 2 * chunk + 100; // bytes per rank: 3 chunks
            let ag_in = pattern(rank, 7, ag_len);
            let bc_in = pattern(rank, 8, 300);

            let mut ar_host = vec![POISON; n * 4];
            let mut ag_host_in = vec![POISON; ag_len];
            let mut ag_host_out = vec![POISON; ag_len * size];
            let mut bc_host = vec![POISON; 300];
            let ar_dev = device(f32_bytes(&ar_in));
            let ag_dev_in = device(ag_in);
            let ag_dev_out: Vec<_> = (0..size).map(|_| device(vec![0; ag_len])).collect();
            let bc_dev = device(bc_in);

            let (ar_buf, ag_in_buf, bc_buf) = (buf(&mut ar_host), buf(&mut ag_host_in), buf(&mut bc_host));
            let ag_out_whole = RawBuf::from_slice(&mut ag_host_out);
            let mut addresses = Addresses::new(mode != Mode::Direct);
            let mut ar = op_with(OpKind::AllReduce, DType::Float32, vec![], addresses.of(ar_buf, 1));
            ar.reduce_op = ReduceOp::Sum;
            let ag = op_with(OpKind::AllGather, DType::UInt8, addresses.of(ag_in_buf, 1), addresses.of(ag_out_whole, size));
            let mut bc = op_with(OpKind::Broadcast, DType::UInt8, vec![], addresses.of(bc_buf, 1));
            bc.root = (size - 1) as i64;
            // Where the fake device copies: the host buffers, or (windowed) the op's own
            // placeholders, whose chunks it moves into its window.
            let (ar_host_buf, ag_host_in_buf, ag_host_views, bc_host_buf) = if mode == Mode::Windowed {
                (ar.outputs[0], ag.inputs[0], ag.outputs.clone(), bc.outputs[0])
            } else {
                (ar_buf, ag_in_buf, views(&mut ag_host_out, size, ag_len), bc_buf)
            };
            let log = Arc::new(Mutex::new(Vec::new()));
            let fake = FakeDevice {
                ops: vec![
                    StagedOp {
                        chunk,
                        inputs: vec![Staged { host: ar_host_buf, device: ar_dev.clone() }],
                        outputs: vec![Staged { host: ar_host_buf, device: ar_dev.clone() }],
                    },
                    StagedOp {
                        chunk,
                        inputs: vec![Staged { host: ag_host_in_buf, device: ag_dev_in.clone() }],
                        outputs: ag_host_views.iter().zip(&ag_dev_out).map(|(v, d)| Staged { host: *v, device: d.clone() }).collect(),
                    },
                    StagedOp {
                        chunk: usize::MAX,
                        inputs: vec![Staged { host: bc_host_buf, device: bc_dev.clone() }],
                        outputs: vec![Staged { host: bc_host_buf, device: bc_dev.clone() }],
                    },
                ],
                log: log.clone(),
                fail_at: None,
                bindings: Some(if mode == Mode::Deferred { addresses.table } else { Vec::new() }),
                window: (mode == Mode::Windowed).then(|| Window::new(size + 1, chunk)),
            };
            f.op(run_staged(&comm, vec![ar, ag, bc], fake), &what)?;

            let got = bytes_f32(&ar_dev.lock().unwrap());
            let bad = each_element(got.len(), |i| {
                let want: f32 = (0..size).map(|r| value(r, i)).sum();
                (got[i] != want).then(|| format!("[{i}]: {} != {want}", got[i]))
            });
            f.result(bad, format!("{what}: all-reduce"));
            for (r, d) in ag_dev_out.iter().enumerate() {
                f.result(same_bytes(&d.lock().unwrap(), &pattern(r, 7, ag_len)), format!("{what}: all-gather block of rank {r}"));
            }
            f.result(same_bytes(&bc_dev.lock().unwrap(), &pattern(size - 1, 8, 300)), format!("{what}: broadcast"));
            if mode == Mode::Windowed {
                f.check(ar_host.iter().chain(&ag_host_in).chain(&ag_host_out).all(|&b| b == POISON), || format!("{what}: whole buffers untouched"));
            }
            let want_log: Vec<(usize, usize, char)> = std::iter::once((0, 0, 'h'))
                .chain(
                    [(0, 4), (1, 3), (2, 1)]
                        .iter()
                        .flat_map(|&(op, chunks)| (0..chunks).flat_map(move |k| [(op, k, 'i'), (op, k, 'o')])),
                )
                .collect();
            f.eq(&*log.lock().unwrap(), &want_log, format!("{what}: hook order"));
            Ok(())
        });
    }
    failures.finish(&format!("staged job ({mode:?}) over {net:?}"));
}

fn staged_job(net: Net) {
    staged_job_with(net, Mode::Direct);
}

/// As the bridge runs jobs on accelerator tensors: op buffers that are placeholders until the
/// staging binds them (a core that touched one before would crash, one that moved it wrongly
/// would leave poison in the results).
fn staged_job_with_placeholders(net: Net) {
    staged_job_with(net, Mode::Deferred);
}

/// The same job with each chunk in a window of chunk-sized buffers (sets reused every third
/// chunk, poisoned before each use): the core must run each chunk where inputs_ready says.
fn staged_job_in_a_window(net: Net) {
    staged_job_with(net, Mode::Windowed);
}

/// The staging cannot allocate its host buffers on one rank (pinned memory exhausted): every
/// rank's job fails with that message, none hangs.
fn host_buffer_failure_fails_every_rank(net: Net) {
    let mut failures = Failures::new();
    sweep_ranks(&mut failures, "host buffer failure", 3, cfg(net), LIMIT, move |rank, comm, _, f| {
        let mut host = vec![0u8; 4096];
        let mut addresses = Addresses::new(true);
        let o = op_with(OpKind::AllReduce, DType::Float32, vec![], addresses.of(buf(&mut host), 1));
        let mut fake = FakeDevice::new(vec![StagedOp { chunk: usize::MAX, inputs: vec![], outputs: vec![] }]);
        fake.bindings = (rank != 2).then_some(addresses.table);
        expect_err_mentioning(f, run_staged(&comm, vec![o], fake), &["out of pinned memory"], &format!("rank {rank}: rank 2 could not allocate its staging"));
        Ok(())
    });
    failures.finish(&format!("host buffer failure over {net:?}"));
}

/// A staging failure on one rank (a device error) fails the job on every rank, with its message.
fn staging_failure_fails_every_rank(net: Net) {
    let c = match net {
        Net::Tcp => 32 << 10,
        Net::Shm => 8192,
    };
    let mut failures = Failures::new();
    sweep_ranks(&mut failures, "staging failure", 3, cfg(net), LIMIT, move |rank, comm, _, f| {
        let n = 3 * c / 4;
        let mut host = vec![0u8; n * 4];
        let o = op_with(OpKind::AllReduce, DType::Float32, vec![], vec![buf(&mut host)]);
        let mut fake = FakeDevice::new(vec![StagedOp { chunk: c, inputs: vec![], outputs: vec![] }]);
        fake.fail_at = (rank == 1).then_some((0, 1));
        expect_err_mentioning(f, run_staged(&comm, vec![o], fake), &["device lost"], &format!("rank {rank}: rank 1's staging failed"));
        Ok(())
    });
    failures.finish(&format!("staging failure over {net:?}"));
}

/// A staging that describes a chunk's window wrongly on one rank (one byte short): the core
/// refuses to run the chunk there, and every rank fails, that one naming the op and itself.
fn window_mismatch_fails_every_rank(net: Net) {
    let mut failures = Failures::new();
    sweep_ranks(&mut failures, "window mismatch", 3, cfg(net), LIMIT, move |rank, comm, _, f| {
        let n = 1000;
        let mut host = vec![POISON; n * 4];
        let mut addresses = Addresses::new(true);
        let o = op_with(OpKind::AllReduce, DType::Float32, vec![], addresses.of(buf(&mut host), 1));
        let placeholder = o.outputs[0];
        let dev = device(f32_bytes(&vec![1.0; n]));
        let mut fake = FakeDevice::new(vec![StagedOp {
            chunk: usize::MAX,
            inputs: vec![Staged { host: placeholder, device: dev.clone() }],
            outputs: vec![Staged { host: placeholder, device: dev }],
        }]);
        let mut window = Window::new(1, n * 4);
        window.short = rank == 1;
        fake.window = Some(window);
        let what = format!("rank {rank}: rank 1's window was described wrongly");
        if let Some(e) = expect_err(f, run_staged(&comm, vec![o], fake), &what)
            && rank == 1
        {
            mentions(f, &e, &["internal error", "allreduce #0 on rank 1"], &what);
        }
        Ok(())
    });
    failures.finish(&format!("window mismatch over {net:?}"));
}

/// Ranks configured with different chunk sizes fail with a message that names the setting
/// (shared memory) or the sizes (TCP), instead of exchanging different ranges.
fn chunk_size_mismatch(net: Net) {
    let store = xccl_rs::MemoryStore::new();
    let handles: Vec<_> = (0..2usize)
        .map(|rank| {
            let store = store.clone();
            let base = cfg(net);
            std::thread::spawn(move || {
                let cfg = Config { pipeline_chunk_bytes: 8192 << rank, ..base };
                let comm = xccl_rs::Communicator::new(&store, rank, 2, cfg).expect("communicator");
                let mut host = vec![0u8; 40_000];
                let o = op_with(OpKind::AllReduce, DType::Float32, vec![], vec![buf(&mut host)]);
                run(&comm, vec![o])
            })
        })
        .collect();
    let mut failures = Failures::new();
    for (rank, h) in handles.into_iter().enumerate() {
        // Over TCP the chunks' frames differ in length: the receiver names the sizes.
        let needle = match net {
            Net::Shm => "XCCL_RS_PIPELINE_CHUNK_BYTES",
            Net::Tcp => "size mismatch",
        };
        expect_err_mentioning(&mut failures, h.join().unwrap(), &[needle], &format!("rank {rank}: chunk sizes differ"));
    }
    failures.finish(&format!("chunk size mismatch over {net:?}"));
}

both_nets!(
    staged_job,
    staged_job_with_placeholders,
    staged_job_in_a_window,
    window_mismatch_fails_every_rank,
    staging_failure_fails_every_rank,
    host_buffer_failure_fails_every_rank,
    chunk_size_mismatch
);

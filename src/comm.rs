//! The communicator of one group: its rank and size, the connections, the sequence numbers and
//! the progress thread. Callers submit *jobs* (one op, or a coalesced batch); the progress
//! thread runs them strictly in submission order — the order every rank must agree on — and
//! reports each through its completion callback. Different groups have different threads, so
//! their operations run concurrently.
//!
//! A job whose caller is about to wait for it anyway (a synchronous c10d call) runs on the
//! caller's thread when the progress thread is idle: that saves two thread wake-ups, which
//! dominate the latency of small collectives. Order is preserved: the fast path is taken only
//! when no earlier job is queued or running.
//!
//! A failure is final: the thread tells every peer (an abort frame, or closing the stream when
//! a frame was cut), and every later job fails at once with the first error. That is NCCL's
//! model too: after a collective fails, ranks can no longer agree on where the streams are.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

use parking_lot::Mutex;

use crate::abort::{AbortSwitch, FailureListener, FailureNotice};
use crate::algorithms::mesh::p2p::{self, P2pCounters};
use crate::algorithms::select::{self, Algorithm, FabricCaps, FirstUses};
use crate::stats::{GroupStats, OpSample, Totals, fabric_name};
use crate::algorithms::{Step, run_collective};
use crate::buf::{Buf, Extent};
use crate::config::Config;
use crate::error::{CommError, Result};
use crate::fabric::Fabric;
use crate::op::{Completion, Op};
use crate::pipeline;
use crate::rendezvous::{Store, agree_on_secret};
use crate::staging::{DeviceCopies, DirectOutput, StagedJob, StagedTensor};
use crate::transport::OpCtx;
use crate::transport::shm::heap::{Heap, HeapBlock};
use crate::types::OpKind;

/// Called once when a job finishes, on the progress thread.
pub type OnDone = Box<dyn FnOnce(Result<Completion>) + Send>;

/// Called once when a job finishes, on the thread that ran it, with the time it started
/// running there (torch.profiler's range of its execution: csrc/profile.cc).
pub type OnRan = Box<dyn FnOnce(Result<Completion>, SystemTime) + Send>;

/// A job's accelerator tensors and the device that copies them (src/staging/).
pub struct Staged {
    pub tensors: Vec<StagedTensor>,
    pub device: Box<dyn DeviceCopies>,
}

enum Job {
    Run { ops: Vec<Op<Buf>>, staging: Option<StagedJob>, done: OnRan },
    /// This rank rejected its part of `op` locally: tell the peers and fail the communicator.
    Abort { op: OpKind, message: String },
    /// Work outlives the last job (a transport's held sends): move it while idle.
    Progress,
}

pub struct Communicator {
    rank: usize,
    size: usize,
    shared: Arc<Shared>,
    queue: Mutex<Option<mpsc::Sender<Job>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    timeout_ms: Arc<AtomicU64>,
    /// Collectives submitted so far: the number the next one will carry.
    submitted: AtomicU64,
    abort_switch: Arc<AbortSwitch>,
    failure: Arc<FailureNotice>,
    /// How long shutdown waits for the failure listeners still running (the abort hooks).
    failure_hooks_wait: Duration,
    pipeline_chunk_bytes: usize,
    /// This rank's shared-memory heap (transport/shm/heap.rs), in a single-host group; let go
    /// at shutdown (tensors allocated from it keep it, and its descriptor, while they live).
    heap: Mutex<Option<Arc<Heap>>>,
    /// The group's name as torch knows it, for the statistics (stats.rs).
    group_name: Arc<Mutex<String>>,
}

impl Communicator {
    /// Connects to every rank of the group (blocks until all have joined, or the timeout) and
    /// starts the progress thread.
    pub fn new(store: &dyn Store, rank: usize, size: usize, config: Config) -> Result<Communicator> {
        crate::config::init_logging();
        if size == 0 || rank >= size {
            return Err(CommError::invalid(format!("rank {rank} is not in a group of size {size}")));
        }
        let secret = agree_on_secret(store, rank, config.timeout)?;
        let fabric = Fabric::build(store, rank, size, &secret, &config)?;
        let heap = fabric.host_heap();
        let timeout_ms = Arc::new(AtomicU64::new(config.timeout.as_millis().min(u64::MAX as u128) as u64));
        let (tx, rx) = mpsc::channel();
        let pipeline_chunk_bytes = config.pipeline_chunk_bytes;
        let failure_hooks_wait = config.failure_hooks_wait;
        let abort_switch = Arc::new(AbortSwitch::new()?);
        let failure = Arc::new(FailureNotice::default());
        let group_name = Arc::new(Mutex::new(String::new()));
        let stats = GroupStats::new(rank, group_name.clone(), config.stats_path.as_deref(), config.stats_max_bytes);
        let worker = Worker {
            fabric,
            abort_switch: abort_switch.clone(),
            failure: failure.clone(),
            config,
            timeout_ms: timeout_ms.clone(),
            seq: 0,
            p2p: P2pCounters::new(size),
            scratch: Vec::new(),
            failed: None,
            first_uses: FirstUses::default(),
            stats,
        };
        let shared = Arc::new(Shared { worker: Mutex::new(worker), pending: AtomicUsize::new(0) });
        let thread_shared = shared.clone();
        let thread = std::thread::Builder::new()
            .name(format!("xccl_rs-r{rank}"))
            .spawn(move || thread_shared.serve(rx))
            .map_err(|e| CommError::io(format!("cannot start the progress thread: {e}")))?;
        Ok(Communicator {
            rank,
            size,
            shared,
            queue: Mutex::new(Some(tx)),
            thread: Mutex::new(Some(thread)),
            timeout_ms,
            submitted: AtomicU64::new(0),
            abort_switch,
            failure,
            failure_hooks_wait,
            pipeline_chunk_bytes,
            heap: Mutex::new(heap),
            group_name,
        })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn size(&self) -> usize {
        self.size
    }

    /// The configured chunk size of large collectives (pipeline.rs).
    pub fn pipeline_chunk_bytes(&self) -> usize {
        self.pipeline_chunk_bytes
    }

    /// The sequence number the next collective will carry.
    pub fn next_seq(&self) -> u64 {
        self.submitted.load(Ordering::Relaxed)
    }

    /// Blocks moved through shared memory so far (0 when this rank has no shared-memory
    /// group): shows which transport a group uses, for diagnostics and tests.
    pub fn shm_blocks_used(&self) -> u64 {
        self.shared.worker.lock().fabric.shm().map_or(0, |s| s.blocks_used())
    }

    /// Names the group in its statistics lines (torch names groups after they are made).
    pub fn set_group_name(&self, name: &str) {
        *self.group_name.lock() = name.to_string();
    }

    /// The group's statistics so far: ops, bytes and time per (op kind, algorithm).
    pub fn stats(&self) -> Vec<(OpKind, Algorithm, Totals)> {
        self.shared.worker.lock().stats.totals()
    }

    /// Operations that read peers' tensors in place (zero-copy) so far: for diagnostics and tests.
    pub fn zero_copy_ops(&self) -> u64 {
        self.shared.worker.lock().fabric.zero_copy_ops()
    }

    /// Operations that read peers' buffers by cross-memory attach so far (diagnostics, tests).
    pub fn cma_ops(&self) -> u64 {
        self.shared.worker.lock().fabric.cma_ops()
    }

    /// Whether this rank has a heap to allocate tensors from ([`alloc_shared`](Self::alloc_shared)).
    pub fn has_heap(&self) -> bool {
        self.heap.lock().is_some()
    }

    /// `bytes` of this rank's shared-memory heap, which the peers of its host can read in
    /// place: collectives on tensors there are zero-copy. Freed when the block is dropped.
    pub fn alloc_shared(&self, bytes: usize) -> Result<HeapBlock> {
        match self.heap.lock().as_ref() {
            Some(heap) => heap.alloc(bytes),
            None => Err(CommError::invalid(format!(
                "rank {}: this group has no shared-memory heap (its ranks are not all on one host, XCCL_RS_TRANSPORT=tcp or XCCL_RS_SHM_HEAP_BYTES=0), or it was shut down",
                self.rank
            ))),
        }
    }

    pub fn set_timeout(&self, timeout: Duration) {
        self.timeout_ms.store(timeout.as_millis().min(u64::MAX as u128) as u64, Ordering::Relaxed);
    }

    /// Queues a job on host memory; `done` runs on the progress thread when it finishes.
    /// Layout errors are returned here, before anything is queued.
    pub fn submit(&self, ops: Vec<Op>, done: OnDone) -> Result<()> {
        self.submit_with(ops.iter().map(Op::<Buf>::from).collect(), None, Box::new(move |r, _| done(r)), false)
    }

    /// As [`submit`](Self::submit), for ops whose buffers may be ranges of `staged`'s tensors;
    /// with `caller_waits`, the job may run on the calling thread (then `done` has run when
    /// this returns). The staging's copies run on the thread that runs the job.
    /// A group that failed refuses new jobs here, quoting its first error (also async ones: the
    /// caller learns at the call, as with NCCL's revoked communicators).
    pub fn submit_with(&self, ops: Vec<Op<Buf>>, staged: Option<Staged>, done: OnRan, caller_waits: bool) -> Result<()> {
        if let Some(first) = self.failure.first() {
            let what = ops.first().map_or("job", |o| o.kind.name());
            return Err(CommError::new(first.kind, failed_earlier(&first)).within(format!("rank {}: {what}", self.rank)));
        }
        let local = |e: CommError| e.within(format!("rank {}", self.rank));
        for op in &ops {
            op.validate(self.rank, self.size).map_err(local)?;
        }
        let staging = match staged.map(|s| StagedJob::new(&ops, s.tensors, self.pipeline_chunk_bytes, s.device)) {
            None => None,
            Some(Ok(job)) => Some(job),
            Some(Err(e)) => {
                // The bridge described this rank's buffers wrongly: its peers may already be in
                // the op, so fail them at once rather than let them wait for the timeout.
                let e = local(e);
                self.abort(ops.first().map_or(OpKind::Barrier, |o| o.kind), &e.message);
                return Err(e);
            }
        };
        let collectives = ops.iter().filter(|op| !op.kind.is_p2p()).count() as u64;
        let queue = self.queue.lock();
        if queue.is_none() {
            return Err(CommError::aborted("the communicator was shut down"));
        }
        self.submitted.fetch_add(collectives, Ordering::Relaxed);
        if caller_waits && self.shared.pending.load(Ordering::Acquire) == 0 {
            if let Some(mut worker) = self.shared.worker.try_lock() {
                // Later submitters queue behind us: the progress thread needs this lock.
                drop(queue);
                let started = SystemTime::now();
                let result = worker.run_job_guarded(&ops, staging);
                let more = worker.progress().is_some();
                drop(worker);
                if more && let Some(tx) = self.queue.lock().as_ref() {
                    // The progress thread carries it on; it was asleep in the queue.
                    let _ = tx.send(Job::Progress);
                }
                let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| done(result, started)));
                return Ok(());
            }
        }
        self.shared.pending.fetch_add(1, Ordering::AcqRel);
        let sent = queue.as_ref().map(|tx| tx.send(Job::Run { ops, staging, done }).is_ok()).unwrap_or(false);
        if !sent {
            self.shared.pending.fetch_sub(1, Ordering::AcqRel);
            return Err(CommError::aborted("the progress thread has exited"));
        }
        Ok(())
    }

    /// Fails the communicator because this rank cannot take part in `op` (a local argument
    /// error); peers waiting in that op fail at once with `message` instead of timing out.
    pub fn abort(&self, op: OpKind, message: &str) {
        let _ = self.send(Job::Abort { op, message: message.to_string() });
    }

    /// Aborts the group (torch's `Backend.abort()`), from any thread: the op running now stops
    /// where it waits, queued and later ops fail at once, and the peers are told (abort frames,
    /// the shared-memory abort flag), so that ranks blocked with this one fail too.
    /// The group counts as failed when this returns: `error()` says so and the failure
    /// listeners have run.
    pub fn abort_now(&self, reason: &str) {
        let message = format!("rank {}: {reason}", self.rank);
        self.abort_switch.raise(reason);
        if self.failure.record(&CommError::aborted(message.clone())) {
            self.failure.wait_for_listeners(Duration::MAX);
        }
        let _ = self.send(Job::Abort { op: OpKind::Barrier, message });
    }

    /// The first error that failed the group (None while it works).
    pub fn error(&self) -> Option<CommError> {
        self.failure.first()
    }

    /// `listener` is called once, on the thread that finds it, when the group fails.
    pub fn on_failure(&self, listener: FailureListener) {
        self.failure.listen(listener);
    }

    fn send(&self, job: Job) -> Result<()> {
        let queue = self.queue.lock();
        let tx = queue.as_ref().ok_or_else(|| CommError::aborted("the communicator was shut down"))?;
        self.shared.pending.fetch_add(1, Ordering::AcqRel);
        tx.send(job).map_err(|_| {
            self.shared.pending.fetch_sub(1, Ordering::AcqRel);
            CommError::aborted("the progress thread has exited")
        })
    }

    /// Finishes queued work, then stops the progress thread and closes the connections and
    /// shared memory. Later jobs fail with a clear error. Idempotent. A group that failed first
    /// lets its failure listeners (the abort hooks: torch's flight-recorder dump) finish, within
    /// `XCCL_RS_FAILURE_HOOKS_WAIT_MS`: torch lets go of a group's hooks once it is shut down.
    pub fn shutdown(&self) {
        if !self.failure.wait_for_listeners(self.failure_hooks_wait) {
            tracing::warn!(rank = self.rank, "shutting the group down while its abort hooks still run");
        }
        drop(self.queue.lock().take());
        if let Some(t) = self.thread.lock().take() {
            let _ = t.join();
        }
        self.shared.worker.lock().close();
        self.heap.lock().take();
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// What the caller and the progress thread share.
struct Shared {
    /// Held while a job runs, by the progress thread or by an inline caller.
    worker: Mutex<Worker>,
    /// Jobs queued and not yet finished.
    pending: AtomicUsize,
}

impl Shared {
    fn serve(&self, rx: mpsc::Receiver<Job>) {
        // Set while the transport has work that outlives the jobs: how soon to move it again.
        let mut idle: Option<Duration> = None;
        loop {
            let job = match idle {
                None => rx.recv().map_err(|_| mpsc::RecvTimeoutError::Disconnected),
                Some(after) => rx.recv_timeout(after),
            };
            let job = match job {
                Ok(job) => job,
                Err(mpsc::RecvTimeoutError::Timeout) => Job::Progress,
                Err(mpsc::RecvTimeoutError::Disconnected) => return,
            };
            match job {
                Job::Progress => idle = self.worker.lock().progress(),
                Job::Run { ops, staging, done } => {
                    let mut worker = self.worker.lock();
                    let started = SystemTime::now();
                    let result = worker.run_job_guarded(&ops, staging);
                    idle = worker.progress();
                    drop(worker);
                    self.pending.fetch_sub(1, Ordering::AcqRel);
                    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| done(result, started)));
                }
                Job::Abort { op, message } => {
                    let mut worker = self.worker.lock();
                    let ctx = worker.ctx(op, worker.seq);
                    worker.fail(&ctx, CommError::aborted(message));
                    drop(worker);
                    self.pending.fetch_sub(1, Ordering::AcqRel);
                }
            }
        }
    }
}

/// The state jobs run on: connections, sequence numbers, scratch memory.
struct Worker {
    /// The group's connections, built once (fabric.rs).
    fabric: Fabric,
    config: Config,
    timeout_ms: Arc<AtomicU64>,
    /// The next collective's sequence number.
    seq: u64,
    p2p: P2pCounters,
    scratch: Vec<u8>,
    failed: Option<CommError>,
    abort_switch: Arc<AbortSwitch>,
    failure: Arc<FailureNotice>,
    first_uses: FirstUses,
    stats: GroupStats,
}

impl Worker {
    /// Moves what the transport still has in flight between jobs; how soon to call again, or
    /// `None` when nothing is left (or the group failed).
    fn progress(&mut self) -> Option<Duration> {
        if self.failed.is_some() {
            return None;
        }
        self.fabric.net.progress()
    }

    fn close(&mut self) {
        if self.failed.is_none() {
            self.failed = Some(CommError::aborted("the group was destroyed"));
        }
        self.fabric.close();
        self.abort_switch.close();
        self.stats.flush();
    }

    /// Runs a job; a panic becomes an error (and fails the communicator) instead of unwinding
    /// into the caller or killing the progress thread.
    fn run_job_guarded(&mut self, ops: &[Op<Buf>], mut staging: Option<StagedJob>) -> Result<Completion> {
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.run_job(ops, staging.as_mut()))) {
            Ok(r) => r,
            Err(panic) => {
                let what = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "unknown panic".into());
                let e = CommError::io(format!("internal error (please report): {what}"));
                let ctx = self.ctx(OpKind::Barrier, self.seq);
                self.fail(&ctx, e.clone());
                Err(e)
            }
        }
    }

    fn ctx(&self, op: OpKind, seq: u64) -> OpCtx {
        let timeout = Duration::from_millis(self.timeout_ms.load(Ordering::Relaxed));
        OpCtx {
            op,
            seq,
            rank: self.fabric.net.rank(),
            deadline: Instant::now().checked_add(timeout).unwrap_or_else(|| Instant::now() + Duration::from_secs(1 << 40)),
            timeout,
            abort: Some(self.abort_switch.clone()),
        }
    }

    fn fail(&mut self, ctx: &OpCtx, e: CommError) {
        if self.failed.is_none() {
            tracing::error!(error = %e, "xccl_rs communicator failed");
            self.fabric.abort(ctx, &e.message);
            // The listeners run on: the caller hears of `e` now, and the interpreter's exit
            // waits for them (abort.rs `wait_for_listeners`).
            self.failure.record(&e);
            self.failed = Some(e);
        }
    }

    /// Runs a job's ops in order; consecutive sends/receives with known peers form one phase.
    /// `staging` (accelerator tensors) allocates its host memory first, is told before each op
    /// or chunk needs its inputs and after its outputs are final, and finishes after the last
    /// op. An error in a copy fails the group like a transport error, so that peers already in
    /// the collective fail at once with this rank's message; an error in `finish` (the copies
    /// back, after every op succeeded) fails only this job.
    fn run_job(&mut self, ops: &[Op<Buf>], mut staging: Option<&mut StagedJob>) -> Result<Completion> {
        if let Some(e) = &self.failed {
            return Err(CommError::aborted(failed_earlier(e)));
        }
        if let Some(s) = staging.as_deref_mut() {
            if let Err(e) = s.start(self.fabric.parts.host_heaps_mut()) {
                let ctx = self.ctx(ops.first().map_or(OpKind::Barrier, |o| o.kind), self.seq);
                let e = ctx.annotate(e);
                self.fail(&ctx, e.clone());
                return Err(e);
            }
        }
        let mut completion = Completion { source_rank: -1 };
        let mut i = 0;
        while i < ops.len() {
            let op = &ops[i];
            let result = if matches!(op.kind, OpKind::Send | OpKind::Recv) {
                let end = i + ops[i..].iter().take_while(|o| matches!(o.kind, OpKind::Send | OpKind::Recv)).count();
                let ctx = self.ctx(op.kind, self.p2p_seq(op));
                let r = self.with_staging(&mut staging, ops, i..end, &ctx, |w, batch| {
                    p2p::run_batch(w.fabric.net.as_mut(), batch, &mut w.p2p, &ctx)
                });
                i = end;
                r.map_err(|e| (ctx, e))
            } else if op.kind == OpKind::RecvAnySource {
                let ctx = self.ctx(op.kind, 0);
                let r = self.with_staging(&mut staging, ops, i..i + 1, &ctx, |w, one| p2p::recv_any(w.fabric.net.as_mut(), &one[0], &mut w.p2p, &ctx));
                i += 1;
                r.map(|c| completion = c).map_err(|e| (ctx, e))
            } else {
                let ctx = self.ctx(op.kind, self.seq);
                self.seq += 1;
                let started = Instant::now();
                let staged = staging.is_some();
                let r = self.run_one(op, i, &ctx, staging.as_deref_mut());
                if let Ok(algorithm) = r {
                    self.record(op, ctx.seq, staged, started, algorithm);
                }
                i += 1;
                r.map(drop).map_err(|e| (ctx, e))
            };
            if let Err((ctx, e)) = result {
                self.fail(&ctx, e.clone());
                return Err(e);
            }
        }
        if let Some(s) = staging {
            let ctx = self.ctx(ops.last().map_or(OpKind::Barrier, |o| o.kind), self.seq.saturating_sub(1));
            s.finish().map_err(|e| ctx.annotate(e))?;
        }
        Ok(completion)
    }

    /// Runs point-to-point ops `range` of `ops` (one phase, not chunked) on host memory, between
    /// their staging's waits and copies back.
    fn with_staging<T>(
        &mut self,
        staging: &mut Option<&mut StagedJob>,
        ops: &[Op<Buf>],
        range: std::ops::Range<usize>,
        ctx: &OpCtx,
        run: impl FnOnce(&mut Self, &[Op]) -> Result<T>,
    ) -> Result<T> {
        let on_host = range
            .clone()
            .map(|i| match staging.as_deref_mut() {
                Some(s) => s.inputs_ready(i, 0, &ops[i]),
                None => ops[i].host(),
            })
            .collect::<Result<Vec<Op>>>()
            .map_err(|e| ctx.annotate(e))?;
        let result = run(self, &on_host)?;
        if let Some(s) = staging.as_deref_mut() {
            range.clone().try_for_each(|i| s.outputs_done(i, 0)).map_err(|e| ctx.annotate(e))?;
        }
        Ok(result)
    }

    /// Adds a collective that succeeded, started at `started`, to the group's statistics.
    fn record(&mut self, op: &Op<Buf>, seq: u64, staged: bool, started: Instant, algorithm: Algorithm) {
        let duration = started.elapsed();
        // The wall clock only where a line shows it.
        let start = if self.stats.writes_lines() { SystemTime::now() - duration } else { SystemTime::UNIX_EPOCH };
        let total = |bufs: &[Buf]| bufs.iter().map(|b| b.len()).sum::<usize>();
        let shape = self.fabric.parts.shape();
        self.stats.record(&OpSample {
            seq,
            op: op.kind,
            dtype: op.dtype,
            bytes: total(&op.inputs).max(total(&op.outputs)),
            algorithm,
            fabric: fabric_name(shape, staged),
            start,
            duration,
            ranks: self.fabric.net.size(),
        });
    }

    fn p2p_seq(&self, op: &Op<Buf>) -> u64 {
        let peer = op.root as usize;
        if op.kind == OpKind::Send { self.p2p.sent[peer] } else { self.p2p.received[peer] }
    }

    /// Runs collective `op` (op `index` of its job), chunk by chunk (pipeline.rs); returns the
    /// algorithm of its first chunk, the largest (what statistics name).
    fn run_one(&mut self, op: &Op<Buf>, index: usize, ctx: &OpCtx, staging: Option<&mut StagedJob>) -> Result<Algorithm> {
        let identity = op.identity();
        let chunk_bytes = self.config.pipeline_chunk_bytes;
        let world_size = self.fabric.net.size();
        let mut first = None;
        pipeline::run_chunks(op, index, chunk_bytes, ctx, staging, |chunk, staging| {
            let fabric = FabricCaps::of(&self.fabric.parts, world_size);
            let path = select::select_for(chunk, &fabric);
            first.get_or_insert(select::algorithm_of_path(path, op.kind, &fabric));
            self.first_uses.note(op.kind, &fabric, path, identity.count as usize * op.dtype.size(), ctx.rank);
            let mut step = Step {
                transport: self.fabric.net.as_mut(),
                ctx,
                par: &self.fabric.par,
                identity,
                round_bytes: self.config.round_bytes,
                scratch: &mut self.scratch,
                world_size,
                direct_output: staging.map(|s| s as &mut dyn DirectOutput),
            };
            run_collective(&mut step, &mut self.fabric.parts, chunk, path)
        })?;
        Ok(first.unwrap_or_else(|| select::algorithm(op.kind, self.fabric.parts.shape())))
    }
}

/// The error of a job on a group that failed with `first`.
fn failed_earlier(first: &CommError) -> String {
    format!("this group failed earlier and cannot be used any more; the first error was: {}", first.message)
}

//! The staging of accelerator tensors (src/staging/), through a fake device whose streams run
//! lazily, as late as the events allow: a queued copy runs only when something waits for an
//! event behind it (the host, or another stream). A core that computed on a chunk before
//! waiting for it would read the poison pinned memory starts with; one that reused a window set
//! before its copies back, or copied back before the caller's earlier work, would leave wrong
//! bytes on the device. The device tensors start as garbage, and the caller's stream holds the
//! work that writes their real contents (before event 0, `issued`). Each test reports every
//! failing point (tests/common/failures.rs), named by its parameters and rank.

#[macro_use]
mod common;
use common::*;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use xccl_rs::buf::Buf;
use xccl_rs::comm::Staged;
use xccl_rs::staging::plan::COPY_AHEAD;
use xccl_rs::staging::{DeviceCopies, Event, HostRegistration, Pinned, StagedTensor, Toward, release_idle_arenas};
use xccl_rs::{CommError, Config, DType, Op, OpKind, ReduceOp};

const LIMIT: Duration = Duration::from_secs(60);
const POISON: u8 = 0xFF; // all-ones f32 is a NaN: it would show in every sum
const GARBAGE: u8 = 0xEE; // a device tensor before the caller's work has written it

fn cfg(net: Net) -> Config {
    net_config(net, Duration::from_secs(20), 4096)
}

fn chunk_for(net: Net) -> usize {
    cfg(net).pipeline_chunk_bytes
}

/// A device tensor: its bytes (shared with the test, which reads the results) and layout.
#[derive(Clone)]
struct FakeTensor {
    bytes: Arc<Mutex<Vec<u8>>>,
    contiguous: bool,
    read: bool,
    write: bool,
}

impl FakeTensor {
    fn described(&self) -> StagedTensor {
        StagedTensor { bytes: self.bytes.lock().unwrap().len(), contiguous: self.contiguous, read: self.read, write: self.write }
    }
}

#[derive(Debug)]
enum Action {
    /// The caller's earlier work: writes a tensor's real contents.
    Fill {
        tensor: usize,
        bytes: Vec<u8>,
    },
    /// [`DeviceCopies::copy`]'s arguments: toward, then tensor, tensor offset, block, block offset, length.
    Copy(Toward, [usize; 5]),
    Mark(usize),
    Wait(usize),
}

const CALLER: usize = 0;

fn queue_of(t: Toward) -> usize {
    match t {
        Toward::Host => 1,
        Toward::Device => 2,
    }
}

struct FakeDevice {
    tensors: Vec<FakeTensor>,
    /// Pinned blocks' memory, which the core reads and writes through addresses.
    owned: Vec<Vec<u8>>,
    /// Blocks (address, length): pinned ones (in `owned`) and registered memory adopted.
    blocks: Vec<(usize, usize)>,
    /// Whether it registers host memory (DeviceCopies::register).
    registers: bool,
    /// Blocks adopted in this job.
    pub adopted: Arc<Mutex<usize>>,
    /// The caller's stream, the to-host stream and the copy-back stream.
    queues: [VecDeque<Action>; 3],
    fired: Vec<bool>,
    stream_of_event: Vec<usize>,
    /// Fail this many'th synchronize (0-based) with "device lost"; fail every allocation.
    fail_sync: Option<usize>,
    fail_alloc: bool,
    syncs: usize,
    host_records: usize,
    /// The most chunks whose copies to the host were queued and not yet waited for.
    pub most_ahead: Arc<Mutex<usize>>,
    pub pinned_bytes: Arc<Mutex<usize>>,
    finished: Arc<Mutex<bool>>,
}

impl FakeDevice {
    /// A device holding `tensors` (starting as garbage), whose caller's stream writes `contents`.
    fn new(tensors: Vec<FakeTensor>, contents: Vec<Vec<u8>>) -> FakeDevice {
        let mut caller = VecDeque::new();
        for (t, bytes) in contents.into_iter().enumerate() {
            tensors[t].bytes.lock().unwrap().fill(GARBAGE);
            caller.push_back(Action::Fill { tensor: t, bytes });
        }
        caller.push_back(Action::Mark(0));
        FakeDevice {
            tensors,
            owned: Vec::new(),
            blocks: Vec::new(),
            registers: false,
            adopted: Arc::new(Mutex::new(0)),
            queues: [caller, VecDeque::new(), VecDeque::new()],
            fired: vec![false],
            stream_of_event: vec![CALLER],
            fail_sync: None,
            fail_alloc: false,
            syncs: 0,
            host_records: 0,
            most_ahead: Arc::new(Mutex::new(0)),
            pinned_bytes: Arc::new(Mutex::new(0)),
            finished: Arc::new(Mutex::new(false)),
        }
    }

    /// Runs stream `q` until `event` has fired.
    fn run_until(&mut self, q: usize, event: usize) -> Result<(), CommError> {
        while !self.fired[event] {
            let action = self.queues[q].pop_front().ok_or_else(|| CommError::io(format!("fake device: event {event} never fires")))?;
            self.execute(action)?;
        }
        Ok(())
    }

    /// Runs every stream to its end (the device does, eventually), the copy-back stream first.
    fn drain(&mut self) -> Result<(), CommError> {
        for q in [2, 1, CALLER] {
            while let Some(action) = self.queues[q].pop_front() {
                self.execute(action)?;
            }
        }
        Ok(())
    }

    fn execute(&mut self, action: Action) -> Result<(), CommError> {
        match action {
            Action::Fill { tensor, bytes } => self.tensors[tensor].bytes.lock().unwrap().copy_from_slice(&bytes),
            Action::Mark(e) => self.fired[e] = true,
            Action::Wait(e) => self.run_until(self.stream_of_event[e], e)?,
            Action::Copy(toward, [tensor, tensor_offset, block, block_offset, len]) => {
                let mut device = self.tensors[tensor].bytes.lock().unwrap();
                let device = &mut device[tensor_offset..tensor_offset + len];
                let (address, block_len) = self.blocks[block];
                assert!(block_offset + len <= block_len, "checked when queued");
                // SAFETY: the block is pinned memory of `owned`, or memory the core adopted,
                // which it keeps mapped until the job ends (DeviceCopies::adopt); the range lies
                // inside it (asserted above); the core touches it only under the events.
                let host = unsafe { std::slice::from_raw_parts_mut((address + block_offset) as *mut u8, len) };
                match toward {
                    Toward::Host => host.copy_from_slice(device),
                    Toward::Device => device.copy_from_slice(host),
                }
            }
        }
        Ok(())
    }
}

impl DeviceCopies for FakeDevice {
    fn alloc_pinned(&mut self, bytes: usize) -> Result<Pinned, CommError> {
        if self.fail_alloc {
            return Err(CommError::io("out of pinned memory"));
        }
        *self.pinned_bytes.lock().unwrap() += bytes;
        self.owned.push(vec![POISON; bytes]);
        let address = self.owned.last_mut().unwrap().as_mut_ptr() as usize;
        self.blocks.push((address, bytes));
        Ok(Pinned { block: self.blocks.len() - 1, address, bytes })
    }

    fn register(&mut self, address: usize, bytes: usize) -> Result<Option<HostRegistration>, CommError> {
        if !self.registers {
            return Ok(None);
        }
        let mut registered = REGISTERED.lock().unwrap();
        if registered.iter().any(|&(a, b)| address < a + b && a < address + bytes) {
            return Err(CommError::io(format!("fake device: {bytes} bytes at {address:#x} overlap a registration")));
        }
        registered.push((address, bytes));
        REGISTRATIONS_MADE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(Some(HostRegistration::new(address, unregister)))
    }

    fn registrar(&self) -> Option<fn(usize)> {
        self.registers.then_some(unregister as fn(usize))
    }

    fn adopt(&mut self, address: usize, bytes: usize) -> Result<Pinned, CommError> {
        let registered = REGISTERED.lock().unwrap().iter().any(|&(a, b)| a <= address && address + bytes <= a + b);
        if !registered {
            return Err(CommError::io(format!("fake device: adopting {bytes} bytes at {address:#x}, which are not registered")));
        }
        *self.adopted.lock().unwrap() += 1;
        self.blocks.push((address, bytes));
        Ok(Pinned { block: self.blocks.len() - 1, address, bytes })
    }

    fn copy(
        &mut self,
        toward: Toward,
        tensor: usize,
        tensor_offset: usize,
        block: usize,
        block_offset: usize,
        len: usize,
    ) -> Result<(), CommError> {
        let t = self.tensors.get(tensor).ok_or_else(|| CommError::io("no such tensor"))?;
        let tensor_len = t.bytes.lock().unwrap().len();
        let block_len = self.blocks.get(block).map_or(0, |b| b.1);
        if tensor_offset + len > tensor_len || block_offset + len > block_len {
            return Err(CommError::io(format!("fake device: copy of {len} bytes out of bounds")));
        }
        if !t.contiguous && (tensor_offset != 0 || len != tensor_len) {
            return Err(CommError::io("fake device: a part of a non-contiguous tensor"));
        }
        self.queues[queue_of(toward)].push_back(Action::Copy(toward, [tensor, tensor_offset, block, block_offset, len]));
        Ok(())
    }

    fn record(&mut self, toward: Toward) -> Result<Event, CommError> {
        let e = self.fired.len();
        self.fired.push(false);
        self.stream_of_event.push(queue_of(toward));
        self.queues[queue_of(toward)].push_back(Action::Mark(e));
        if toward == Toward::Host {
            self.host_records += 1;
            let mut most = self.most_ahead.lock().unwrap();
            *most = (*most).max(self.host_records - self.syncs);
        }
        Ok(Event(e))
    }

    fn synchronize(&mut self, event: Event) -> Result<(), CommError> {
        self.syncs += 1;
        if self.fail_sync == Some(self.syncs - 1) {
            return Err(CommError::io("device lost"));
        }
        self.run_until(self.stream_of_event[event.0], event.0)
    }

    fn stream_wait(&mut self, toward: Toward, event: Event) -> Result<(), CommError> {
        self.queues[queue_of(toward)].push_back(Action::Wait(event.0));
        Ok(())
    }

    fn finish(&mut self) -> Result<(), CommError> {
        *self.finished.lock().unwrap() = true;
        Ok(())
    }
}

/// Host memory registered with the fake device (address, bytes), by every test of this binary.
static REGISTERED: Mutex<Vec<(usize, usize)>> = Mutex::new(Vec::new());
/// Registrations made so far, by every test of this binary.
static REGISTRATIONS_MADE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

fn registrations_made() -> usize {
    REGISTRATIONS_MADE.load(std::sync::atomic::Ordering::Relaxed)
}

fn unregister(address: usize) {
    let mut registered = REGISTERED.lock().unwrap();
    let at = registered.iter().position(|&(a, _)| a == address).expect("unregistering memory that is not registered");
    registered.swap_remove(at);
}

impl Drop for FakeDevice {
    fn drop(&mut self) {
        // The job is over: the device runs what is queued (a real one does, eventually).
        let _ = self.drain();
    }
}

fn tensor(bytes: usize, contiguous: bool, read: bool, write: bool) -> FakeTensor {
    FakeTensor { bytes: Arc::new(Mutex::new(vec![0; bytes])), contiguous, read, write }
}

fn staged(t: usize, offset: usize, len: usize) -> Buf {
    Buf::Staged { tensor: t, offset, len }
}

/// `parts` equal consecutive ranges of staged tensor `t` of `len` bytes.
fn staged_parts(t: usize, len: usize, parts: usize) -> Vec<Buf> {
    (0..parts).map(|p| staged(t, p * len / parts, len / parts)).collect()
}

fn job_op(kind: OpKind, dtype: DType, inputs: Vec<Buf>, outputs: Vec<Buf>) -> Op<Buf> {
    let mut o = Op::new(kind, dtype);
    o.inputs = inputs;
    o.outputs = outputs;
    o
}

/// Submits `ops` staged through `fake` and waits for the job's result.
fn run_staged(comm: &xccl_rs::Communicator, ops: Vec<Op<Buf>>, fake: FakeDevice) -> Result<xccl_rs::Completion, CommError> {
    let tensors = fake.tensors.iter().map(FakeTensor::described).collect();
    let (tx, rx) = std::sync::mpsc::channel();
    comm.submit_with(ops, Some(Staged { tensors, device: Box::new(fake) }), Box::new(move |r, _| drop(tx.send(r))), false)?;
    rx.recv().unwrap()
}

fn sum_check(got: &[u8], size: usize, salt: usize) -> Result<(), String> {
    let got = bytes_f32(got);
    each_element(got.len(), |i| {
        let want: f32 = (0..size).map(|r| value(r, i + salt)).sum();
        (got[i] != want).then(|| format!("[{i}]: {} != {want}", got[i]))
    })
}

fn f32_input(rank: usize, n: usize, salt: usize) -> Vec<u8> {
    f32_bytes(&(0..n).map(|i| value(rank, i + salt)).collect::<Vec<_>>())
}

/// Large contiguous tensors: an in-place all-reduce of 10 chunks and more and an all-gather of
/// 5 chunks per rank, which the plan puts through a window of 3 sets (so every set is reused),
/// each of one slot per view: 3 × (size + 1) chunk-sized slots, less than the tensors' size.
fn windowed_job(net: Net) {
    let c = chunk_for(net);
    sweep_sizes(net, "windowed job", move |size, rank, comm, f| {
        let what = format!("size {size} rank {rank}");
        let ar_len = 10 * c + 20;
        let ag_len = 5 * c - 12;
        let ar = tensor(ar_len, true, true, true);
        let ag_in = tensor(ag_len, true, true, false);
        let ag_out = tensor(ag_len * size, true, false, true);
        let tensors = vec![ar.clone(), ag_in.clone(), ag_out.clone()];
        let contents = vec![f32_input(rank, ar_len / 4, 0), pattern(rank, 7, ag_len), vec![0xAB; ag_len * size]];
        let fake = FakeDevice::new(tensors, contents);
        let (most_ahead, pinned) = (fake.most_ahead.clone(), fake.pinned_bytes.clone());
        let mut all_reduce = job_op(OpKind::AllReduce, DType::Float32, vec![], vec![staged(0, 0, ar_len)]);
        all_reduce.reduce_op = ReduceOp::Sum;
        let all_gather = job_op(OpKind::AllGather, DType::UInt8, vec![staged(1, 0, ag_len)], staged_parts(2, ag_len * size, size));
        f.op(run_staged(&comm, vec![all_reduce, all_gather], fake), &what)?;
        f.result(sum_check(&ar.bytes.lock().unwrap(), size, 0), format!("{what}: all-reduce"));
        let out = ag_out.bytes.lock().unwrap();
        for r in 0..size {
            f.result(
                same_bytes(&out[r * ag_len..(r + 1) * ag_len], &pattern(r, 7, ag_len)),
                format!("{what}: all-gather block of rank {r}"),
            );
        }
        f.eq(*pinned.lock().unwrap(), 3 * (size + 1) * c, format!("{what}: pinned bytes (the window)"));
        // Queued one chunk ahead of the host's waits, not all at once.
        f.eq(*most_ahead.lock().unwrap(), COPY_AHEAD, format!("{what}: chunks queued beyond those waited for"));
        Ok(())
    });
}

/// Runs `job(size, rank, comm, failures)` on every rank of groups of 1, 2 and 3 ranks over `net`.
fn sweep_sizes(
    net: Net,
    what: &str,
    job: impl Fn(usize, usize, xccl_rs::Communicator, &mut Failures) -> Result<(), Stop> + Copy + Send + Sync + 'static,
) {
    let mut failures = Failures::new();
    for size in [1usize, 2, 3] {
        sweep_ranks(&mut failures, &format!("{what} size {size}"), size, cfg(net), LIMIT, move |rank, comm, _, f| job(size, rank, comm, f));
    }
    failures.finish(&format!("{what} over {net:?}"));
}

/// Tensors that keep whole buffers: an all-reduce of two chunks (a window of two sets would
/// not be smaller), a strided tensor (copied whole), an all-to-all (not chunked), a broadcast
/// whose receivers copy nothing to the host, and a send and a receive (one phase).
fn whole_buffer_job(net: Net) {
    let c = chunk_for(net);
    sweep_sizes(net, "whole-buffer job", move |size, rank, comm, f| {
        let what = format!("size {size} rank {rank}");
        let (two_len, strided_len, piece, bc_len, p2p_len) = (2 * c - 8, 1000, 64, 300, 512);
        let root = size - 1;
        let mut tensors = vec![
            tensor(two_len, true, true, true),
            tensor(strided_len, false, true, true),
            tensor(piece * size, true, true, false),
            tensor(piece * size, true, false, true),
            tensor(bc_len, true, rank == root, rank != root),
        ];
        let mut contents = vec![
            f32_input(rank, two_len / 4, 0),
            f32_input(rank, strided_len / 4, 3),
            pattern(rank, 9, piece * size),
            vec![0xAB; piece * size],
            if rank == root { pattern(root, 8, bc_len) } else { vec![0xCD; bc_len] },
        ];
        let sum = |t: usize, len: usize| {
            let mut o = job_op(OpKind::AllReduce, DType::Float32, vec![], vec![staged(t, 0, len)]);
            o.reduce_op = ReduceOp::Sum;
            o
        };
        let mut broadcast = job_op(OpKind::Broadcast, DType::UInt8, vec![], vec![staged(4, 0, bc_len)]);
        broadcast.root = root as i64;
        let mut ops = vec![
            sum(0, two_len),
            sum(1, strided_len),
            job_op(OpKind::AllToAll, DType::UInt8, staged_parts(2, piece * size, size), staged_parts(3, piece * size, size)),
            broadcast,
        ];
        if size > 1 {
            tensors.push(tensor(p2p_len, true, true, false));
            tensors.push(tensor(p2p_len, true, false, true));
            contents.push(pattern(rank, 11, p2p_len));
            contents.push(vec![0; p2p_len]);
            let mut send = job_op(OpKind::Send, DType::UInt8, vec![staged(5, 0, p2p_len)], vec![]);
            send.root = ((rank + 1) % size) as i64;
            let mut recv = job_op(OpKind::Recv, DType::UInt8, vec![], vec![staged(6, 0, p2p_len)]);
            recv.root = ((rank + size - 1) % size) as i64;
            ops.extend([send, recv]);
        }
        let whole: usize = tensors.iter().map(|t| t.bytes.lock().unwrap().len()).sum();
        let kept = tensors.clone();
        let fake = FakeDevice::new(tensors, contents);
        let pinned = fake.pinned_bytes.clone();
        f.op(run_staged(&comm, ops, fake), &what)?;
        f.result(sum_check(&kept[0].bytes.lock().unwrap(), size, 0), format!("{what}: all-reduce of two chunks"));
        f.result(sum_check(&kept[1].bytes.lock().unwrap(), size, 3), format!("{what}: all-reduce of a strided tensor"));
        let got = kept[3].bytes.lock().unwrap().clone();
        for r in 0..size {
            // Rank r's piece for this rank: piece number `rank` of its input.
            let want = &pattern(r, 9, piece * size)[rank * piece..(rank + 1) * piece];
            f.result(same_bytes(&got[r * piece..(r + 1) * piece], want), format!("{what}: all-to-all piece from rank {r}"));
        }
        f.result(same_bytes(&kept[4].bytes.lock().unwrap(), &pattern(root, 8, bc_len)), format!("{what}: broadcast"));
        if size > 1 {
            let from = (rank + size - 1) % size;
            f.result(same_bytes(&kept[6].bytes.lock().unwrap(), &pattern(from, 11, p2p_len)), format!("{what}: receive"));
        }
        f.eq(*pinned.lock().unwrap(), whole, format!("{what}: pinned bytes (a whole buffer per tensor)"));
        Ok(())
    });
}

/// One rank's staging cannot allocate its pinned memory: every rank's job fails with that
/// message, none hangs.
fn pinned_memory_failure_fails_every_rank(net: Net) {
    let mut failures = Failures::new();
    sweep_ranks(&mut failures, "pinned memory failure", 3, cfg(net), LIMIT, move |rank, comm, _, f| {
        let t = tensor(4096, true, true, true);
        let mut fake = FakeDevice::new(vec![t], vec![f32_input(rank, 1024, 0)]);
        fake.fail_alloc = rank == 2;
        let o = job_op(OpKind::AllReduce, DType::Float32, vec![], vec![staged(0, 0, 4096)]);
        expect_err_mentioning(
            f,
            run_staged(&comm, vec![o], fake),
            &["out of pinned memory"],
            &format!("rank {rank}: rank 2 could not allocate"),
        );
        Ok(())
    });
    failures.finish(&format!("pinned memory failure over {net:?}"));
}

/// A device error on one rank while waiting for its second chunk fails the job on every rank,
/// with its message, and says which operation it broke.
fn device_failure_fails_every_rank(net: Net) {
    let c = chunk_for(net);
    let mut failures = Failures::new();
    sweep_ranks(&mut failures, "device failure", 3, cfg(net), LIMIT, move |rank, comm, _, f| {
        let len = 3 * c;
        let mut fake = FakeDevice::new(vec![tensor(len, true, true, true)], vec![f32_input(rank, len / 4, 0)]);
        fake.fail_sync = (rank == 1).then_some(1);
        let o = job_op(OpKind::AllReduce, DType::Float32, vec![], vec![staged(0, 0, len)]);
        let what = format!("rank {rank}: rank 1's device failed");
        if let Some(e) = expect_err_mentioning(f, run_staged(&comm, vec![o], fake), &["device lost"], &what)
            && rank == 1
        {
            mentions(f, &e, &["allreduce #0 on rank 1"], &what);
        }
        Ok(())
    });
    failures.finish(&format!("device failure over {net:?}"));
}

/// A staged range outside its tensor on one rank (a bridge bug): refused at submit there,
/// never memory to touch, and the peers fail at once instead of waiting for it.
fn range_outside_its_tensor_fails_every_rank(net: Net) {
    let mut failures = Failures::new();
    sweep_ranks(&mut failures, "range outside its tensor", 3, cfg(net), LIMIT, move |rank, comm, _, f| {
        let fake = FakeDevice::new(vec![tensor(4096, true, true, true)], vec![f32_input(rank, 1024, 0)]);
        let offset = if rank == 1 { 64 } else { 0 };
        let o = job_op(OpKind::AllReduce, DType::Float32, vec![], vec![staged(0, offset, 4096)]);
        let what = format!("rank {rank}: rank 1 described a range past its tensor");
        let needle = if rank == 1 { "internal error" } else { "rank 1" };
        expect_err_mentioning(f, run_staged(&comm, vec![o], fake), &[needle], &what);
        Ok(())
    });
    failures.finish(&format!("range outside its tensor over {net:?}"));
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
    windowed_job,
    whole_buffer_job,
    pinned_memory_failure_fails_every_rank,
    device_failure_fails_every_rank,
    range_outside_its_tensor_fails_every_rank,
    chunk_size_mismatch
);

/// A broadcast of a staged tensor over shared memory, in chunks of 1 MiB (the smallest that
/// cross-memory attach reads): by default the receivers read each chunk from the root's pinned
/// buffer by cross-memory attach (counted on every rank; the last, short chunk goes through the
/// slots), with `XCCL_RS_CMA=0` none does; either way every receiver's device tensor ends with
/// the root's bytes, from every root, at 2 and 3 ranks.
#[test]
fn staged_broadcast_reads_the_roots_pinned_buffer_by_cma() {
    use xccl_rs::config::CmaUse;
    const MIB: usize = 1 << 20;
    let len = 3 * MIB + 100;
    for setting in [CmaUse::StagedBroadcasts, CmaUse::Never] {
        let config = Config { cma: setting, pipeline_chunk_bytes: MIB, shm_slot_bytes: 64 << 10, ..cfg(Net::Shm) };
        let mut failures = Failures::new();
        for size in [2usize, 3] {
            let group = format!("staged broadcast, cma {setting:?}, size {size}");
            sweep_ranks(&mut failures, &group, size, config.clone(), LIMIT, move |rank, comm, _, f| {
                for root in 0..size {
                    let what = format!("root {root}, rank {rank}");
                    let t = tensor(len, true, rank == root, rank != root);
                    let fake = FakeDevice::new(vec![t.clone()], vec![pattern(rank, root as u64, len)]);
                    let broadcast = Op { root: root as i64, ..job_op(OpKind::Broadcast, DType::UInt8, vec![], vec![staged(0, 0, len)]) };
                    f.op(run_staged(&comm, vec![broadcast], fake), &what)?;
                    f.result(same_bytes(&t.bytes.lock().unwrap(), &pattern(root, root as u64, len)), &what);
                    let want = if setting == CmaUse::Never { 0 } else { 3 * (root as u64 + 1) };
                    f.eq(comm.cma_ops(), want, format!("{what}: chunks read by cross-memory attach"));
                }
                Ok(())
            });
        }
        failures.finish(&format!("staged broadcast with cma {setting:?}"));
    }
}

/// A broadcast of a staged tensor on a device that registers host memory (CUDA does): the root
/// stages it in its arena, registered shared memory, and every receiver copies each chunk of
/// 1 MiB or more from there straight onto its device (one adopted block per chunk; the last,
/// short chunk goes through the slots). Six chunks through the window's three sets, on a device
/// that runs copies only when waited for: a receiver that let the root go on before its copy
/// had run would copy the root's later bytes. With a rank whose device cannot register, the
/// others stage as before when it is the root, and it copies on the host when it receives; with
/// `XCCL_RS_REGISTERED_STAGING=0` nobody registers. Two rounds per root reuse the arena and the
/// registrations. Then the arenas outlive their groups: a second group, as a sync that rebuilds
/// its group every round makes, registers nothing, and once released no registration is left.
#[test]
fn staged_broadcast_receivers_copy_straight_from_the_roots_registered_arena() {
    const MIB: usize = 1 << 20;
    let len = 5 * MIB + 100;
    let config = Config { pipeline_chunk_bytes: MIB, shm_slot_bytes: 64 << 10, ..cfg(Net::Shm) };
    let mut failures = Failures::new();
    // One group's broadcasts from every root in `roots`, twice each: checks the bytes and the
    // blocks adopted.
    let sweep = |failures: &mut Failures, size: usize, roots: Vec<usize>, cannot_register: Option<usize>, enabled: bool| {
        let group = format!("size {size}, roots {roots:?}, rank that cannot register {cannot_register:?}, registered staging {enabled}");
        let config = Config { registered_staging: enabled, ..config.clone() };
        sweep_ranks(failures, &group, size, config, LIMIT, move |rank, comm, _, f| {
            let registers = |r: usize| Some(r) != cannot_register;
            for &root in &roots {
                for round in 0..2u64 {
                    let what = format!("root {root}, round {round}, rank {rank}");
                    let salt = 2 * root as u64 + round;
                    let t = tensor(len, true, rank == root, rank != root);
                    let mut fake = FakeDevice::new(vec![t.clone()], vec![pattern(rank, salt, len)]);
                    fake.registers = registers(rank);
                    let adopted = fake.adopted.clone();
                    let broadcast = Op { root: root as i64, ..job_op(OpKind::Broadcast, DType::UInt8, vec![], vec![staged(0, 0, len)]) };
                    f.op(run_staged(&comm, vec![broadcast], fake), &what)?;
                    f.result(same_bytes(&t.bytes.lock().unwrap(), &pattern(root, salt, len)), &what);
                    let want = match (registers(rank), registers(root)) {
                        _ if !enabled => 0,
                        (false, _) | (true, false) => 0,
                        _ if rank == root => 1, // the window, in the arena
                        _ => 5,                 // each chunk of 1 MiB, from the root's arena
                    };
                    f.eq(*adopted.lock().unwrap(), want, format!("{what}: blocks adopted"));
                }
            }
            Ok(())
        });
    };
    for size in [2usize, 3] {
        for (cannot_register, enabled) in [(None, true), (Some(size - 1), true), (None, false)] {
            sweep(&mut failures, size, (0..size).collect(), cannot_register, enabled);
            release_idle_arenas();
        }
    }
    for group in 0..2 {
        let before = registrations_made();
        sweep(&mut failures, 2, vec![0], None, true);
        let made = registrations_made() - before;
        // The root's arena and the receiver's mapping of it, by the first group only.
        let want = if group == 0 { 2 } else { 0 };
        failures.check(made == want, || format!("group {group} of root 0 registered {made} times, expected {want}"));
    }
    release_idle_arenas();
    let left = REGISTERED.lock().unwrap().clone();
    failures.check(left.is_empty(), || format!("registrations left after the arenas were released: {left:?}"));
    failures.finish("staged broadcast through registered arenas");
}

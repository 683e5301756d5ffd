//! The Rust side of the C++ bridge: adapts the c10d Store to [`Store`], turns
//! [`ffi::OpRequest`]s into [`Op`]s and completions into `work_done` calls. With the `bridge`
//! feature also the Python module init symbol, which must be defined here (a C++ `extern "C"`
//! symbol linked into a Rust cdylib is not exported); the C++ library of the CMake package
//! (feature `cpp` alone) has no Python and must not reference it.

use std::fmt;
use std::time::Duration;

use crate::buf::{Buf, RawBuf};
use crate::comm::{Communicator, Staged};
use crate::config::Config;
use crate::error::{CommError, ErrorKind, Result};
use crate::ffi::ffi::{self, BufferView, FailureListener, OpRequest, StagingHandle, StoreRef, WorkDone};
use crate::op::Op;
use crate::rendezvous::Store;
use crate::staging::{DeviceCopies, Event, HostRegistration, Pinned, StagedTensor, Toward};
use crate::types::{DType, OpKind, ReduceOp};
use crate::transport::shm::heap::HeapBlock;

// SAFETY: the C++ StoreRef holds an intrusive_ptr to a c10d::Store; c10d stores are used from
// several threads by torch itself (their clients lock internally).
unsafe impl Send for StoreRef {}
// SAFETY: as above; we only call its const, internally synchronized methods.
unsafe impl Sync for StoreRef {}
// SAFETY: WorkDone owns a shared_ptr to a mutex-protected state; it is moved to the progress
// thread and used there once.
unsafe impl Send for WorkDone {}
// SAFETY: FailureListener holds a weak_ptr to a mutex-protected hook table; the progress thread
// (or whichever thread finds a failure) calls it, and only through group_failed, which locks.
unsafe impl Send for FailureListener {}
// SAFETY: as above: group_failed takes it by shared reference and locks the table it reaches.
unsafe impl Sync for FailureListener {}
// SAFETY: StagingHandle owns a shared_ptr to the job's DeviceStaging; it is moved to the thread
// that runs the job and used only there (the caller's thread no longer touches the staging
// after sealing it).
unsafe impl Send for StagingHandle {}

/// The C++ staging primitives (csrc/device.cc), as the core's [`DeviceCopies`].
struct BridgeDevice(cxx::UniquePtr<StagingHandle>);

fn device_error(e: cxx::Exception) -> CommError {
    CommError::io(e.what().to_string())
}

fn toward(t: Toward) -> ffi::Toward {
    match t {
        Toward::Host => ffi::Toward::Host,
        Toward::Device => ffi::Toward::Device,
    }
}

impl DeviceCopies for BridgeDevice {
    fn alloc_pinned(&mut self, bytes: usize) -> Result<Pinned> {
        let b = ffi::staging_alloc_pinned(self.0.pin_mut(), bytes).map_err(device_error)?;
        Ok(Pinned { block: b.block, address: b.address, bytes })
    }
    fn register(&mut self, address: usize, bytes: usize) -> Result<Option<HostRegistration>> {
        let registered = ffi::staging_register_host(self.0.pin_mut(), address, bytes).map_err(device_error)?;
        Ok(registered.then(|| HostRegistration::new(address, ffi::staging_unregister_host)))
    }
    fn registrar(&self) -> Option<fn(usize)> {
        ffi::staging_can_register_host(&self.0).then_some(ffi::staging_unregister_host as fn(usize))
    }
    fn adopt(&mut self, address: usize, bytes: usize) -> Result<Pinned> {
        let block = ffi::staging_adopt(self.0.pin_mut(), address, bytes).map_err(device_error)?;
        Ok(Pinned { block, address, bytes })
    }
    fn copy(&mut self, to: Toward, tensor: usize, tensor_offset: usize, block: usize, block_offset: usize, bytes: usize) -> Result<()> {
        ffi::staging_copy(self.0.pin_mut(), toward(to), tensor, tensor_offset, block, block_offset, bytes).map_err(device_error)
    }
    fn record(&mut self, to: Toward) -> Result<Event> {
        ffi::staging_record(self.0.pin_mut(), toward(to)).map(Event).map_err(device_error)
    }
    fn synchronize(&mut self, event: Event) -> Result<()> {
        ffi::staging_synchronize(self.0.pin_mut(), event.0).map_err(device_error)
    }
    fn stream_wait(&mut self, to: Toward, event: Event) -> Result<()> {
        ffi::staging_stream_wait(self.0.pin_mut(), toward(to), event.0).map_err(device_error)
    }
    fn finish(&mut self) -> Result<()> {
        ffi::staging_finish(self.0.pin_mut()).map_err(device_error)
    }
}

struct BridgeStore(cxx::UniquePtr<StoreRef>);

impl Store for BridgeStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let store = self.0.as_ref().ok_or_else(|| CommError::io("null store"))?;
        ffi::store_set(store, key, value).map_err(|e| CommError::io(format!("store set '{key}' failed: {e}")))
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let store = self.0.as_ref().ok_or_else(|| CommError::io("null store"))?;
        ffi::store_get(store, key, timeout.as_millis() as u64)
            .map_err(|e| CommError::timeout(format!("store get '{key}' failed: {e}")))
    }
}

pub struct RustComm(Communicator);

pub fn new_comm(store: cxx::UniquePtr<StoreRef>, rank: i32, size: i32, timeout_ms: u64) -> std::result::Result<Box<RustComm>, BridgeError> {
    catch(|| {
        if rank < 0 || size <= 0 {
            return Err(CommError::invalid(format!("invalid rank {rank} / size {size}")));
        }
        let config = Config::from_env(Duration::from_millis(timeout_ms))?;
        let store = BridgeStore(store);
        Communicator::new(&store, rank as usize, size as usize, config).map(|c| Box::new(RustComm(c)))
    })
}

/// The bridge's shared enums carry the core's codes. For each pair this checks, when the crate
/// compiles, that every variant of the core's enum (the match is exhaustive, so a new variant
/// must be added here) has the same number in the bridge's enum of the same name.
macro_rules! same_codes {
    ($core:ident, $shared:ident, [$($v:ident),* $(,)?]) => {
        const _: () = {
            const fn shared_code(v: $core) -> u8 {
                match v {
                    $($core::$v => ffi::$shared::$v.repr,)*
                }
            }
            $(assert!(shared_code($core::$v) == $core::$v as u8, concat!("ffi::", stringify!($shared), "::", stringify!($v)));)*
        };
    };
}
same_codes!(OpKind, OpKind, [AllReduce, Broadcast, Reduce, AllGather, Gather, Scatter, ReduceScatter, AllToAll, Barrier, Send, Recv, RecvAnySource]);
same_codes!(DType, DType, [
    Float64, Float32, Float16, BFloat16, Int8, UInt8, Int16, Int32, Int64, Bool, UInt16, UInt32, UInt64,
    Float8E4M3FN, Float8E5M2, Float8E4M3FNUZ, Float8E5M2FNUZ, Bytes,
]);
same_codes!(ReduceOp, ReduceOp, [Sum, Avg, Product, Min, Max, BAnd, BOr, BXor, PreMulSum]);

fn core_kind(k: ffi::OpKind) -> Result<OpKind> {
    OpKind::from_code(k.repr).ok_or_else(|| CommError::invalid(format!("unknown op kind {}", k.repr)))
}

/// The op's name as torch spells it (stats.rs), for C++'s profiler ranges.
pub fn op_label(kind: ffi::OpKind) -> &'static str {
    core_kind(kind).map_or("op", crate::stats::op_label)
}

fn to_op(r: &OpRequest) -> Result<Op<Buf>> {
    let kind = core_kind(r.kind)?;
    let dtype = DType::from_code(r.dtype.repr).ok_or_else(|| CommError::invalid(format!("unknown dtype code {}", r.dtype.repr)))?;
    let reduce_op = ReduceOp::from_code(r.reduce_op.repr)
        .ok_or_else(|| CommError::invalid(format!("unknown reduce op code {}", r.reduce_op.repr)))?;
    let view = |b: &BufferView| match b.place {
        // SAFETY: the C++ side builds host views from tensors it keeps alive (in the work
        // state) until the job's completion, and no one else touches them meanwhile (c10d's
        // contract for in-flight tensors).
        ffi::BufferPlace::Host => Ok(Buf::Host(unsafe { RawBuf::new(b.start as *mut u8, b.bytes) })),
        // Bounds against the tensor are checked by the staging plan, at submit.
        ffi::BufferPlace::Staged => Ok(Buf::Staged { tensor: b.tensor, offset: b.start, len: b.bytes }),
        _ => Err(CommError::invalid(format!("unknown buffer place {}", b.place.repr))),
    };
    let views = |v: &[BufferView]| v.iter().map(view).collect::<Result<Vec<_>>>();
    Ok(Op {
        kind,
        dtype,
        reduce_op,
        premul_factor: r.premul_factor,
        root: r.root,
        tag: r.tag,
        inputs: views(&r.inputs)?,
        outputs: views(&r.outputs)?,
        staged: false,
    })
}

/// An allocation of the shared-memory heap, owned by the tensor whose memory it is.
pub struct SharedBlock(HeapBlock);

impl SharedBlock {
    pub fn address(&self) -> usize {
        self.0.address()
    }
}

impl RustComm {
    pub fn alloc_shared(&self, bytes: usize) -> std::result::Result<Box<SharedBlock>, BridgeError> {
        catch(|| self.0.alloc_shared(bytes).map(|b| Box::new(SharedBlock(b))))
    }

    pub fn has_heap(&self) -> bool {
        self.0.has_heap()
    }

    pub fn zero_copy_ops(&self) -> u64 {
        self.0.zero_copy_ops()
    }

    pub fn stats(&self) -> Vec<ffi::OpStatsRow> {
        self.0
            .stats()
            .into_iter()
            .map(|(op, algorithm, t)| ffi::OpStatsRow {
                op: crate::stats::op_label(op),
                path: format!("{algorithm:?}"),
                ops: t.ops,
                bytes: t.bytes,
                nanos: t.nanos,
            })
            .collect()
    }

    pub fn set_group_name(&self, name: &str) {
        self.0.set_group_name(name);
    }

    pub fn submit(
        &self,
        ops: Vec<OpRequest>,
        staged: Vec<ffi::StagedTensor>,
        staging: cxx::UniquePtr<StagingHandle>,
        done: cxx::UniquePtr<WorkDone>,
        caller_waits: bool,
    ) -> std::result::Result<(), BridgeError> {
        catch(|| {
            let ops = ops.iter().map(to_op).collect::<Result<Vec<_>>>()?;
            let tensors = staged.iter().map(|t| StagedTensor { bytes: t.bytes, contiguous: t.contiguous, read: t.read, write: t.write });
            let staged = (!staging.is_null()).then(|| Staged { tensors: tensors.collect(), device: Box::new(BridgeDevice(staging)) });
            self.0.submit_with(
                ops,
                staged,
                Box::new(move |result, started| {
                    let started = unix_micros(started);
                    match result {
                        Ok(c) => ffi::work_done(done, ffi::ErrorKind::Success, "", c.source_rank, started),
                        Err(e) => ffi::work_done(done, shared_error_kind(e.kind), &e.to_string(), -1, started),
                    }
                }),
                caller_waits,
            )
        })
    }

    pub fn abort_op(&self, kind: ffi::OpKind, message: &str) {
        if let Ok(kind) = core_kind(kind) {
            self.0.abort(kind, message);
        }
    }

    pub fn abort_group(&self, reason: &str) {
        self.0.abort_now(reason);
    }

    pub fn error_kind(&self) -> ffi::ErrorKind {
        self.0.error().map_or(ffi::ErrorKind::Success, |e| shared_error_kind(e.kind))
    }

    pub fn listen_for_failure(&self, listener: cxx::UniquePtr<FailureListener>) {
        let listener = std::sync::Arc::new(listener);
        self.0.on_failure(std::sync::Arc::new(move |e: &CommError| {
            if let Some(l) = listener.as_ref().as_ref() {
                ffi::group_failed(l, shared_error_kind(e.kind), &e.to_string());
            }
        }));
    }

    pub fn next_seq(&self) -> u64 {
        self.0.next_seq()
    }

    pub fn set_timeout_ms(&self, timeout_ms: u64) {
        self.0.set_timeout(Duration::from_millis(timeout_ms));
    }

    pub fn shutdown(&self) {
        self.0.shutdown();
    }
}

/// This host's identity by the core's rule (hosts.rs `this_host`), for Python's weight sync.
pub fn host_identity() -> std::result::Result<String, BridgeError> {
    catch(|| {
        let config = Config::from_env(Duration::from_secs(1))?;
        Ok(crate::hosts::this_host(&config))
    })
}

/// Waits, at most `XCCL_RS_FAILURE_HOOKS_WAIT_MS`, until no group's abort hooks are running in
/// this process (abort.rs); true when none are. Python's exit calls it.
pub fn wait_for_failure_hooks() -> std::result::Result<bool, BridgeError> {
    catch(|| {
        let config = Config::from_env(Duration::from_secs(1))?;
        Ok(crate::abort::wait_for_listeners(config.failure_hooks_wait))
    })
}

#[cfg(feature = "bridge")]
unsafe extern "C" {
    /// Defined by csrc/module.cc: pybind11's module init, under a name that does not clash with ours.
    fn PyInit_xccl_rs_cxx() -> *mut std::ffi::c_void;
}

/// The Python extension's entry point (`xccl_rs._C`).
#[cfg(feature = "bridge")]
#[unsafe(no_mangle)]
pub extern "C" fn PyInit__C() -> *mut std::ffi::c_void {
    // SAFETY: called by the Python interpreter with the GIL held, exactly like a module init;
    // the C++ function is a pybind11 module init that catches its own exceptions.
    unsafe { PyInit_xccl_rs_cxx() }
}

/// Microseconds since the Unix epoch: torch.profiler's clock for events reported with their times.
fn unix_micros(t: std::time::SystemTime) -> i64 {
    t.duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_micros() as i64)
}

// How a core error crosses to C++ with its kind.
//
// cxx gives C++ an `extern "Rust"` function's `Err` as a `rust::Error` whose only content is
// the error's `Display` text. So the kind travels in that text: a [`BridgeError`] renders as
// the bridge's `ErrorKind` code in decimal, [`KIND_TAG_END`], then the text the user sees
// (`xccl_rs: ...`, [`CommError`]'s rendering). `raise_core_error` in `csrc/errors.cc`, the one
// decoder, reads the code, strips the tag and raises the exception of that kind. The kind is
// thereby part of the error itself: no state beside it (a thread-local set before returning,
// read after catching) that a second error, or a catch on another thread, could get wrong.
// The alternative, shared structs as return values, would need a dummy value of every
// function's result type on failure.

/// Ends the kind tag (ASCII's unit separator): digits before it, the user's text after it.
/// `csrc/errors.cc` spells the same character.
const KIND_TAG_END: char = '\u{1f}';

/// How a core error reads in torch's terms (`c10d::ErrorType`, and the Python exception).
fn shared_error_kind(kind: ErrorKind) -> ffi::ErrorKind {
    match kind {
        ErrorKind::InvalidArgument => ffi::ErrorKind::InvalidArgument,
        ErrorKind::Timeout => ffi::ErrorKind::Timeout,
        ErrorKind::PeerFailure => ffi::ErrorKind::Remote,
        ErrorKind::Mismatch | ErrorKind::Io | ErrorKind::Aborted => ffi::ErrorKind::Communication,
    }
}

/// The error of every bridge function that returns `Result` (see the module doc).
pub struct BridgeError {
    kind: ffi::ErrorKind,
    /// What the user reads: the core error's rendering, prefix included.
    text: String,
}

impl From<CommError> for BridgeError {
    fn from(e: CommError) -> Self {
        BridgeError { kind: shared_error_kind(e.kind), text: e.to_string() }
    }
}

impl fmt::Display for BridgeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{KIND_TAG_END}{}", self.kind.repr, self.text)
    }
}

/// Runs `f` for a bridge function: its error, or a panic (which must not unwind into C++),
/// becomes the [`BridgeError`] C++ raises.
fn catch<T>(f: impl FnOnce() -> crate::error::Result<T>) -> std::result::Result<T, BridgeError> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(result) => result.map_err(BridgeError::from),
        Err(_) => Err(CommError::io("internal error (a panic in the Rust core; please report it)").into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_is_tagged_with_its_code_before_the_users_text() {
        for &kind in ErrorKind::ALL {
            let text = BridgeError::from(CommError::new(kind, "rank 1: no")).to_string();
            let (code, rest) = text.split_once(KIND_TAG_END).expect("a kind tag");
            assert_eq!(code.parse::<u8>().ok(), Some(shared_error_kind(kind).repr), "{kind:?}: {text:?}");
            assert!(shared_error_kind(kind) != ffi::ErrorKind::Success, "{kind:?}");
            assert_eq!(rest, "xccl_rs: rank 1: no", "{kind:?}");
        }
    }

    #[test]
    fn a_panic_is_an_internal_communication_error() {
        let text = catch::<()>(|| panic!("boom")).err().expect("an error").to_string();
        let communication = ffi::ErrorKind::Communication.repr;
        assert_eq!(text, format!("{communication}{KIND_TAG_END}xccl_rs: internal error (a panic in the Rust core; please report it)"));
    }
}

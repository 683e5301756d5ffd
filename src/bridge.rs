//! The Rust side of the C++ bridge: adapts the c10d Store to [`Store`], turns
//! [`ffi::OpRequest`]s into [`Op`]s and completions into `work_done` calls. With the `bridge`
//! feature also the Python module init symbol, which must be defined here (a C++ `extern "C"`
//! symbol linked into a Rust cdylib is not exported); the C++ library of the CMake package
//! (feature `cpp` alone) has no Python and must not reference it.

use std::cell::Cell;
use std::time::Duration;

use crate::comm::{Communicator, JobStaging};
use crate::config::Config;
use crate::error::{CommError, ErrorKind, Result};
use crate::ffi::ffi::{self, BufferView, OpRequest, StoreRef, WorkDone, WorkReady};
use crate::op::Op;
use crate::pipeline::{Relocation, Staging, chunk_bytes_for};
use crate::rendezvous::Store;
use crate::transport::RawBuf;
use crate::types::{DType, OpKind, ReduceOp};

// SAFETY: the C++ StoreRef holds an intrusive_ptr to a c10d::Store; c10d stores are used from
// several threads by torch itself (their clients lock internally).
unsafe impl Send for StoreRef {}
// SAFETY: as above; we only call its const, internally synchronized methods.
unsafe impl Sync for StoreRef {}
// SAFETY: WorkDone owns a shared_ptr to a mutex-protected state; it is moved to the progress
// thread and used there once.
unsafe impl Send for WorkDone {}
// SAFETY: WorkReady owns a shared_ptr to the job's DeviceStaging; it is moved to the thread that
// runs the job and used only there (the caller's thread no longer touches the staging's
// chunk state after sealing it).
unsafe impl Send for WorkReady {}

/// The C++ staging of a job's accelerator tensors, as the core's [`Staging`] hooks.
struct BridgeStaging(cxx::UniquePtr<WorkReady>);

impl Staging for BridgeStaging {
    fn host_buffers(&mut self) -> Result<Vec<Relocation>> {
        let table = ffi::staging_host_buffers(self.0.pin_mut()).map_err(|e| CommError::io(e.what().to_string()))?;
        Ok(relocations(&table))
    }
    fn inputs_ready(&mut self, op: usize, chunk: usize) -> Result<Vec<Relocation>> {
        let table = ffi::chunk_inputs_ready(self.0.pin_mut(), op, chunk).map_err(|e| CommError::io(e.what().to_string()))?;
        Ok(relocations(&table))
    }
    fn outputs_done(&mut self, op: usize, chunk: usize) -> Result<()> {
        ffi::chunk_outputs_done(self.0.pin_mut(), op, chunk).map_err(|e| CommError::io(e.what().to_string()))
    }
}

fn relocations(table: &[ffi::HostRelocation]) -> Vec<Relocation> {
    table.iter().map(|r| Relocation { placeholder: r.placeholder, bytes: r.bytes, host: r.host }).collect()
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
            .map_err(|e| CommError::new(crate::ErrorKind::Timeout, format!("store get '{key}' failed: {e}")))
    }
}

pub struct RustComm(Communicator);

pub fn new_comm(store: cxx::UniquePtr<StoreRef>, rank: i32, size: i32, timeout_ms: u64) -> std::result::Result<Box<RustComm>, String> {
    catch(|| {
        if rank < 0 || size <= 0 {
            return Err(CommError::invalid(format!("xccl_rs: invalid rank {rank} / size {size}")));
        }
        let config = Config::from_env(Duration::from_millis(timeout_ms)).map_err(|e| CommError::invalid(e.to_string()))?;
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

/// How a core error reads in torch's terms (`c10d::ErrorType`, and the Python exception).
fn shared_error_kind(kind: &ErrorKind) -> ffi::ErrorKind {
    match kind {
        ErrorKind::InvalidArgument => ffi::ErrorKind::InvalidArgument,
        ErrorKind::Timeout => ffi::ErrorKind::Timeout,
        ErrorKind::PeerFailure => ffi::ErrorKind::Remote,
        ErrorKind::Mismatch | ErrorKind::Io | ErrorKind::Aborted => ffi::ErrorKind::Communication,
    }
}

thread_local! {
    /// The kind of the last error a bridge function returned on this thread (`take_error_kind`).
    static LAST_ERROR_KIND: Cell<u8> = const { Cell::new(0) };
}

pub fn take_error_kind() -> ffi::ErrorKind {
    ffi::ErrorKind { repr: LAST_ERROR_KIND.with(|k| k.replace(ffi::ErrorKind::Success.repr)) }
}

fn to_op(r: &OpRequest) -> Result<Op> {
    let kind = core_kind(r.kind)?;
    let dtype = DType::from_code(r.dtype.repr).ok_or_else(|| CommError::invalid(format!("unknown dtype code {}", r.dtype.repr)))?;
    let reduce_op = ReduceOp::from_code(r.reduce_op.repr)
        .ok_or_else(|| CommError::invalid(format!("unknown reduce op code {}", r.reduce_op.repr)))?;
    // SAFETY: the C++ side builds views from tensors it keeps alive (in the work state) until
    // the job's completion, and no one else touches them meanwhile (c10d's contract for
    // in-flight tensors).
    let views = |v: &[BufferView]| v.iter().map(|b| unsafe { RawBuf::new(b.ptr as *mut u8, b.bytes) }).collect();
    Ok(Op {
        kind,
        dtype,
        reduce_op,
        premul_factor: r.premul_factor,
        root: r.root,
        tag: r.tag,
        inputs: views(&r.inputs),
        outputs: views(&r.outputs),
    })
}

impl RustComm {
    pub fn submit(
        &self,
        ops: Vec<OpRequest>,
        ready: cxx::UniquePtr<WorkReady>,
        done: cxx::UniquePtr<WorkDone>,
        caller_waits: bool,
    ) -> std::result::Result<(), String> {
        catch(|| {
            let ops = ops.iter().map(to_op).collect::<Result<Vec<_>>>()?;
            let staging: Option<JobStaging> = (!ready.is_null()).then(|| Box::new(BridgeStaging(ready)) as JobStaging);
            self.0.submit_with(
                ops,
                staging,
                Box::new(move |result| match result {
                    Ok(c) => ffi::work_done(done, ffi::ErrorKind::Success, "", c.source_rank),
                    Err(e) => ffi::work_done(done, shared_error_kind(&e.kind), &e.message, -1),
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

    /// The chunk size the core will run an op of `kind` in (src/pipeline.rs): the bridge plans
    /// its copies of accelerator tensors with the same chunks.
    pub fn chunk_bytes(&self, kind: ffi::OpKind) -> usize {
        core_kind(kind).map_or(usize::MAX, |k| chunk_bytes_for(k, self.0.pipeline_chunk_bytes()))
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

/// This host's identity by the core's rule (comm.rs `this_host`), for Python's weight sync.
pub fn host_identity() -> std::result::Result<String, String> {
    catch(|| {
        let config = Config::from_env(Duration::from_secs(1)).map_err(|e| CommError::invalid(e.to_string()))?;
        Ok(crate::comm::this_host(&config))
    })
}

/// Runs `f`, turning errors and panics into the message C++ will raise.
fn catch<T>(f: impl FnOnce() -> Result<T>) -> std::result::Result<T, String> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => {
            LAST_ERROR_KIND.with(|k| k.set(shared_error_kind(&e.kind).repr));
            Err(e.message)
        }
        Err(_) => {
            LAST_ERROR_KIND.with(|k| k.set(ffi::ErrorKind::Communication.repr));
            Err("xccl_rs: internal error (a panic in the Rust core; please report it)".into())
        }
    }
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

//! The C++ bridge, declarations only (the implementations live in `bridge.rs` on the Rust side
//! and in `csrc/` on the C++ side). Nothing of torch crosses it: C++ turns tensors into
//! [`ffi::BufferView`]s and c10d calls into [`ffi::OpRequest`]s.
//!
//! The vocabulary both languages use is declared here once, as shared enums: op kinds, element
//! types, reduce ops and error kinds (cxx generates the C++ `enum class`es; `bridge.rs` checks at
//! compile time that every code equals the core's own enum's). Errors cross one way: a Rust
//! function that can fail returns `Result`; its message becomes the C++ exception's text and its
//! kind is kept for the same thread (`take_error_kind`), which `csrc/errors.cc` maps, in one
//! place, to a Python `ValueError` or `torch.distributed.DistBackendError`. No panic crosses
//! (the Rust side catches them).

use crate::bridge::{RustComm, host_identity, new_comm, take_error_kind};

#[cxx::bridge(namespace = "xccl_rs")]
pub mod ffi {
    /// What a collective or point-to-point call is (the core's `types::OpKind`).
    #[repr(u8)]
    enum OpKind {
        AllReduce = 0,
        Broadcast = 1,
        Reduce = 2,
        AllGather = 3,
        Gather = 4,
        Scatter = 5,
        ReduceScatter = 6,
        AllToAll = 7,
        Barrier = 8,
        Send = 9,
        Recv = 10,
        RecvAnySource = 11,
    }

    /// Element types (the core's `types::DType`); `Bytes`: any other dtype, moved, never reduced.
    #[repr(u8)]
    enum DType {
        Float64 = 0,
        Float32 = 1,
        Float16 = 2,
        BFloat16 = 3,
        Int8 = 4,
        UInt8 = 5,
        Int16 = 6,
        Int32 = 7,
        Int64 = 8,
        Bool = 9,
        UInt16 = 10,
        UInt32 = 11,
        UInt64 = 12,
        Float8E4M3FN = 13,
        Float8E5M2 = 14,
        Float8E4M3FNUZ = 15,
        Float8E5M2FNUZ = 16,
        Bytes = 17,
    }

    /// Reduce ops (the core's `types::ReduceOp`; c10d's `RedOpType` has the same numbers).
    #[repr(u8)]
    enum ReduceOp {
        Sum = 0,
        Avg = 1,
        Product = 2,
        Min = 3,
        Max = 4,
        BAnd = 5,
        BOr = 6,
        BXor = 7,
        PreMulSum = 8,
    }

    /// How an error reads to the caller, in the terms of torch's `c10d::ErrorType`.
    #[repr(u8)]
    enum ErrorKind {
        /// No error.
        Success = 0,
        /// Arguments that can never work (raised as `ValueError`; the group is not failed).
        InvalidArgument = 1,
        /// The operation did not finish within the timeout.
        Timeout = 2,
        /// A peer failed (closed its connection, reported its own error).
        Remote = 3,
        /// Any other failure of the group (mismatch between ranks, I/O, an aborted group).
        Communication = 4,
    }

    /// A contiguous host buffer: its address and its length in bytes.
    struct BufferView {
        ptr: usize,
        bytes: usize,
    }

    /// Host memory (`host`) behind a placeholder range that staged buffers were described with.
    struct HostRelocation {
        placeholder: usize,
        bytes: usize,
        host: usize,
    }

    /// One operation, in the layout `src/op.rs` documents.
    struct OpRequest {
        kind: OpKind,
        dtype: DType,
        reduce_op: ReduceOp,
        premul_factor: f64,
        root: i64,
        tag: i64,
        inputs: Vec<BufferView>,
        outputs: Vec<BufferView>,
    }

    extern "Rust" {
        type RustComm;
        /// Connects to the group (blocking) and starts its progress thread.
        fn new_comm(store: UniquePtr<StoreRef>, rank: i32, size: i32, timeout_ms: u64) -> Result<Box<RustComm>>;
        /// Queues a job; `done` is completed on the progress thread, or before this returns when
        /// `caller_waits` let it run on the calling thread. `ready` (null for host tensors) is
        /// the job's staging of accelerator tensors: its chunk hooks run on that thread.
        fn submit(
            self: &RustComm,
            ops: Vec<OpRequest>,
            ready: UniquePtr<WorkReady>,
            done: UniquePtr<WorkDone>,
            caller_waits: bool,
        ) -> Result<()>;
        /// Fails the group because this rank rejected its part of an op of `kind`.
        fn abort_op(self: &RustComm, kind: OpKind, message: &str);
        /// The chunk size (bytes of each buffer) the core runs an op of `kind` in; usize::MAX
        /// when such ops are not chunked. Chunk k of a buffer of L bytes is [k*c, min((k+1)*c, L)),
        /// and there are max(1, ceil(L / c)) chunks.
        fn chunk_bytes(self: &RustComm, kind: OpKind) -> usize;
        fn next_seq(self: &RustComm) -> u64;
        fn set_timeout_ms(self: &RustComm, timeout_ms: u64);
        fn shutdown(self: &RustComm);
        /// The kind of the last error a function of this bridge returned to this thread (then
        /// `Success` until the next one).
        fn take_error_kind() -> ErrorKind;
        /// Which ranks share memory: equal identities (XCCL_RS_HOST_ID, else host and /dev/shm).
        fn host_identity() -> Result<String>;
    }

    unsafe extern "C++" {
        include!("xccl_rs/store.h");
        include!("xccl_rs/work.h");

        /// A c10d Store.
        type StoreRef;
        /// The completion side of one Work.
        type WorkDone;
        /// The staging of a job's accelerator tensors (chunk_inputs_ready / chunk_outputs_done).
        type WorkReady;

        fn store_set(store: &StoreRef, key: &str, value: &[u8]) -> Result<()>;
        fn store_get(store: &StoreRef, key: &str, timeout_ms: u64) -> Result<Vec<u8>>;
        /// On the thread that runs the job, first: allocates the pinned host memory of its staged
        /// tensors and says which placeholder range each whole buffer stands for.
        fn staging_host_buffers(ready: Pin<&mut WorkReady>) -> Result<Vec<HostRelocation>>;
        /// Blocks until chunk `chunk` of op `op`'s staged inputs is on the host; Err if staging
        /// failed. Returns where the chunk's windowed ranges are (pipeline::Staging::inputs_ready).
        fn chunk_inputs_ready(ready: Pin<&mut WorkReady>, op: usize, chunk: usize) -> Result<Vec<HostRelocation>>;
        /// Chunk `chunk` of op `op`'s outputs is final: enqueues its copy back to the device.
        fn chunk_outputs_done(ready: Pin<&mut WorkReady>, op: usize, chunk: usize) -> Result<()>;
        /// Marks the work finished: `kind` Success (and `error` empty) on success.
        fn work_done(done: UniquePtr<WorkDone>, kind: ErrorKind, error: &str, source_rank: i64);
    }
}

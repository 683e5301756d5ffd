//! The C++ bridge, declarations only (the implementations live in `bridge.rs` on the Rust side
//! and in `csrc/` on the C++ side). Nothing of torch crosses it: C++ turns tensors into
//! [`ffi::BufferView`]s and c10d calls into [`ffi::OpRequest`]s.
//!
//! The vocabulary both languages use is declared here once, as shared enums: op kinds, element
//! types, reduce ops and error kinds (cxx generates the C++ `enum class`es; `bridge.rs` checks at
//! compile time that every code equals the core's own enum's). Errors cross one way: a Rust
//! function that can fail returns `Result`, whose error carries its kind in its text
//! (`bridge.rs` encodes it, `csrc/errors.cc` decodes it), and `csrc/errors.cc` maps the
//! kind, in one place, to a Python `ValueError` or `torch.distributed.DistBackendError`. No
//! panic crosses (the Rust side catches them).

use crate::bridge::{RustComm, SharedBlock, host_identity, new_comm, op_label, wait_for_failure_hooks};

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

    /// Where a buffer's bytes are.
    #[repr(u8)]
    enum BufferPlace {
        /// Host memory, at address `start`.
        Host = 0,
        /// Bytes from `start` on of the job's staged accelerator tensor number `tensor`.
        Staged = 1,
    }

    /// A contiguous buffer of an op: `bytes` bytes at `start` (see [`BufferPlace`]).
    struct BufferView {
        place: BufferPlace,
        tensor: usize,
        start: usize,
        bytes: usize,
    }

    /// An accelerator tensor of a job, staged through host memory (the core's `StagedTensor`).
    struct StagedTensor {
        bytes: usize,
        contiguous: bool,
        read: bool,
        write: bool,
    }

    /// Pinned host memory the staging allocated: its number and address.
    struct PinnedBlock {
        block: usize,
        address: usize,
    }

    /// Which way a staging copy goes; each direction has its own stream.
    #[repr(u8)]
    enum Toward {
        Host = 0,
        Device = 1,
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

    /// A group's statistics for one (op kind, algorithm): src/stats.rs.
    struct OpStatsRow {
        op: &'static str,
        path: String,
        ops: u64,
        bytes: u64,
        nanos: u64,
    }

    extern "Rust" {
        type RustComm;
        /// Connects to the group (blocking) and starts its progress thread.
        fn new_comm(store: UniquePtr<StoreRef>, rank: i32, size: i32, timeout_ms: u64) -> Result<Box<RustComm>>;
        /// Queues a job; `done` is completed on the progress thread, or before this returns when
        /// `caller_waits` let it run on the calling thread. `staging` (null for a job on host
        /// tensors) holds the job's accelerator tensors, `staged` describes them; the core plans
        /// and runs their copies on that thread, through the `staging_*` primitives below.
        fn submit(
            self: &RustComm,
            ops: Vec<OpRequest>,
            staged: Vec<StagedTensor>,
            staging: UniquePtr<StagingHandle>,
            done: UniquePtr<WorkDone>,
            caller_waits: bool,
        ) -> Result<()>;
        /// Fails the group because this rank rejected its part of an op of `kind`.
        fn abort_op(self: &RustComm, kind: OpKind, message: &str);
        /// Aborts the group from any thread (torch's `Backend.abort()`): the running op stops,
        /// later ones fail, peers are told.
        fn abort_group(self: &RustComm, reason: &str);
        /// The kind of the error that failed the group; `Success` while it works.
        fn error_kind(self: &RustComm) -> ErrorKind;
        /// `listener` hears the group's first failure (`group_failed`), once, on the thread that
        /// finds it: torch's abort hooks.
        fn listen_for_failure(self: &RustComm, listener: UniquePtr<FailureListener>);
        fn next_seq(self: &RustComm) -> u64;
        fn set_timeout_ms(self: &RustComm, timeout_ms: u64);
        fn shutdown(self: &RustComm);

        /// Memory in this rank's shared-memory heap (transport/shm/heap.rs), freed when dropped.
        type SharedBlock;
        fn alloc_shared(self: &RustComm, bytes: usize) -> Result<Box<SharedBlock>>;
        fn has_heap(self: &RustComm) -> bool;
        fn zero_copy_ops(self: &RustComm) -> u64;
        /// The group's statistics so far, one row per (op kind, algorithm) that ran.
        fn stats(self: &RustComm) -> Vec<OpStatsRow>;
        /// Names the group in its statistics lines.
        fn set_group_name(self: &RustComm, name: &str);
        /// The op's name as torch's flight recorder and profiler ranges spell it ("all_reduce").
        fn op_label(kind: OpKind) -> &'static str;
        fn address(self: &SharedBlock) -> usize;
        /// Which ranks share memory: equal identities (XCCL_RS_HOST_ID, else host and /dev/shm).
        fn host_identity() -> Result<String>;
        /// Waits (at most XCCL_RS_FAILURE_HOOKS_WAIT_MS) until no abort hooks are running; true
        /// when none are. Python's exit calls it, without the GIL.
        fn wait_for_failure_hooks() -> Result<bool>;
    }

    unsafe extern "C++" {
        include!("xccl_rs/store.h");
        include!("xccl_rs/work.h");
        include!("xccl_rs/hooks.h");

        /// A c10d Store.
        type StoreRef;
        /// The completion side of one Work.
        type WorkDone;
        /// A job's accelerator tensors and the device primitives that copy them (csrc/device.h).
        type StagingHandle;
        /// Who hears that a group failed: a backend's abort hooks (csrc/hooks.cc).
        type FailureListener;

        fn store_set(store: &StoreRef, key: &str, value: &[u8]) -> Result<()>;
        fn store_get(store: &StoreRef, key: &str, timeout_ms: u64) -> Result<Vec<u8>>;

        // The staging primitives (the core's `staging::DeviceCopies`), called on the thread that
        // runs the job. Each throws (an Err here) on a device error.
        /// `bytes` of pinned host memory, kept until the job ends.
        fn staging_alloc_pinned(staging: Pin<&mut StagingHandle>, bytes: usize) -> Result<PinnedBlock>;
        /// A block on `bytes` of registered host memory at `address` (kept registered and
        /// mapped until the job ends); its number.
        fn staging_adopt(staging: Pin<&mut StagingHandle>, address: usize, bytes: usize) -> Result<usize>;
        /// Registers host memory with the job's device runtime; false where it cannot.
        fn staging_register_host(staging: Pin<&mut StagingHandle>, address: usize, bytes: usize) -> Result<bool>;
        /// Whether the job's device runtime has a way to register host memory.
        fn staging_can_register_host(staging: &StagingHandle) -> bool;
        /// Ends a registration. Never throws.
        fn staging_unregister_host(address: usize);
        /// Queues on `toward`'s stream a copy of `bytes` bytes between byte `tensor_offset` of
        /// staged tensor `tensor` and byte `block_offset` of pinned block `block`.
        fn staging_copy(
            staging: Pin<&mut StagingHandle>,
            toward: Toward,
            tensor: usize,
            tensor_offset: usize,
            block: usize,
            block_offset: usize,
            bytes: usize,
        ) -> Result<()>;
        /// Records an event on `toward`'s stream; returns its number (0 is the call's event).
        fn staging_record(staging: Pin<&mut StagingHandle>, toward: Toward) -> Result<usize>;
        /// Blocks until event `event` has fired.
        fn staging_synchronize(staging: Pin<&mut StagingHandle>, event: usize) -> Result<()>;
        /// Makes `toward`'s stream wait for event `event`.
        fn staging_stream_wait(staging: Pin<&mut StagingHandle>, toward: Toward, event: usize) -> Result<()>;
        /// After the last copy back: records the event the caller's stream waits for.
        fn staging_finish(staging: Pin<&mut StagingHandle>) -> Result<()>;
        /// The group failed with `message`: runs the listener's hooks on a C++ thread and
        /// returns when they have. Never throws.
        fn group_failed(listener: &FailureListener, kind: ErrorKind, message: &str);
        /// Marks the work finished: `kind` Success (and `error` empty) on success;
        /// `started_unix_us` is when the job started running (its profiler range).
        fn work_done(done: UniquePtr<WorkDone>, kind: ErrorKind, error: &str, source_rank: i64, started_unix_us: i64);
    }
}

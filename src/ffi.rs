//! The C++ bridge, declarations only (the implementations live in `bridge.rs` on the Rust side
//! and in `csrc/` on the C++ side). Nothing of torch crosses it: C++ turns tensors into
//! [`ffi::BufferView`]s and c10d calls into [`ffi::OpRequest`]s. Every Rust function that can
//! fail returns `Result`, which cxx turns into a C++ exception that the bridge rethrows as a
//! `c10::DistBackendError`; no panic crosses (the Rust side catches them).

use crate::bridge::{RustComm, check_reduction, new_comm};

#[cxx::bridge(namespace = "xccl_rs")]
pub mod ffi {
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
        kind: u8,
        dtype: u8,
        reduce_op: u8,
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
        fn abort_op(self: &RustComm, kind: u8, message: &str);
        /// The chunk size (bytes of each buffer) the core runs an op of `kind` in; usize::MAX
        /// when such ops are not chunked. Chunk k of a buffer of L bytes is [k*c, min((k+1)*c, L)),
        /// and there are max(1, ceil(L / c)) chunks.
        fn chunk_bytes(self: &RustComm, kind: u8) -> usize;
        fn next_seq(self: &RustComm) -> u64;
        fn set_timeout_ms(self: &RustComm, timeout_ms: u64);
        fn shutdown(self: &RustComm);
        /// Ok if `op` is defined on `dtype`, else the message to raise.
        fn check_reduction(dtype: u8, op: u8) -> Result<()>;
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
        /// Marks the work finished: `error` empty on success.
        fn work_done(done: UniquePtr<WorkDone>, error: &str, source_rank: i64);
    }
}

//! Accelerator tensors staged through host memory. The algorithms run on host memory only; a
//! job whose ops name ranges of accelerator tensors ([`Buf::Staged`](crate::buf::Buf)) gets
//! host memory for them here, chunk by chunk, so that the device's copies overlap the host's
//! work: while the host works on chunk k, the device copies chunk k+1 to the host and chunk
//! k−1 back, on two streams (the two directions of the link).
//!
//! The core owns the whole protocol: which tensors get a buffer of their own and which go
//! through a *window* of chunk-sized slots ([`plan`]), and the order of every copy, event and
//! wait ([`job`]); a broadcast's staging in registered shared memory, copied onto the
//! receivers' devices from there ([`shared`]). The device side (the bridge, csrc/device.cc)
//! only offers primitives, [`DeviceCopies`]: pinned host memory, registering and adopting
//! shared memory, a copy of a byte range on one of two streams, events.
//!
//! Terms used throughout:
//! - *staged tensor*: an accelerator tensor of the job ([`StagedTensor`], numbered in the job);
//! - *view*: the byte range of a staged tensor that one op uses (one of its buffers);
//! - *chunk*: chunk k of an op is the byte range `[k·c, (k+1)·c)` of each of its buffers
//!   (src/pipeline.rs); the job's chunks in the order the core runs them have a *copy number*;
//! - *window*: `sets` sets of `slots` slots of `slot_bytes` each; chunk number n keeps its
//!   views in set n mod sets, one slot per windowed view of its op.

pub mod job;
pub mod plan;
pub mod shared;

pub use job::StagedJob;
pub use shared::{HostRegistration, MappedArena, SharedStaging, release_idle_arenas};

use crate::buf::RawBuf;
use crate::error::Result;

/// An accelerator tensor of a job, as the bridge describes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StagedTensor {
    pub bytes: usize,
    /// Contiguous tensors are copied by chunks; others whole (a strided copy cannot be cut).
    pub contiguous: bool,
    /// The job reads it: its bytes are copied to the host.
    pub read: bool,
    /// The job writes it: its bytes are copied back when the job succeeds.
    pub write: bool,
}

/// Which way a copy goes; each direction has its own stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Toward {
    Host,
    Device,
}

/// An event recorded on a stream: it fires when the work queued on that stream before it is done.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Event(pub usize);

/// The event recorded on the caller's stream when the job was issued: copies must follow the
/// work queued before the collective.
pub const ISSUED: Event = Event(0);

/// A block of pinned host memory, valid until [`DeviceCopies::finish`] or the end of the job.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pinned {
    /// Its number, for [`DeviceCopies::copy`].
    pub block: usize,
    pub address: usize,
    pub bytes: usize,
}

/// The device primitives a staged job needs. Called only on the thread that runs the job.
pub trait DeviceCopies: Send {
    /// `bytes` of pinned host memory. It stays valid, and nobody else touches it, until the job
    /// ends; copies queued on it keep it until they have run.
    fn alloc_pinned(&mut self, bytes: usize) -> Result<Pinned>;
    /// Registers `bytes` of host memory at `address`, shared memory mapped by this process, with
    /// the device runtime, so that copies to and from it run as fast as pinned memory's. The
    /// memory must stay mapped until the registration is dropped. None where the runtime has
    /// no way to register host memory (shared.rs).
    fn register(&mut self, address: usize, bytes: usize) -> Result<Option<HostRegistration>>;
    /// Where the runtime has a way to register host memory, the function that ends its
    /// registrations: memory that it registered for one job serves every job whose device
    /// names the same (staging/shared.rs keeps registered arenas across groups). None where it
    /// has no way.
    fn registrar(&self) -> Option<fn(usize)>;
    /// A block for [`copy`](Self::copy) on `bytes` of memory at `address` that [`register`]
    /// registered, which stays registered and mapped until the job ends.
    ///
    /// [`register`]: Self::register
    fn adopt(&mut self, address: usize, bytes: usize) -> Result<Pinned>;
    /// Queues on `toward`'s stream a copy of `bytes` bytes between byte `tensor_offset` of staged
    /// tensor `tensor` and byte `block_offset` of pinned block `block`. A non-contiguous tensor
    /// can only be copied whole (offset 0, all its bytes).
    fn copy(&mut self, toward: Toward, tensor: usize, tensor_offset: usize, block: usize, block_offset: usize, bytes: usize) -> Result<()>;
    /// Records an event on `toward`'s stream.
    fn record(&mut self, toward: Toward) -> Result<Event>;
    /// Blocks this thread until `event` has fired.
    fn synchronize(&mut self, event: Event) -> Result<()>;
    /// Makes `toward`'s stream wait for `event` before its later work.
    fn stream_wait(&mut self, toward: Toward, event: Event) -> Result<()>;
    /// After the job's last copy back: records the event the caller's stream waits for in
    /// `Work.wait()`, and releases the pinned memory (its pending copies keep it as needed).
    fn finish(&mut self) -> Result<()>;
}

/// What a staged job offers the algorithm that runs its current chunk: taking the chunk's
/// output from elsewhere than its pinned memory (a broadcast's receivers, shared.rs).
pub trait DirectOutput: Send {
    /// The current chunk's only output is the `source.len()` bytes at `source`, part of a peer's
    /// arena (`arena`, mapped here), unchanged until this returns. Copies them straight onto the
    /// device, registering the arena first where needed, and returns once the copy has run:
    /// true. False, having copied nothing, where the output is no accelerator tensor's or the
    /// arena cannot be registered: then the caller copies on the host.
    fn deliver(&mut self, source: RawBuf, arena: &MappedArena) -> Result<bool>;
}

//! xccl_rs: a torch.distributed backend. This crate is the core (it knows nothing of torch):
//! communicators, transports, collective algorithms and reduction kernels. With the `cpp`
//! feature it also holds the C++ bridge (for libtorch programs, through the CMake package); with
//! `bridge` it is moreover the Python extension module `xccl_rs._C`.
//! See docs/architecture.md.

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod abort;
pub mod algorithms;
pub mod buf;
pub mod comm;
pub mod config;
pub mod error;
pub mod fabric;
pub mod hosts;
pub mod keys;
pub mod op;
pub mod par;
pub mod peers;
pub mod pipeline;
pub mod reduce;
pub mod rendezvous;
pub mod staging;
pub mod stats;
pub mod stream_copy;
pub mod transport;
pub mod types;

pub use comm::Communicator;
pub use config::Config;
pub use error::{CommError, ErrorKind};
pub use op::{Completion, Op};
pub use rendezvous::{MemoryStore, Store};
pub use transport::RawBuf;
pub use types::{DType, OpKind, ReduceOp};

/// The unit tests' collector of failing points, shared with the integration tests.
#[cfg(test)]
#[path = "../tests/common/failures.rs"]
pub(crate) mod failures;

#[cfg(feature = "cpp")]
mod bridge;
#[cfg(feature = "cpp")]
mod ffi;

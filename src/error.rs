//! The one error type of the core. Messages follow gloo's style: they name the operation, its
//! sequence number, the ranks and the sizes involved, so a user can act on them without a debugger.

use std::fmt;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// Arguments that can never work (bad sizes, unsupported dtype/op): raised before data moves.
    InvalidArgument,
    /// Ranks disagree about the operation (size, dtype, op, root or order).
    Mismatch,
    /// The operation did not finish within the group timeout.
    Timeout,
    /// A peer closed its connection or reported an error of its own.
    PeerFailure,
    /// Socket or system call failure.
    Io,
    /// The communicator failed earlier and can no longer be used.
    Aborted,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CommError {
    pub kind: ErrorKind,
    pub message: String,
}

impl CommError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        CommError { kind, message: message.into() }
    }
    pub fn invalid(message: impl Into<String>) -> Self {
        CommError::new(ErrorKind::InvalidArgument, message)
    }
    pub fn mismatch(message: impl Into<String>) -> Self {
        CommError::new(ErrorKind::Mismatch, message)
    }
    pub fn io(message: impl Into<String>) -> Self {
        CommError::new(ErrorKind::Io, message)
    }
    pub fn peer(message: impl Into<String>) -> Self {
        CommError::new(ErrorKind::PeerFailure, message)
    }
}

impl fmt::Display for CommError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for CommError {}

pub type Result<T> = std::result::Result<T, CommError>;

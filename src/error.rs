//! The one error type of the core. Messages follow gloo's style: they name the operation, its
//! sequence number, the ranks and the sizes involved, so a user can act on them without a debugger.
//!
//! What a user reads is `xccl_rs: ` and the message, rendered by [`CommError`]'s `Display` and
//! nowhere else: `message` never carries the prefix, so an error that quotes another one quotes
//! its `message` and the prefix appears once, at the front.

use std::fmt;

/// Declares [`ErrorKind`] and, for each kind, the [`CommError`] constructor named beside it.
macro_rules! error_kinds {
    ($( $(#[doc = $doc:literal])* $kind:ident => $constructor:ident, )*) => {
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum ErrorKind {
            $( $(#[doc = $doc])* $kind, )*
        }

        impl ErrorKind {
            /// Every kind, in declaration order.
            pub const ALL: &'static [ErrorKind] = &[$(ErrorKind::$kind),*];
        }

        impl CommError {
            $(
                #[doc = concat!("An error of kind [`ErrorKind::", stringify!($kind), "`].")]
                pub fn $constructor(message: impl Into<String>) -> Self {
                    CommError::new(ErrorKind::$kind, message)
                }
            )*
        }
    };
}

error_kinds! {
    /// Arguments that can never work (bad sizes, unsupported dtype/op): raised before data moves.
    InvalidArgument => invalid,
    /// Ranks disagree about the operation (size, dtype, op, root or order).
    Mismatch => mismatch,
    /// The operation did not finish within the group timeout.
    Timeout => timeout,
    /// A peer closed its connection or reported an error of its own.
    PeerFailure => peer,
    /// Socket or system call failure.
    Io => io,
    /// The communicator failed earlier and can no longer be used.
    Aborted => aborted,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CommError {
    pub kind: ErrorKind,
    /// The text after the prefix: what went wrong, led by where ([`within`](Self::within)).
    pub message: String,
}

/// How every error the user sees begins.
pub const PREFIX: &str = "xccl_rs: ";

impl CommError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        CommError { kind, message: message.into() }
    }

    /// The same error, its message led by where it happened (`place`: "rank 2", "allreduce #17
    /// on rank 2") and a colon, the form every message uses.
    pub fn within(self, place: impl fmt::Display) -> Self {
        CommError { kind: self.kind, message: format!("{place}: {}", self.message) }
    }
}

impl fmt::Display for CommError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{PREFIX}{}", self.message)
    }
}

impl std::error::Error for CommError {}

pub type Result<T> = std::result::Result<T, CommError>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prefix_is_rendered_once_however_deep_the_context() {
        let e = CommError::peer("rank 1 closed its connection").within("allreduce #3 on rank 0").within("rank 0");
        assert_eq!(e.kind, ErrorKind::PeerFailure);
        assert_eq!(e.to_string(), "xccl_rs: rank 0: allreduce #3 on rank 0: rank 1 closed its connection");
    }
}

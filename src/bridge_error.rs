//! How a core error crosses the C++ bridge with its kind.
//!
//! cxx gives C++ an `extern "Rust"` function's `Err` as a `rust::Error` whose only content is
//! the error's `Display` text. So the kind travels in that text: a [`BridgeError`] renders as
//! the bridge's `ErrorKind` code in decimal, [`KIND_TAG_END`], then the text the user sees
//! (`xccl_rs: ...`, [`CommError`]'s rendering). `raise_core_error` in `csrc/errors.cc`, the one
//! decoder, reads the code, strips the tag and raises the exception of that kind. The kind is
//! thereby part of the error itself: no state beside it (a thread-local set before returning,
//! read after catching) that a second error, or a catch on another thread, could get wrong.
//! The alternative, shared structs as return values, would need a dummy value of every
//! function's result type on failure.

use std::fmt;

use crate::error::{CommError, ErrorKind};
use crate::ffi::ffi;

/// Ends the kind tag (ASCII's unit separator): digits before it, the user's text after it.
/// `csrc/errors.cc` spells the same character.
pub const KIND_TAG_END: char = '\u{1f}';

/// How a core error reads in torch's terms (`c10d::ErrorType`, and the Python exception).
pub fn shared_error_kind(kind: ErrorKind) -> ffi::ErrorKind {
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
pub fn catch<T>(f: impl FnOnce() -> crate::error::Result<T>) -> Result<T, BridgeError> {
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

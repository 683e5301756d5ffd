//! The buffers of an operation. Algorithms see host memory only ([`RawBuf`]). A job's op can
//! also name a byte range of an accelerator tensor that the bridge stages through host memory
//! ([`Buf::Staged`]): such a range has no host address until the staging gives it one, chunk by
//! chunk (src/staging/), so it is a different type, never a pointer.

/// A contiguous host buffer owned by the caller for the duration of an operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawBuf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a RawBuf is only an address and a length; the caller of `RawBuf::new` guarantees the
// memory stays valid and is not used by anyone else until the operation completes, which is
// what moving it to the progress thread needs.
unsafe impl Send for RawBuf {}
// SAFETY: a RawBuf is Copy, so a thread holding `&RawBuf` can do no more than one holding a copy
// of it, which `Send` above already allows (threads that split one operation's buffers, as the
// rail thread of mixed/overlap.rs does, then share the op by reference).
unsafe impl Sync for RawBuf {}

impl RawBuf {
    /// # Safety
    /// `ptr` must be valid for reads and writes of `len` bytes until the operation that uses
    /// this buffer completes, and nothing else may access the memory meanwhile except through
    /// RawBufs of the same operation. `ptr` may be dangling when `len` is 0.
    pub unsafe fn new(ptr: *mut u8, len: usize) -> RawBuf {
        RawBuf { ptr, len }
    }

    /// A buffer over a Rust slice, for tests and scratch space owned by the core.
    pub fn from_slice(s: &mut [u8]) -> RawBuf {
        RawBuf { ptr: s.as_mut_ptr(), len: s.len() }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// The sub-buffer `[offset, offset + len)`. Panics when out of bounds: callers compute
    /// ranges from lengths they validated, so a failure here is a bug, never peer input.
    pub fn sub(&self, offset: usize, len: usize) -> RawBuf {
        assert!(offset.checked_add(len).is_some_and(|end| end <= self.len), "RawBuf::sub out of bounds");
        // In bounds (checked above), so the result stays inside the caller's buffer. Wrapping
        // arithmetic only because `ptr` may dangle when `len` is 0 (then `offset` is 0 too).
        RawBuf { ptr: self.ptr.wrapping_add(offset), len }
    }

    /// Copies `self` into `dst` (equal lengths); a no-op when both are the same memory.
    pub fn copy_to(&self, dst: RawBuf) {
        assert_eq!(self.len, dst.len, "RawBuf::copy_to length mismatch");
        if self.len == 0 || self.ptr == dst.ptr {
            return;
        }
        // SAFETY: both are valid for `len` bytes (RawBuf::new's contract). Distinct views of one
        // operation never partially overlap (buffers are whole tensors or disjoint sub-ranges),
        // and exact equality was handled above, so the ranges do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr, dst.ptr, self.len) }
    }
}

/// A buffer of a submitted op: host memory, or a range of a staged accelerator tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Buf {
    Host(RawBuf),
    /// Bytes `[offset, offset + len)` of the job's staged tensor number `tensor`.
    Staged { tensor: usize, offset: usize, len: usize },
}

impl Buf {
    /// The sub-range `[offset, offset + len)`. Panics when out of bounds, like [`RawBuf::sub`].
    pub fn sub(&self, offset: usize, len: usize) -> Buf {
        match *self {
            Buf::Host(b) => Buf::Host(b.sub(offset, len)),
            Buf::Staged { tensor, offset: start, len: whole } => {
                assert!(offset.checked_add(len).is_some_and(|end| end <= whole), "Buf::sub out of bounds");
                Buf::Staged { tensor, offset: start + offset, len }
            }
        }
    }
}

/// The length of a buffer of either kind: what layout checks and chunking need.
pub trait Extent {
    fn len(&self) -> usize;
}

impl Extent for RawBuf {
    fn len(&self) -> usize {
        self.len
    }
}

impl Extent for Buf {
    fn len(&self) -> usize {
        match self {
            Buf::Host(b) => b.len(),
            Buf::Staged { len, .. } => *len,
        }
    }
}

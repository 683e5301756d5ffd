//! What every rank says about the op that starts at a block, compared across ranks before any
//! rank reads another's data (group.rs `check_descs`), and how a mismatch is put in words. It
//! lies in shared memory as `OpDesc` (layout.rs).

use crate::types::{DType, OpKind, ReduceOp};

/// What a rank says about an op, as it lies in shared memory: the codes are the core's
/// (types.rs); a peer's are read with [`Desc::op`] and the others, which say `Unknown` for a
/// code this build does not know rather than trusting it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Desc {
    pub seq: u64,
    /// `OpKind`'s code.
    pub kind: u8,
    /// `DType`'s code.
    pub dtype: u8,
    /// `ReduceOp`'s code for a reduction, else 0.
    pub reduce: u8,
    /// log2 of the pipeline's chunk size (pipeline.rs): ranks configured differently would
    /// exchange different ranges.
    pub chunk_log: u8,
    pub count: u64,
    pub root: u64,
}

/// A code read from a peer: one this build knows, or the raw byte.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Code<T> {
    Known(T),
    Unknown(u8),
}

impl<T> Code<T> {
    fn of(code: u8, decode: impl Fn(u8) -> Option<T>) -> Code<T> {
        decode(code).map_or(Code::Unknown(code), Code::Known)
    }
}

impl Desc {
    pub fn op(&self) -> Code<OpKind> {
        Code::of(self.kind, OpKind::from_code)
    }
    pub fn dtype(&self) -> Code<DType> {
        Code::of(self.dtype, DType::from_code)
    }
    pub fn reduce(&self) -> Code<ReduceOp> {
        Code::of(self.reduce, ReduceOp::from_code)
    }

    /// What differs between two ranks' descriptions of an op, in words for the mismatch error
    /// (the first difference a user can act on).
    pub fn mismatch(&self, theirs: &Desc) -> &'static str {
        if theirs.seq != self.seq || theirs.kind != self.kind {
            "ranks must call the same collectives in the same order"
        } else if theirs.dtype != self.dtype {
            "dtype mismatch"
        } else if theirs.chunk_log != self.chunk_log {
            "XCCL_RS_PIPELINE_CHUNK_BYTES differs between the ranks"
        } else if theirs.reduce != self.reduce {
            "reduce op mismatch"
        } else if theirs.count != self.count {
            "size mismatch"
        } else {
            "root mismatch"
        }
    }

    /// "allreduce #5 with 1000 elements of float32 (op SUM, root 0)", for mismatch messages.
    pub fn describe(&self) -> String {
        let op = match self.op() {
            Code::Known(k) => k.name().to_string(),
            Code::Unknown(c) => format!("an unknown op (code {c})"),
        };
        let dtype = match self.dtype() {
            Code::Known(t) => t.name().to_string(),
            Code::Unknown(c) => format!("an unknown dtype (code {c})"),
        };
        let reduce = match self.reduce() {
            Code::Known(r) => r.name().to_string(),
            Code::Unknown(c) => format!("code {c}"),
        };
        format!("{op} #{} with {} elements of {dtype} (op {reduce}, root {})", self.seq, self.count, self.root as i64)
    }
}

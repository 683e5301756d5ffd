//! Elementwise reduction kernels: the arithmetic at the heart of every reducing collective.
//!
//! A [`Reduction`] names the element type, the operator and how to finish (AVG's divisor,
//! PREMUL_SUM's factor). [`reduce_raw`] combines any number of equally long source buffers
//! into a destination, which may be exactly one of the sources (in-place). Semantics follow
//! PyTorch/NCCL: half types accumulate in f32 and round once, integers wrap, float MIN/MAX
//! propagate NaN, integer AVG truncates toward zero, bool ops are logical.
//!
//! Layout: this file holds the API and validation; `dispatch` picks a monomorphized kernel for a
//! (dtype, op) pair, `kernels` is the blocked loop, `elem` moves elements between memory and
//! accumulators (with `convert` for the half types, `bf16_pairs` for bf16's, `f16c` for float16's in the
//! AVX2 and AVX-512 builds), and `ops` is the per-element arithmetic.

mod bf16_pairs;
mod convert;
#[cfg(target_arch = "x86_64")]
mod f16c;
mod dispatch;
mod elem;
mod kernels;
mod ops;
#[cfg(test)]
mod tests;

use crate::types::{DType, ReduceOp};

/// A fully described reduction: what to combine and how to finish.
#[derive(Clone, Copy, Debug)]
pub struct Reduction {
    pub dtype: DType,
    pub op: ReduceOp,
    /// Number of ranks in the group: the divisor of AVG.
    pub world_size: usize,
    /// PREMUL_SUM's factor (ignored for other ops).
    pub premul_factor: f64,
}

impl Reduction {
    /// Ok(()) if this dtype/op combination is supported, else a message naming the op and dtype
    /// the way torch users know them (`ReduceOp.BAND`, `float32`).
    pub fn validate(&self) -> Result<(), String> {
        let (dtype, op) = (self.dtype, self.op);
        match dtype {
            DType::Float8E4M3FN
            | DType::Float8E5M2
            | DType::Float8E4M3FNUZ
            | DType::Float8E5M2FNUZ => {
                return Err(format!(
                    "reductions on {dtype} are not supported (float8 tensors can be moved by \
                     broadcast, all_gather, all_to_all, scatter, gather, send and recv, but not reduced)"
                ));
            }
            DType::Bytes => {
                return Err(format!(
                    "reductions on {dtype} tensors are not supported (tensors of this dtype are moved \
                     as opaque bytes by broadcast, all_gather, all_to_all, scatter, gather, send and \
                     recv, but cannot be reduced)"
                ));
            }
            _ => {}
        }
        match op {
            ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor if dtype.is_floating() => Err(format!(
                "ReduceOp.{op} is not defined for {dtype} tensors (bitwise ops need integer or bool tensors)"
            )),
            ReduceOp::Avg if dtype == DType::Bool => {
                Err("ReduceOp.AVG is not defined for bool tensors".to_string())
            }
            ReduceOp::Avg if self.world_size == 0 => {
                Err("ReduceOp.AVG needs world_size >= 1, got 0".to_string())
            }
            ReduceOp::PreMulSum if !dtype.is_floating() => Err(format!(
                "ReduceOp.PREMUL_SUM needs a floating-point tensor, got {dtype}"
            )),
            _ => Ok(()),
        }
    }
}

/// dst[i] = finish(op(srcs[0][i], srcs[1][i], ..., srcs[k-1][i])) for i in 0..count,
/// combining in the order of `srcs` (left to right).
/// `finish` is applied only when `apply_finish` is true: AVG divides by world_size (a true
/// division in the accumulation type, not a multiply by the reciprocal), PREMUL_SUM multiplies
/// by premul_factor; every other op's finish is the identity.
///
/// # Safety
/// - every srcs[j] points to `count` valid, initialized elements of `r.dtype` (unaligned allowed);
/// - dst points to `count` writable elements; dst may be EXACTLY equal to one or more srcs[j]
///   (in-place), but must not partially overlap any of them;
/// - srcs is non-empty; r.validate() returned Ok.
///
/// # Panics
/// If `srcs` is empty or `r` does not validate (both are contract violations, checked cheaply
/// once per call rather than trusted).
pub unsafe fn reduce_raw(
    r: &Reduction,
    dst: *mut u8,
    srcs: &[*const u8],
    count: usize,
    apply_finish: bool,
) {
    assert!(
        !srcs.is_empty(),
        "reduce_raw needs at least one source buffer"
    );
    if count == 0 {
        return;
    }
    let bufs = kernels::Buffers { dst, srcs, count };
    // SAFETY: the caller guarantees the buffer contract `kernels::Buffers` documents (valid,
    // initialized sources of `count` elements, writable dst equal to or disjoint from each).
    unsafe { dispatch::reduce(r, bufs, apply_finish) }
}

/// Safe form of [`reduce_raw`] over byte slices: count = dst.len() / element size.
///
/// # Panics
/// If `r` does not validate, `srcs` is empty, dst's length is not a multiple of the element
/// size, or any source's length differs from dst's.
pub fn reduce_slices(r: &Reduction, dst: &mut [u8], srcs: &[&[u8]], apply_finish: bool) {
    if let Err(msg) = r.validate() {
        panic!("{msg}");
    }
    assert!(
        !srcs.is_empty(),
        "reduce_slices needs at least one source slice"
    );
    let size = r.dtype.size();
    assert!(
        dst.len().is_multiple_of(size),
        "destination length {} is not a multiple of the {} element size {size}",
        dst.len(),
        r.dtype
    );
    for (j, src) in srcs.iter().enumerate() {
        assert_eq!(
            src.len(),
            dst.len(),
            "source {j} has {} bytes but the destination has {}",
            src.len(),
            dst.len()
        );
    }
    let ptrs: Vec<*const u8> = srcs.iter().map(|s| s.as_ptr()).collect();
    // SAFETY: every source is a live, initialized slice of dst.len() bytes = count elements;
    // dst is a unique borrow, so it cannot overlap any source; srcs is non-empty and r validated.
    unsafe { reduce_raw(r, dst.as_mut_ptr(), &ptrs, dst.len() / size, apply_finish) }
}

//! From a runtime (dtype, op) pair to one monomorphized kernel.
//!
//! Each arm names concrete element, operator and finish types, so the branching on dtype and op
//! happens once per call, never per element. Ops that validate() rejects for a dtype have no
//! kernel; reaching one is a contract violation and panics with validate()'s message.

use half::{bf16, f16};

use super::Reduction;
use super::elem::{BoolElem, Elem};
use super::kernels::{Buffers, run};
use super::ops::{Arith, BAnd, BOr, BXor, Bits, Float, Identity, Max, Min, Prod, Sum};
use crate::types::{DType, ReduceOp};

/// Runs the kernel for `r` over `b`.
///
/// # Safety
/// `b` must satisfy the `Buffers` contract for `r.dtype`, with non-empty `b.srcs`.
pub(super) unsafe fn reduce(r: &Reduction, b: Buffers<'_>, apply_finish: bool) {
    // SAFETY: every arm passes the caller's buffers on with the element type matching r.dtype
    // (f64 for Float64, f16 for Float16, ..., BoolElem for the 1-byte Bool), so the caller's
    // contract for r.dtype is the contract each callee needs.
    unsafe {
        match r.dtype {
            DType::Float64 => float::<f64>(r, b, apply_finish),
            DType::Float32 => float::<f32>(r, b, apply_finish),
            DType::Float16 => float::<f16>(r, b, apply_finish),
            DType::BFloat16 => float::<bf16>(r, b, apply_finish),
            DType::Int8 => int::<i8>(r, b, apply_finish),
            DType::Int16 => int::<i16>(r, b, apply_finish),
            DType::Int32 => int::<i32>(r, b, apply_finish),
            DType::Int64 => int::<i64>(r, b, apply_finish),
            DType::UInt8 => int::<u8>(r, b, apply_finish),
            DType::UInt16 => int::<u16>(r, b, apply_finish),
            DType::UInt32 => int::<u32>(r, b, apply_finish),
            DType::UInt64 => int::<u64>(r, b, apply_finish),
            DType::Bool => boolean(r, b),
            DType::Float8E4M3FN
            | DType::Float8E5M2
            | DType::Float8E4M3FNUZ
            | DType::Float8E5M2FNUZ
            | DType::Bytes => unsupported(r),
        }
    }
}

/// Float types: the arithmetic ops plus PREMUL_SUM.
///
/// # Safety
/// As [`reduce`], with `E` the element type of `r.dtype`.
unsafe fn float<E: Elem>(r: &Reduction, b: Buffers<'_>, apply_finish: bool)
where
    E::Acc: Float,
{
    // SAFETY: the caller's contract, passed on unchanged.
    unsafe {
        match r.op {
            ReduceOp::PreMulSum => {
                run::<E, Sum, _>(b, apply_finish.then(|| E::Acc::premul(r.premul_factor)))
            }
            _ => arith::<E>(r, b, apply_finish),
        }
    }
}

/// Integer types: the arithmetic ops plus the bitwise ones.
///
/// # Safety
/// As [`reduce`], with `E` the element type of `r.dtype`.
unsafe fn int<E: Elem>(r: &Reduction, b: Buffers<'_>, apply_finish: bool)
where
    E::Acc: Arith + Bits,
{
    // SAFETY: the caller's contract, passed on unchanged.
    unsafe {
        match r.op {
            ReduceOp::BAnd => run::<E, BAnd, Identity>(b, None),
            ReduceOp::BOr => run::<E, BOr, Identity>(b, None),
            ReduceOp::BXor => run::<E, BXor, Identity>(b, None),
            _ => arith::<E>(r, b, apply_finish),
        }
    }
}

/// SUM, PRODUCT, MIN, MAX and AVG, shared by floats and integers.
///
/// # Safety
/// As [`reduce`], with `E` the element type of `r.dtype`.
unsafe fn arith<E: Elem>(r: &Reduction, b: Buffers<'_>, apply_finish: bool)
where
    E::Acc: Arith,
{
    // SAFETY: the caller's contract, passed on unchanged.
    unsafe {
        match r.op {
            ReduceOp::Sum => run::<E, Sum, Identity>(b, None),
            ReduceOp::Product => run::<E, Prod, Identity>(b, None),
            ReduceOp::Min => run::<E, Min, Identity>(b, None),
            ReduceOp::Max => run::<E, Max, Identity>(b, None),
            ReduceOp::Avg => run::<E, Sum, _>(b, apply_finish.then(|| E::Acc::avg(r.world_size))),
            ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor | ReduceOp::PreMulSum => unsupported(r),
        }
    }
}

/// bool: every op is logical, none has a finish (AVG and PREMUL_SUM are rejected).
///
/// # Safety
/// As [`reduce`], with `r.dtype` == Bool.
unsafe fn boolean(r: &Reduction, b: Buffers<'_>) {
    // SAFETY: the caller's contract, passed on unchanged.
    unsafe {
        match r.op {
            ReduceOp::Sum | ReduceOp::Max | ReduceOp::BOr => {
                run::<BoolElem, BOr, Identity>(b, None)
            }
            ReduceOp::Product | ReduceOp::Min | ReduceOp::BAnd => {
                run::<BoolElem, BAnd, Identity>(b, None)
            }
            ReduceOp::BXor => run::<BoolElem, BXor, Identity>(b, None),
            ReduceOp::Avg | ReduceOp::PreMulSum => unsupported(r),
        }
    }
}

#[cold]
fn unsupported(r: &Reduction) -> ! {
    let msg = r
        .validate()
        .err()
        .unwrap_or_else(|| format!("no kernel for ReduceOp.{} on {}", r.op, r.dtype));
    panic!("reduce_raw called with an invalid reduction: {msg}")
}

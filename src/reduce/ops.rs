//! Per-element arithmetic on accumulator values: the combining operators and the finishing steps.
//!
//! Every operator is a zero-sized marker type and every method is `#[inline(always)]`, so a
//! kernel monomorphized for one (type, op) pair has a branch-free inner loop the compiler can
//! vectorize. Integer arithmetic wraps (torch casts an overflowing int sum back the same way);
//! float MIN/MAX propagate NaN like `torch.minimum`/`torch.maximum`.

use std::ops::{Div, Mul};

/// Arithmetic every numeric accumulator supports: SUM, PRODUCT, MIN, MAX and AVG's finish.
pub(super) trait Arith: Copy + Default {
    /// AVG's finishing step for this accumulator (true division for floats, truncating integer
    /// division for integers).
    type Avg: Finish<Self>;
    fn avg(world_size: usize) -> Self::Avg;
    fn add(self, b: Self) -> Self;
    fn mul(self, b: Self) -> Self;
    fn min(self, b: Self) -> Self;
    fn max(self, b: Self) -> Self;
}

/// Bitwise arithmetic: integers and bool only, so floats cannot reach BAND/BOR/BXOR kernels.
pub(super) trait Bits: Copy + Default {
    fn and(self, b: Self) -> Self;
    fn or(self, b: Self) -> Self;
    fn xor(self, b: Self) -> Self;
}

/// Float accumulators: the only ones PREMUL_SUM is defined for.
pub(super) trait Float: Arith + Mul<Output = Self> {
    fn premul(factor: f64) -> MulBy<Self>;
}

/// One combining operator, applied left to right: `acc = combine(acc, next)`.
pub(super) trait Combine<A> {
    fn combine(a: A, b: A) -> A;
}

/// The step applied once to the fully combined value (when the caller asks for it).
pub(super) trait Finish<A>: Copy {
    fn finish(self, a: A) -> A;
}

pub(super) struct Sum;
pub(super) struct Prod;
pub(super) struct Min;
pub(super) struct Max;
pub(super) struct BAnd;
pub(super) struct BOr;
pub(super) struct BXor;

macro_rules! combine_via {
    ($marker:ty, $bound:ident, $method:ident) => {
        impl<A: $bound> Combine<A> for $marker {
            #[inline(always)]
            fn combine(a: A, b: A) -> A {
                a.$method(b)
            }
        }
    };
}
combine_via!(Sum, Arith, add);
combine_via!(Prod, Arith, mul);
combine_via!(Min, Arith, min);
combine_via!(Max, Arith, max);
combine_via!(BAnd, Bits, and);
combine_via!(BOr, Bits, or);
combine_via!(BXor, Bits, xor);

/// The finish of every op except AVG and PREMUL_SUM.
#[derive(Clone, Copy)]
pub(super) struct Identity;

impl<A> Finish<A> for Identity {
    #[inline(always)]
    fn finish(self, a: A) -> A {
        a
    }
}

/// Float AVG: a true division, so the result is the correctly rounded quotient of the sum.
#[derive(Clone, Copy)]
pub(super) struct DivBy<A>(A);

impl<A: Copy + Div<Output = A>> Finish<A> for DivBy<A> {
    #[inline(always)]
    fn finish(self, a: A) -> A {
        a / self.0
    }
}

/// PREMUL_SUM: the combined sum times the factor, in the accumulation type.
#[derive(Clone, Copy)]
pub(super) struct MulBy<A>(A);

impl<A: Copy + Mul<Output = A>> Finish<A> for MulBy<A> {
    #[inline(always)]
    fn finish(self, a: A) -> A {
        a * self.0
    }
}

/// Integer AVG: wrapped sum divided by world_size, truncating toward zero (NCCL's semantics).
/// The divisor is held in a wider type `W` so any world_size is exact (or, when clamped, still
/// larger than every value of the element type, giving the same quotient).
#[derive(Clone, Copy)]
pub(super) struct DivTrunc<W>(W);

macro_rules! float_arith {
    ($t:ty) => {
        impl Arith for $t {
            type Avg = DivBy<$t>;
            #[inline(always)]
            fn avg(world_size: usize) -> DivBy<$t> {
                DivBy(world_size as $t)
            }
            #[inline(always)]
            fn add(self, b: $t) -> $t {
                self + b
            }
            #[inline(always)]
            fn mul(self, b: $t) -> $t {
                self * b
            }
            // NaN in either operand wins; otherwise `std::min` (first operand on ties).
            // Written as compare-and-select so it vectorizes to cmp + blend.
            #[inline(always)]
            fn min(self, b: $t) -> $t {
                if b < self || b.is_nan() { b } else { self }
            }
            #[inline(always)]
            fn max(self, b: $t) -> $t {
                if b > self || b.is_nan() { b } else { self }
            }
        }

        impl Float for $t {
            #[inline(always)]
            fn premul(factor: f64) -> MulBy<$t> {
                MulBy(factor as $t)
            }
        }
    };
}
float_arith!(f32);
float_arith!(f64);

macro_rules! int_arith {
    ($t:ty, $wide:ty) => {
        impl Arith for $t {
            type Avg = DivTrunc<$wide>;
            #[inline(always)]
            fn avg(world_size: usize) -> DivTrunc<$wide> {
                // validate() rejects world_size 0; max(1) keeps the division total anyway.
                DivTrunc(<$wide>::try_from(world_size.max(1)).unwrap_or(<$wide>::MAX))
            }
            #[inline(always)]
            fn add(self, b: $t) -> $t {
                self.wrapping_add(b)
            }
            #[inline(always)]
            fn mul(self, b: $t) -> $t {
                self.wrapping_mul(b)
            }
            #[inline(always)]
            fn min(self, b: $t) -> $t {
                Ord::min(self, b)
            }
            #[inline(always)]
            fn max(self, b: $t) -> $t {
                Ord::max(self, b)
            }
        }

        impl Finish<$t> for DivTrunc<$wide> {
            #[inline(always)]
            fn finish(self, a: $t) -> $t {
                // `/` on signed integers truncates toward zero: -7 / 2 == -3. The quotient's
                // magnitude never exceeds |a|, so narrowing back is lossless.
                (<$wide>::from(a) / self.0) as $t
            }
        }

        impl Bits for $t {
            #[inline(always)]
            fn and(self, b: $t) -> $t {
                self & b
            }
            #[inline(always)]
            fn or(self, b: $t) -> $t {
                self | b
            }
            #[inline(always)]
            fn xor(self, b: $t) -> $t {
                self ^ b
            }
        }
    };
}
// The wide divisor type holds every value of the element type and, for the narrow types,
// world_size up to i64::MAX (beyond which the quotient is 0 either way).
int_arith!(i8, i64);
int_arith!(i16, i64);
int_arith!(i32, i64);
int_arith!(i64, i128);
int_arith!(u8, u64);
int_arith!(u16, u64);
int_arith!(u32, u64);
int_arith!(u64, u64);

/// A bool accumulator: always exactly 0 or 1 (inputs are normalized on load), so the bitwise
/// operators are the logical ones and results never need re-normalizing.
#[repr(transparent)]
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
pub(super) struct Bool01(pub(super) u8);

impl Bits for Bool01 {
    #[inline(always)]
    fn and(self, b: Bool01) -> Bool01 {
        Bool01(self.0 & b.0)
    }
    #[inline(always)]
    fn or(self, b: Bool01) -> Bool01 {
        Bool01(self.0 | b.0)
    }
    #[inline(always)]
    fn xor(self, b: Bool01) -> Bool01 {
        Bool01(self.0 ^ b.0)
    }
}

//! Moving elements between (possibly unaligned) caller memory and aligned accumulator blocks.
//!
//! An [`Elem`] is one in-memory element type. `load` widens a run of elements into its
//! accumulator type, `combine_from` folds a run into an accumulator block, and `store` narrows
//! back: plain element reads/writes for types that accumulate in themselves, an f32 conversion
//! for float16/bfloat16 (so a sum is rounded once, at the end), and a 0/1 normalization for bool.
//! Caller memory is only touched through raw-pointer unaligned reads/writes and byte copies,
//! never references, because caller buffers may be unaligned and may alias each other exactly.
//! Every source after the first is read straight into the combining loop (no staging copy), up
//! to four sources per pass over the accumulator, and the half-type conversions are fused into
//! their read and write loops, so each loop stays a single vectorized pass.

#[cfg(not(target_arch = "x86_64"))]
use half::f16;

#[cfg(not(target_arch = "x86_64"))]
use super::convert::{f16_to_f32, f32_to_f16};
use super::ops::{Bool01, Combine};

/// One in-memory element type and how it maps to its accumulator.
pub(super) trait Elem {
    /// Bytes per element in memory.
    const SIZE: usize;
    /// What the kernel combines in.
    type Acc: Copy + Default;
    /// The element type the AVX2 and AVX-512 builds of the loop use in this one's place, with
    /// the same memory layout and accumulator: itself, except float16, whose conversions there
    /// are the F16C instructions (f16c.rs).
    type Simd: Elem<Acc = Self::Acc>;

    /// Element `i` at `src`, widened to the accumulator.
    ///
    /// # Safety
    /// `src` must point to more than `i` readable, initialized elements (any alignment).
    unsafe fn read(src: *const u8, i: usize) -> Self::Acc;

    /// Reads `out.len()` elements starting at `src` into `out`, widened to the accumulator.
    ///
    /// # Safety
    /// `src` must point to `out.len()` readable, initialized elements (any alignment).
    #[inline(always)]
    unsafe fn load(src: *const u8, out: &mut [Self::Acc]) {
        for (i, o) in out.iter_mut().enumerate() {
            // SAFETY: i < out.len(), which the caller guarantees readable at `src`.
            *o = unsafe { Self::read(src, i) };
        }
    }

    /// `acc[i] = C::combine(... C::combine(acc[i], element i at srcs[0]) ..., element i at
    /// srcs[K - 1])` for every i: K sources folded in one pass, left to right, so the
    /// accumulator is read and written once per K sources instead of once per source.
    ///
    /// # Safety
    /// Every `srcs[k]` must point to `acc.len()` readable, initialized elements (any alignment).
    #[inline(always)]
    unsafe fn combine_from<C: Combine<Self::Acc>, const K: usize>(srcs: [*const u8; K], acc: &mut [Self::Acc]) {
        for (i, a) in acc.iter_mut().enumerate() {
            let mut v = *a;
            for src in srcs {
                // SAFETY: i < acc.len(), which the caller guarantees readable at every source.
                v = C::combine(v, unsafe { Self::read(src, i) });
            }
            *a = v;
        }
    }

    /// Writes `acc` narrowed to the element type to `dst`.
    ///
    /// # Safety
    /// `dst` must point to `acc.len()` writable elements (any alignment).
    unsafe fn store(acc: &[Self::Acc], dst: *mut u8);
}

/// Types that accumulate in themselves: loading and storing is a byte copy, and combining
/// reads each element in place (the trait's `combine_from`).
macro_rules! native_elem {
    ($($t:ty),*) => {$(
        impl Elem for $t {
            const SIZE: usize = size_of::<$t>();
            type Acc = $t;
            type Simd = $t;

            #[inline(always)]
            unsafe fn load(src: *const u8, out: &mut [$t]) {
                // SAFETY: the caller guarantees `src` holds out.len() initialized elements; `out`
                // is a distinct local buffer; every bit pattern is a valid value of `$t`.
                unsafe {
                    std::ptr::copy_nonoverlapping(src, out.as_mut_ptr().cast::<u8>(), size_of_val(out))
                }
            }

            #[inline(always)]
            unsafe fn read(src: *const u8, i: usize) -> $t {
                // SAFETY: the caller guarantees element i readable; read_unaligned needs no
                // alignment; every bit pattern is a valid value of `$t`.
                unsafe { src.cast::<$t>().add(i).read_unaligned() }
            }

            #[inline(always)]
            unsafe fn store(acc: &[$t], dst: *mut u8) {
                // SAFETY: the caller guarantees `dst` has room for acc.len() elements; `acc` is a
                // distinct local buffer.
                unsafe { std::ptr::copy_nonoverlapping(acc.as_ptr().cast::<u8>(), dst, size_of_val(acc)) }
            }
        }
    )*};
}
native_elem!(f32, f64, i8, i16, i32, i64, u8, u16, u32, u64);

/// float16/bfloat16: accumulate in f32, so every partial result keeps f32 precision and the
/// output is rounded (to nearest even) exactly once, on store. The conversions are fused into
/// the read and write loops. `half_elem! { T => widen, narrow, Simd }` stores element by
/// element; `half_elem! { T => widen, Simd, { loops } }` takes the type's own `load`,
/// `combine_from` and `store` (bf16_pairs.rs, f16c.rs), sharing only what every 16-bit float is.
macro_rules! half_elem {
    ($t:ty => $widen:path, $simd:ty, { $($loops:tt)* }) => {
        impl Elem for $t {
            const SIZE: usize = 2;
            type Acc = f32;
            type Simd = $simd;

            #[inline(always)]
            unsafe fn read(src: *const u8, i: usize) -> f32 {
                // SAFETY: the caller guarantees element i readable; read_unaligned needs no
                // alignment.
                $widen(unsafe { src.cast::<u16>().add(i).read_unaligned() })
            }

            $($loops)*
        }
    };
    ($($t:ty => $widen:path, $narrow:path, $simd:ty);* $(;)?) => {$(
        half_elem!($t => $widen, $simd, {
            #[inline(always)]
            unsafe fn store(acc: &[f32], dst: *mut u8) {
                let dst = dst.cast::<u16>();
                for (i, &a) in acc.iter().enumerate() {
                    // SAFETY: i < acc.len(), and the caller guarantees that many writable
                    // elements at `dst`; write_unaligned needs no alignment. `acc` is a distinct
                    // local buffer.
                    unsafe { dst.add(i).write_unaligned($narrow(a)) };
                }
            }
        });
    )*};
}
pub(super) use half_elem;
// float16's impl on x86-64 is in f16c.rs, with its F16C build.
#[cfg(not(target_arch = "x86_64"))]
half_elem! {
    f16 => f16_to_f32, f32_to_f16, f16;
}
// bf16's impl reads and writes pairs of elements (bf16_pairs.rs).

/// torch.bool: one byte per element. Any nonzero byte is read as true, so results are always
/// exactly 0 or 1 even if a producer left other nonzero bytes behind.
pub(super) struct BoolElem;

impl Elem for BoolElem {
    const SIZE: usize = 1;
    type Acc = Bool01;
    type Simd = BoolElem;

    #[inline(always)]
    unsafe fn read(src: *const u8, i: usize) -> Bool01 {
        // SAFETY: the caller guarantees byte i readable.
        Bool01(u8::from(unsafe { src.add(i).read() } != 0))
    }

    #[inline(always)]
    unsafe fn store(acc: &[Bool01], dst: *mut u8) {
        // SAFETY: the caller guarantees `dst` has room for acc.len() bytes; `acc` is a distinct
        // local buffer.
        unsafe { std::ptr::copy_nonoverlapping(acc.as_ptr().cast::<u8>(), dst, acc.len()) }
    }
}

//! float16 through the F16C instructions, for the AVX2 and AVX-512 builds of the loop.
//!
//! The branch-free software conversions (convert.rs) cost about fifteen integer operations per
//! element each way, which made float16 reductions compute-bound at a quarter of bfloat16's
//! speed. `vcvtph2ps` widens eight elements exactly in one instruction and `vcvtps2ph` rounds
//! eight to nearest, ties to even (subnormals and overflow as IEEE says, NaN made quiet with
//! its top payload bits kept): the same values as convert.rs (a test compares them with `half`
//! over every float16 and a sweep of float32 that covers every rounding case). Eight elements
//! of every source are widened and folded at a time, in registers.
//!
//! Every function here executes F16C instructions: [`F16c`] is used only through
//! [`Elem::Simd`] by `run_avx2`/`run_avx512`, which are compiled with `f16c` and run only
//! where the CPU has it (kernels.rs, `allowed`), and by a test that checks for it first.

use std::arch::x86_64::{
    __m128i, _MM_FROUND_TO_NEAREST_INT, _mm_loadu_si128, _mm_storeu_si128, _mm256_cvtph_ps, _mm256_cvtps_ph, _mm256_loadu_ps,
    _mm256_storeu_ps,
};

use std::mem::transmute;

use half::f16;

use super::convert::{f16_to_f32, f32_to_f16};
use super::elem::{Elem, half_elem};
use super::ops::Combine;

// float16 itself: converted in software (convert.rs), with F16c in its place in the AVX builds.
half_elem! {
    f16 => f16_to_f32, f32_to_f16, F16c;
}

/// Elements per F16C instruction.
const LANES: usize = 8;

/// float16 with F16C conversions (a marker: memory holds plain float16 elements).
pub(super) struct F16c;

/// Widens `n` elements at `src` into `n` f32 at `out` (which need not be initialized).
///
/// # Safety
/// The CPU must have F16C; `src` must hold `n` readable, initialized elements and `out` room
/// for `n` f32, not overlapping them.
#[inline(always)]
unsafe fn widen(src: *const u8, out: *mut f32, n: usize) {
    let full = n / LANES * LANES;
    for i in (0..full).step_by(LANES) {
        // SAFETY: elements i..i + 8 are inside both buffers (i + 8 <= full <= n); loadu and
        // storeu need no alignment; the CPU has F16C (the caller's contract).
        unsafe {
            let halves = _mm_loadu_si128(src.add(2 * i).cast::<__m128i>());
            _mm256_storeu_ps(out.add(i), _mm256_cvtph_ps(halves));
        }
    }
    for i in full..n {
        // SAFETY: i < n, so element i is readable and out[i] writable (the caller's contract).
        unsafe { out.add(i).write(F16c::read(src, i)) };
    }
}

half_elem! { F16c => f16_to_f32, F16c, {
    #[inline(always)]
    unsafe fn load(src: *const u8, out: &mut [f32]) {
        // SAFETY: the Elem contract (out.len() elements at src; `out` is a local block, not
        // caller memory), and F16C (module doc).
        unsafe { widen(src, out.as_mut_ptr(), out.len()) }
    }

    #[inline(always)]
    unsafe fn combine_from<C: Combine<f32>, const K: usize>(srcs: [*const u8; K], acc: &mut [f32]) {
        let full = acc.len() / LANES * LANES;
        for i in (0..full).step_by(LANES) {
            let lanes = &mut acc[i..i + LANES];
            let mut v = [0f32; LANES];
            v.copy_from_slice(lanes);
            for src in srcs {
                // SAFETY: elements i..i + 8 of every source are readable (i + 8 <= full <=
                // acc.len(), the Elem contract); loadu needs no alignment; F16C (module doc).
                // An __m256 is eight f32, any bits valid, so it may be read as an array.
                let x: [f32; LANES] = unsafe { transmute(_mm256_cvtph_ps(_mm_loadu_si128(src.add(2 * i).cast::<__m128i>()))) };
                for (a, b) in v.iter_mut().zip(x) {
                    *a = C::combine(*a, b);
                }
            }
            lanes.copy_from_slice(&v);
        }
        for (i, a) in acc.iter_mut().enumerate().skip(full) {
            for src in srcs {
                // SAFETY: i < acc.len(), so element i of every source is readable.
                *a = C::combine(*a, unsafe { Self::read(src, i) });
            }
        }
    }

    #[inline(always)]
    unsafe fn store(acc: &[f32], dst: *mut u8) {
        let full = acc.len() / LANES * LANES;
        for i in (0..full).step_by(LANES) {
            // SAFETY: elements i..i + 8 are inside both buffers; loadu/storeu need no
            // alignment; F16C (module doc). Rounding: to nearest, ties to even.
            unsafe {
                let halves = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(acc.as_ptr().add(i)));
                _mm_storeu_si128(dst.add(2 * i).cast::<__m128i>(), halves);
            }
        }
        for (i, &a) in acc.iter().enumerate().skip(full) {
            // SAFETY: i < acc.len(), so element i is writable (the Elem contract).
            unsafe { dst.cast::<u16>().add(i).write_unaligned(f32_to_f16(a)) };
        }
    }
}}

//! The blocked reduction loop, generic over element type, combining operator and finish.
//!
//! Work proceeds in blocks of [`BLOCK`] elements: the block of the first source is loaded into a
//! local accumulator array, each further source's block is combined into it, the finish is
//! applied, and only then is the block stored to dst. Because every source's block has been
//! read before dst's block is written, dst may be exactly one (or several) of the sources. (A
//! plain per-element loop over raw pointers would also be correct, but the compiler cannot prove
//! the buffers distinct and would fall back to scalar code exactly in the in-place case.) The
//! accumulator is aligned and small enough to stay in L1, and the per-element loops contain no
//! branches on op or dtype, so they vectorize.
//!
//! On x86_64 the same loop is also compiled with AVX-512 (F, BW, VL) and with AVX2 enabled, both
//! with F16C, and the widest the CPU has is picked at run time; elsewhere the portable build of
//! the loop runs. AVX-512 halves the instructions per byte. In those two builds float16 is
//! converted by F16C's instructions (`Elem::Simd`, f16c.rs) instead of integer arithmetic.

use super::elem::Elem;
use super::ops::{Combine, Finish};

/// Elements per block: a 4-8 KiB accumulator that stays in L1 while every source streams through.
pub(super) const BLOCK: usize = 1024;

/// Sources folded into the accumulator per pass over it. One per pass made the accumulator's
/// loads and stores, not the sources' reads, the limit in cache (bf16 most: two bytes read per
/// four-byte accumulator stored); four per pass cut that traffic by four and still leave
/// registers for the sources in the AVX2 build.
const SOURCES_PER_PASS: usize = 4;

/// The caller's buffers, as raw pointers.
///
/// Contract (what every `unsafe fn` taking a `Buffers` requires): each `srcs[j]` points to
/// `count` readable, initialized elements of the reduction's dtype; `dst` points to `count`
/// writable elements and is either exactly equal to or disjoint from each source; any alignment.
#[derive(Clone, Copy)]
pub(super) struct Buffers<'a> {
    pub(super) dst: *mut u8,
    pub(super) srcs: &'a [*const u8],
    pub(super) count: usize,
}

/// The builds of the loop, narrowest first.
#[cfg(test)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Level {
    Portable,
    Avx2,
    Avx512,
}

#[cfg(test)]
thread_local! {
    /// Lets tests run a narrower build of the loop than the CPU allows (each build is tested
    /// on machines that have the widest).
    pub(super) static MAX_LEVEL: std::cell::Cell<Level> = const { std::cell::Cell::new(Level::Avx512) };
}

/// Whether the AVX-512 (`avx512`) or AVX2 build may run: the CPU has it (and, in tests, it is
/// not capped below it).
#[cfg(target_arch = "x86_64")]
fn allowed(avx512: bool) -> bool {
    #[cfg(test)]
    {
        let cap = MAX_LEVEL.with(|l| l.get());
        if cap < if avx512 { Level::Avx512 } else { Level::Avx2 } {
            return false;
        }
    }
    // Both builds also convert float16 with F16C (f16c.rs), which every AVX2 CPU we know has.
    if !std::arch::is_x86_feature_detected!("f16c") {
        return false;
    }
    if avx512 {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vl")
    } else {
        std::arch::is_x86_feature_detected!("avx2")
    }
}

/// Reduces `b` with element type `E` and operator `C`, applying `finish` if it is `Some`.
///
/// # Safety
/// `b` must satisfy the [`Buffers`] contract for element type `E`, and `b.srcs` must be non-empty.
pub(super) unsafe fn run<E: Elem, C: Combine<E::Acc>, F: Finish<E::Acc>>(b: Buffers<'_>, finish: Option<F>) {
    #[cfg(target_arch = "x86_64")]
    {
        if allowed(true) {
            // SAFETY: the CPU supports AVX-512 F/BW/VL and F16C (checked by `allowed`); the
            // buffer contract is the caller's, and E::Simd has E's memory layout.
            unsafe { run_avx512::<E::Simd, C, F>(b, finish) };
            return;
        }
        if allowed(false) {
            // SAFETY: the CPU supports AVX2 and F16C (checked by `allowed`); the buffer contract
            // is the caller's, and E::Simd has E's memory layout.
            unsafe { run_avx2::<E::Simd, C, F>(b, finish) };
            return;
        }
    }
    // SAFETY: the buffer contract is the caller's.
    unsafe { run_blocks::<E, C, F>(b, finish) }
}

/// [`run_blocks`] compiled with AVX2 (and F16C) enabled, so its inlined loops use 256-bit vectors.
///
/// # Safety
/// The CPU must support AVX2 and F16C, and `b` must satisfy the [`Buffers`] contract for `E` with
/// non-empty `b.srcs`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn run_avx2<E: Elem, C: Combine<E::Acc>, F: Finish<E::Acc>>(b: Buffers<'_>, finish: Option<F>) {
    // SAFETY: the buffer contract is the caller's.
    unsafe { run_blocks::<E, C, F>(b, finish) }
}

/// [`run_blocks`] compiled with AVX-512 (F, BW, VL, and F16C) enabled: 512-bit vectors.
///
/// # Safety
/// The CPU must support AVX-512 F, BW and VL and F16C, and `b` must satisfy the [`Buffers`] contract for
/// `E` with non-empty `b.srcs`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
unsafe fn run_avx512<E: Elem, C: Combine<E::Acc>, F: Finish<E::Acc>>(b: Buffers<'_>, finish: Option<F>) {
    // SAFETY: the buffer contract is the caller's.
    unsafe { run_blocks::<E, C, F>(b, finish) }
}

/// The loop itself; `inline(always)` so each caller compiles it with its own target features.
///
/// # Safety
/// `b` must satisfy the [`Buffers`] contract for `E`, with non-empty `b.srcs`.
#[inline(always)]
unsafe fn run_blocks<E: Elem, C: Combine<E::Acc>, F: Finish<E::Acc>>(b: Buffers<'_>, finish: Option<F>) {
    let Some((&first, rest)) = b.srcs.split_first() else {
        return;
    };
    let mut acc_block = [E::Acc::default(); BLOCK];

    let mut done = 0;
    while done < b.count {
        let n = (b.count - done).min(BLOCK);
        let offset = done * E::SIZE;
        let acc = &mut acc_block[..n];

        // SAFETY: done + n <= count, so `first + offset` starts n readable elements inside the
        // first source (Buffers contract); `acc` has length n.
        unsafe { E::load(first.add(offset), acc) };
        for group in rest.chunks(SOURCES_PER_PASS) {
            // SAFETY: as above, for each source of the group.
            unsafe { combine_group::<E, C>(group, offset, acc) };
        }
        if let Some(f) = finish {
            for a in acc.iter_mut() {
                *a = f.finish(*a);
            }
        }
        // Every source's block is already in `acc`, so this write cannot clobber input still
        // needed, even when dst is exactly one of the sources.
        // SAFETY: done + n <= count, so `dst + offset` starts n writable elements (Buffers
        // contract); `acc` has length n.
        unsafe { E::store(acc, b.dst.add(offset)) };
        done += n;
    }
}

/// Folds the 1 to [`SOURCES_PER_PASS`] sources of `group`, each from `offset` bytes on, into
/// `acc` in one pass, left to right.
///
/// # Safety
/// Every source must hold `acc.len()` readable, initialized elements of `E` from `offset` on.
#[inline(always)]
unsafe fn combine_group<E: Elem, C: Combine<E::Acc>>(group: &[*const u8], offset: usize, acc: &mut [E::Acc]) {
    // wrapping_add is add here (the offset stays inside every source), without an unsafe block.
    let at = |k: usize| group[k].wrapping_add(offset);
    // SAFETY: each arm passes sources of the group at `offset`, which the caller guarantees.
    unsafe {
        match group.len() {
            4 => E::combine_from::<C, 4>([at(0), at(1), at(2), at(3)], acc),
            3 => E::combine_from::<C, 3>([at(0), at(1), at(2)], acc),
            2 => E::combine_from::<C, 2>([at(0), at(1)], acc),
            _ => E::combine_from::<C, 1>([at(0)], acc),
        }
    }
}

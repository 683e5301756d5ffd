//! bfloat16 read and written two elements at a time, with no shuffles.
//!
//! Widening a bf16 vector to f32 lanes element by element (`vpmovzxwd`) runs on the one shuffle
//! port of x86 cores and made bf16 reductions about half as fast per byte as f32 ones in cache.
//! A pair of neighbouring elements is one 32-bit word instead: the element in its low half widens
//! to `word << 16` and the one in its high half to `word & 0xFFFF_0000`, two plain integer ops
//! per word that vectorize on any port. So the accumulator block holds the pairs' low elements
//! in its first half and their high elements in its second (the finish is elementwise, so the
//! order of the accumulator does not matter, only that load, combine and store agree), and the
//! store packs two rounded halves back into a word. An odd last element sits at the block's end
//! and goes the plain way.

use half::bf16;

use super::convert::{bf16_to_f32, f32_to_bf16};
use super::elem::{Elem, half_elem};
use super::ops::Combine;

/// The f32 values of the two elements of a word read from memory, in memory order.
#[inline(always)]
fn widen(word: u32) -> (f32, f32) {
    let (low_half, high_half) = (f32::from_bits(word << 16), f32::from_bits(word & 0xFFFF_0000));
    if cfg!(target_endian = "little") { (low_half, high_half) } else { (high_half, low_half) }
}

/// The word holding `first` and `second`, rounded, in memory order.
#[inline(always)]
fn narrow(first: f32, second: f32) -> u32 {
    let (first, second) = (u32::from(f32_to_bf16(first)), u32::from(f32_to_bf16(second)));
    if cfg!(target_endian = "little") { first | (second << 16) } else { (first << 16) | second }
}

/// The accumulator block split as this layout has it: (first elements of the pairs, second
/// elements of the pairs, the odd last element if any).
#[inline(always)]
fn split(acc: &mut [f32]) -> (&mut [f32], &mut [f32], &mut [f32]) {
    let pairs = acc.len() / 2;
    let (firsts, rest) = acc.split_at_mut(pairs);
    let (seconds, last) = rest.split_at_mut(pairs);
    (firsts, seconds, last)
}

half_elem! { bf16 => bf16_to_f32, bf16, {
    #[inline(always)]
    unsafe fn load(src: *const u8, out: &mut [f32]) {
        let (firsts, seconds, last) = split(out);
        let words = src.cast::<u32>();
        for (p, (a, b)) in firsts.iter_mut().zip(seconds.iter_mut()).enumerate() {
            // SAFETY: word p is elements 2p and 2p + 1 < out.len(), which the caller guarantees
            // readable and initialized at `src`; read_unaligned needs no alignment.
            (*a, *b) = widen(unsafe { words.add(p).read_unaligned() });
        }
        if let [x] = last {
            // SAFETY: the last element, index out.len() - 1, is readable (as above).
            *x = unsafe { Self::read(src, 2 * firsts.len()) };
        }
    }

    #[inline(always)]
    unsafe fn combine_from<C: Combine<f32>, const K: usize>(srcs: [*const u8; K], acc: &mut [f32]) {
        let (firsts, seconds, last) = split(acc);
        let pairs = firsts.len();
        let words = srcs.map(|s| s.cast::<u32>());
        for (p, (a, b)) in firsts.iter_mut().zip(seconds.iter_mut()).enumerate() {
            let (mut va, mut vb) = (*a, *b);
            for w in words {
                // SAFETY: as in `load`, for every source.
                let (x, y) = widen(unsafe { w.add(p).read_unaligned() });
                (va, vb) = (C::combine(va, x), C::combine(vb, y));
            }
            (*a, *b) = (va, vb);
        }
        if let [v] = last {
            for s in srcs {
                // SAFETY: as in `load`, for every source.
                *v = C::combine(*v, unsafe { Self::read(s, 2 * pairs) });
            }
        }
    }

    #[inline(always)]
    unsafe fn store(acc: &[f32], dst: *mut u8) {
        let pairs = acc.len() / 2;
        let (firsts, rest) = acc.split_at(pairs);
        let (seconds, last) = rest.split_at(pairs);
        let words = dst.cast::<u32>();
        for (p, (&a, &b)) in firsts.iter().zip(seconds).enumerate() {
            // SAFETY: word p is elements 2p and 2p + 1 < acc.len(), which the caller guarantees
            // writable at `dst`; write_unaligned needs no alignment. `acc` is a local buffer.
            unsafe { words.add(p).write_unaligned(narrow(a, b)) };
        }
        if let [x] = last {
            // SAFETY: the last element, index acc.len() - 1, is writable (as above).
            unsafe { dst.cast::<u16>().add(2 * pairs).write_unaligned(f32_to_bf16(*x)) };
        }
    }
}}

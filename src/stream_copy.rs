//! Copies with non-temporal (streaming) stores, for results that no rank reads again within
//! the op: the outputs of the copy-out steps. An ordinary store first reads the destination's
//! cache line from memory (to own it), then writes it back later: three bytes of memory traffic
//! per byte copied when the destination is not in cache. A streaming store writes the line
//! without reading it, and does not evict data the op still needs from the cache.

/// Copies `len` bytes from `src` to `dst` with streaming stores where the CPU has them (every
/// x86-64 does: SSE2), else as `copy_nonoverlapping`. The stores are fenced before returning,
/// so a later release store (a counter's publish) orders after them, as after ordinary ones.
///
/// # Safety
/// As `std::ptr::copy_nonoverlapping`: `src` readable and `dst` writable for `len` bytes, the
/// two ranges disjoint.
pub unsafe fn copy_streaming(src: *const u8, dst: *mut u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
        // Streaming stores need 16-byte aligned destinations: copy up to the first one plainly.
        let head = ((dst as usize).wrapping_neg() & 15).min(len);
        let body = (len - head) / 64 * 64;
        // SAFETY (all blocks below): [0, head), [head, head + body) and [head + body, len) lie
        // within both buffers by the caller's contract; `d` is 16-byte aligned by the choice of
        // `head`, and every store is at a multiple of 16 from it; loads are unaligned.
        unsafe {
            std::ptr::copy_nonoverlapping(src, dst, head);
            let (s, d) = (src.add(head), dst.add(head));
            let mut i = 0;
            while i < body {
                let a = _mm_loadu_si128(s.add(i) as *const __m128i);
                let b = _mm_loadu_si128(s.add(i + 16) as *const __m128i);
                let c = _mm_loadu_si128(s.add(i + 32) as *const __m128i);
                let e = _mm_loadu_si128(s.add(i + 48) as *const __m128i);
                _mm_stream_si128(d.add(i) as *mut __m128i, a);
                _mm_stream_si128(d.add(i + 16) as *mut __m128i, b);
                _mm_stream_si128(d.add(i + 32) as *mut __m128i, c);
                _mm_stream_si128(d.add(i + 48) as *mut __m128i, e);
                i += 64;
            }
            // Streaming stores are weakly ordered: fence them before anything that publishes them.
            _mm_sfence();
            std::ptr::copy_nonoverlapping(s.add(body), d.add(body), len - head - body);
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    // SAFETY: the caller's contract is copy_nonoverlapping's.
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, len)
    };
}

#[cfg(test)]
mod tests {
    use super::copy_streaming;

    #[test]
    fn every_alignment_and_length_copies_exactly_its_bytes() {
        let src: Vec<u8> = (0..1000u32).map(|i| (i * 31 % 251) as u8).collect();
        for src_off in [0, 1, 7, 16] {
            for dst_off in [0, 3, 8, 15, 16] {
                for len in [0, 1, 15, 16, 63, 64, 65, 127, 200, 513, 900] {
                    let mut dst = vec![0xEEu8; 1000];
                    // SAFETY: offsets + len <= 916 + 16 < 1000 for both buffers; distinct Vecs.
                    unsafe { copy_streaming(src.as_ptr().add(src_off), dst.as_mut_ptr().add(dst_off), len) };
                    let what = format!("src +{src_off}, dst +{dst_off}, {len} bytes");
                    assert_eq!(&dst[dst_off..dst_off + len], &src[src_off..src_off + len], "{what}: copied bytes");
                    assert!(dst[..dst_off].iter().chain(&dst[dst_off + len..]).all(|&b| b == 0xEE), "{what}: wrote outside");
                }
            }
        }
    }
}

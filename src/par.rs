//! Helper threads for the copies and reductions of large shared-memory blocks.
//!
//! One core moves memory at a fraction of what the machine can (docs/perf.md has the host's
//! figures for one thread and for all). A rank with cores to spare therefore splits the copies and reductions of one block step across `threads`
//! threads of its own (itself and `threads - 1` helpers in a rayon pool kept for the group's
//! lifetime).
//!
//! Terms: a *step* is the list of copies (or the one reduction) a rank does between two
//! synchronizations of a block; a *piece* is the byte range of a step one thread takes. Pieces
//! are at least `min_piece` bytes (so that small steps stay on the calling thread, where they
//! cost no hand-off) and cut at 64-byte boundaries (whole elements of every dtype, whole cache
//! lines). Every thread finishes its piece before the step returns, so the counters that
//! publish a block are written only after all of its bytes are.

use crate::reduce::{Reduction, reduce_raw};
use crate::stream_copy::copy_streaming;
use crate::transport::RawBuf;

/// Pieces are cut at multiples of this (a cache line; a multiple of every element size).
const ALIGN: usize = 64;

pub struct Par {
    pool: Option<rayon::ThreadPool>,
    threads: usize,
    min_piece: usize,
    /// Copy-out steps of at least this many bytes use streaming stores (stream_copy.rs).
    streaming_min: usize,
}

/// Raw pointers for helper threads.
#[derive(Clone, Copy)]
struct SendPtr(*mut u8);
// SAFETY: the pointers address memory of the running operation that stays valid until the
// step returns (in_place_scope joins every helper first); pieces are disjoint byte ranges of
// the destinations, so no two threads write the same byte.
unsafe impl Send for SendPtr {}
// SAFETY: as above; helpers only read through the shared copies.
unsafe impl Sync for SendPtr {}

impl SendPtr {
    // A method, not `.0`: closures capture whole values through it (a `.0` in a closure would
    // capture the bare pointer, which is not Send).
    fn at(self, offset: usize) -> *mut u8 {
        self.0.wrapping_add(offset)
    }
}

impl Par {
    /// `threads` threads in all (1: everything on the calling thread, no pool); copy-out steps
    /// of at least `streaming_min` bytes use streaming stores.
    pub fn new(threads: usize, min_piece: usize, streaming_min: usize) -> Par {
        let threads = threads.max(1);
        let pool = (threads > 1)
            .then(|| {
                rayon::ThreadPoolBuilder::new()
                    .num_threads(threads - 1)
                    .thread_name(|i| format!("xccl_rs-copy-{i}"))
                    .build()
                    .map_err(|e| tracing::warn!(threads, error = %e, "no helper threads; copying on one"))
                    .ok()
            })
            .flatten();
        let threads = if pool.is_some() { threads } else { 1 };
        Par { pool, threads, min_piece: min_piece.max(ALIGN), streaming_min }
    }

    /// Everything on the calling thread, no pool, no streaming stores: for a rank whose steps
    /// never split (it shares no memory, or its group is closed).
    pub fn serial() -> Par {
        Par { pool: None, threads: 1, min_piece: ALIGN, streaming_min: usize::MAX }
    }

    /// How many pieces `bytes` of work are cut into.
    fn pieces(&self, bytes: usize) -> usize {
        if self.threads == 1 { 1 } else { (bytes / self.min_piece).clamp(1, self.threads) }
    }

    /// Runs `f(piece_index)` for every piece, the calling thread taking piece 0.
    fn run(&self, pieces: usize, f: impl Fn(usize) + Sync) {
        match &self.pool {
            Some(pool) if pieces > 1 => pool.in_place_scope(|s| {
                let f = &f;
                for p in 1..pieces {
                    s.spawn(move |_| f(p));
                }
                f(0);
            }),
            _ => (0..pieces).for_each(f),
        }
    }

    /// Does every `(src, dst)` copy of a step (equal lengths, as `RawBuf::copy_to`).
    pub fn copy_all(&self, copies: &[(RawBuf, RawBuf)]) {
        self.copy_pieces(copies, false)
    }

    /// `copy_all` for a copy-out step: the destinations are results no rank reads again in
    /// this op, written with streaming stores (stream_copy.rs) when the op writes
    /// `op_bytes` ≥ `streaming_min` in all on this rank: then its results would not stay in
    /// this rank's share of the cache anyway. (Decided per op, not per step: a large op that goes
    /// in blocks streams all of them, since its blocks leave the cache one after another.)
    pub fn copy_all_out(&self, copies: &[(RawBuf, RawBuf)], op_bytes: usize) {
        self.copy_pieces(copies, op_bytes >= self.streaming_min)
    }

    /// One copy-out, split (see `copy_all_out`).
    pub fn copy_out(&self, src: RawBuf, dst: RawBuf, op_bytes: usize) {
        self.copy_all_out(&[(src, dst)], op_bytes);
    }

    /// Threads in all (the calling one included).
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// The smallest op whose copy-outs use streaming stores.
    pub fn streaming_min(&self) -> usize {
        self.streaming_min
    }

    fn copy_pieces(&self, copies: &[(RawBuf, RawBuf)], streaming: bool) {
        let total: usize = copies.iter().map(|(s, _)| s.len()).sum();
        let pieces = self.pieces(total);
        if pieces == 1 && !streaming {
            copies.iter().for_each(|(s, d)| s.copy_to(*d));
            return;
        }
        let per = total.div_ceil(pieces).div_ceil(ALIGN) * ALIGN;
        let shared: Vec<(SendPtr, SendPtr, usize)> = copies
            .iter()
            .map(|(s, d)| {
                assert_eq!(s.len(), d.len(), "Par::copy_all length mismatch");
                (SendPtr(s.ptr()), SendPtr(d.ptr()), s.len())
            })
            .collect();
        self.run(pieces, |p| {
            let (lo, hi) = ((p * per).min(total), ((p + 1) * per).min(total));
            let mut at = 0; // global offset of the current copy's first byte
            for &(s, d, len) in &shared {
                let (start, end) = (lo.max(at), hi.min(at + len));
                if start < end && s.0 != d.0 {
                    // SAFETY: [start - at, end - at) lies inside this copy's source and
                    // destination (valid for `len` bytes by RawBuf's contract); pieces are
                    // disjoint, and a step's sources and destinations do not overlap unless
                    // they are the same buffer, which is skipped (as in RawBuf::copy_to).
                    unsafe { copy_bytes(s.at(start - at), d.at(start - at), end - start, streaming) };
                }
                at += len;
            }
        });
    }

    /// Runs `f(lo, hi)` for the byte ranges `[lo, hi)` that `bytes` of work are cut into (at
    /// 64-byte boundaries), one per thread, the calling thread taking the first.
    pub fn split(&self, bytes: usize, f: impl Fn(usize, usize) + Sync) {
        let pieces = self.pieces(bytes);
        let per = bytes.div_ceil(pieces).div_ceil(ALIGN) * ALIGN;
        self.run(pieces, |p| {
            let (lo, hi) = ((p * per).min(bytes), ((p + 1) * per).min(bytes));
            if lo < hi {
                f(lo, hi);
            }
        });
    }

    /// One copy, split.
    pub fn copy(&self, src: RawBuf, dst: RawBuf) {
        self.copy_all(&[(src, dst)]);
    }

    /// `reduce_raw` over `count` elements of `esz` bytes, split in pieces of whole elements
    /// (`reduce_and_replicate` with no replicas).
    ///
    /// # Safety
    /// As `reduce_raw` for the whole range: every src holds `count` elements, `dst` is
    /// writable for `count` elements and equals a src exactly or overlaps none.
    pub unsafe fn reduce(&self, r: &Reduction, dst: *mut u8, srcs: &[*const u8], count: usize, esz: usize) {
        // SAFETY: the caller's contract, with no replicas.
        unsafe { self.reduce_and_replicate(r, dst, srcs, &[], count, esz, 0) }
    }

    /// `reduce` into `dst`, then every thread copies its own piece of the result into every
    /// destination of `replicas`: one hand-off per call, and each piece is copied while it is
    /// still in its thread's cache. The copies are copy-outs of an op writing `op_bytes`
    /// (streaming stores from `streaming_min`, as `copy_all_out`).
    ///
    /// # Safety
    /// As `reduce` for `dst` and `srcs`; every replica is writable for `count` elements, and
    /// is either exactly equal to a src (overwritten after that piece's reduction has read
    /// it) or overlaps none; replicas overlap neither `dst` nor each other; no one else
    /// touches any of these ranges until the call returns.
    pub unsafe fn reduce_and_replicate(
        &self,
        r: &Reduction,
        dst: *mut u8,
        srcs: &[*const u8],
        replicas: &[*mut u8],
        count: usize,
        esz: usize,
        op_bytes: usize,
    ) {
        let (bytes, streaming) = (count * esz, op_bytes >= self.streaming_min);
        if self.pieces(bytes) == 1 {
            // SAFETY: the caller's contract; the one piece is the whole range, so nothing is
            // shifted and no list is allocated.
            unsafe {
                reduce_raw(r, dst, srcs, count, true);
                replicas.iter().for_each(|&d| copy_bytes(dst, d, bytes, streaming));
            }
            return;
        }
        let dst = SendPtr(dst);
        let srcs: Vec<SendPtr> = srcs.iter().map(|&s| SendPtr(s as *mut u8)).collect();
        let replicas: Vec<SendPtr> = replicas.iter().map(|&d| SendPtr(d)).collect();
        // Pieces are cut at 64-byte boundaries, whole elements of every dtype; the last one
        // ends at count * esz.
        self.split(bytes, |lo, hi| {
            let piece_srcs: Vec<*const u8> = srcs.iter().map(|s| s.at(lo) as *const u8).collect();
            // SAFETY: [lo, hi) lies inside every buffer (hi <= count * esz) and starts and ends
            // on whole elements; pieces are disjoint, so each thread writes its own bytes of dst
            // and of every replica; dst's equality with or disjointness from each src is kept
            // by shifting all of them by lo; a replica equal to a src is written only after
            // this piece's reduction has read it; replicas overlap nothing else (the caller).
            unsafe {
                reduce_raw(r, dst.at(lo), &piece_srcs, (hi - lo) / esz, true);
                replicas.iter().for_each(|d| copy_bytes(dst.at(lo), d.at(lo), hi - lo, streaming));
            }
        });
    }
}

/// One copy of `len` bytes, with streaming stores or ordinary ones.
///
/// # Safety
/// As `std::ptr::copy_nonoverlapping`.
unsafe fn copy_bytes(src: *const u8, dst: *mut u8, len: usize, streaming: bool) {
    // SAFETY: the caller's contract is both functions'.
    unsafe { if streaming { copy_streaming(src, dst, len) } else { std::ptr::copy_nonoverlapping(src, dst, len) } }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::failures::Failures;
    use crate::types::{DType, ReduceOp};

    #[test]
    fn copy_all_covers_every_byte_once() {
        let mut failures = Failures::new();
        for threads in [1, 2, 3, 5] {
            let par = Par::new(threads, 64, usize::MAX);
            let mut a: Vec<u8> = (0..10_007u32).map(|i| (i * 7 % 251) as u8).collect();
            let mut b: Vec<u8> = (0..333u32).map(|i| (i % 13) as u8).collect();
            let (mut x, mut y) = (vec![0u8; a.len()], vec![0u8; b.len()]);
            par.copy_all(&[
                (RawBuf::from_slice(&mut a), RawBuf::from_slice(&mut x)),
                (RawBuf::from_slice(&mut b), RawBuf::from_slice(&mut y)),
            ]);
            failures.check(a == x, || format!("threads {threads}: the copy of 10007 bytes differs"));
            failures.check(b == y, || format!("threads {threads}: the copy of 333 bytes differs"));
        }
        failures.finish("Par::copy_all");
    }

    #[test]
    fn copy_all_out_with_streaming_stores_covers_every_byte_once() {
        let mut failures = Failures::new();
        for (threads, streaming_min) in [(1, 0), (2, 0), (3, 0), (2, 20_000), (2, usize::MAX)] {
            let par = Par::new(threads, 64, streaming_min);
            let mut a: Vec<u8> = (0..10_007u32).map(|i| (i * 7 % 251) as u8).collect();
            let mut b: Vec<u8> = (0..333u32).map(|i| (i % 13) as u8).collect();
            // Destinations off 16-byte alignment, so the unaligned head is exercised.
            let (mut x, mut y) = (vec![0u8; a.len() + 3], vec![0u8; b.len() + 3]);
            par.copy_all_out(
                &[
                    (RawBuf::from_slice(&mut a), RawBuf::from_slice(&mut x[3..])),
                    (RawBuf::from_slice(&mut b), RawBuf::from_slice(&mut y[3..])),
                ],
                a.len() + b.len(),
            );
            let what = format!("threads {threads}, streaming from {streaming_min}");
            failures.check(a[..] == x[3..] && x[..3] == [0; 3], || format!("{what}: the copy of 10007 bytes differs"));
            failures.check(b[..] == y[3..] && y[..3] == [0; 3], || format!("{what}: the copy of 333 bytes differs"));
        }
        failures.finish("Par::copy_all_out");
    }

    #[test]
    fn reduce_split_matches_serial() {
        let r = Reduction { dtype: DType::Float32, op: ReduceOp::Avg, world_size: 3, premul_factor: 1.0 };
        let inputs: Vec<Vec<f32>> = (0..3).map(|k| (0..4099).map(|i| (i * (k + 1)) as f32 * 0.5).collect()).collect();
        let srcs: Vec<*const u8> = inputs.iter().map(|v| v.as_ptr() as *const u8).collect();
        let mut want = vec![0f32; 4099];
        // SAFETY: three inputs of 4099 f32 each; `want` is a distinct buffer of 4099 f32.
        unsafe { reduce_raw(&r, want.as_mut_ptr() as *mut u8, &srcs, 4099, true) };
        let mut failures = Failures::new();
        for threads in [2, 3, 7] {
            let mut got = vec![0f32; 4099];
            // SAFETY: as above.
            unsafe { Par::new(threads, 64, usize::MAX).reduce(&r, got.as_mut_ptr() as *mut u8, &srcs, 4099, 4) };
            let wrong = got.iter().zip(&want).filter(|(g, w)| g != w).count();
            failures.check(wrong == 0, || format!("threads {threads}: {wrong} of 4099 elements differ from the serial reduction"));
        }
        failures.finish("Par::reduce");
    }

    #[test]
    fn reduce_and_replicate_writes_the_sum_everywhere() {
        // In place as the zero-copy all-reduce does it: the destination is source 0, and every
        // replica is one of the other sources, overwritten after its piece was read.
        let n = 4099;
        let r = Reduction { dtype: DType::Float32, op: ReduceOp::Sum, world_size: 3, premul_factor: 1.0 };
        let input = |k: usize| -> Vec<f32> { (0..n).map(|i| ((i * (k + 3)) % 97) as f32 - 40.0).collect() };
        // The reference: plain float32 adds, in rank order.
        let want: Vec<f32> = (0..n).map(|i| input(0)[i] + input(1)[i] + input(2)[i]).collect();
        let mut failures = Failures::new();
        for (threads, streaming_min) in [(1, usize::MAX), (2, 0), (3, usize::MAX), (5, 0)] {
            let mut bufs: Vec<Vec<f32>> = (0..3).map(input).collect();
            let ptrs: Vec<*mut u8> = bufs.iter_mut().map(|v| v.as_mut_ptr() as *mut u8).collect();
            let srcs: Vec<*const u8> = ptrs.iter().map(|&p| p as *const u8).collect();
            // SAFETY: three distinct buffers of n f32; the destination is exactly srcs[0] and
            // the replicas exactly srcs[1] and srcs[2].
            unsafe { Par::new(threads, 64, streaming_min).reduce_and_replicate(&r, ptrs[0], &srcs, &ptrs[1..], n, 4, n * 4) };
            for (k, got) in bufs.iter().enumerate() {
                let wrong = got.iter().zip(&want).filter(|(g, w)| g != w).count();
                failures.check(wrong == 0, || {
                    format!("threads {threads}, streaming from {streaming_min}: buffer {k} has {wrong} of {n} elements wrong")
                });
            }
        }
        failures.finish("Par::reduce_and_replicate");
    }
}

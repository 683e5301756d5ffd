//! Overlapping a rail-aligned op's step between hosts with its steps within the host.
//!
//! Run one after the other, a rail-aligned op's shared-memory steps leave the rail idle and its
//! rail step leaves the memory idle. Here the op is cut into *pieces* (the same byte range of
//! every buffer of the op), and piece p's rail step runs on a thread of its own while this
//! thread runs the shared-memory steps of the pieces before and after it:
//!
//! ```text
//! this thread:  before(0) before(1) before(2) ...              after(0) after(1) after(2)
//! rail thread:            remote(0) remote(1) remote(2) ...
//! ```
//!
//! `before(p)` runs before `remote(p)`, and `after(p)` after it; the rail thread takes pieces in
//! order. Every rank of a host and of a rail cuts the op the same way ([`pieces`] depends on
//! the op's size only), so the ranks run the same steps in the same order: the shared-memory
//! steps on this thread, the rail steps on the rail thread.
//!
//! A failure on either side stops the other: the rail thread stops when this thread stops
//! handing it pieces, this thread when the rail thread stops handing them back. The first
//! error is returned; the caller then aborts the group as for any failed step.

use std::sync::mpsc;

use super::among;
use crate::algorithms::Step;
use crate::error::{CommError, Result};
use crate::transport::shm::ShmGroup;

/// The smallest piece worth a piece of its own: below it, a piece's fixed costs (a barrier of
/// the host's ranks, a message header each way) outweigh what the overlap saves.
pub const MIN_PIECE_BYTES: usize = 1 << 20;

/// The most pieces an op is cut into: the first `before` and the last `after` are what the
/// overlap cannot hide, so more pieces hide more, with diminishing returns.
pub const MAX_PIECES: usize = 8;

/// The byte ranges `(offset, len)` an op whose buffers have `bytes` bytes (a multiple of `esz`)
/// is cut into: near-equal, whole elements, each at least [`MIN_PIECE_BYTES`] (one piece when
/// the op is smaller than two).
pub fn pieces(bytes: usize, esz: usize) -> Vec<(usize, usize)> {
    let count = (bytes / MIN_PIECE_BYTES).clamp(1, MAX_PIECES);
    let elems = bytes / esz;
    (0..count)
        .map(|p| {
            let (start, end) = (elems * p / count, elems * (p + 1) / count);
            (start * esz, (end - start) * esz)
        })
        .collect()
}

/// Runs the `pieces` (byte ranges `(offset, len)`, from [`pieces`]) through `before` (shared
/// memory, this thread), `remote` (among `rail`, on a thread of its own) and `after` (shared
/// memory, this thread), overlapped as the module describes (one piece runs on this thread
/// alone); each gets its piece's range. While this thread waits for a piece's rail
/// step, its host's ranks see it as waiting on a remote rank (ShmGroup::in_remote_step).
pub fn overlapped<B, R, A>(
    shm: &mut ShmGroup,
    step: &mut Step<'_>,
    rail: &[usize],
    pieces: &[(usize, usize)],
    mut before: B,
    remote: R,
    mut after: A,
) -> Result<()>
where
    B: FnMut(&mut ShmGroup, (usize, usize)) -> Result<()>,
    R: Fn(&mut Step<'_>, (usize, usize)) -> Result<()> + Send,
    A: FnMut(&mut ShmGroup, (usize, usize)) -> Result<()>,
{
    if let [piece] = *pieces {
        // Nothing to overlap: no thread.
        before(shm, piece)?;
        among(Some(&*shm), step, rail, |s| remote(s, piece))?;
        return after(shm, piece);
    }
    let (to_rail, rail_inbox) = mpsc::channel::<usize>();
    let (from_rail, done) = mpsc::channel::<usize>();
    std::thread::scope(|scope| {
        let rail_thread = scope.spawn(move || -> Result<()> {
            for p in rail_inbox {
                among(None, step, rail, |s| remote(s, pieces[p]))?;
                if from_rail.send(p).is_err() {
                    break; // this thread failed and stopped listening
                }
            }
            Ok(())
        });
        let local = (|| -> Result<()> {
            for (p, &piece) in pieces.iter().enumerate() {
                before(shm, piece)?;
                // The rail thread only stops early after an error, which join() reports.
                let _ = to_rail.send(p);
            }
            drop(to_rail);
            for &piece in pieces {
                match shm.in_remote_step(|| done.recv()) {
                    Ok(_) => after(shm, piece)?,
                    Err(_) => return Err(CommError::aborted("the step between hosts stopped")),
                }
            }
            Ok(())
        })();
        drop(done);
        let remote_result = rail_thread.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        // The rail step's error says why this thread stopped waiting, so it comes first.
        remote_result.and(local)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_cover_the_op_in_whole_elements() {
        for (bytes, esz) in [(0, 4), (12, 4), (MIN_PIECE_BYTES * 2 + 6, 2), (MIN_PIECE_BYTES * 3 - 4, 4), (MIN_PIECE_BYTES * 100 + 8, 8)] {
            let ps = pieces(bytes, esz);
            assert!(!ps.is_empty() && ps.len() <= MAX_PIECES, "{bytes}: {} pieces", ps.len());
            let mut at = 0;
            for &(offset, len) in &ps {
                assert_eq!(offset, at, "{bytes}: pieces are contiguous");
                assert_eq!(len % esz, 0, "{bytes}: whole elements");
                assert!(ps.len() == 1 || len >= MIN_PIECE_BYTES - esz, "{bytes}: a piece of {len} bytes");
                at += len;
            }
            assert_eq!(at, bytes, "{bytes}: the pieces cover the op");
        }
        assert_eq!(pieces(MIN_PIECE_BYTES * 2, 4).len(), 2);
        assert_eq!(pieces(MIN_PIECE_BYTES * 2 - 4, 4).len(), 1);
    }
}

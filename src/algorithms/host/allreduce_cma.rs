//! All-reduce in place on ordinary tensors, by cross-memory attach (transport/shm/cma.rs):
//! ranks read each other's tensors with one kernel copy instead of passing them through the
//! slots. select.rs sends here the all-reduces past the one-shot limit large enough to repay the
//! pre-sync (`reads_by_cma`) on a group with cross-memory attach on. The op starts with the
//! zero-copy pre-sync (zero_copy.rs), in which every rank also publishes where its tensor lies
//! in its own memory; then, decided during the op from every rank's answer, it finishes
//! zero-copy (push.rs) when every tensor lies in its heap, else in two steps:
//!
//! 1. Rank r reduces part r. Piece by piece ([`PIECE`] bytes, so the pieces stay in cache), it
//!    reads part r of every peer's tensor into a bounce buffer of its own and reduces them,
//!    with its own part, in rank order into part r of its own tensor. Then it publishes
//!    `Reduced`.
//! 2. Once all have, rank r reads part j of rank j's tensor straight into part j of its own,
//!    for every j ≠ r, then publishes `Consumed` and waits for everyone's.
//!
//! Rank r writes only its own tensor, and only parts no peer reads at that step (the zero-copy
//! path writes into the peers' tensors instead, through their mapped heaps:
//! push.rs); every element is reduced once, on its part's owner, in rank order,
//! so every rank ends with the same bits as through the slots. Per rank this moves about 4N of memory
//! traffic (the kernel's copy reads and writes), against 5N through the slots; but each read
//! pins the peer's pages, and with every rank reading every peer at once that cost more than
//! the copy it saves on the hosts we measured, so it is off unless `XCCL_RS_CMA=1`.

use std::cell::RefCell;
use std::sync::Mutex;

use super::push::push;
use super::zero_copy::{all_in_heap, presync};
use crate::algorithms::split::split_range;
use crate::error::{CommError, Result};
use crate::op::Op;
use crate::par::Par;
use crate::reduce::reduce_raw;
use crate::transport::OpCtx;
use crate::transport::shm::{Counter, Desc, ShmGroup, cma};

/// Bytes of each peer read per reduction in step 1: with 7 peers, 896 KiB of bounce buffers,
/// within a core's L2.
const PIECE: usize = 128 << 10;

thread_local! {
    /// Step 1's bounce buffers, one piece per peer: kept by each thread (the rank's and its
    /// helpers, which live as long as the group), so an op allocates nothing.
    static BOUNCE: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// The error of a read that the kernel refused: the peer died, or its published address does
/// not hold its tensor.
fn read_error(ctx: &OpCtx, shm: &ShmGroup, r: usize, bytes: usize, e: std::io::Error) -> CommError {
    CommError::peer(format!(
        "{}: reading rank {}'s tensor of {bytes} bytes by cross-memory attach failed: {e} (did it exit?)",
        ctx.describe(),
        shm.group_rank(r)
    ))
}

/// After a pre-sync, the all-reduce zero-copy if every rank's tensor is in its heap, else by
/// cross-memory attach.
pub fn run(shm: &mut ShmGroup, par: &Par, ctx: &OpCtx, op: &Op, desc: Desc) -> Result<()> {
    let g = presync(shm, ctx, desc, &op.outputs[..1])?;
    if all_in_heap(shm, g) {
        return push(shm, par, ctx, op, g, g);
    }
    read_by_cma(shm, par, ctx, op, g)
}

/// The two steps (module comment), after the pre-sync for block `g`.
fn read_by_cma(shm: &mut ShmGroup, par: &Par, ctx: &OpCtx, op: &Op, g: u64) -> Result<()> {
    let buf = op.outputs[0];
    let (rank, size) = (shm.rank(), shm.size());
    let esz = op.dtype.size();
    let count = buf.len() / esz;
    let part = |r: usize| {
        let (s, l) = split_range(count, size, r);
        (s * esz, l * esz)
    };
    let cma = shm.cma().expect("cross-memory attach was agreed");
    // Each rank's pid, and where its tensor lies in its own memory (published in the pre-sync).
    let peers: Vec<(i32, u64)> = (0..size).map(|r| (cma.pid(r), shm.placement(g, r).addr)).collect();
    if let Some(cma) = shm.cma_mut() {
        cma.count_op();
    }
    let failed: Mutex<Option<(usize, std::io::Error)>> = Mutex::new(None);
    let fail = |r: usize, e: std::io::Error| {
        let mut f = failed.lock().unwrap_or_else(|p| p.into_inner());
        f.get_or_insert((r, e));
    };
    let base = buf.ptr() as usize;

    // Step 1: part `rank`, from every tensor, into this rank's.
    let (my_start, my_len) = part(rank);
    let reduction = op.reduction(size);
    par.split(my_len, |lo, hi| {
        BOUNCE.with_borrow_mut(|bounce| {
            bounce.resize((size - 1) * PIECE, 0);
            let mut srcs: Vec<*const u8> = Vec::with_capacity(size);
            let mut at = lo;
            while at < hi {
                let n = PIECE.min(hi - at);
                let mine = (base + my_start + at) as *mut u8;
                srcs.clear();
                let mut slot = 0;
                for (r, &(pid, addr)) in peers.iter().enumerate() {
                    if r == rank {
                        srcs.push(mine as *const u8);
                        continue;
                    }
                    let into = &mut bounce[slot * PIECE..slot * PIECE + n];
                    slot += 1;
                    let from = addr.saturating_add((my_start + at) as u64);
                    if let Err(e) = cma::read(pid, from, into) {
                        return fail(r, e);
                    }
                    srcs.push(into.as_ptr());
                }
                // SAFETY: every source holds `n` bytes: this rank's own piece (inside its
                // tensor, which is `buf.len()` bytes) and the bounce pieces just read; the
                // destination is exactly the own source and overlaps no other (the bounce
                // buffers are this thread's); no peer writes this part of this tensor before
                // all have published Reduced. `n` is a whole number of elements (parts and
                // pieces are, and the last piece ends where the part does).
                unsafe { reduce_raw(&reduction, mine, &srcs, n / esz, true) };
                at += n;
            }
        })
    });
    if let Some((r, e)) = failed.lock().unwrap_or_else(|p| p.into_inner()).take() {
        return Err(read_error(ctx, shm, r, buf.len(), e));
    }
    shm.publish(Counter::Reduced, g);
    shm.wait_all(Counter::Reduced, g, ctx)?;

    // Step 2: every other part, from its owner, into this rank's tensor.
    let others: Vec<usize> = (0..size).filter(|&r| r != rank).collect();
    let total: usize = others.iter().map(|&r| part(r).1).sum();
    par.split(total, |lo, hi| {
        // This thread's bytes [lo, hi) of the concatenated parts.
        let mut at = 0;
        for &r in &others {
            let (s, l) = part(r);
            let (from, to) = (lo.max(at), hi.min(at + l));
            if from < to {
                let (offset, n) = (s + from - at, to - from);
                // SAFETY: [offset, offset + n) lies inside this rank's tensor (part r of it);
                // threads take disjoint ranges, and no peer reads this part now (they read
                // their own parts in this step).
                let into = unsafe { std::slice::from_raw_parts_mut((base + offset) as *mut u8, n) };
                let (pid, addr) = peers[r];
                if let Err(e) = cma::read(pid, addr.saturating_add(offset as u64), into) {
                    return fail(r, e);
                }
            }
            at += l;
        }
    });
    if let Some((r, e)) = failed.lock().unwrap_or_else(|p| p.into_inner()).take() {
        return Err(read_error(ctx, shm, r, buf.len(), e));
    }
    shm.publish(Counter::Consumed, g);
    shm.wait_all(Counter::Consumed, g, ctx)
}

//! Broadcast over shared memory: the root copies each block of its tensor into its slot; the
//! others copy it out of the root's slot straight into their tensors. Slots alternate, so the
//! root fills block g + 1 while the others read block g.
//!
//! On a group with heaps, from select.rs's zero-copy size ([`run_asking_root_heap`]), every rank
//! says with the first block whether its tensor lies in its heap (only the root's answer is
//! read), and a root whose does fills no slot. Then, decided during the op once the first
//! block's exchange shows the root's answer, the others copy the whole tensor from the root's
//! heap, where it is (zero_copy.rs): one copy per receiver, against two through the slots, and
//! the root copies nothing. That costs no synchronization more than the slot path.
//!
//! On a group whose ranks can read each other by cross-memory attach (transport/shm/cma.rs),
//! from select.rs's size for it ([`run_asking_root_whereabouts`]), the root also says whether
//! the others may read its tensor where it lies in its own memory: by default only when the
//! tensor is the pinned buffer through which an accelerator tensor is staged (`Op::staged`),
//! with `XCCL_RS_CMA=1` always, if the kernel lets it read its own tensor so (memory that a
//! driver maps may not be). Then it fills no slot either, and the others read the whole
//! tensor from its memory: one kernel copy per receiver. A staged broadcast so leaves one host
//! copy between the root's copy off its device and each receiver's copy onto its own.
//!
//! Where the device runtime registers host memory, a staged broadcast's root stages in its
//! arena, registered shared memory that its process keeps across groups, and says so
//! (`Placement::arena`); a receiver whose output is an accelerator tensor's then copies from the
//! root's arena straight onto its device (staging/shared.rs): no host copy at all.

use std::ops::ControlFlow;

use super::blocks::{Block, each_block_until, exchange_produced, finish_block};
use super::zero_copy::{count_zero_copy, describe_views, in_heap, peer_views};
use crate::error::{CommError, Result};
use crate::op::Op;
use crate::par::Par;
use crate::staging::DirectOutput;
use crate::transport::{OpCtx, RawBuf};
use crate::transport::shm::{Counter, Desc, ShmGroup, cma};

/// What the first block asks of the root.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Ask {
    Nothing,
    /// Whether its tensor lies in its heap.
    Heap,
    /// Also whether the others may read it by cross-memory attach, and where.
    HeapOrCma,
}

/// Through the slots.
pub fn run(shm: &mut ShmGroup, par: &Par, ctx: &OpCtx, op: &Op, desc: Desc) -> Result<()> {
    through_slots(shm, par, ctx, op, desc, Ask::Nothing, None)
}

/// Through the slots, or from the root's heap when its tensor lies there (module comment).
pub fn run_asking_root_heap(shm: &mut ShmGroup, par: &Par, ctx: &OpCtx, op: &Op, desc: Desc, direct: Option<&mut dyn DirectOutput>) -> Result<()> {
    through_slots(shm, par, ctx, op, desc, Ask::Heap, direct)
}

/// Through the slots, or from the root's tensor where it lies (its heap, or its memory by
/// cross-memory attach) when the root allows it (module comment).
pub fn run_asking_root_whereabouts(shm: &mut ShmGroup, par: &Par, ctx: &OpCtx, op: &Op, desc: Desc, direct: Option<&mut dyn DirectOutput>) -> Result<()> {
    through_slots(shm, par, ctx, op, desc, Ask::HeapOrCma, direct)
}

/// After the root's answer for block `g` is published: whether the others read its tensor
/// where it lies instead of through the slots.
fn root_readable(shm: &ShmGroup, g: u64, root: usize, ask: Ask) -> bool {
    in_heap(shm, g, root) || (ask == Ask::HeapOrCma && shm.placement(g, root).addr != 0)
}

fn through_slots(shm: &mut ShmGroup, par: &Par, ctx: &OpCtx, op: &Op, desc: Desc, ask: Ask, direct: Option<&mut dyn DirectOutput>) -> Result<()> {
    let (rank, root) = (shm.rank(), op.root as usize);
    let buf = op.outputs[0];
    let block_bytes = shm.slot_bytes();
    let offers_cma = rank == root
        && ask == Ask::HeapOrCma
        && shm.cma().is_some_and(|c| c.ordinary() || op.staged)
        && cma::readable(buf);
    let from_root = each_block_until(shm, ctx, buf.len(), block_bytes, |shm, Block { index: b, g, last, start, len }| {
        let asked = b == 0 && ask != Ask::Nothing;
        let in_place = asked && {
            // Every rank writes its answer (only the root's is read), so no stale one remains.
            describe_views(shm, g, if rank == root { &op.outputs[..1] } else { &[] }, offers_cma);
            root_readable(shm, g, root, ask)
        };
        if rank == root && !in_place {
            par.copy(buf.sub(start, len), shm.slot(rank, g).sub(0, len));
        }
        exchange_produced(shm, g, (b == 0).then_some(desc), ctx)?;
        // The root's description is checked now, so its answer is that of this op.
        if asked && root_readable(shm, g, root, ask) {
            return Ok(ControlFlow::Break((g, last)));
        }
        if rank != root {
            par.copy_out(shm.slot(root, g).sub(0, len), buf.sub(start, len), buf.len());
        }
        finish_block(shm, g);
        Ok(ControlFlow::Continue(()))
    })?;
    match from_root {
        Some((first, last)) => read_root(shm, par, ctx, op, first, last, direct),
        None => Ok(()),
    }
}

/// After the exchange of the op's first block `first`, in which the root said where its tensor
/// lies and that it may be read there: every other rank copies it from the root's heap, or
/// reads it by cross-memory attach, into its own tensor and publishes `Consumed` for the op's
/// last block `last`; the root returns once all have. A receiver whose read fails returns its
/// error without publishing, so the root's wait ends in a timeout naming it.
///
/// Where the root's tensor lies in its staging arena (staging/shared.rs) and this rank's output
/// is an accelerator tensor's chunk, `direct` copies it from the root's arena straight onto the
/// device, and publishes only once that copy has run.
fn read_root(shm: &mut ShmGroup, par: &Par, ctx: &OpCtx, op: &Op, first: u64, last: u64, direct: Option<&mut dyn DirectOutput>) -> Result<()> {
    let (rank, root) = (shm.rank(), op.root as usize);
    let buf = op.outputs[0];
    if in_heap(shm, first, root) {
        count_zero_copy(shm, ctx.seq);
        if rank != root && shm.placement(first, root).arena {
            read_root_arena(shm, par, ctx, op, first, direct)?;
        } else if rank != root {
            let source = peer_views(shm, first, root, 1, buf.len())?[0];
            par.copy_out(source, buf, buf.len());
        }
    } else {
        let cma = shm.cma_mut().ok_or_else(|| CommError::invalid("internal error (please report): a broadcast read by cross-memory attach on a group without it"))?;
        cma.count_op();
        let pid = cma.pid(root);
        if rank != root {
            read_by_cma(par, pid, shm.placement(first, root).addr, buf).map_err(|e| {
                CommError::peer(format!(
                    "{}: reading the root's tensor ({} bytes, rank {}) by cross-memory attach failed: {e} (did it exit?)",
                    ctx.describe(),
                    buf.len(),
                    shm.group_rank(root)
                ))
            })?;
        }
    }
    shm.publish(Counter::Reduced, last);
    shm.publish(Counter::Consumed, last);
    if rank == root { shm.wait_all(Counter::Consumed, last, ctx) } else { Ok(()) }
}

/// A receiver's part of a broadcast whose root staged its tensor in its arena (staging/shared.rs):
/// copies it from there straight onto this rank's device (`direct`) where the arena is
/// registered here, else on the host. The root's range is used only once it lies inside the
/// arena that the root's header names, mapped here.
fn read_root_arena(shm: &mut ShmGroup, par: &Par, ctx: &OpCtx, op: &Op, first: u64, direct: Option<&mut dyn DirectOutput>) -> Result<()> {
    let root = op.root as usize;
    let buf = op.outputs[0];
    let root_rank = shm.group_rank(root);
    let (offset, _) = shm.placement(first, root).heap.unwrap_or_default();
    let (pid, id) = shm.arena_of(root);
    let heaps = shm.heaps_mut().ok_or_else(|| CommError::invalid("internal error (please report): a staging arena read on a group without heaps"))?;
    let arena = heaps.staging_mut().peer(pid, id).map_err(|e| CommError::peer(format!("{}: rank {root_rank}'s tensor: {}", ctx.describe(), e.message)))?;
    let source = arena.range(offset, buf.len()).ok_or_else(|| {
        CommError::io(format!("rank {root_rank} published {} bytes at offset {offset} of its staging arena, which lie outside it", buf.len()))
    })?;
    let delivered = match direct {
        Some(direct) => direct.deliver(source, &arena)?,
        None => false,
    };
    if !delivered {
        par.copy_out(source, buf, buf.len());
    }
    Ok(())
}

/// Reads `buf.len()` bytes of process `pid` from its address `addr` into `buf`, split across
/// `par`'s threads.
fn read_by_cma(par: &Par, pid: i32, addr: u64, buf: RawBuf) -> std::io::Result<()> {
    let failed = std::sync::Mutex::new(None);
    par.split(buf.len(), |lo, hi| {
        // SAFETY: `[lo, hi)` lies inside `buf` (par.split hands out disjoint ranges of
        // `0..buf.len()`), which is valid for writes for the op (RawBuf::new's contract) and is
        // this rank's output: no peer reads or writes it in this op, and each thread writes
        // only its own range.
        let into = unsafe { std::slice::from_raw_parts_mut(buf.ptr().add(lo), hi - lo) };
        if let Err(e) = cma::read(pid, addr.saturating_add(lo as u64), into) {
            failed.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(e);
        }
    });
    failed.into_inner().unwrap_or_else(|p| p.into_inner()).map_or(Ok(()), Err)
}

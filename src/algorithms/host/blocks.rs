//! The steps every shared-memory algorithm repeats per block (see transport/shm/group.rs for
//! the counter protocol): reserve the op's blocks and, before each, wait until its slot is free
//! everywhere ([`each_block`]); announce that this rank's slot is filled (with the op's
//! description on the first block) and wait for everyone; then, after reading, announce the
//! block consumed. And what every rank says about an op before touching peers' data (its
//! description).

use std::convert::Infallible;
use std::ops::ControlFlow;

use crate::error::Result;
use crate::op::OpIdentity;
use crate::par::Par;
use crate::transport::shm::{Counter, Desc, ShmGroup};
use crate::transport::{OpCtx, RawBuf};

/// What every rank of `shm` says about op `seq`, of identity `id`, before touching peers' data.
pub fn describe(shm: &ShmGroup, seq: u64, id: &OpIdentity) -> Desc {
    Desc {
        seq,
        kind: id.kind as u8,
        dtype: id.dtype as u8,
        reduce: id.reduce,
        chunk_log: shm.pipeline_chunk_log(),
        count: id.count,
        root: id.key as u64,
    }
}

/// Number of blocks of `block_bytes` for `len` bytes: at least one, so that even an
/// empty operation checks its description against every rank's.
pub fn block_count(len: usize, block_bytes: usize) -> usize {
    len.div_ceil(block_bytes.max(1)).max(1)
}

/// Range `[start, start+len)` of block `b` over `total` bytes cut into blocks of `block_bytes`.
pub fn block_range(total: usize, block_bytes: usize, b: usize) -> (usize, usize) {
    let start = (b * block_bytes).min(total);
    (start, (total - start).min(block_bytes))
}

/// One block of an op: its index in the op, its number `g`, the op's last block number, and
/// its byte range `[start, start + len)` of the op's buffers.
#[derive(Clone, Copy, Debug)]
pub struct Block {
    pub index: usize,
    pub g: u64,
    pub last: u64,
    pub start: usize,
    pub len: usize,
}

/// Runs `step` on every block of an op of `total` bytes cut in blocks of `block_bytes` (at least
/// one: see `block_count`), after reserving their numbers, each once its slot is free
/// everywhere.
pub fn each_block(
    shm: &mut ShmGroup,
    ctx: &OpCtx,
    total: usize,
    block_bytes: usize,
    mut step: impl FnMut(&ShmGroup, Block) -> Result<()>,
) -> Result<()> {
    each_block_until(shm, ctx, total, block_bytes, |shm, block| step(shm, block).map(ControlFlow::<Infallible>::Continue)).map(drop)
}

/// [`each_block`], stopping after a step that breaks, with its value.
pub fn each_block_until<B>(
    shm: &mut ShmGroup,
    ctx: &OpCtx,
    total: usize,
    block_bytes: usize,
    mut step: impl FnMut(&ShmGroup, Block) -> Result<ControlFlow<B>>,
) -> Result<Option<B>> {
    let blocks = block_count(total, block_bytes);
    let first = shm.begin_op(blocks as u64);
    let last = first + blocks as u64 - 1;
    for index in 0..blocks {
        let (start, len) = block_range(total, block_bytes, index);
        let block = Block { index, g: first + index as u64, last, start, len };
        wait_slot_free(shm, block.g, ctx)?;
        if let ControlFlow::Break(value) = step(shm, block)? {
            return Ok(Some(value));
        }
    }
    Ok(None)
}

/// Waits until every rank has consumed block g − 2, the previous user of g's slot.
pub fn wait_slot_free(shm: &ShmGroup, g: u64, ctx: &OpCtx) -> Result<()> {
    if g > 2 { shm.wait_all(Counter::Consumed, g - 2, ctx) } else { Ok(()) }
}

/// Publishes `Produced` for g and waits for every rank's; on an op's first block, also
/// publishes and checks the op's description.
pub fn exchange_produced(shm: &ShmGroup, g: u64, first: Option<Desc>, ctx: &OpCtx) -> Result<()> {
    if let Some(desc) = first {
        shm.describe(g, desc);
    }
    shm.publish(Counter::Produced, g);
    shm.wait_all(Counter::Produced, g, ctx)?;
    if first.is_some() {
        shm.check_descs(g, ctx)?;
    }
    Ok(())
}

/// Copies every rank's reduced part of block g, `part(r)` = (offset, length) in bytes, from its
/// owner's slot into `block` (after every rank's `Reduced` for g), of an op writing `op_bytes`.
pub fn copy_reduced_parts(shm: &ShmGroup, par: &Par, g: u64, block: RawBuf, part: impl Fn(usize) -> (usize, usize), op_bytes: usize) {
    let copies: Vec<_> = (0..shm.size())
        .map(|r| {
            let (s, l) = part(r);
            (shm.slot(r, g).sub(s, l), block.sub(s, l))
        })
        .collect();
    par.copy_all_out(&copies, op_bytes);
}

/// Publishes `Reduced` and `Consumed` for g: this rank is done with block g.
pub fn finish_block(shm: &ShmGroup, g: u64) {
    shm.publish(Counter::Reduced, g);
    shm.publish(Counter::Consumed, g);
}

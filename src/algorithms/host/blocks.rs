//! The steps every shared-memory algorithm repeats per block (see transport/shm/group.rs for
//! the counter protocol): wait until the block's slot is free everywhere, announce that this
//! rank's slot is filled (with the op's description on the first block) and wait for everyone,
//! then, after reading, announce the block consumed. And what every rank says about an op
//! before touching peers' data (its description).

use crate::error::Result;
use crate::op::OpIdentity;
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

/// Number of blocks for `len` bytes in pieces of `piece` bytes: at least one, so that even an
/// empty operation checks its description against every rank's.
pub fn block_count(len: usize, piece: usize) -> usize {
    len.div_ceil(piece.max(1)).max(1)
}

/// Range `[start, start+len)` of block `b` over `total` bytes cut into `piece`-byte blocks.
pub fn block_range(total: usize, piece: usize, b: usize) -> (usize, usize) {
    let start = (b * piece).min(total);
    (start, (total - start).min(piece))
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
pub fn copy_reduced_parts(shm: &ShmGroup, g: u64, block: RawBuf, part: impl Fn(usize) -> (usize, usize), op_bytes: usize) {
    let copies: Vec<_> = (0..shm.size())
        .map(|r| {
            let (s, l) = part(r);
            (shm.slot(r, g).sub(s, l), block.sub(s, l))
        })
        .collect();
    shm.par().copy_all_out(&copies, op_bytes);
}

/// Publishes `Reduced` and `Consumed` for g: this rank is done with block g.
pub fn finish_block(shm: &ShmGroup, g: u64) {
    shm.publish(Counter::Reduced, g);
    shm.publish(Counter::Consumed, g);
}

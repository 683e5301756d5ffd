//! Large collectives run as a sequence of *chunks*, so that the staging of accelerator tensors
//! overlaps the communication: while the host algorithm works on chunk k, the device copies
//! chunk k + 1 to the host and chunk k − 1 back (src/staging/).
//!
//! The chunk plan is the same on every rank, whatever device its tensors are on (a CPU rank of
//! a mixed group must run the same sequence of sub-operations as a CUDA rank): every buffer of
//! a chunkable op has the same length L (src/op.rs's layout table), and chunk k is the byte
//! range `[k*c, min((k+1)*c, L))` of each buffer, with `c` = `XCCL_RS_PIPELINE_CHUNK_BYTES`.
//! All chunks of an op carry the op's sequence number and its full element count, so the
//! usual checks still compare whole operations across ranks; the chunk size is part of the
//! shared-memory description too, so ranks configured differently fail with a clear error.
//!
//! Chunks of shared-memory collectives follow each other without a pause: their blocks are
//! consecutive generations of the same double-buffered slots (algorithms/host/blocks.rs).

use std::borrow::Cow;

use crate::buf::{Buf, Extent};
use crate::error::Result;
use crate::op::Op;
use crate::staging::StagedJob;
use crate::transport::OpCtx;

/// How many chunks `piece` bytes make in chunks of `chunk` bytes: at least one.
pub fn chunk_count(piece: usize, chunk: usize) -> usize {
    piece.div_ceil(chunk.max(1)).max(1)
}

/// The plan of one op: its chunk size and number of chunks (`usize::MAX` and 1 for an op
/// that is not chunked, op.rs `piece_len`).
pub fn plan<B: Extent>(op: &Op<B>, chunk_bytes: usize) -> (usize, usize) {
    match op.piece_len() {
        Some(len) => (chunk_bytes, chunk_count(len, chunk_bytes)),
        None => (usize::MAX, 1),
    }
}

/// Chunk `k` of `op` (chunk size `c`): the same op on byte range `[k*c, min((k+1)*c, L))` of
/// every buffer.
pub fn chunk_op(op: &Op<Buf>, c: usize, k: usize) -> Op<Buf> {
    let sub = |b: &Buf| {
        let start = k.saturating_mul(c).min(b.len());
        Ok(b.sub(start, (b.len() - start).min(c)))
    };
    op.map_bufs(sub).expect("cutting a chunk cannot fail")
}

/// Runs every chunk of collective `op` (op `index` of its job): `run` for each chunk on host
/// memory, between `staging`'s waits for its inputs and its copies back (their errors say
/// which operation they broke: `ctx`), given the staging to deliver the chunk's output
/// (staging/mod.rs `DirectOutput`). Without staging, every buffer must be host memory.
pub fn run_chunks(
    op: &Op<Buf>,
    index: usize,
    chunk_bytes: usize,
    ctx: &OpCtx,
    mut staging: Option<&mut StagedJob>,
    mut run: impl FnMut(&Op, Option<&mut StagedJob>) -> Result<()>,
) -> Result<()> {
    let (c, chunks) = plan(op, chunk_bytes);
    for k in 0..chunks {
        // A small op is its own only chunk: no copy of its buffer lists.
        let chunk = if chunks == 1 { Cow::Borrowed(op) } else { Cow::Owned(chunk_op(op, c, k)) };
        let on_host = match staging.as_deref_mut() {
            Some(s) => s.inputs_ready(index, k, &chunk),
            None => chunk.host(),
        };
        run(&on_host.map_err(|e| ctx.annotate(e))?, staging.as_deref_mut())?;
        if let Some(s) = staging.as_deref_mut() {
            s.outputs_done(index, k).map_err(|e| ctx.annotate(e))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::buf::RawBuf;
    use crate::types::{DType, OpKind};

    #[test]
    fn chunks_cover_every_buffer_once() {
        let mut a = vec![0u8; 1000];
        let mut outs: Vec<Vec<u8>> = (0..3).map(|_| vec![0u8; 1000]).collect();
        let mut op = Op::new(OpKind::AllGather, DType::UInt8);
        op.inputs.push(Buf::Host(RawBuf::from_slice(&mut a)));
        op.outputs = outs.iter_mut().map(|o| Buf::Host(RawBuf::from_slice(o))).collect();
        let (c, n) = plan(&op, 256);
        let op = op.host().unwrap();
        assert_eq!((c, n), (256, 4));
        let mut failures = crate::failures::Failures::new();
        let mut seen = vec![0u32; 1000];
        for k in 0..n {
            let sub = chunk_op(&Op::<Buf>::from(&op), c, k).host().unwrap();
            for (i, b) in sub.outputs.iter().enumerate() {
                let start = b.ptr() as usize - op.outputs[i].ptr() as usize;
                failures.eq(start, k * 256, format_args!("chunk {k} output {i}: start"));
                if i == 0 {
                    (start..start + b.len()).for_each(|j| seen[j] += 1);
                }
            }
            failures.eq(sub.inputs[0].len(), sub.outputs[0].len(), format_args!("chunk {k}: input vs output length"));
        }
        let wrong: Vec<usize> = (0..seen.len()).filter(|&j| seen[j] != 1).collect();
        failures.check(wrong.is_empty(), || format!("{} bytes of output 0 not covered exactly once, first {:?}", wrong.len(), wrong.first()));
        failures.finish("chunk_op");
    }

    #[test]
    fn unchunked_kinds_and_small_ops_are_one_chunk() {
        let mut a = vec![0u8; 100];
        let mut op: Op = Op::new(OpKind::AllReduce, DType::UInt8);
        op.outputs.push(RawBuf::from_slice(&mut a));
        assert_eq!(plan(&op, 256).1, 1);
        assert_eq!(plan(&op, 64).1, 2);
        let empty: Op = Op::new(OpKind::AllReduce, DType::UInt8);
        assert_eq!(plan(&empty, 64), (usize::MAX, 1));
        op.kind = OpKind::AllToAll;
        assert_eq!(plan(&op, 64), (usize::MAX, 1));
        assert_eq!(chunk_count(0, 64), 1);
        assert_eq!(chunk_count(128, 64), 2);
        assert_eq!(chunk_count(129, 64), 3);
    }
}

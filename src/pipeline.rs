//! Large collectives run as a sequence of *chunks*, so that the staging of accelerator tensors
//! overlaps the communication: while the host algorithm works on chunk k, the device copies
//! chunk k + 1 to the host and chunk k − 1 back (csrc/device.cc).
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
//! consecutive generations of the same double-buffered slots (shm_blocks.rs).

use std::borrow::Cow;

use crate::error::{CommError, Result};
use crate::op::Op;
use crate::transport::{OpCtx, RawBuf};
use crate::types::OpKind;

/// A placeholder address range that a job's buffers were described with, and the host memory
/// it stands for (see [`Staging::host_buffers`]). Addresses as integers: a placeholder is never
/// dereferenced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Relocation {
    pub placeholder: usize,
    pub bytes: usize,
    pub host: usize,
}

/// The bridge's side of a job on staged accelerator tensors. `op` is the index of the op in its
/// job, `chunk` its chunk (0 for ops that are not chunked). Both are called on the thread that
/// runs the job, in chunk order; an error fails the job and the group.
pub trait Staging: Send {
    /// Called once, on the thread that runs the job, before anything else: the host memory
    /// behind the placeholder ranges some of the job's buffers were described with. The bridge
    /// allocates its pinned staging memory here rather than on the caller's thread, so that
    /// issuing an async op allocates nothing. The memory must stay valid, and untouched by
    /// anyone else, until the job completes. Default: none (every buffer is real memory).
    fn host_buffers(&mut self) -> Result<Vec<Relocation>> {
        Ok(Vec::new())
    }
    /// Returns when chunk `chunk` of every input of op `op` is on the host, with where that
    /// chunk's ranges are on the host when the staging keeps them in a window of chunk-sized
    /// buffers rather than in whole buffers: the chunk's buffers inside a placeholder range of
    /// the table are moved there for this chunk only (empty: nothing moves). Only chunked ops
    /// may move; the window's memory must stay valid until `outputs_done` of the same chunk.
    fn inputs_ready(&mut self, op: usize, chunk: usize) -> Result<Vec<Relocation>>;
    /// Chunk `chunk` of every output of op `op` is final on the host: copy it back.
    fn outputs_done(&mut self, op: usize, chunk: usize) -> Result<()>;
}

/// The chunk size in bytes for an op of `kind`, given the configured `chunk_bytes`:
/// `usize::MAX` (one chunk: every buffer whole) for kinds that are not chunked. The bridge
/// plans its copies with the same function.
pub fn chunk_bytes_for(kind: OpKind, chunk_bytes: usize) -> usize {
    use OpKind::*;
    match kind {
        AllReduce | Broadcast | Reduce | Scatter | ReduceScatter | AllGather | Gather => chunk_bytes,
        AllToAll | Barrier | Send | Recv | RecvAnySource => usize::MAX,
    }
}

/// How many chunks `piece` bytes make in chunks of `chunk` bytes: at least one.
pub fn chunk_count(piece: usize, chunk: usize) -> usize {
    piece.div_ceil(chunk.max(1)).max(1)
}

/// The plan of one op: its chunk size and number of chunks.
pub fn plan(op: &Op, chunk_bytes: usize) -> (usize, usize) {
    match op.piece_len() {
        Some(len) => (chunk_bytes, chunk_count(len, chunk_bytes)),
        None => (usize::MAX, 1),
    }
}

/// Chunk `k` of `op` (chunk size `c`): the same op on byte range `[k*c, min((k+1)*c, L))` of
/// every buffer.
pub fn chunk_op(op: &Op, c: usize, k: usize) -> Op {
    let sub = |b: &crate::transport::RawBuf| {
        let start = k.saturating_mul(c).min(b.len());
        b.sub(start, (b.len() - start).min(c))
    };
    Op { inputs: op.inputs.iter().map(sub).collect(), outputs: op.outputs.iter().map(sub).collect(), ..op.clone() }
}

/// `ops` with every buffer inside a placeholder range of `table` moved to the host memory it
/// stands for (same offset); other buffers (host tensors of a mixed job) are left as they are.
/// A buffer that starts in a range but runs past its end is an error (the bridge described it
/// wrongly), not memory to touch; callers prefix it with the op (OpCtx::annotate).
pub fn relocate(ops: &[Op], table: &[Relocation]) -> Result<Vec<Op>> {
    let moved = |b: &RawBuf| -> Result<RawBuf> {
        let ptr = b.ptr() as usize;
        let Some(r) = table.iter().find(|r| ptr >= r.placeholder && ptr - r.placeholder < r.bytes.max(1)) else {
            return Ok(*b);
        };
        let offset = ptr - r.placeholder;
        if b.len() > r.bytes - offset.min(r.bytes) {
            return Err(CommError::invalid(format!(
                "internal error (please report): a buffer of {} bytes at offset {offset} of a staging buffer of {} bytes",
                b.len(),
                r.bytes
            )));
        }
        // SAFETY: in bounds of the host memory `r` describes (checked above), which the staging
        // keeps valid and reserved for this job until it completes (Staging::host_buffers).
        Ok(unsafe { RawBuf::new((r.host + offset) as *mut u8, b.len()) })
    };
    ops.iter()
        .map(|op| {
            Ok(Op {
                inputs: op.inputs.iter().map(moved).collect::<Result<_>>()?,
                outputs: op.outputs.iter().map(moved).collect::<Result<_>>()?,
                ..op.clone()
            })
        })
        .collect()
}

/// Runs every chunk of a collective: `staging`'s hooks around each, `run` for the chunk itself.
pub fn run_chunks(
    op: &Op,
    index: usize,
    chunk_bytes: usize,
    ctx: &OpCtx,
    mut staging: Option<&mut (dyn Staging + '_)>,
    mut run: impl FnMut(&Op) -> Result<()>,
) -> Result<()> {
    let (c, chunks) = plan(op, chunk_bytes);
    for k in 0..chunks {
        let window = match staging.as_deref_mut() {
            Some(s) => s.inputs_ready(index, k)?,
            None => Vec::new(),
        };
        let chunk = if chunks == 1 { Cow::Borrowed(op) } else { Cow::Owned(chunk_op(op, c, k)) };
        if window.is_empty() {
            run(&chunk)?;
        } else {
            let moved = relocate(std::slice::from_ref(&chunk), &window).map_err(|e| ctx.annotate(e))?;
            run(&moved[0])?;
        }
        if let Some(s) = staging.as_deref_mut() {
            s.outputs_done(index, k)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::RawBuf;
    use crate::types::DType;

    #[test]
    fn chunks_cover_every_buffer_once() {
        let mut a = vec![0u8; 1000];
        let mut outs: Vec<Vec<u8>> = (0..3).map(|_| vec![0u8; 1000]).collect();
        let mut op = Op::new(OpKind::AllGather, DType::UInt8);
        op.inputs.push(RawBuf::from_slice(&mut a));
        op.outputs = outs.iter_mut().map(|o| RawBuf::from_slice(o)).collect();
        let (c, n) = plan(&op, 256);
        assert_eq!((c, n), (256, 4));
        let mut failures = crate::failures::Failures::new();
        let mut seen = vec![0u32; 1000];
        for k in 0..n {
            let sub = chunk_op(&op, c, k);
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
    fn relocation_moves_placeholders_only_and_checks_bounds() {
        let mut real = vec![0u8; 300];
        let host = real.as_mut_ptr() as usize;
        let base = 1usize << 60;
        let table = [Relocation { placeholder: base, bytes: 256, host }];
        let mut other = vec![0u8; 8];
        let mut op = Op::new(OpKind::AllGather, DType::UInt8);
        let placeholder = |offset: usize, len: usize| {
            // SAFETY: placeholders, never dereferenced; relocate reads their addresses only.
            unsafe { RawBuf::new((base + offset) as *mut u8, len) }
        };
        op.inputs.push(placeholder(64, 64));
        op.outputs.push(RawBuf::from_slice(&mut other));
        op.outputs.push(placeholder(128, 128));
        let moved = relocate(&[op.clone()], &table).unwrap();
        assert_eq!(moved[0].inputs[0].ptr() as usize, host + 64);
        assert_eq!(moved[0].inputs[0].len(), 64);
        assert_eq!(moved[0].outputs[0].ptr(), other.as_mut_ptr(), "a host buffer stays");
        assert_eq!(moved[0].outputs[1].ptr() as usize, host + 128);
        op.outputs[1] = placeholder(200, 64);
        let e = relocate(&[op], &table).unwrap_err();
        assert!(e.message.contains("offset 200"), "{}", e.message);
    }

    #[test]
    fn unchunked_kinds_and_small_ops_are_one_chunk() {
        let mut a = vec![0u8; 100];
        let mut op = Op::new(OpKind::AllReduce, DType::UInt8);
        op.outputs.push(RawBuf::from_slice(&mut a));
        assert_eq!(plan(&op, 256).1, 1);
        assert_eq!(plan(&op, 64).1, 2);
        let empty = Op::new(OpKind::AllReduce, DType::UInt8);
        assert_eq!(plan(&empty, 64), (usize::MAX, 1));
        op.kind = OpKind::AllToAll;
        assert_eq!(plan(&op, 64), (usize::MAX, 1));
        assert_eq!(chunk_count(0, 64), 1);
        assert_eq!(chunk_count(128, 64), 2);
        assert_eq!(chunk_count(129, 64), 3);
    }
}

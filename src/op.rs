//! An operation as the core sees it: plain buffers, a dtype, a reduction and a root — no torch.
//! The bridge turns every c10d call into one or more `Op`s. [`Op::validate`] checks the layout
//! before anything moves: it is what keeps the algorithms inside the caller's buffers.
//!
//! Buffer layout per kind (`in`/`out` are `inputs`/`outputs`; "views" are per-rank buffers):
//! ```text
//! AllReduce      out = [buf]                     in place
//! Broadcast      out = [buf]                     the root's is the source
//! Reduce         out = [buf]                     in place on the root; other ranks' unchanged
//! AllGather      in = [x]     out = size views, each len(x)
//! Gather         in = [x]     out = size views on the root, [] elsewhere
//! Scatter        in = size views on the root, [] elsewhere   out = [y], each view len(y)
//! ReduceScatter  in = size views, each len(y)    out = [y]
//! AllToAll       in = size views   out = size views   (any lengths; checked pairwise)
//! Barrier        nothing
//! Send           in = [x]     peer = destination
//! Recv           out = [y]    peer = source
//! RecvAnySource  out = [y]
//! ```

use crate::buf::{Buf, Extent, RawBuf};
use crate::error::{CommError, Result};
use crate::reduce::Reduction;
use crate::transport::MessageId;
use crate::types::{DType, OpKind, ReduceOp};

/// An operation on buffers of type `B`: [`RawBuf`] (host memory) for the algorithms, [`Buf`]
/// for a submitted job, whose buffers may be ranges of staged accelerator tensors.
#[derive(Clone, Debug)]
pub struct Op<B = RawBuf> {
    pub kind: OpKind,
    pub dtype: DType,
    pub reduce_op: ReduceOp,
    /// PREMUL_SUM's factor.
    pub premul_factor: f64,
    /// Root of rooted collectives; peer of send/recv.
    pub root: i64,
    /// Tag of point-to-point messages.
    pub tag: i64,
    pub inputs: Vec<B>,
    pub outputs: Vec<B>,
    /// Its host buffers are the pinned memory through which the job stages accelerator tensors
    /// (staging/): a broadcast's root lets its peers read them by cross-memory attach.
    pub staged: bool,
}

/// What every message of an op says it belongs to, and what each rank of a shared-memory group
/// writes about it, so that ranks running different ops fail instead of exchanging bytes. It is
/// the submitted op's ([`Op::identity`]): its chunks (pipeline.rs) and the levels of a
/// hierarchical collective run on parts of the op, or with a root renumbered for the level, but
/// announce the whole op as the group numbers it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpIdentity {
    pub kind: OpKind,
    pub dtype: DType,
    /// The reduction's ReduceOp code, else 0.
    pub reduce: u8,
    /// [`Op::count`].
    pub count: u64,
    /// [`Op::key`].
    pub key: i64,
}

impl OpIdentity {
    /// The identity message `seq` of this op carries; each transfer sets its own count (phases
    /// announce the agreed count, all-to-all each pair's, a confirmation none).
    pub fn message(&self, seq: u64) -> MessageId {
        MessageId { op: self.kind as u8, dtype: self.dtype as u8, reduce: self.reduce, seq, count: self.count, key: self.key }
    }
}

/// What a finished job reports back.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Completion {
    /// For receive-from-any-source: the rank the message came from; else -1.
    pub source_rank: i64,
}

impl<B: Extent> Op<B> {
    /// A bare op of `kind`; fill in the fields the kind needs.
    pub fn new(kind: OpKind, dtype: DType) -> Op<B> {
        Op {
            kind,
            dtype,
            reduce_op: ReduceOp::Sum,
            premul_factor: 1.0,
            root: 0,
            tag: 0,
            inputs: Vec::new(),
            outputs: Vec::new(),
            staged: false,
        }
    }

    pub fn reduction(&self, world_size: usize) -> Reduction {
        Reduction { dtype: self.dtype, op: self.reduce_op, world_size, premul_factor: self.premul_factor }
    }

    pub fn is_reduction(&self) -> bool {
        matches!(self.kind, OpKind::AllReduce | OpKind::Reduce | OpKind::ReduceScatter)
    }

    /// The element count every message of this collective announces and its receivers check:
    /// the per-rank piece (the input of a gather or a send, the output of the others); 0 for
    /// all-to-all, whose pieces differ per pair, and barrier.
    pub fn count(&self) -> u64 {
        let elems = |b: Option<&B>| b.map_or(0, |b| (b.len() / self.dtype.size()) as u64);
        match self.kind {
            OpKind::AllGather | OpKind::Gather | OpKind::Send => elems(self.inputs.first()),
            OpKind::AllToAll | OpKind::Barrier => 0,
            _ => elems(self.outputs.first()),
        }
    }

    /// The key every message of this op carries and its receivers check: the root of a rooted
    /// collective, the tag of a point-to-point message, else 0.
    pub fn key(&self) -> i64 {
        match self.kind {
            OpKind::Broadcast | OpKind::Reduce | OpKind::Gather | OpKind::Scatter => self.root,
            OpKind::Send | OpKind::Recv | OpKind::RecvAnySource => self.tag,
            OpKind::AllReduce | OpKind::AllGather | OpKind::ReduceScatter | OpKind::AllToAll | OpKind::Barrier => 0,
        }
    }

    /// What every message of this op, and its shared-memory description, say it belongs to.
    pub fn identity(&self) -> OpIdentity {
        OpIdentity {
            kind: self.kind,
            dtype: self.dtype,
            reduce: if self.is_reduction() { self.reduce_op as u8 } else { 0 },
            count: self.count(),
            key: self.key(),
        }
    }

    /// The length in bytes every buffer of a chunkable op has (the module table), which the
    /// pipeline cuts into chunks; `None` for ops that are not chunked: all-to-all (its buffers
    /// differ), barrier and point-to-point.
    pub fn piece_len(&self) -> Option<usize> {
        let first = match self.kind {
            OpKind::AllGather | OpKind::Gather => self.inputs.first(),
            OpKind::AllReduce | OpKind::Broadcast | OpKind::Reduce | OpKind::Scatter | OpKind::ReduceScatter => {
                self.outputs.first()
            }
            OpKind::AllToAll | OpKind::Barrier | OpKind::Send | OpKind::Recv | OpKind::RecvAnySource => return None,
        };
        first.map(|b| b.len())
    }

    /// Checks that buffers, root and dtype fit the kind (see the module table). The message
    /// starts with the op name; the caller adds rank and sequence number.
    pub fn validate(&self, rank: usize, size: usize) -> Result<()> {
        let name = self.kind.name();
        let esz = self.dtype.size();
        let bad = |m: String| Err(CommError::invalid(format!("{name}: {m}")));
        for b in self.inputs.iter().chain(self.outputs.iter()) {
            if b.len() % esz != 0 {
                return bad(format!("a buffer of {} bytes is not a whole number of {} elements", b.len(), self.dtype));
            }
        }
        if self.is_reduction() {
            if let Err(m) = self.reduction(size).validate() {
                return bad(m);
            }
        }
        let rooted = matches!(
            self.kind,
            OpKind::Broadcast | OpKind::Reduce | OpKind::Gather | OpKind::Scatter | OpKind::Send | OpKind::Recv
        );
        if rooted && (self.root < 0 || self.root as usize >= size) {
            let what = if self.kind.is_p2p() { "peer" } else { "root" };
            return bad(format!("{what} {} is not a rank of this group of {size}", self.root));
        }
        if matches!(self.kind, OpKind::Send | OpKind::Recv) && self.root as usize == rank {
            return bad(format!("rank {rank} cannot {name} to or from itself"));
        }
        let is_root = self.root >= 0 && self.root as usize == rank;
        let (n_in, n_out) = (self.inputs.len(), self.outputs.len());
        let want = |inputs: usize, outputs: usize| -> Result<()> {
            if n_in != inputs || n_out != outputs {
                return Err(CommError::invalid(format!(
                    "{name}: expected {inputs} input and {outputs} output buffers, got {n_in} and {n_out}"
                )));
            }
            Ok(())
        };
        let equal_views = |views: &[B], len: usize, what: &str| -> Result<()> {
            for (r, v) in views.iter().enumerate() {
                if v.len() != len {
                    return Err(CommError::invalid(format!(
                        "{name}: {what} for rank {r} has {} elements, expected {}",
                        v.len() / esz,
                        len / esz
                    )));
                }
            }
            Ok(())
        };
        match self.kind {
            OpKind::AllReduce | OpKind::Broadcast | OpKind::Reduce => want(0, 1),
            OpKind::AllGather => {
                want(1, size)?;
                equal_views(&self.outputs, self.inputs[0].len(), "output")
            }
            OpKind::Gather => {
                want(1, if is_root { size } else { 0 })?;
                equal_views(&self.outputs, self.inputs[0].len(), "output")
            }
            OpKind::Scatter => {
                want(if is_root { size } else { 0 }, 1)?;
                equal_views(&self.inputs, self.outputs[0].len(), "input")
            }
            OpKind::ReduceScatter => {
                want(size, 1)?;
                equal_views(&self.inputs, self.outputs[0].len(), "input")
            }
            OpKind::AllToAll => {
                want(size, size)?;
                if self.inputs[rank].len() != self.outputs[rank].len() {
                    return bad(format!(
                        "rank {rank} sends itself {} elements but expects {}",
                        self.inputs[rank].len() / esz,
                        self.outputs[rank].len() / esz
                    ));
                }
                Ok(())
            }
            OpKind::Barrier => want(0, 0),
            OpKind::Send => want(1, 0),
            OpKind::Recv | OpKind::RecvAnySource => want(0, 1),
        }
    }

    /// The same op on other buffers: `f` maps each input and output.
    pub fn map_bufs<C>(&self, mut f: impl FnMut(&B) -> Result<C>) -> Result<Op<C>> {
        Ok(Op {
            kind: self.kind,
            dtype: self.dtype,
            reduce_op: self.reduce_op,
            premul_factor: self.premul_factor,
            root: self.root,
            tag: self.tag,
            inputs: self.inputs.iter().map(&mut f).collect::<Result<_>>()?,
            outputs: self.outputs.iter().map(&mut f).collect::<Result<_>>()?,
            staged: self.staged,
        })
    }
}

impl Op<Buf> {
    /// The op on its host buffers; an error when one is a staged range (a job without staging
    /// cannot run it).
    pub fn host(&self) -> Result<Op> {
        self.map_bufs(|b| match b {
            Buf::Host(raw) => Ok(*raw),
            Buf::Staged { .. } => Err(CommError::invalid(
                "internal error (please report): a staged buffer in a job without staging",
            )),
        })
    }
}

impl From<&Op> for Op<Buf> {
    fn from(op: &Op) -> Op<Buf> {
        op.map_bufs(|b| Ok(Buf::Host(*b))).expect("mapping host buffers cannot fail")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The identity names what receivers check: a reduction's op, a rooted op's root, a
    /// point-to-point op's tag, and the per-rank piece as the count.
    #[test]
    fn identity_carries_what_receivers_check() {
        let (mut piece, mut whole) = (vec![0u8; 8], vec![0u8; 24]);
        let mut reduce: Op = Op::new(OpKind::ReduceScatter, DType::Float32);
        reduce.reduce_op = ReduceOp::Max;
        reduce.inputs.push(RawBuf::from_slice(&mut whole));
        reduce.outputs.push(RawBuf::from_slice(&mut piece));
        let id = reduce.identity();
        assert_eq!((id.kind, id.dtype, id.reduce, id.count, id.key), (OpKind::ReduceScatter, DType::Float32, ReduceOp::Max as u8, 2, 0));

        let mut broadcast: Op = Op { root: 3, reduce_op: ReduceOp::Max, ..Op::new(OpKind::Broadcast, DType::Float32) };
        broadcast.outputs.push(RawBuf::from_slice(&mut whole));
        let id = broadcast.identity();
        assert_eq!((id.reduce, id.count, id.key), (0, 6, 3));

        let mut send: Op = Op { root: 1, tag: 7, ..Op::new(OpKind::Send, DType::UInt8) };
        send.inputs.push(RawBuf::from_slice(&mut piece));
        let message = send.identity().message(5);
        assert_eq!((message.op, message.seq, message.count, message.key), (OpKind::Send as u8, 5, 8, 7));
    }
}

//! Point-to-point messages. They take no collective sequence number (ranks that are not
//! involved never see them); instead each ordered pair of ranks numbers its messages, and a
//! frame carries that number and the tag, so a receive matches the sender's send exactly or
//! fails with a clear error. Like gloo, a send completes once its bytes are handed to the
//! connection: when the receiver rejects them, it aborts the group, and the sender learns it
//! at its next operation (or, for a message larger than the socket buffers, at once). A batch (from `batch_isend_irecv`, or ops between startCoalescing
//! and endCoalescing) goes to the transport as one phase, so a ring of large sends and receives
//! cannot deadlock.

use crate::error::Result;
use crate::op::{Completion, Op};
use crate::transport::{Direction, MessageId, OpCtx, Transfer, Transport};
use crate::types::OpKind;

/// Per-pair message numbers of one rank.
pub struct P2pCounters {
    pub sent: Vec<u64>,
    pub received: Vec<u64>,
}

impl P2pCounters {
    pub fn new(size: usize) -> Self {
        P2pCounters { sent: vec![0; size], received: vec![0; size] }
    }
}

/// The identity of message `seq` of a pair (the payload's length is its buffer's).
fn message(op: &Op, seq: u64) -> MessageId {
    // Both sides name the message by the sender's op, so a receive expects a Send message.
    MessageId { op: OpKind::Send as u8, ..op.identity().message(seq) }
}

/// Runs a batch of sends and receives with known peers as one phase.
pub fn run_batch(transport: &mut dyn Transport, ops: &[Op], counters: &mut P2pCounters, ctx: &OpCtx) -> Result<()> {
    let mut transfers = Vec::with_capacity(ops.len());
    for op in ops {
        let peer = op.root as usize;
        let (dir, seq, buf) = match op.kind {
            OpKind::Send => (Direction::Send, &mut counters.sent[peer], op.inputs[0]),
            OpKind::Recv => (Direction::Recv, &mut counters.received[peer], op.outputs[0]),
            other => unreachable!("{} is not a batched point-to-point op", other.name()),
        };
        transfers.push(Transfer { peer, dir, id: message(op, *seq), buf });
        *seq += 1;
    }
    transport.exchange(&transfers, ctx)
}


/// Receives one message from whichever rank sends a matching one first.
pub fn recv_any(transport: &mut dyn Transport, op: &Op, counters: &mut P2pCounters, ctx: &OpCtx) -> Result<Completion> {
    let tag = op.tag;
    let received = &counters.received;
    // A candidate is a peer whose next message is its next one to us, with our tag (the
    // transport offers data messages only: aborts fail the probe).
    let accept = |peer: usize, id: &MessageId| id.op == OpKind::Send as u8 && id.key == tag && id.seq == received[peer];
    let peer = transport.probe_any(&accept, ctx)?;
    let seq = counters.received[peer];
    let transfer = Transfer { peer, dir: Direction::Recv, id: message(op, seq), buf: op.outputs[0] };
    counters.received[peer] += 1;
    transport.exchange(&[transfer], ctx)?;
    Ok(Completion { source_rank: peer as i64 })
}

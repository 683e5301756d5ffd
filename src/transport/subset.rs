//! A transport over some ranks of another: `members[i]` of the inner transport is rank i of
//! this one, so an algorithm written for a whole group (algorithms/*_direct.rs) runs unchanged
//! among, say, the leaders of a hierarchical collective. Peers are mapped on the way in and
//! back; messages, their identities and error messages are the inner transport's, so errors name the
//! group's ranks, not the subset's indices.
//!
//! The inner transport still watches every connection during a phase, including those to ranks
//! outside the subset: an abort from any rank of the group fails the phase at once.

use super::{MessageId, OpCtx, Transfer, Transport};
use crate::error::{CommError, Result};

pub struct Subset<'a> {
    inner: &'a mut dyn Transport,
    members: &'a [usize],
    rank: usize,
}

impl<'a> Subset<'a> {
    /// The subset `members` (ranks of `inner`, distinct) in which this rank is `members[rank]`.
    pub fn new(inner: &'a mut dyn Transport, members: &'a [usize], rank: usize) -> Subset<'a> {
        debug_assert_eq!(members[rank], inner.rank(), "this rank must be the subset's member `rank`");
        Subset { inner, members, rank }
    }

    fn index_of(&self, inner_rank: usize) -> Option<usize> {
        self.members.iter().position(|&m| m == inner_rank)
    }
}

impl Transport for Subset<'_> {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.members.len()
    }

    fn exchange(&mut self, transfers: &[Transfer], ctx: &OpCtx) -> Result<()> {
        let mut mapped = Vec::with_capacity(transfers.len());
        for t in transfers {
            let peer = *self.members.get(t.peer).ok_or_else(|| {
                CommError::invalid(format!("{}: transfer to invalid peer {} of a subset of {}", ctx.describe(), t.peer, self.members.len()))
            })?;
            mapped.push(Transfer { peer, ..*t });
        }
        self.inner.exchange(&mapped, ctx)
    }

    fn probe_any(&mut self, accept: &dyn Fn(usize, &MessageId) -> bool, ctx: &OpCtx) -> Result<usize> {
        let members = self.members;
        let accept_member = |p: usize, h: &MessageId| members.iter().position(|&m| m == p).is_some_and(|i| accept(i, h));
        let p = self.inner.probe_any(&accept_member, ctx)?;
        Ok(self.index_of(p).expect("probe_any accepted only members"))
    }

    /// A failure is the whole group's: every rank of the inner transport is told.
    fn abort(&mut self, ctx: &OpCtx, message: &str) {
        self.inner.abort(ctx, message);
    }

    /// The connections belong to the inner transport, which outlives this view.
    fn close(&mut self) {}
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;
    use crate::transport::{Direction, RawBuf};
    use crate::types::OpKind;

    /// Records what reaches the inner transport; `probe_any` offers peers 0..size in order.
    struct Recorder {
        rank: usize,
        size: usize,
        peers_seen: Vec<usize>,
        aborted: bool,
    }

    impl Transport for Recorder {
        fn rank(&self) -> usize {
            self.rank
        }
        fn size(&self) -> usize {
            self.size
        }
        fn exchange(&mut self, transfers: &[Transfer], _ctx: &OpCtx) -> Result<()> {
            self.peers_seen.extend(transfers.iter().map(|t| t.peer));
            Ok(())
        }
        fn probe_any(&mut self, accept: &dyn Fn(usize, &MessageId) -> bool, _ctx: &OpCtx) -> Result<usize> {
            let h = MessageId::default();
            (0..self.size).find(|&p| p != self.rank && accept(p, &h)).ok_or_else(|| CommError::invalid("none"))
        }
        fn abort(&mut self, _ctx: &OpCtx, _message: &str) {
            self.aborted = true;
        }
        fn close(&mut self) {}
    }

    fn ctx() -> OpCtx {
        OpCtx { op: OpKind::AllReduce, seq: 0, rank: 3, deadline: Instant::now() + Duration::from_secs(1), timeout: Duration::from_secs(1), abort: None }
    }

    #[test]
    fn maps_peers_both_ways() {
        let mut inner = Recorder { rank: 3, size: 6, peers_seen: Vec::new(), aborted: false };
        let members = [1, 3, 5];
        let mut sub = Subset::new(&mut inner, &members, 1);
        assert_eq!((sub.rank(), sub.size()), (1, 3));
        let t = |peer| Transfer { peer, dir: Direction::Send, id: MessageId::default(), buf: RawBuf::from_slice(&mut []) };
        sub.exchange(&[t(0), t(2)], &ctx()).unwrap();
        assert!(sub.exchange(&[t(3)], &ctx()).is_err(), "index 3 is outside a subset of 3");
        // Inner ranks 0, 2 and 4 are not members: the first member offered is rank 1, index 0;
        // refusing index 0 leaves rank 5, index 2.
        assert_eq!(sub.probe_any(&|_, _| true, &ctx()).unwrap(), 0);
        assert_eq!(sub.probe_any(&|i, _| i != 0, &ctx()).unwrap(), 2);
        sub.abort(&ctx(), "x");
        assert_eq!(inner.peers_seen, vec![1, 5]);
        assert!(inner.aborted);
    }
}

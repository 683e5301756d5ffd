//! A transport over some ranks of another: `members[i]` of the inner transport is rank i of
//! this one, so an algorithm written for a whole group (algorithms/*_direct.rs) runs unchanged
//! among, say, the leaders of a hierarchical collective. Peers are mapped on the way in and
//! back; frames, headers and error messages are the inner transport's, so errors name the
//! group's ranks, not the subset's indices.
//!
//! The inner transport still watches every connection during a phase, including those to ranks
//! outside the subset: an abort from any rank of the group fails the phase at once.

use super::{Header, OpCtx, Transfer, Transport};
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

    fn probe_any(&mut self, accept: &dyn Fn(usize, &Header) -> bool, ctx: &OpCtx) -> Result<usize> {
        let members = self.members;
        let accept_member = |p: usize, h: &Header| members.iter().position(|&m| m == p).is_some_and(|i| accept(i, h));
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

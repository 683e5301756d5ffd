//! Who to blame when a TCP group times out.
//!
//! A stopped rank (SIGSTOP, a hung driver, a pulled cable) sends nothing, so it cannot say it is
//! stuck; the ranks waiting for it time out. But ranks waiting for *those* ranks time out at about
//! the same moment, and each would blame whom it waits for: in a broadcast from rank 0, with rank
//! 3 stopped, rank 0 waits for 3 while ranks 1 and 2 wait for 0, and whoever times out first tells
//! the group its own view. So a rank that times out does not fail at once. It starts a *timeout
//! round*: it sends every peer a timeout notice (frame.rs) listing the ranks it still waits for,
//! stops sending data, and listens for the peers' notices for a short grace. A rank that hears a
//! notice starts its own round the same way. A rank that answers is alive; the ranks that are
//! waited for, by anyone who answered, and never answer themselves are the ones stuck (or whose
//! link is down). Every rank ends its round after the grace (sooner, when everyone it suspects has
//! answered) with an error naming them.

use std::time::{Duration, Instant};

use crate::error::{CommError, ErrorKind};
use crate::transport::OpCtx;

/// How long a rank listens for its peers' notices. Long enough for a notice to cross a loaded
/// machine or a network; short against any timeout, and the error comes this much later.
pub const NOTICE_GRACE: Duration = Duration::from_millis(500);

pub struct TimeoutRound {
    me: usize,
    /// The ranks this rank still waited for when the round began.
    mine: Vec<usize>,
    /// What the error says before the blame: this rank's own timeout, or the notice that began
    /// the round.
    cause: String,
    kind: ErrorKind,
    /// peer → the ranks its notice listed, once it answered (alive).
    heard: Vec<Option<Vec<usize>>>,
    /// Peers whose connection closed during the round (dead, not stuck).
    closed: Vec<bool>,
    pub until: Instant,
}

impl TimeoutRound {
    /// A round that begins with this rank's own timeout; `cause` is the timeout's message.
    pub fn after_timeout(me: usize, size: usize, mine: Vec<usize>, cause: String, now: Instant) -> TimeoutRound {
        TimeoutRound::new(me, size, mine, cause, ErrorKind::Timeout, now)
    }

    /// A round that begins with `peer`'s notice that it waits for `waits`.
    pub fn after_notice(me: usize, size: usize, mine: Vec<usize>, peer: usize, waits: &[usize], ctx: &OpCtx, now: Instant) -> TimeoutRound {
        let cause = format!("{}: rank {peer} timed out waiting for ranks {waits:?}", ctx.describe());
        let mut round = TimeoutRound::new(me, size, mine, cause, ErrorKind::PeerFailure, now);
        round.hear(peer, waits.to_vec());
        round
    }

    fn new(me: usize, size: usize, mine: Vec<usize>, cause: String, kind: ErrorKind, now: Instant) -> TimeoutRound {
        TimeoutRound { me, mine, cause, kind, heard: vec![None; size], closed: vec![false; size], until: now + NOTICE_GRACE }
    }

    /// The ranks this rank's own notice lists.
    pub fn waits(&self) -> &[usize] {
        &self.mine
    }

    pub fn hear(&mut self, peer: usize, waits: Vec<usize>) {
        self.heard[peer] = Some(waits);
    }

    pub fn closed(&mut self, peer: usize) {
        self.closed[peer] = true;
    }

    pub fn answered(&self, peer: usize) -> bool {
        self.heard[peer].is_some() || self.closed[peer]
    }

    /// Ranks waited for by this rank or by anyone who answered, and the closed ones.
    fn suspects(&self) -> Vec<bool> {
        let mut s = self.closed.clone();
        for &r in self.mine.iter().chain(self.heard.iter().flatten().flatten()) {
            s[r] = true;
        }
        s[self.me] = false;
        s
    }

    /// Whether every suspect has answered or closed: waiting longer teaches nothing.
    pub fn settled(&self) -> bool {
        self.suspects().iter().enumerate().all(|(r, &s)| !s || self.answered(r))
    }

    /// The suspects that never answered, and the closed ones: the ranks to name.
    pub fn culprits(&self) -> Vec<usize> {
        let s = self.suspects();
        (0..s.len()).filter(|&r| s[r] && (self.closed[r] || self.heard[r].is_none())).collect()
    }

    pub fn error(&self) -> CommError {
        let culprits = self.culprits();
        let alive: Vec<usize> = (0..self.heard.len()).filter(|&r| self.heard[r].is_some()).collect();
        let mut msg = self.cause.clone();
        if self.kind != ErrorKind::Timeout && !culprits.is_empty() {
            // Begun by a notice: what the round found is this rank's whole view.
            msg += &format!("; ranks not heard from: {culprits:?}");
        } else if !culprits.is_empty() && culprits != self.mine {
            msg += &format!("; the group's timeout notices show that ranks {culprits:?} stopped answering");
            if !alive.is_empty() {
                msg += &format!(" (ranks {alive:?} answered: alive, and waiting too)");
            }
        }
        msg += " (is a rank stuck, dead, or in a different collective?)";
        CommError::new(self.kind, msg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round(me: usize, mine: Vec<usize>) -> TimeoutRound {
        TimeoutRound::after_timeout(me, 4, mine, "timed out".into(), Instant::now())
    }

    #[test]
    fn a_rank_waiting_for_a_waiting_rank_blames_whom_that_one_waits_for() {
        // Rank 1 waits for the root 0, which waits for the stopped rank 3.
        let mut r = round(1, vec![0]);
        assert!(!r.settled());
        r.hear(0, vec![3]);
        assert!(!r.settled(), "rank 3 may still answer");
        assert_eq!(r.culprits(), vec![3]);
        assert!(r.error().message.contains("ranks [3] stopped answering"), "{}", r.error().message);
        r.hear(2, vec![0]);
        assert_eq!(r.culprits(), vec![3]);
    }

    #[test]
    fn with_no_answer_the_ranks_waited_for_are_named() {
        let r = round(0, vec![3]);
        assert_eq!(r.culprits(), vec![3]);
        assert!(!r.error().message.contains("notices"), "nothing learnt, nothing added");
    }

    #[test]
    fn everyone_answering_settles_the_round() {
        // Ranks waiting for each other (a cycle: different collectives) all answer.
        let mut r = round(0, vec![1]);
        r.hear(1, vec![0]);
        assert!(r.settled());
        assert!(r.culprits().is_empty());
    }

    #[test]
    fn a_closed_peer_is_named_and_settles() {
        let mut r = round(0, vec![2]);
        r.closed(2);
        assert!(r.settled());
        assert_eq!(r.culprits(), vec![2]);
    }

    #[test]
    fn a_round_begun_by_a_notice_reports_a_peer_failure() {
        let ctx = OpCtx {
            op: crate::types::OpKind::Broadcast,
            seq: 5,
            rank: 2,
            deadline: Instant::now(),
            timeout: Duration::from_secs(1),
            abort: None,
        };
        let r = TimeoutRound::after_notice(2, 4, vec![], 0, &[3], &ctx, Instant::now());
        assert_eq!(r.culprits(), vec![3]);
        let e = r.error();
        assert_eq!(e.kind, ErrorKind::PeerFailure);
        assert!(e.message.contains("rank 0 timed out waiting for ranks [3]; ranks not heard from: [3]"), "{}", e.message);
    }
}

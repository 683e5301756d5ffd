//! Links on demand: which connections a rank makes, and when.
//!
//! A rank does not connect to every other rank. At set-up it links only to its *eager* peers
//! (the fabric's choice: peers.rs), and every other link is made on *first use*: when a phase
//! names a peer it has no link to, the rank dials it inside the phase's own poll loop, while the
//! phase's other transfers go on. A rank listens for the group's whole life, and every loop it
//! runs (set-up, a phase, a probe) also takes the connections of peers dialing it, so a peer
//! that needs this rank is never kept waiting by a rank that is busy elsewhere.
//!
//! Who dials: at set-up, of two eager peers the higher rank dials; afterwards, whichever rank
//! needs the link first. Two ranks that need each other at the same moment both dial; the
//! handshake's verdict (handshake.rs) keeps the higher rank's connection and both sides learn
//! it before a frame crosses, so each pair ends with exactly one link. A dial that lost such a
//! crossing waits for the peer's connection; how long is the caller's deadline.
//!
//! Every link, eager or not, passes the same handshake (the group's secret, both ways).

use std::net::{SocketAddr, TcpListener};
use std::time::{Duration, Instant};

use super::accept::{Acceptor, Terms, Verdict};
use super::connect::{Dial, DialEvent, MeshSpec, advertised_host, listen_on, terms};
use super::handshake::{Link, Secret};
use super::socket;
use crate::error::{CommError, Result};
use crate::keys::Key;
use crate::rendezvous::{Store, parse_address, rendezvous_error};

pub(crate) struct Linker {
    rank: usize,
    size: usize,
    secret: Secret,
    flags: u16,
    handshake_timeout: Duration,
    listener: TcpListener,
    /// Every peer's published address (`None` for this rank).
    addrs: Vec<Option<SocketAddr>>,
    acceptor: Acceptor,
    dials: Vec<Dial>,
    /// The pair's link exists (it was handed out).
    linked: Vec<bool>,
    /// This rank's dial lost a crossing: the peer's own connection is on its way.
    awaited: Vec<bool>,
    /// Where this loop's poll entries start, and how many the acceptor has.
    entries: (usize, usize),
}

impl Linker {
    /// Listens and publishes this rank's address.
    pub fn new(spec: &MeshSpec<'_>) -> Result<Linker> {
        let (rank, size) = (spec.rank, spec.size);
        let host = advertised_host(spec.socket_host);
        let listener = listen_on(&host)?;
        let port = listener.local_addr().map_err(|e| CommError::io(e.to_string()))?.port();
        spec.store.set(&Key::Address(rank).text(), format!("{host}:{port}").as_bytes())?;
        let addrs = vec![None; size];
        let t = terms(spec);
        Ok(Linker {
            rank,
            size,
            secret: spec.secret.clone(),
            flags: t.flags,
            handshake_timeout: t.handshake_timeout,
            listener,
            addrs,
            acceptor: Acceptor::default(),
            dials: Vec::new(),
            linked: vec![false; size],
            awaited: vec![false; size],
            entries: (0, 0),
        })
    }


    /// Reads the published addresses of `peers` not known yet (waiting, until `deadline`, for
    /// a rank that has not published: each publishes before it reads any).
    pub fn learn_addresses(&mut self, store: &dyn Store, peers: &[usize], deadline: Instant) -> Result<()> {
        for &peer in peers.iter().filter(|&&p| p != self.rank) {
            if self.addrs[peer].is_some() {
                continue;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            let raw = store.get(&Key::Address(peer).text(), left).map_err(|e| rendezvous_error(self.rank, peer, e))?;
            let parsed = parse_address(&raw).map_err(|m| CommError::io(format!("rank {peer} published an unusable address: {m}")))?;
            self.addrs[peer] = Some(parsed);
        }
        Ok(())
    }

    /// Starts dialing `peer`, unless the pair has a link, a dial, or the peer's dial is coming.
    pub fn dial(&mut self, peer: usize) {
        if peer == self.rank || self.linked[peer] || self.awaited[peer] || self.dials.iter().any(|d| d.peer == peer) {
            return;
        }
        let addr = self.addrs[peer].expect("addresses are learnt at set-up");
        tracing::debug!(rank = self.rank, peer, "dialing");
        self.dials.push(Dial::new(peer, addr));
    }

    /// Appends this rank's poll entries (the listener, incoming handshakes, dials) to `fds`,
    /// after dropping the incoming handshakes that ran out of time. Returns when the linker
    /// wants to run again without an event (a handshake's expiry, a dial's retry).
    pub fn push_fds(&mut self, fds: &mut Vec<libc::pollfd>) -> Option<Instant> {
        let now = Instant::now();
        // A dial crossed by the peer's, which this rank accepted, ends now (the peer, dialing
        // too, takes its close quietly).
        let linked = &self.linked;
        self.dials.retain(|d| !linked[d.peer]);
        let expiry = self.acceptor.expire(self.rank, now);
        let start = fds.len();
        self.acceptor.push_fds(&self.listener, fds);
        let accepting = fds.len() - start;
        for d in &self.dials {
            let (fd, events) = d.poll_entry().unwrap_or((-1, 0));
            fds.push(libc::pollfd { fd, events, revents: 0 });
        }
        self.entries = (start, accepting);
        let retry = self.dials.iter().filter_map(Dial::retry_at).min();
        [expiry, retry].into_iter().flatten().min()
    }

    /// After a poll over the entries of [`push_fds`](Self::push_fds): moves every handshake
    /// on and returns the links that came up. `Err`: a peer that cannot be linked to.
    pub fn progress(&mut self, fds: &[libc::pollfd]) -> Result<Vec<(usize, Link)>> {
        let (start, accepting) = self.entries;
        let now = Instant::now();
        let mut links = Vec::new();

        // Dials first: a crossing is settled by the verdicts, whatever the order.
        let dial_fds = &fds[start + accepting..];
        let dials = std::mem::take(&mut self.dials);
        let mut kept = Vec::with_capacity(dials.len());
        let terms = Terms { rank: self.rank, size: self.size, secret: &self.secret, flags: self.flags, handshake_timeout: self.handshake_timeout };
        let mut outcome = Ok(());
        for (i, mut d) in dials.into_iter().enumerate() {
            let ready = dial_fds.get(i).is_some_and(|f| f.revents != 0);
            let due = d.retry_at().is_some_and(|t| t <= now);
            if outcome.is_err() || !(ready || due) {
                kept.push(d);
                continue;
            }
            match d.step(&terms, now) {
                Ok(DialEvent::Waiting) => kept.push(d),
                Ok(DialEvent::Linked(link)) => links.push((d.peer, link)),
                Ok(DialEvent::Superseded) => {
                    tracing::debug!(rank = self.rank, peer = d.peer, "crossed dial: the peer's connection wins");
                    self.awaited[d.peer] = true;
                }
                Err(e) => outcome = Err(e),
            }
        }
        self.dials = kept;
        outcome?;
        for (peer, _) in &links {
            if self.linked[*peer] {
                return Err(CommError::io(format!("rank {} and rank {peer} linked twice (please report)", self.rank)));
            }
            self.linked[*peer] = true;
        }

        let (rank, linked, dials) = (self.rank, &self.linked, &self.dials);
        let mut decide = |from: usize| {
            // The higher rank's connection wins a crossing, whether it is still dialing or
            // already linked (its dial's verdict came first).
            let mine = linked[from] || dials.iter().any(|d| d.peer == from);
            if rank > from && mine {
                Verdict::KeepMine
            } else if linked[from] {
                Verdict::Duplicate
            } else {
                Verdict::Accept
            }
        };
        let accepted = self.acceptor.progress(&self.listener, &fds[start..start + accepting], &terms, &mut decide)?;
        for (peer, _) in &accepted {
            if self.linked[*peer] {
                return Err(CommError::io(format!("rank {peer} connected to rank {} twice", self.rank)));
            }
            self.linked[*peer] = true;
            // A lower rank's own dial, crossed by this one, will hear keep-mine and end.
        }
        links.extend(accepted);
        for (_, link) in &links {
            let s = &link.stream;
            s.set_read_timeout(None).ok();
            s.set_write_timeout(None).ok();
            s.set_nodelay(true).and_then(|_| s.set_nonblocking(true)).map_err(|e| CommError::io(e.to_string()))?;
        }
        Ok(links)
    }

    /// Why there is no link to `peer` yet, for a timeout's message.
    pub fn why_unlinked(&self, peer: usize) -> String {
        match self.dials.iter().find(|d| d.peer == peer) {
            Some(Dial { last_error: Some(why), .. }) => format!("rank {} could not connect to rank {peer}: {why}", self.rank),
            Some(_) => format!("rank {peer} did not answer rank {}'s connection", self.rank),
            None => format!("rank {peer} never connected to rank {}", self.rank),
        }
    }

    /// Set-up: links to every peer of `eager` (which must be the same relation on every rank:
    /// rank a lists b exactly when b lists a). Of each pair the higher rank dials. Links that
    /// other peers open meanwhile (on first use) are returned too.
    pub fn establish(&mut self, store: &dyn Store, eager: &[usize], deadline: Instant) -> Result<Vec<(usize, Link)>> {
        let lower: Vec<usize> = eager.iter().copied().filter(|&p| p < self.rank).collect();
        self.learn_addresses(store, &lower, deadline)?;
        for peer in lower {
            self.dial(peer);
        }
        let mut links = Vec::new();
        let mut fds = Vec::new();
        loop {
            let missing: Vec<usize> = eager.iter().copied().filter(|&p| !self.linked[p]).collect();
            if missing.is_empty() {
                return Ok(links);
            }
            let now = Instant::now();
            if now >= deadline {
                let dials: Vec<String> =
                    missing.iter().filter(|&&p| p < self.rank).map(|&p| self.why_unlinked(p)).collect();
                let mut msg = format!("rank {} timed out waiting for ranks {missing:?} to connect and authenticate", self.rank);
                if !dials.is_empty() {
                    msg += &format!(" ({})", dials.join("; "));
                }
                return Err(CommError::timeout(msg));
            }
            fds.clear();
            let wake = self.push_fds(&mut fds).map_or(deadline, |w| w.min(deadline));
            let wait = wake.saturating_duration_since(now).min(Duration::from_millis(100));
            socket::poll(&mut fds, wait.as_millis().max(1) as i32)
                .map_err(|e| CommError::io(format!("poll failed while rank {} connected: {e}", self.rank)))?;
            links.extend(self.progress(&fds)?);
        }
    }
}

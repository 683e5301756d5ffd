//! The accepting side of the links: takes the connections of peers that dial this rank and
//! authenticates each (handshake.rs). A rank listens for the group's whole life, so a peer may
//! dial it at set-up or on first use (linker.rs); the [`Acceptor`] runs inside whatever loop
//! the rank is in (set-up, an exchange, a probe).
//!
//! Anyone who can reach the port can connect, so no connection is trusted or waited on alone.
//! Every handshake runs at once, non-blocking, in one `poll(2)` loop, each with a short deadline
//! of its own: a stranger that says nothing, says garbage, or replays a recorded handshake only
//! ever holds its own connection, which is closed (and logged with its address) when it fails
//! or runs out of time. Real peers are never kept waiting behind it.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::handshake::{
    CHALLENGE_LEN, Challenge, HELLO_LEN, Hello, Link, PROOF_LEN, Secret, Transcript, VERDICT_ACCEPT, VERDICT_KEEP_MINE,
    decode_proof, flags_mismatch, random_nonce,
};
use super::socket;
use crate::error::{CommError, Result};

/// At most this many handshakes are in progress; a new connection beyond it pushes out the
/// oldest (a real peer that loses its place reconnects: connect.rs).
pub const MAX_PENDING: usize = 256;

/// What the accepting rank checks handshakes against.
#[derive(Clone, Copy)]
pub struct Terms<'a> {
    pub rank: usize,
    pub size: usize,
    pub secret: &'a Secret,
    /// This rank's link flags (handshake.rs): a peer with other flags is an error.
    pub flags: u16,
    /// How long one connection may take to authenticate.
    pub handshake_timeout: Duration,
}

/// What the acceptor answers a peer that proved it knows the secret (handshake.rs: VERDICT).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// This connection becomes the pair's link.
    Accept,
    /// This rank dials the peer too and, being the higher rank, keeps its own connection.
    KeepMine,
    /// The pair already has a link: a second one is refused.
    Duplicate,
}

pub struct AcceptSpec<'a> {
    pub rank: usize,
    pub size: usize,
    pub secret: &'a Secret,
    /// This rank's link flags (handshake.rs): a peer with other flags is an error.
    pub flags: u16,
    /// When the group's set-up times out.
    pub deadline: Instant,
    /// How long one connection may take to authenticate.
    pub handshake_timeout: Duration,
    /// Set by the connecting side when it failed: stop accepting.
    pub stop: &'a AtomicBool,
}

/// Where one incoming handshake stands.
enum Step {
    ReadHello { buf: [u8; HELLO_LEN], got: usize },
    SendChallenge { bytes: [u8; CHALLENGE_LEN], sent: usize, transcript: Transcript },
    ReadProof { buf: [u8; PROOF_LEN], got: usize, transcript: Transcript },
}

struct Pending {
    stream: TcpStream,
    addr: SocketAddr,
    until: Instant,
    step: Step,
}

impl Pending {
    /// The rank its hello named, once the hello passed.
    fn from(&self) -> Option<usize> {
        match &self.step {
            Step::ReadHello { .. } => None,
            Step::SendChallenge { transcript, .. } | Step::ReadProof { transcript, .. } => Some(transcript.from as usize),
        }
    }
}

/// What one readiness event did to a handshake.
enum Progress {
    Waiting,
    Authenticated {
        from: usize,
        frame_key: [u8; 32],
    },
    /// A real peer whose connection loses to the one this rank dials (keep-mine was sent).
    Superseded,
    Refused(String),
    /// A real peer (it proved the secret) configured differently: the group cannot form.
    Mismatch(String),
}

/// The handshakes a listening rank has in progress.
#[derive(Default)]
pub struct Acceptor {
    pending: Vec<Pending>,
}

impl Acceptor {
    /// Closes the handshakes that ran out of time; returns when the next one will.
    pub fn expire(&mut self, rank: usize, now: Instant) -> Option<Instant> {
        self.pending.retain(|p| {
            let alive = now < p.until;
            if !alive {
                refuse(rank, p.addr, "it did not complete the handshake in time");
            }
            alive
        });
        self.pending.iter().map(|p| p.until).min()
    }

    /// Appends the listener's and every handshake's poll entry (in that order).
    pub fn push_fds(&self, listener: &TcpListener, fds: &mut Vec<libc::pollfd>) {
        fds.push(libc::pollfd { fd: listener.as_raw_fd(), events: libc::POLLIN, revents: 0 });
        for p in &self.pending {
            let events = if matches!(p.step, Step::SendChallenge { .. }) { libc::POLLOUT } else { libc::POLLIN };
            fds.push(libc::pollfd { fd: p.stream.as_raw_fd(), events, revents: 0 });
        }
    }

    /// Moves the handshakes on after a poll: `fds` are the entries [`push_fds`](Self::push_fds)
    /// appended. `decide` answers each peer that proved the secret. Returns the new links.
    pub fn progress(
        &mut self,
        listener: &TcpListener,
        fds: &[libc::pollfd],
        terms: &Terms<'_>,
        decide: &mut dyn FnMut(usize) -> Verdict,
    ) -> Result<Vec<(usize, Link)>> {
        let mut links = Vec::new();
        let mut keep = Vec::with_capacity(self.pending.len());
        // Handshakes first (their entries follow the listener's), then new arrivals.
        for (mut p, fd) in self.pending.drain(..).zip(fds[1..].iter()) {
            if fd.revents == 0 {
                keep.push(p);
                continue;
            }
            match advance(&mut p, terms, decide) {
                Progress::Waiting => keep.push(p),
                Progress::Superseded => tracing::debug!(rank = terms.rank, addr = %p.addr, "crossed dial: kept ours"),
                // A rank this one dials too, or is linked to, may drop its crossing dial.
                Progress::Refused(why) if p.from().is_some_and(|from| decide(from) != Verdict::Accept) => {
                    tracing::debug!(rank = terms.rank, addr = %p.addr, why, "crossed dial closed")
                }
                Progress::Refused(why) => refuse(terms.rank, p.addr, &why),
                Progress::Mismatch(why) => return Err(CommError::invalid(why)),
                Progress::Authenticated { from, frame_key } => {
                    tracing::debug!(rank = terms.rank, from, addr = %p.addr, "authenticated");
                    links.push((from, Link { stream: p.stream, frame_key }));
                }
            }
        }
        self.pending = keep;
        if fds[0].revents != 0 {
            accept_new(listener, &mut self.pending, terms)?;
        }
        Ok(links)
    }
}

/// Accepts and authenticates one connection from every rank above `spec.rank` (the full mesh's
/// accepting half, as connect.rs's `connect_mesh` runs it). Returns `links[r]` for those ranks
/// (`None` elsewhere).
pub fn accept_peers(listener: &TcpListener, spec: &AcceptSpec<'_>) -> Result<Vec<Option<Link>>> {
    let AcceptSpec { rank, size, deadline, .. } = *spec;
    let terms = Terms { rank, size, secret: spec.secret, flags: spec.flags, handshake_timeout: spec.handshake_timeout };
    let mut links: Vec<Option<Link>> = (0..size).map(|_| None).collect();
    let mut missing = size.saturating_sub(rank + 1);
    let mut acceptor = Acceptor::default();
    listener.set_nonblocking(true).map_err(|e| CommError::io(e.to_string()))?;
    let mut fds: Vec<libc::pollfd> = Vec::new();
    while missing > 0 {
        if spec.stop.load(Ordering::Acquire) {
            return Err(CommError::io("connection set-up cancelled"));
        }
        let now = Instant::now();
        if now >= deadline {
            let absent: Vec<usize> = (rank + 1..size).filter(|&r| links[r].is_none()).collect();
            return Err(CommError::timeout(format!("rank {rank} timed out waiting for ranks {absent:?} to connect and authenticate")));
        }
        let next_expiry = acceptor.expire(rank, now).unwrap_or(deadline).min(deadline);
        fds.clear();
        acceptor.push_fds(listener, &mut fds);
        // Wake at least every 50 ms to see the stop flag.
        let wait = next_expiry.saturating_duration_since(now).min(Duration::from_millis(50));
        socket::poll(&mut fds, wait.as_millis().max(1) as i32)
            .map_err(|e| CommError::io(format!("poll failed while rank {rank} accepted connections: {e}")))?;
        let mut decide = |from: usize| if from > rank && links[from].is_none() { Verdict::Accept } else { Verdict::Duplicate };
        for (from, link) in acceptor.progress(listener, &fds, &terms, &mut decide)? {
            if links[from].is_some() || from < rank {
                return Err(CommError::io(format!("rank {from} connected to rank {rank} twice")));
            }
            links[from] = Some(link);
            missing -= 1;
        }
    }
    Ok(links)
}

fn refuse(rank: usize, addr: SocketAddr, why: &str) {
    tracing::warn!("rank {rank} refused a connection from {addr}: {why}");
}

/// Takes every connection waiting on the listener into `pending`.
fn accept_new(listener: &TcpListener, pending: &mut Vec<Pending>, spec: &Terms<'_>) -> Result<()> {
    loop {
        match listener.accept() {
            Ok((stream, addr)) => {
                if stream.set_nonblocking(true).is_err() {
                    continue;
                }
                if pending.len() >= MAX_PENDING {
                    let oldest = pending.remove(0);
                    refuse(spec.rank, oldest.addr, &format!("more than {MAX_PENDING} connections were authenticating at once"));
                }
                let until = Instant::now() + spec.handshake_timeout;
                pending.push(Pending { stream, addr, until, step: Step::ReadHello { buf: [0; HELLO_LEN], got: 0 } });
            }
            Err(e) if socket::would_block(&e) => return Ok(()),
            // Out of file descriptors (a flood of connections): make room and go on.
            Err(e) if matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)) => {
                if pending.is_empty() {
                    std::thread::sleep(Duration::from_millis(10));
                    return Ok(());
                }
                let oldest = pending.remove(0);
                refuse(spec.rank, oldest.addr, &format!("no file descriptors left ({e})"));
            }
            // The peer reset the connection before we took it, and the like: not ours to fail on.
            Err(e) if matches!(e.raw_os_error(), Some(libc::ECONNABORTED | libc::EPROTO | libc::EPERM | libc::EINTR)) => {}
            Err(e) => return Err(CommError::io(format!("accept failed on rank {}: {e}", spec.rank))),
        }
    }
}

/// Reads or writes what the socket allows: `Ok(true)` when `buf[*done..]` is complete.
pub(super) fn pump(stream: &TcpStream, buf: &mut [u8], done: &mut usize, write: bool) -> std::result::Result<bool, String> {
    let fd = stream.as_raw_fd();
    while *done < buf.len() {
        let step = if write { socket::send2(fd, &buf[*done..], &[]) } else { socket::recv(fd, &mut buf[*done..]) };
        match step {
            Ok(0) if !write => return Err("it closed the connection during the handshake".into()),
            Ok(n) => *done += n,
            Err(e) if socket::would_block(&e) => return Ok(false),
            Err(e) => return Err(format!("the connection failed during the handshake: {e}")),
        }
    }
    Ok(true)
}

/// Moves one handshake on as far as its socket allows.
fn advance(p: &mut Pending, spec: &Terms<'_>, decide: &mut dyn FnMut(usize) -> Verdict) -> Progress {
    loop {
        let next = match &mut p.step {
            Step::ReadHello { buf, got } => match pump(&p.stream, buf, got, false) {
                Ok(false) => return Progress::Waiting,
                Err(why) => return Progress::Refused(why),
                Ok(true) => match hello_to_challenge(buf, spec) {
                    Ok(step) => step,
                    Err(why) => return Progress::Refused(why),
                },
            },
            Step::SendChallenge { bytes, sent, transcript } => match pump(&p.stream, bytes, sent, true) {
                Ok(false) => return Progress::Waiting,
                Err(why) => return Progress::Refused(why),
                Ok(true) => Step::ReadProof { buf: [0; PROOF_LEN], got: 0, transcript: *transcript },
            },
            Step::ReadProof { buf, got, transcript } => match pump(&p.stream, buf, got, false) {
                Ok(false) => return Progress::Waiting,
                Err(why) => return Progress::Refused(why),
                Ok(true) => {
                    return match decode_proof(buf) {
                        Err(why) => Progress::Refused(why),
                        Ok(mac) if !transcript.verify_connector(spec.secret, &mac) => {
                            Progress::Refused("its proof does not match the group's secret (a stranger, or a replayed handshake)".into())
                        }
                        Ok(_) if transcript.flags_c != spec.flags => {
                            Progress::Mismatch(flags_mismatch(spec.rank, spec.flags, transcript.from as usize, transcript.flags_c))
                        }
                        Ok(_) => answer(&p.stream, transcript, spec, decide),
                    };
                }
            },
        };
        p.step = next;
    }
}

/// Sends the verdict on a proven connection. The socket is fresh and the verdict one byte, so
/// it goes at once or the connection is gone.
fn answer(stream: &TcpStream, transcript: &Transcript, spec: &Terms<'_>, decide: &mut dyn FnMut(usize) -> Verdict) -> Progress {
    let from = transcript.from as usize;
    let byte = match decide(from) {
        Verdict::Accept => VERDICT_ACCEPT,
        Verdict::KeepMine => VERDICT_KEEP_MINE,
        Verdict::Duplicate => return Progress::Refused(format!("rank {from} is already linked to rank {}", spec.rank)),
    };
    match socket::send2(stream.as_raw_fd(), &[byte], &[]) {
        Ok(1) if byte == VERDICT_ACCEPT => Progress::Authenticated { from, frame_key: transcript.frame_key(spec.secret) },
        Ok(1) => Progress::Superseded,
        Ok(_) => Progress::Refused("the verdict could not be sent".into()),
        Err(e) => Progress::Refused(format!("the connection failed before the verdict: {e}")),
    }
}

/// Checks a hello against the group and answers it with this rank's nonce and proof.
fn hello_to_challenge(buf: &[u8; HELLO_LEN], spec: &Terms<'_>) -> std::result::Result<Step, String> {
    let hello = Hello::decode(buf)?;
    let (from, to) = (hello.from as usize, hello.to as usize);
    if to != spec.rank {
        return Err(format!("its hello is addressed to rank {to}"));
    }
    if from == spec.rank || from >= spec.size {
        return Err(format!("its hello comes from rank {from}, not another rank of a group of {} (this is rank {})", spec.size, spec.rank));
    }
    let transcript = Transcript {
        from: hello.from,
        to: hello.to,
        flags_c: hello.flags,
        flags_a: spec.flags,
        nonce_c: hello.nonce,
        nonce_a: random_nonce()?,
    };
    let challenge = Challenge { flags: spec.flags, nonce: transcript.nonce_a, mac: transcript.acceptor_mac(spec.secret) };
    Ok(Step::SendChallenge { bytes: challenge.encode(), sent: 0, transcript })
}

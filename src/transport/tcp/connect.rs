//! The dialing side of the links. Every rank listens on an ephemeral port of the address it
//! advertises (not on every interface) and publishes `host:port` in the store; a rank that
//! needs a link to a peer dials it (a [`Dial`]: connect, then the handshake of handshake.rs,
//! non-blocking, inside whatever loop the rank is in) and authenticates both ways with the
//! group's secret before the connection carries a frame. When to dial is linker.rs's business.

use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, RawFd};
use std::time::{Duration, Instant};

use super::accept::{Terms, pump};
use super::handshake::{
    CHALLENGE_LEN, Challenge, FLAG_TLS, Hello, Link, PROOF_LEN, Transcript, VERDICT_ACCEPT, VERDICT_KEEP_MINE, encode_proof,
    flags_mismatch, random_nonce, Secret,
};
use crate::error::{CommError, Result};
use crate::rendezvous::Store;

/// How long one connection may take to authenticate (less when the group's timeout is shorter).
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// How long one `connect(2)` may block. The kernel completes a connection without the peer's
/// help, so this is only ever reached when the address does not answer at all.
const CONNECT_ATTEMPT: Duration = Duration::from_millis(500);

/// Connections the kernel queues for a listener that is busy elsewhere: a rank takes new
/// connections only while it runs set-up or an op, and a whole group may dial it at once.
const LISTEN_BACKLOG: libc::c_int = 4096;

/// The address this rank advertises: `XCCL_RS_SOCKET_HOST`, else what the hostname resolves to
/// (any IPv4 address), else loopback.
pub(super) fn advertised_host(configured: Option<&str>) -> String {
    if let Some(h) = configured {
        return h.to_string();
    }
    let mut buf = [0u8; 256];
    // SAFETY: `buf` is writable for its whole length, which is what we pass.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc == 0 {
        let len = buf.iter().position(|&c| c == 0).unwrap_or(buf.len());
        if let Ok(name) = std::str::from_utf8(&buf[..len]) {
            if let Ok(addrs) = (name, 0u16).to_socket_addrs() {
                if let Some(a) = addrs.into_iter().find(|a| a.is_ipv4()) {
                    return a.ip().to_string();
                }
            }
        }
    }
    "127.0.0.1".to_string()
}

/// Listens on the advertised address only, so the mesh's port is not open on every interface.
/// An address this host cannot bind (behind NAT, say) falls back to all interfaces, with a
/// warning: the handshake still keeps strangers out.
pub(super) fn listen_on(host: &str) -> Result<TcpListener> {
    let ip: Option<IpAddr> = (host, 0u16).to_socket_addrs().ok().and_then(|mut a| a.next()).map(|a| a.ip());
    let bound = match ip.map(|ip| (ip, TcpListener::bind((ip, 0)))) {
        Some((_, Ok(l))) => Ok(l),
        other => {
            if let Some((ip, Err(e))) = other {
                tracing::warn!("cannot listen on the advertised address {ip} ({e}); listening on all interfaces");
            }
            TcpListener::bind((Ipv4Addr::UNSPECIFIED, 0)).map_err(|e| CommError::io(format!("bind failed: {e}")))
        }
    }?;
    // SAFETY: `listen` on a socket we own and already listen on only resizes its queue (the
    // kernel caps it at somaxconn).
    unsafe { libc::listen(bound.as_raw_fd(), LISTEN_BACKLOG) };
    bound.set_nonblocking(true).map_err(|e| CommError::io(e.to_string()))?;
    Ok(bound)
}

/// What a rank needs to join its group's links.
#[derive(Clone, Copy)]
pub struct MeshSpec<'a> {
    /// Where the ranks publish their addresses.
    pub store: &'a dyn Store,
    pub rank: usize,
    pub size: usize,
    /// The group's secret (rendezvous.rs), which every connection proves it knows.
    pub secret: &'a Secret,
    /// `XCCL_RS_SOCKET_HOST`: the address to advertise.
    pub socket_host: Option<&'a str>,
    /// `XCCL_RS_TLS`: every link runs TLS after its handshake (tls.rs).
    pub tls: bool,
    pub timeout: Duration,
}

impl MeshSpec<'_> {
    /// The flags this rank's handshakes carry.
    pub fn flags(&self) -> u16 {
        if self.tls { FLAG_TLS } else { 0 }
    }
}

/// Connects this rank to every other rank at once (the full mesh: every peer eager, linker.rs)
/// and returns `links[r]` = the connection to rank r (`None` for this rank itself).
pub fn connect_mesh(spec: &MeshSpec<'_>) -> Result<Vec<Option<Link>>> {
    let mut links: Vec<Option<Link>> = (0..spec.size).map(|_| None).collect();
    if spec.size == 1 {
        return Ok(links);
    }
    let deadline = Instant::now() + spec.timeout;
    let mut linker = super::linker::Linker::new(spec)?;
    let everyone: Vec<usize> = (0..spec.size).filter(|&p| p != spec.rank).collect();
    for (peer, link) in linker.establish(spec.store, &everyone, deadline)? {
        links[peer] = Some(link);
    }
    Ok(links)
}

/// Where one outgoing handshake stands.
enum DialStep {
    /// Not connected: connect at `retry_at`.
    Idle,
    ReadChallenge { stream: TcpStream, buf: [u8; CHALLENGE_LEN], got: usize, hello: Hello },
    SendProof { stream: TcpStream, bytes: [u8; PROOF_LEN], sent: usize, transcript: Transcript },
    ReadVerdict { stream: TcpStream, buf: [u8; 1], got: usize, transcript: Transcript },
}

/// What a dial came to after a step.
pub enum DialEvent {
    Waiting,
    /// The peer accepted: this connection is the pair's link.
    Linked(Link),
    /// The peer dials this rank too and keeps its own connection (handshake.rs: VERDICT).
    Superseded,
}

/// One rank's outgoing connection to a peer, from `connect(2)` to the verdict. Connection
/// failures and handshakes cut short are retried (the peer may be flooded by strangers, or
/// have pushed this one out); a peer that answers but cannot prove it knows the secret is an
/// error at once. How long to go on is the caller's deadline.
pub struct Dial {
    pub peer: usize,
    addr: SocketAddr,
    step: DialStep,
    retry_at: Instant,
    backoff: Duration,
    /// Why the last attempt failed, for the error of a dial that never completes.
    pub last_error: Option<String>,
}

impl Dial {
    pub fn new(peer: usize, addr: SocketAddr) -> Dial {
        Dial { peer, addr, step: DialStep::Idle, retry_at: Instant::now(), backoff: Duration::from_millis(1), last_error: None }
    }

    /// The socket to poll and for what, once connected.
    pub fn poll_entry(&self) -> Option<(RawFd, i16)> {
        match &self.step {
            DialStep::Idle => None,
            DialStep::ReadChallenge { stream, .. } | DialStep::ReadVerdict { stream, .. } => Some((stream.as_raw_fd(), libc::POLLIN)),
            DialStep::SendProof { stream, .. } => Some((stream.as_raw_fd(), libc::POLLOUT)),
        }
    }

    /// When an idle dial wants to connect (again).
    pub fn retry_at(&self) -> Option<Instant> {
        matches!(self.step, DialStep::Idle).then_some(self.retry_at)
    }

    /// Moves the dial on: connects when idle and due, else reads or writes what the socket
    /// allows. `Err` is a peer that cannot be linked to (another secret, other flags).
    pub fn step(&mut self, terms: &Terms<'_>, now: Instant) -> Result<DialEvent> {
        loop {
            match std::mem::replace(&mut self.step, DialStep::Idle) {
                DialStep::Idle if now < self.retry_at => return Ok(DialEvent::Waiting),
                DialStep::Idle => match self.connect(terms) {
                    Ok(step) => self.step = step,
                    // A published address listens for its group's whole life: refused, the
                    // rank is gone (it exited, or destroyed its group).
                    Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                        return Err(CommError::peer(format!(
                            "rank {} is gone: its address {} refused rank {}'s connection (did it exit or crash?)",
                            self.peer, self.addr, terms.rank
                        )));
                    }
                    Err(e) => return Ok(self.retry(e.to_string(), now)),
                },
                DialStep::ReadChallenge { stream, mut buf, mut got, hello } => match pump(&stream, &mut buf, &mut got, false) {
                    Ok(false) => {
                        self.step = DialStep::ReadChallenge { stream, buf, got, hello };
                        return Ok(DialEvent::Waiting);
                    }
                    Err(why) => return Ok(self.retry(format!("no challenge came back: {why}"), now)),
                    Ok(true) => self.step = self.check_challenge(stream, &buf, &hello, terms)?,
                },
                DialStep::SendProof { stream, mut bytes, mut sent, transcript } => match pump(&stream, &mut bytes, &mut sent, true) {
                    Ok(false) => {
                        self.step = DialStep::SendProof { stream, bytes, sent, transcript };
                        return Ok(DialEvent::Waiting);
                    }
                    Err(why) => return Ok(self.retry(format!("proof failed: {why}"), now)),
                    Ok(true) if transcript.flags_a != transcript.flags_c => {
                        // The proof went even so, so that the peer too learns why.
                        return Err(CommError::invalid(flags_mismatch(terms.rank, transcript.flags_c, self.peer, transcript.flags_a)));
                    }
                    Ok(true) => self.step = DialStep::ReadVerdict { stream, buf: [0], got: 0, transcript },
                },
                DialStep::ReadVerdict { stream, mut buf, mut got, transcript } => match pump(&stream, &mut buf, &mut got, false) {
                    Ok(false) => {
                        self.step = DialStep::ReadVerdict { stream, buf, got, transcript };
                        return Ok(DialEvent::Waiting);
                    }
                    Err(why) => return Ok(self.retry(format!("no verdict came back: {why}"), now)),
                    Ok(true) if buf[0] == VERDICT_ACCEPT => {
                        return Ok(DialEvent::Linked(Link { stream, frame_key: transcript.frame_key(terms.secret) }));
                    }
                    Ok(true) if buf[0] == VERDICT_KEEP_MINE => return Ok(DialEvent::Superseded),
                    Ok(true) => return Err(CommError::io(format!("rank {} sent an unknown verdict {:#x}", self.peer, buf[0]))),
                },
            }
        }
    }

    fn retry(&mut self, why: String, now: Instant) -> DialEvent {
        tracing::debug!(peer = self.peer, addr = %self.addr, error = %why, "dial retry");
        self.last_error = Some(why);
        self.step = DialStep::Idle;
        self.retry_at = now + self.backoff;
        self.backoff = (self.backoff * 2).min(Duration::from_millis(100));
        DialEvent::Waiting
    }

    /// Connects and sends the hello (a fresh socket takes its 48 bytes at once).
    fn connect(&self, terms: &Terms<'_>) -> std::io::Result<DialStep> {
        let mut stream = TcpStream::connect_timeout(&self.addr, CONNECT_ATTEMPT).map_err(context("could not connect"))?;
        let nonce = random_nonce().map_err(std::io::Error::other)?;
        let hello = Hello { from: terms.rank as u32, to: self.peer as u32, flags: terms.flags, nonce };
        stream.set_write_timeout(Some(CONNECT_ATTEMPT))?;
        stream.write_all(&hello.encode()).map_err(context("hello failed"))?;
        stream.set_write_timeout(None)?;
        stream.set_nonblocking(true)?;
        Ok(DialStep::ReadChallenge { stream, buf: [0; CHALLENGE_LEN], got: 0, hello })
    }

    /// Checks the acceptor's answer; a peer that cannot prove the secret is an error.
    fn check_challenge(&self, stream: TcpStream, buf: &[u8; CHALLENGE_LEN], hello: &Hello, terms: &Terms<'_>) -> Result<DialStep> {
        let (rank, peer, addr) = (terms.rank, self.peer, self.addr);
        let not_the_peer = |why: &str| CommError::io(format!("rank {rank} could not authenticate rank {peer} at {addr}: {why}"));
        let challenge = Challenge::decode(buf).map_err(|m| not_the_peer(&m))?;
        let transcript =
            Transcript { from: hello.from, to: hello.to, flags_c: hello.flags, flags_a: challenge.flags, nonce_c: hello.nonce, nonce_a: challenge.nonce };
        if !transcript.verify_acceptor(terms.secret, &challenge.mac) {
            return Err(not_the_peer("its answer does not match the group's secret (is another process on that port?)"));
        }
        Ok(DialStep::SendProof { stream, bytes: encode_proof(&transcript.connector_mac(terms.secret)), sent: 0, transcript })
    }
}

/// An error's text led by what failed, its kind kept.
fn context(what: &'static str) -> impl Fn(std::io::Error) -> std::io::Error {
    move |e| std::io::Error::new(e.kind(), format!("{what}: {e}"))
}

/// The terms of `spec`'s handshakes.
pub(super) fn terms<'a>(spec: &MeshSpec<'a>) -> Terms<'a> {
    Terms { rank: spec.rank, size: spec.size, secret: spec.secret, flags: spec.flags(), handshake_timeout: HANDSHAKE_TIMEOUT.min(spec.timeout) }
}

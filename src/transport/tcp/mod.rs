//! The TCP transport: non-blocking sockets, at most one per pair of ranks, driven by `poll(2)`.
//! A rank links at set-up only to the eager peers its fabric names, and to any other peer on
//! first use (linker.rs). All transfers of a phase make progress together, so two ranks sending each other
//! large messages never deadlock on full socket buffers, and a waiting rank sleeps in the kernel
//! instead of spinning (ranks may outnumber cores).

pub mod accept;
pub mod connect;
pub mod exchange;
pub mod frame;
pub mod handshake;
mod linker;
pub mod seal;
mod socket;
mod timeout_round;
pub mod tls;
mod tunnel;

use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::time::Instant;

use rustls::pki_types::CertificateDer;

use crate::error::Result;
use crate::peers::PeerSet;
use crate::transport::OpCtx;
pub use connect::MeshSpec;
use connect::HANDSHAKE_TIMEOUT;
use handshake::Link;
use linker::Linker;
use seal::Seal;
use tunnel::Tunnel;

/// What carries a link's bytes: the TCP socket itself, or the local end of its TLS tunnel.
/// Either is a non-blocking stream socket, used the same way.
pub(crate) enum Wire {
    Plain(TcpStream),
    Tls(Tunnel),
}

impl AsRawFd for Wire {
    fn as_raw_fd(&self) -> RawFd {
        match self {
            Wire::Plain(s) => s.as_raw_fd(),
            Wire::Tls(t) => t.local.as_raw_fd(),
        }
    }
}

impl Wire {
    /// Why the link's TLS tunnel stopped, if it failed (always `None` without TLS).
    pub fn failure(&self) -> Option<String> {
        match self {
            Wire::Plain(_) => None,
            Wire::Tls(t) => t.failure(),
        }
    }

    pub fn shutdown(&self, how: Shutdown) -> std::io::Result<()> {
        match self {
            Wire::Plain(s) => s.shutdown(how),
            Wire::Tls(t) => t.local.shutdown(how),
        }
    }
}

/// Per-peer connection state that outlives a phase.
pub(crate) struct Peer {
    pub stream: Wire,
    /// The peer closed its end (EOF seen while it was not needed): later use is an error.
    pub closed: bool,
    /// A frame was left half written by a failed phase: the stream can no longer be framed.
    pub broken_out: bool,
    /// Seals the headers this rank sends on the connection (seal.rs).
    pub seal_out: Seal,
    /// Checks the headers the peer sends.
    pub seal_in: Seal,
}

pub struct TcpTransport {
    rank: usize,
    size: usize,
    peers: Vec<Option<Peer>>,
    /// Makes the links not yet there (`None` once closed, or alone in the group).
    linker: Option<Linker>,
    /// With `XCCL_RS_TLS`: this rank's identity and every peer's certificate, read at set-up.
    tls: Option<TlsKeys>,
}

struct TlsKeys {
    identity: tls::Identity,
    certs: Vec<Option<CertificateDer<'static>>>,
}

/// A rank that listens for its peers, its address published ([`TcpTransport::listen`]).
pub struct Listening {
    linker: Option<Linker>,
    identity: Option<tls::Identity>,
    deadline: Instant,
}

impl Listening {
    /// Set-up's second half: links to the `eager` peers and learns every other peer's address.
    pub fn connect(self, spec: &MeshSpec<'_>, eager: &PeerSet) -> Result<TcpTransport> {
        let (rank, size, deadline) = (spec.rank, spec.size, self.deadline);
        let mut t = TcpTransport { rank, size, peers: (0..size).map(|_| None).collect(), linker: None, tls: None };
        let Some(mut linker) = self.linker else { return Ok(t) };
        let eager: Vec<usize> = eager.ranks().iter().copied().filter(|&p| p != rank && p < size).collect();
        let links = linker.establish(spec.store, &eager, deadline)?;
        // The other peers' addresses (and certificates), for the links made on first use: the
        // group keeps no store after set-up.
        let everyone: Vec<usize> = (0..size).collect();
        linker.learn_addresses(spec.store, &everyone, deadline)?;
        if let Some(identity) = self.identity {
            let mut certs = vec![None; size];
            for (peer, cert) in certs.iter_mut().enumerate().filter(|(p, _)| *p != rank) {
                *cert = Some(tls::peer_cert(spec.store, rank, peer, deadline.saturating_duration_since(Instant::now()))?);
            }
            t.tls = Some(TlsKeys { identity, certs });
        }
        t.linker = Some(linker);
        t.install(links, Instant::now() + HANDSHAKE_TIMEOUT.min(spec.timeout))?;
        Ok(t)
    }
}

impl TcpTransport {
    /// Rendezvous through the spec's store, and link to the `eager` peers (a symmetric
    /// relation: peers.rs); every other link is made on first use.
    pub fn connect(spec: &MeshSpec<'_>, eager: &PeerSet) -> Result<TcpTransport> {
        Self::listen(spec)?.connect(spec, eager)
    }

    /// Set-up's first half: listens and publishes this rank's address (and TLS certificate),
    /// so that peers may dial it while the group still agrees on its settings. The set-up's
    /// timeout counts from here.
    pub fn listen(spec: &MeshSpec<'_>) -> Result<Listening> {
        let deadline = Instant::now() + spec.timeout;
        if spec.size == 1 {
            return Ok(Listening { linker: None, identity: None, deadline });
        }
        let identity = match spec.tls {
            true => {
                let identity = tls::Identity::generate()?;
                identity.publish(spec.store, spec.rank)?;
                Some(identity)
            }
            false => None,
        };
        Ok(Listening { linker: Some(Linker::new(spec)?), identity, deadline })
    }

    /// Whether this rank has a link to `peer` (made at set-up or on first use).
    pub fn is_linked(&self, peer: usize) -> bool {
        self.peers.get(peer).is_some_and(Option::is_some)
    }

    /// Takes new links into use: TLS on each (all handshakes at once, then waits for each,
    /// at most until `deadline`), then their frame seals.
    fn install(&mut self, links: Vec<(usize, Link)>, deadline: Instant) -> Result<()> {
        let wires: Vec<(usize, Wire, [u8; handshake::MAC_LEN])> = match &self.tls {
            None => links.into_iter().map(|(p, l)| (p, Wire::Plain(l.stream), l.frame_key)).collect(),
            Some(keys) => {
                let mut opening = Vec::with_capacity(links.len());
                for (peer, link) in links {
                    let cert = keys.certs[peer].clone().expect("every peer's certificate is read at set-up");
                    let conn = tls::connection(&keys.identity, self.rank, peer, cert)?;
                    opening.push((peer, tunnel::open(link.stream, conn, self.rank, peer, deadline)?, link.frame_key));
                }
                opening.into_iter().map(|(p, o, key)| o.finish().map(|t| (p, Wire::Tls(t), key))).collect::<Result<_>>()?
            }
        };
        for (peer, stream, frame_key) in wires {
            tracing::debug!(rank = self.rank, peer, "linked");
            self.peers[peer] = Some(Peer {
                stream,
                closed: false,
                broken_out: false,
                seal_out: Seal::new(&frame_key, self.rank, peer),
                seal_in: Seal::new(&frame_key, peer, self.rank),
            });
        }
        Ok(())
    }

    /// First use of `peer`: starts its link unless there is one (or one on its way).
    fn want_link(&mut self, peer: usize) {
        if self.peers[peer].is_none() {
            if let Some(linker) = self.linker.as_mut() {
                linker.dial(peer);
            }
        }
    }

    /// Adds the linker's poll entries (listener, handshakes) to a loop's; returns when it
    /// wants to run without an event.
    fn push_link_fds(&mut self, fds: &mut Vec<libc::pollfd>) -> Option<Instant> {
        self.linker.as_mut().and_then(|l| l.push_fds(fds))
    }

    /// After a loop's poll: moves the handshakes on and takes the links that came up.
    fn progress_links(&mut self, fds: &[libc::pollfd], ctx: &OpCtx) -> Result<()> {
        let Some(linker) = self.linker.as_mut() else { return Ok(()) };
        let links = linker.progress(fds).map_err(|e| ctx.annotate(e))?;
        if !links.is_empty() {
            let deadline = ctx.deadline.min(Instant::now() + HANDSHAKE_TIMEOUT);
            self.install(links, deadline).map_err(|e| ctx.annotate(e))?;
        }
        Ok(())
    }

    /// Why there is no link to `peer`, for a timeout's message.
    fn why_unlinked(&self, peer: usize) -> String {
        self.linker.as_ref().map_or_else(|| format!("rank {} has no link to rank {peer}", self.rank), |l| l.why_unlinked(peer))
    }
}

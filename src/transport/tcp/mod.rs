//! The TCP transport: a full mesh of non-blocking sockets, one per pair of ranks, driven by
//! `poll(2)`. All transfers of a phase make progress together, so two ranks sending each other
//! large messages never deadlock on full socket buffers, and a waiting rank sleeps in the kernel
//! instead of spinning (ranks may outnumber cores).

pub mod accept;
pub mod connect;
pub mod exchange;
pub mod frame;
pub mod handshake;
pub mod seal;
mod socket;
mod timeout_round;
pub mod tls;
mod tunnel;

use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::time::Instant;

use crate::error::Result;
pub use connect::MeshSpec;
use connect::HANDSHAKE_TIMEOUT;
use handshake::Link;
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
}

impl TcpTransport {
    /// Rendezvous through the spec's store and connect to every other rank.
    pub fn connect(spec: &MeshSpec<'_>) -> Result<TcpTransport> {
        let (rank, size) = (spec.rank, spec.size);
        let identity = match spec.tls {
            true => {
                let identity = tls::Identity::generate()?;
                identity.publish(spec.store, rank)?;
                Some(identity)
            }
            false => None,
        };
        let links = connect::connect_mesh(spec)?;
        let wires = match &identity {
            Some(identity) => secure(spec, identity, links)?,
            None => links.into_iter().map(|l| l.map(|l| (Wire::Plain(l.stream), l.frame_key))).collect(),
        };
        let peers = wires
            .into_iter()
            .enumerate()
            .map(|(peer, wire)| {
                wire.map(|(stream, frame_key)| Peer {
                    stream,
                    closed: false,
                    broken_out: false,
                    seal_out: Seal::new(&frame_key, rank, peer),
                    seal_in: Seal::new(&frame_key, peer, rank),
                })
            })
            .collect();
        Ok(TcpTransport { rank, size, peers })
    }
}

type Secured = Vec<Option<(Wire, [u8; handshake::MAC_LEN])>>;

/// Runs TLS on every authenticated link: all handshakes at once, then waits for each.
fn secure(spec: &MeshSpec<'_>, identity: &tls::Identity, links: Vec<Option<Link>>) -> Result<Secured> {
    let deadline = Instant::now() + HANDSHAKE_TIMEOUT.min(spec.timeout);
    let mut opening = Vec::with_capacity(links.len());
    for (peer, link) in links.into_iter().enumerate() {
        let Some(link) = link else {
            opening.push(None);
            continue;
        };
        let left = deadline.saturating_duration_since(Instant::now());
        let cert = tls::peer_cert(spec.store, spec.rank, peer, left)?;
        let conn = tls::connection(identity, spec.rank, peer, cert)?;
        opening.push(Some((tunnel::open(link.stream, conn, spec.rank, peer, deadline)?, link.frame_key)));
    }
    opening.into_iter().map(|o| o.map(|(t, key)| t.finish().map(|t| (Wire::Tls(t), key))).transpose()).collect()
}

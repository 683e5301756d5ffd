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

use std::net::TcpStream;

use crate::error::Result;
pub use connect::MeshSpec;
use seal::Seal;

/// Per-peer connection state that outlives a phase.
pub(crate) struct Peer {
    pub stream: TcpStream,
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
        let links = connect::connect_mesh(spec)?;
        let peers = links
            .into_iter()
            .enumerate()
            .map(|(peer, link)| {
                link.map(|link| Peer {
                    stream: link.stream,
                    closed: false,
                    broken_out: false,
                    seal_out: Seal::new(&link.frame_key, rank, peer),
                    seal_in: Seal::new(&link.frame_key, peer, rank),
                })
            })
            .collect();
        Ok(TcpTransport { rank, size, peers })
    }
}

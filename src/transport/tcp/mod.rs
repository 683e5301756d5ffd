//! The TCP transport: a full mesh of non-blocking sockets, one per pair of ranks, driven by
//! `poll(2)`. All transfers of a phase make progress together, so two ranks sending each other
//! large messages never deadlock on full socket buffers, and a waiting rank sleeps in the kernel
//! instead of spinning (ranks may outnumber cores).

pub mod connect;
pub mod exchange;
pub mod frame;
mod timeout_round;
mod socket;

use std::net::TcpStream;

use crate::error::Result;
pub use connect::MeshSpec;

/// Per-peer connection state that outlives a phase.
pub(crate) struct Peer {
    pub stream: TcpStream,
    /// The peer closed its end (EOF seen while it was not needed): later use is an error.
    pub closed: bool,
    /// A frame was left half written by a failed phase: the stream can no longer be framed.
    pub broken_out: bool,
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
        let streams = connect::connect_mesh(spec)?;
        let peers = streams
            .into_iter()
            .map(|s| s.map(|stream| Peer { stream, closed: false, broken_out: false }))
            .collect();
        Ok(TcpTransport { rank, size, peers })
    }
}

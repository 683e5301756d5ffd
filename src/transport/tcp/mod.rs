//! The TCP transport: a full mesh of non-blocking sockets, one per pair of ranks, driven by
//! `poll(2)`. All transfers of a phase make progress together, so two ranks sending each other
//! large messages never deadlock on full socket buffers, and a waiting rank sleeps in the kernel
//! instead of spinning (ranks may outnumber cores).

pub mod connect;
pub mod exchange;
pub mod frame;
mod socket;

use std::net::TcpStream;
use std::time::Duration;

use crate::error::Result;
use crate::rendezvous::Store;

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
    /// Rendezvous through `store` and connect to every other rank.
    pub fn connect(
        store: &dyn Store,
        rank: usize,
        size: usize,
        token: u64,
        socket_host: Option<&str>,
        timeout: Duration,
    ) -> Result<TcpTransport> {
        let streams = connect::connect_mesh(store, rank, size, token, socket_host, timeout)?;
        let peers = streams
            .into_iter()
            .map(|s| s.map(|stream| Peer { stream, closed: false, broken_out: false }))
            .collect();
        Ok(TcpTransport { rank, size, peers })
    }
}

//! The OFI transport: messages between ranks over libfabric, for the fabrics TCP cannot use
//! well (verbs, EFA, CXI, PSM3) and, through libfabric's `tcp` provider, anywhere.
//!
//! It carries data only. A group that asks for it (`XCCL_RS_TRANSPORT=ofi`) still links over
//! TCP first, to the same eager peers as without it, with its authenticated handshake
//! (tcp/handshake.rs): abort frames and the detection of a dead peer stay there, and this
//! transport owns that [`TcpTransport`] and watches its connections while it waits, linking any
//! other peer it waits for on first use. Terms:
//!
//! - *endpoint*: one reliable unconnected libfabric endpoint (FI_EP_RDM) per rank, with tagged
//!   messages and a completion queue that our progress thread reads (libfabric's manual
//!   progress: nothing moves unless we read it), on the provider and domain nic.rs chooses.
//!   Peers' addresses come through the Store (setup.rs, gather.rs) into the endpoint's address
//!   vector, one entry per rank, so any subset of the group can talk. A group that ends cleanly
//!   leaves its endpoint to its process's next group, a *generation* later (pool.rs);
//! - *header* and *payload*: each transfer is a 40-byte header on the header tag, which the
//!   receiver checks like TCP's frame header, then the payload on the message's tag, both
//!   within the provider's tag width (tags.rs), straight from and into the algorithm's buffers
//!   (header.rs), as one message or several in order: over `tcp;ofi_rxm`, a
//!   payload of a few MiB goes as messages of its eager limit, so that none waits for a
//!   rendezvous (cutting.rs);
//! - *held send*: a point-to-point send whose bytes this transport copied, so that it completes
//!   before its receiver posts, as over TCP (held.rs);
//! - *post*: one send or receive handed to libfabric, with a context that comes back in its
//!   completion; a buffer is the provider's from its post to its completion, so a phase that
//!   fails cancels what it posted and waits for it before it returns (exchange.rs).

mod cutting;
mod exchange;
mod gather;
pub mod header;
mod held;
mod lookahead;
pub mod nic;
pub mod pool;
mod setup;
pub mod shim;
pub mod tags;

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use cutting::Cutting;
use header::Header;
use held::Held;
use lookahead::LookAhead;
use pool::PoolKey;
use shim::Endpoint;
use tags::TagLayout;

use crate::transport::tcp::TcpTransport;
use crate::transport::{Direction, MessageId};
pub use setup::{Local, connect};

/// One rank's libfabric endpoint, its peers' addresses, and the TCP mesh for control.
pub struct OfiTransport {
    rank: usize,
    size: usize,
    /// The control connections (abort frames, dead peers).
    tcp: TcpTransport,
    /// `None` once closed, or given up after a phase whose posts could not be reclaimed.
    ep: Option<Endpoint>,
    /// Sends completed before their receivers asked (held.rs). Declared after `ep`, so that
    /// the endpoint closes before the buffers it may still read are freed.
    held: Held,
    /// Each peer's posted look-ahead for its next header, if any (lookahead.rs); after `ep`
    /// for the same reason.
    lookahead: Vec<Option<LookAhead>>,
    /// How long closing the group waits for held sends (the group's timeout).
    linger: Duration,
    /// An abort was sent: closing does not wait for held sends.
    aborted: bool,
    /// Why the endpoint was given up, for later phases' errors.
    broken: Option<String>,
    /// Each rank's handle in the address vector (this rank's own entry unused).
    addrs: Vec<u64>,
    /// How payloads are cut into messages (cutting.rs).
    cutting: Cutting,
    /// How tags fit the provider's tag bits (tags.rs).
    tags: TagLayout,
    /// The generation of every rank's endpoint (this rank's own at its index): tags to a rank
    /// carry its generation (pool.rs).
    generations: Vec<u32>,
    /// What the endpoint was opened for, to give it back to the process's pool (pool.rs).
    key: PoolKey,
    /// Peers' addresses in the endpoint's address vector, with their handles.
    known: HashMap<Vec<u8>, u64>,
    /// A phase or probe of the group failed: its endpoint is not reused.
    failed: bool,
    /// Headers that look-aheads received, per peer, for the receives to come.
    stash: Vec<VecDeque<Header>>,
    /// How long a wait polls the completion queue before it sleeps (XCCL_RS_SPIN_US).
    spin: Duration,
    /// The provider in use, for logs and errors ("tcp;ofi_rxm").
    provider: String,
}

impl OfiTransport {
    /// The libfabric provider this transport uses.
    pub fn provider(&self) -> &str {
        &self.provider
    }

    /// The generation that tags between this rank and `peer` carry in direction `dir`: the
    /// receiving endpoint's.
    fn generation(&self, peer: usize, dir: Direction) -> u32 {
        match dir {
            Direction::Send => self.generations[peer],
            Direction::Recv => self.generations[self.rank],
        }
    }

    /// The tag of a header sent to `peer` or received from it.
    fn header_tag(&self, peer: usize, dir: Direction) -> u64 {
        self.tags.header(self.generation(peer, dir))
    }

    /// The tag of the payload of `id` sent to `peer` or received from it.
    fn payload_tag(&self, peer: usize, dir: Direction, id: &MessageId) -> u64 {
        self.tags.payload(self.generation(peer, dir), id)
    }
}

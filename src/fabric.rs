//! A group's *fabric*: the connections its ranks talk through, built once per communicator
//! from the host map (hosts.rs). The table that picks an algorithm for an op looks only at the
//! fabric's [`Shape`] (algorithms/select.rs). Terms:
//!
//! - the *mesh*: the TCP transport, which can link any pair of ranks. Every fabric has one:
//!   set-up and abort frames use it whatever else there is. A rank links at set-up only to the
//!   eager peers of its shape (peers.rs), to others on first use;
//! - the *net*: the transport between hosts, which all-to-all, point-to-point messages and the
//!   steps that shared memory does not do use: the mesh itself, or with `XCCL_RS_TRANSPORT=ofi`
//!   libfabric (transport/ofi/), which owns the mesh for its control frames;
//! - `Mesh`: nothing else — every host has one rank, or `XCCL_RS_TRANSPORT=tcp`;
//! - `Host`: every rank is on this host: one shared-memory group of them all;
//! - `Mixed`: several hosts, some with two or more ranks: the host map, and a shared-memory
//!   group among this host's ranks when it has two or more (the hierarchical algorithms).
//!
//! What is still to come plugs in here: another transport (oneCCL) is another way to build
//! the parts and its own rows in the selection table; a zero-copy shared-memory path is rows
//! that pick it on `Host`; rebuilding a group after a rank is dropped is building a fabric
//! again, for the ranks that remain ([`Fabric::build`] needs only the group's store and
//! numbering).

use std::sync::Arc;

use crate::config::{Config, TransportChoice};
use crate::error::Result;
use crate::hosts::{HostMap, this_host};
use crate::par::Par;
use crate::peers::eager_peers;
use crate::rendezvous::Store;
use crate::transport::shm::heap::{Heap, Heaps};
use crate::transport::shm::{ShmGroup, ShmSettings};
use crate::transport::tcp::handshake::Secret;
use crate::transport::choice::agree_on_transport;
use crate::transport::ofi;
use crate::transport::tcp::{MeshSpec, TcpTransport};
use crate::transport::{OpCtx, RawBuf, Transport};

/// The connections of one rank of a group.
pub struct Fabric {
    /// The net (see the module docs).
    pub net: Box<dyn Transport>,
    /// What the ranks share besides it.
    pub parts: Parts,
    /// This rank's threads for the copies and reductions of shared-memory steps (par.rs):
    /// the algorithms' to use, sized by how many ranks share this host's memory.
    pub par: Par,
}

/// What a fabric has besides the mesh.
pub enum Parts {
    Mesh,
    Host(ShmGroup),
    Mixed(Mixed),
}

impl Parts {
    /// The heaps of a single-host group.
    pub fn host_heaps_mut(&mut self) -> Option<&mut Heaps> {
        match self {
            Parts::Host(shm) => shm.heaps_mut(),
            _ => None,
        }
    }

    pub fn shape(&self) -> Shape {
        match self {
            Parts::Mesh => Shape::Mesh,
            Parts::Host(_) => Shape::Host,
            Parts::Mixed(_) => Shape::Mixed,
        }
    }

    pub fn shm(&self) -> Option<&ShmGroup> {
        match self {
            Parts::Mesh => None,
            Parts::Host(shm) => Some(shm),
            Parts::Mixed(m) => m.shm.as_ref(),
        }
    }
}

/// A fabric's kind, the selection table's input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shape {
    Mesh,
    Host,
    Mixed,
}

impl Shape {
    pub const ALL: [Shape; 3] = [Shape::Mesh, Shape::Host, Shape::Mixed];
}

/// A mixed group's parts.
pub struct Mixed {
    pub hosts: HostMap,
    /// This host's ranks' shared memory (local indices 0..k), present when k ≥ 2.
    pub shm: Option<ShmGroup>,
    /// Scratch for a representative's partial result, distinct from the TCP step's.
    partial: Vec<u8>,
}

impl Mixed {
    /// Scratch of `bytes` bytes (grown, never shrunk).
    pub fn partial(&mut self, bytes: usize) -> RawBuf {
        if self.partial.len() < bytes {
            self.partial.resize(bytes, 0);
        }
        RawBuf::from_slice(&mut self.partial[..bytes])
    }
}

/// This rank's compute threads when `shm_ranks` ranks share its memory (`None`: it shares none,
/// and its steps never split).
fn compute_threads(config: &Config, shm_ranks: Option<usize>) -> Par {
    match shm_ranks {
        Some(k) => Par::new(config.threads_for(k), config.thread_min_bytes, config.streaming_min_for(k)),
        None => Par::serial(),
    }
}

impl Fabric {
    /// Connects this rank to every rank of the group (blocks until all have joined, or the
    /// timeout): the mesh, then shared memory where the host map allows it. A single host
    /// shares memory among all ranks; several hosts, some with two or more ranks, make a
    /// mixed group; one rank per host leaves nothing to share.
    pub fn build(store: &dyn Store, rank: usize, size: usize, secret: &Secret, config: &Config) -> Result<Fabric> {
        let socket_host = config.socket_host.as_deref();
        let spec = MeshSpec { store, rank, size, secret, socket_host, tls: config.tls, timeout: config.timeout };
        // Listening first: peers that arrive early dial it while the group agrees.
        let listening = TcpTransport::listen(&spec)?;
        agree_on_transport(store, rank, size, config.transport, config.timeout)?;
        let host_map = if size > 1 && config.transport != TransportChoice::Tcp {
            Some(HostMap::exchange(store, rank, size, &this_host(config), config.timeout)?)
        } else {
            None
        };
        // TCP links where its algorithms need; OFI keeps the same links for control (aborts,
        // dead peers), and links any other peer it waits for on first use.
        let eager = eager_peers(rank, size, host_map.as_ref());
        let tcp = listening.connect(&spec, &eager)?;
        let net: Box<dyn Transport> = match config.transport {
            TransportChoice::Ofi => {
                // Which of its host's ranks this one is: each local rank takes its own NIC.
                let local = match host_map.as_ref() {
                    Some(m) => ofi::Local { rank: m.local_index(rank), size: m.ranks(m.host_of(rank)).len() },
                    None => ofi::Local { rank: 0, size: 1 },
                };
                Box::new(ofi::connect(store, tcp, config, local)?)
            }
            TransportChoice::Auto | TransportChoice::Tcp => Box::new(tcp),
        };
        let (parts, hosts) = match host_map {
            Some(map) => Self::shared_memory(store, rank, map, config)?,
            None => (Parts::Mesh, 1),
        };
        let shm_ranks = parts.shm().map(|s| s.size());
        let fabric = Fabric { net, parts, par: compute_threads(config, shm_ranks) };
        let local_ranks = shm_ranks.unwrap_or(1);
        // What the group reads by cross-memory attach: nothing, staged broadcasts, or all it can.
        let cma = fabric.shm().and_then(|s| s.cma()).map_or("off", |c| if c.ordinary() { "all" } else { "staged" });
        let threads = fabric.par.threads();
        let streaming_min = shm_ranks.map_or(0, |_| fabric.par.streaming_min());
        tracing::info!(
            rank,
            size,
            shape = ?fabric.parts.shape(),
            transport = config.transport.name(),
            tls = config.tls,
            shm = fabric.shm().is_some(),
            cma,
            hosts,
            local_ranks,
            threads,
            streaming_min,
            "xccl_rs communicator connected"
        );
        Ok(fabric)
    }

    /// The parts besides the mesh, from the group's host map, and how many hosts it has.
    fn shared_memory(store: &dyn Store, rank: usize, hosts: HostMap, config: &Config) -> Result<(Parts, usize)> {
        let host = hosts.host_of(rank);
        let local = hosts.ranks(host).to_vec();
        // Only a single-host group reads tensors in place (zero-copy), so only it has heaps.
        let setup = |namespace: &str, heap_bytes: usize| {
            ShmGroup::setup(store, &local, hosts.local_index(rank), namespace, ShmSettings::of(config, heap_bytes))
        };
        let count = hosts.host_count();
        let parts = if count == 1 {
            Parts::Host(setup("", config.shm_heap_bytes)?)
        } else if !hosts.any_shared() {
            Parts::Mesh
        } else {
            let shm = if local.len() > 1 { Some(setup(&format!("/h{host}"), 0)?) } else { None };
            Parts::Mixed(Mixed { hosts, shm, partial: Vec::new() })
        };
        Ok((parts, count))
    }

    /// This rank's shared-memory heap, in a group whose ranks all share this host (the only
    /// groups whose collectives read tensors in place).
    pub fn host_heap(&self) -> Option<Arc<Heap>> {
        match &self.parts {
            Parts::Host(shm) => shm.heaps().map(|h| h.own().clone()),
            _ => None,
        }
    }

    /// Zero-copy operations so far (0 without shared memory).
    pub fn zero_copy_ops(&self) -> u64 {
        self.shm().and_then(|s| s.heaps()).map_or(0, |h| h.zero_copy_ops())
    }

    /// Operations that read peers by cross-memory attach so far.
    pub fn cma_ops(&self) -> u64 {
        self.shm().and_then(|s| s.cma()).map_or(0, |c| c.ops())
    }

    /// The shared-memory group this rank belongs to, if any.
    pub fn shm(&self) -> Option<&ShmGroup> {
        self.parts.shm()
    }

    /// Tells every peer that this rank failed `ctx`'s operation: abort frames over the mesh,
    /// and the shared-memory group's abort flag (peers waiting on it fail within 100 ms).
    pub fn abort(&mut self, ctx: &OpCtx, message: &str) {
        self.net.abort(ctx, message);
        if let Some(shm) = self.shm() {
            shm.abort(message);
        }
    }

    /// Unmaps shared memory, stops the compute threads and closes every connection (the group
    /// is being destroyed).
    pub fn close(&mut self) {
        self.parts = Parts::Mesh;
        self.par = Par::serial();
        self.net.close();
    }
}

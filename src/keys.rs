//! Every key the core writes to or reads from a group's Store, declared once: the side that
//! publishes a value and the side that reads it name the same variant, so a misspelt key is a
//! compile error, not a rank waiting for a key nobody writes.
//!
//! The Store a group receives is already private to the group (torch's `PrefixStore` per group
//! and device), so keys only tell the core's own exchanges apart.

/// One key of the core's rendezvous.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Key<'a> {
    /// The group's secret, which rank 0 draws (rendezvous.rs).
    Secret,
    /// How to reach a rank over TCP: `host:port` (transport/tcp/connect.rs).
    Address(usize),
    /// A rank's XCCL_RS_TRANSPORT setting (transport/choice.rs).
    Transport(usize),
    /// Rank 0's verdict on every rank's setting: `ok` or the error (transport/choice.rs).
    TransportVerdict,
    /// A rank's libfabric endpoint address, or why it has none (transport/ofi/setup.rs).
    OfiAddress(usize),
    /// Every rank's `OfiAddress` value, gathered by rank 0 into one (transport/ofi/gather.rs).
    OfiAddresses,
    /// A rank's TLS certificate, DER (transport/tcp/tls.rs).
    TlsCert(usize),
    /// A rank's host identity (hosts.rs).
    Host(usize),
    /// The name of a rank's shared-memory segment, within one host's group (`namespace` keeps
    /// the groups of different hosts apart; transport/shm/setup.rs).
    ShmSegment { namespace: &'a str, rank: usize },
    /// Whether a rank could map every peer's segment.
    ShmMapped { namespace: &'a str, rank: usize },
    /// The name of a rank's shared-memory heap.
    ShmHeap { namespace: &'a str, rank: usize },
    /// A rank's answer to the cross-memory-attach probe.
    ShmCma { namespace: &'a str, rank: usize },
}

impl Key<'_> {
    /// The key's text in the Store.
    pub fn text(&self) -> String {
        match self {
            Key::Secret => "xccl_rs/secret".to_string(),
            Key::Address(rank) => format!("xccl_rs/addr/{rank}"),
            Key::TlsCert(rank) => format!("xccl_rs/tls_cert/{rank}"),
            Key::Transport(rank) => format!("xccl_rs/transport/{rank}"),
            Key::TransportVerdict => "xccl_rs/transport_verdict".to_string(),
            Key::OfiAddress(rank) => format!("xccl_rs/ofi_addr/{rank}"),
            Key::OfiAddresses => "xccl_rs/ofi_addrs".to_string(),
            Key::Host(rank) => format!("xccl_rs/host/{rank}"),
            Key::ShmSegment { namespace, rank } => format!("xccl_rs/shm{namespace}/{rank}"),
            Key::ShmMapped { namespace, rank } => format!("xccl_rs/shm_mapped{namespace}/{rank}"),
            Key::ShmHeap { namespace, rank } => format!("xccl_rs/shm_heap{namespace}/{rank}"),
            Key::ShmCma { namespace, rank } => format!("xccl_rs/shm_cma{namespace}/{rank}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_key_is_distinct() {
        let ns = "/h1";
        let keys = [
            Key::Secret,
            Key::Address(1),
            Key::TlsCert(1),
            Key::Transport(1),
            Key::TransportVerdict,
            Key::OfiAddress(1),
            Key::OfiAddresses,
            Key::Host(1),
            Key::ShmSegment { namespace: ns, rank: 1 },
            Key::ShmMapped { namespace: ns, rank: 1 },
            Key::ShmHeap { namespace: ns, rank: 1 },
            Key::ShmCma { namespace: ns, rank: 1 },
        ];
        let texts: std::collections::HashSet<_> = keys.iter().map(Key::text).collect();
        assert_eq!(texts.len(), keys.len());
        assert_eq!(Key::Address(3).text(), "xccl_rs/addr/3", "tests and tools read this one");
    }
}

//! Which peers a rank links to at set-up (its *eager* peers); every other TCP link is made on
//! first use (transport/tcp/linker.rs). The rule follows what the fabric's algorithms use, so
//! that a group of n ranks opens about n links per host instead of n·(n−1)/2 in all:
//!
//! - `Mesh` (one rank per host, or `XCCL_RS_TRANSPORT=tcp`): the direct algorithms talk to
//!   every rank, so every rank is eager;
//! - `Host` (one host): collectives go through shared memory; TCP carries only point-to-point
//!   and all-to-all messages, linked on first use: no rank is eager;
//! - `Mixed` (several hosts): this host's ranks are reached through shared memory; over TCP a
//!   rank talks to its *rail peers*, the ranks of the same local index on the other hosts
//!   (hosts.rs). The leaders (local index 0) are each other's rail peers.
//!
//! The relation must be symmetric (a lists b exactly when b lists a), since set-up waits for
//! every eager link: each rule below is.

use crate::hosts::HostMap;

/// A set of ranks, ascending.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PeerSet(Vec<usize>);

impl PeerSet {
    /// Every rank of a group of `size` but `rank`.
    pub fn all_but(rank: usize, size: usize) -> PeerSet {
        PeerSet((0..size).filter(|&p| p != rank).collect())
    }

    pub fn none() -> PeerSet {
        PeerSet(Vec::new())
    }

    /// The given ranks (sorted, duplicates dropped).
    pub fn of(mut ranks: Vec<usize>) -> PeerSet {
        ranks.sort_unstable();
        ranks.dedup();
        PeerSet(ranks)
    }

    pub fn ranks(&self) -> &[usize] {
        &self.0
    }

    pub fn contains(&self, rank: usize) -> bool {
        self.0.binary_search(&rank).is_ok()
    }
}

/// The eager peers of `rank` in a group of `size`: `hosts` is the group's host map, `None`
/// when the fabric is TCP only (`XCCL_RS_TRANSPORT=tcp`). Mirrors fabric.rs's choice of shape.
pub fn eager_peers(rank: usize, size: usize, hosts: Option<&HostMap>) -> PeerSet {
    let Some(hosts) = hosts else { return PeerSet::all_but(rank, size) };
    if hosts.host_count() == 1 {
        PeerSet::none()
    } else if !hosts.any_shared() {
        PeerSet::all_but(rank, size)
    } else {
        rail_peers(rank, hosts)
    }
}

/// The ranks of `rank`'s local index on every other host that has one.
pub fn rail_peers(rank: usize, hosts: &HostMap) -> PeerSet {
    let (own, local) = (hosts.host_of(rank), hosts.local_index(rank));
    PeerSet((0..hosts.host_count()).filter(|&h| h != own).filter_map(|h| hosts.ranks(h).get(local).copied()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(ids: &[&str]) -> HostMap {
        HostMap::from_ids(&ids.iter().map(|s| s.as_bytes().to_vec()).collect::<Vec<_>>())
    }

    #[test]
    fn each_shape_has_its_eager_peers() {
        assert_eq!(eager_peers(1, 3, None).ranks(), &[0, 2], "tcp only: everyone");
        assert_eq!(eager_peers(1, 3, Some(&map(&["a", "a", "a"]))).ranks(), &[] as &[usize], "one host: no one");
        assert_eq!(eager_peers(1, 3, Some(&map(&["a", "b", "c"]))).ranks(), &[0, 2], "one rank per host: everyone");
        // Hosts a = [0, 2, 4], b = [1, 3], c = [5]: rails by local index.
        let m = map(&["a", "b", "a", "b", "a", "c"]);
        assert_eq!(eager_peers(0, 6, Some(&m)).ranks(), &[1, 5], "a leader: the other leaders");
        assert_eq!(eager_peers(2, 6, Some(&m)).ranks(), &[3]);
        assert_eq!(eager_peers(4, 6, Some(&m)).ranks(), &[] as &[usize], "no rank of local index 2 elsewhere");
    }

    #[test]
    fn the_relation_is_symmetric() {
        let m = map(&["a", "b", "a", "b", "a", "c", "c", "b"]);
        for a in 0..8 {
            for &b in eager_peers(a, 8, Some(&m)).ranks() {
                assert!(eager_peers(b, 8, Some(&m)).contains(a), "{a} lists {b}, not the other way");
            }
        }
    }
}

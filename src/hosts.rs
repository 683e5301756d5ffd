//! Which ranks of a group share a host, so that a group spanning several hosts can talk through
//! shared memory within each host and TCP between hosts (algorithms/mixed/).
//!
//! Terms: a rank's *host identity* is the hostname with /dev/shm's device and inode (what
//! shared memory needs: [`host_identity`]), or `XCCL_RS_HOST_ID` when set ([`this_host`]).
//! Ranks with equal identities form one *host*; hosts are numbered in the order of their lowest
//! rank, and a host's ranks are listed in rank order, so a rank's *local index* is its position
//! there. A host's *leader* is its lowest rank (local index 0). Every rank builds the
//! same map from the same published identities.

use std::time::Duration;

use crate::config::Config;
use crate::error::{CommError, Result};
use crate::keys::Key;
use crate::rendezvous::{Store, rendezvous_error};
use crate::transport::shm::files::SHM_DIR;

/// The longest host identity a rank may publish (hostname, `/dev/shm` device and inode, or
/// `XCCL_RS_HOST_ID`).
pub const MAX_HOST_ID_LEN: usize = 4096;

/// What identifies "this host and this /dev/shm" (NCCL's shm transport checks both).
pub fn host_identity() -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(SHM_DIR).ok()?;
    let mut buf = [0u8; 256];
    // SAFETY: `buf` is writable for its whole length.
    if unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } != 0 {
        return None;
    }
    let len = buf.iter().position(|&c| c == 0).unwrap_or(buf.len());
    Some(format!("{}|{}|{}", String::from_utf8_lossy(&buf[..len]), meta.dev(), meta.ino()))
}

/// Which ranks share memory: ranks whose identities are equal. `XCCL_RS_HOST_ID` when set, else
/// this host and its /dev/shm; empty when there is no /dev/shm (then no rank shares memory).
pub fn this_host(config: &Config) -> String {
    config.host_id.clone().or_else(host_identity).unwrap_or_default()
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostMap {
    /// Each host's ranks, ascending; hosts ordered by their lowest rank.
    hosts: Vec<Vec<usize>>,
    /// rank → host index.
    host_of: Vec<usize>,
    /// rank → position in its host's list.
    local_index: Vec<usize>,
}

impl HostMap {
    /// The map of ranks whose identities are `ids` (index = rank). An empty identity (this
    /// rank could not tell its host) is a host of its own: it never shares memory.
    pub fn from_ids(ids: &[Vec<u8>]) -> HostMap {
        let mut hosts: Vec<Vec<usize>> = Vec::new();
        let mut host_of = vec![0; ids.len()];
        let mut local_index = vec![0; ids.len()];
        for (rank, id) in ids.iter().enumerate() {
            let found = if id.is_empty() { None } else { hosts.iter().position(|h| ids[h[0]] == *id) };
            let h = found.unwrap_or_else(|| {
                hosts.push(Vec::new());
                hosts.len() - 1
            });
            host_of[rank] = h;
            local_index[rank] = hosts[h].len();
            hosts[h].push(rank);
        }
        HostMap { hosts, host_of, local_index }
    }

    /// Publishes this rank's identity under `xccl_rs/host/<rank>` and reads every rank's.
    pub fn exchange(store: &dyn Store, rank: usize, size: usize, mine: &str, timeout: Duration) -> Result<HostMap> {
        store.set(&Key::Host(rank).text(), mine.as_bytes())?;
        let mut ids = Vec::with_capacity(size);
        for peer in 0..size {
            let id = store.get(&Key::Host(peer).text(), timeout).map_err(|e| rendezvous_error(rank, peer, e))?;
            if id.len() > MAX_HOST_ID_LEN {
                return Err(CommError::io(format!(
                    "rank {peer} published a host identity of {} bytes (at most {MAX_HOST_ID_LEN})",
                    id.len()
                )));
            }
            ids.push(id);
        }
        Ok(HostMap::from_ids(&ids))
    }

    pub fn host_count(&self) -> usize {
        self.hosts.len()
    }

    pub fn world_size(&self) -> usize {
        self.host_of.len()
    }

    /// Host `h`'s ranks, ascending.
    pub fn ranks(&self, h: usize) -> &[usize] {
        &self.hosts[h]
    }

    pub fn host_of(&self, rank: usize) -> usize {
        self.host_of[rank]
    }

    pub fn local_index(&self, rank: usize) -> usize {
        self.local_index[rank]
    }

    pub fn leader(&self, h: usize) -> usize {
        self.hosts[h][0]
    }

    /// Whether some host has two or more ranks (otherwise shared memory has nothing to do).
    pub fn any_shared(&self) -> bool {
        self.hosts.iter().any(|h| h.len() > 1)
    }

    /// The ranks per host when every host has the same number of them (then local index i of
    /// every host exists and the hosts' rails line up), else `None`.
    pub fn uniform(&self) -> Option<usize> {
        let k = self.hosts.first()?.len();
        self.hosts.iter().all(|h| h.len() == k).then_some(k)
    }

    /// The *rail* of local index `i`: the rank of local index `i` on every host, in host order
    /// (a rail-aligned step runs among them; on real nodes each GPU's NIC is on its own rail).
    /// Hosts without such a rank are skipped.
    pub fn rail(&self, i: usize) -> Vec<usize> {
        self.hosts.iter().filter_map(|h| h.get(i).copied()).collect()
    }

    /// One rank per host: `root` for its own host, the leader for every other. These are the
    /// ranks that talk over TCP in a hierarchical step rooted at `root`; with `root` = rank 0
    /// (a leader) they are exactly the leaders.
    pub fn representatives(&self, root: usize) -> Vec<usize> {
        (0..self.hosts.len()).map(|h| if h == self.host_of[root] { root } else { self.leader(h) }).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::HostMap;

    fn map(ids: &[&str]) -> HostMap {
        HostMap::from_ids(&ids.iter().map(|s| s.as_bytes().to_vec()).collect::<Vec<_>>())
    }

    #[test]
    fn hosts_in_order_of_lowest_rank() {
        let m = map(&["b", "a", "b", "c", "a"]);
        assert_eq!(m.host_count(), 3);
        assert_eq!(m.ranks(0), &[0, 2]);
        assert_eq!(m.ranks(1), &[1, 4]);
        assert_eq!(m.ranks(2), &[3]);
        assert_eq!((m.host_of(4), m.local_index(4), m.leader(1)), (1, 1, 1));
        assert_eq!(m.representatives(4), vec![0, 4, 3]);
        assert_eq!(m.representatives(0), vec![0, 1, 3]);
        assert!(m.any_shared());
        assert_eq!(m.uniform(), None);
        assert_eq!(m.rail(1), vec![2, 4]);
    }

    #[test]
    fn rails_of_uniform_hosts() {
        let m = map(&["a", "b", "a", "b", "a", "b"]);
        assert_eq!(m.uniform(), Some(3));
        assert_eq!(m.rail(0), vec![0, 1]);
        assert_eq!(m.rail(2), vec![4, 5]);
    }

    #[test]
    fn unknown_identities_never_share() {
        let m = map(&["", "", "x"]);
        assert_eq!(m.host_count(), 3);
        assert!(!m.any_shared());
        assert_eq!(map(&["x", "x"]).host_count(), 1);
    }
}

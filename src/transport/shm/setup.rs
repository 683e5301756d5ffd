//! Setting up a shared-memory group: every rank creates its segment (and its heap, where the
//! group has heaps), publishes their names through the store, maps every peer's, probes
//! cross-memory attach and opening peers' files through /proc (for staging arenas), and agrees
//! with every rank on what the group can do beyond the slots,
//! so that every rank takes the same path through a collective. Then each rank unlinks its
//! files: from then on nothing of the group is visible in /dev/shm.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::arena::{open_peer_fd, same_file};
use super::group::ShmGroup;
use super::cma::{self, CmaPeers};
use super::heap::{HEAP_PAGE, Heap, Heaps, PeerHeap};
use super::layout::RankHeader;
use super::segment::Segment;
use super::settings::ShmSettings;
use crate::config::CmaUse;
use crate::error::{CommError, Result};
use crate::keys::Key;
use crate::rendezvous::{Store, rendezvous_error};

impl ShmGroup {
    /// Creates this rank's segment, maps every peer's, and unlinks ours once all ranks have
    /// mapped everything. `members` are the group ranks of the local indices (`rank` is this
    /// rank's local index); `namespace` keeps the store keys of different hosts' groups apart
    /// (empty for a single-host group, whose keys are then `xccl_rs/shm/<rank>`).
    pub fn setup(store: &dyn Store, members: &[usize], rank: usize, namespace: &str, settings: ShmSettings) -> Result<ShmGroup> {
        let ShmSettings { slot_bytes, timeout, heap_bytes, .. } = settings;
        let me = members[rank];
        let (own, name) = Segment::create(slot_bytes)?;
        store.set(&Key::ShmSegment { namespace, rank }.text(), name.as_bytes())?;
        // Where this process sees its own header: peers probe cross-memory attach with it.
        let own_header = own.header() as *const RankHeader as u64;
        store.set(&Key::ShmCma { namespace, rank }.text(), own_header.to_string().as_bytes())?;
        let heap = create_heap(heap_bytes, me);
        let heap_name = heap.as_ref().map_or(String::new(), |(_, name)| name.clone());
        store.set(&Key::ShmHeap { namespace, rank }.text(), heap_name.as_bytes())?;
        let heap = heap.map(|(heap, _)| heap);
        let mut segments = map_segments(store, members, rank, namespace, own, slot_bytes, timeout)?;
        let peer_heaps = match heap {
            Some(_) => Some(map_peer_heaps(store, members, rank, namespace, timeout)?),
            None => None,
        };
        let all_heaps = peer_heaps.as_ref().is_some_and(|p| p.iter().enumerate().all(|(peer, h)| peer == rank || h.is_some()));
        let reads_peers = settings.cma != CmaUse::Never && cma::probe_peers(store, members, rank, namespace, &segments, timeout)?;
        let reads_ordinary = settings.cma == CmaUse::Everything;
        let opens_peers = settings.registered_staging && opens_peers_files(&segments, rank);
        let said = Said { all_heaps, reads_peers, reads_ordinary, opens_peers };
        let agreed = agree(store, members, rank, namespace, said, timeout)?;
        segments[rank].unlink();
        if let Some(heap) = &heap {
            heap.unlink();
        }
        for (peer, seg) in segments.iter().enumerate() {
            if !seg.header().is_valid() {
                return Err(CommError::io(format!("rank {}'s shared-memory segment is not initialized", members[peer])));
            }
        }
        let heaps = heap.map(|own| Heaps::new(own, peer_heaps.filter(|_| agreed.zero_copy), agreed.open_peers));
        let cma = agreed.all_read.then(|| CmaPeers::of(&segments, agreed.ordinary)).flatten();
        Ok(ShmGroup::new(rank, members, settings, segments, heaps, cma))
    }
}

/// This rank's heap of `heap_bytes` (none below a page) and its name. A heap that cannot be
/// made (address space limits, say) leaves the group without zero-copy, not without shared
/// memory.
fn create_heap(heap_bytes: usize, me: usize) -> Option<(Arc<Heap>, String)> {
    match (heap_bytes >= HEAP_PAGE).then(|| Heap::create(heap_bytes)).transpose() {
        Ok(heap) => heap.map(|(heap, name)| (Arc::new(heap), name)),
        Err(e) => {
            tracing::warn!("rank {me}: no shared-memory heap, so no zero-copy collectives: {}", e.message);
            None
        }
    }
}

/// Every rank's segment, mapped here (index = local rank), this rank's `own` among them.
fn map_segments(
    store: &dyn Store,
    members: &[usize],
    rank: usize,
    namespace: &str,
    own: Segment,
    slot_bytes: usize,
    timeout: Duration,
) -> Result<Vec<Segment>> {
    let me = members[rank];
    let mut segments = Vec::with_capacity(members.len());
    let mut own = Some(own);
    for (peer, &member) in members.iter().enumerate() {
        if peer == rank {
            segments.push(own.take().expect("own segment placed once"));
            continue;
        }
        let peer_name = store.get(&Key::ShmSegment { namespace, rank: peer }.text(), timeout).map_err(|e| rendezvous_error(me, member, e))?;
        segments.push(Segment::open(&String::from_utf8_lossy(&peer_name), slot_bytes)?);
    }
    Ok(segments)
}

/// Every peer's heap, mapped here where it can be (None at this rank's index, and for a peer
/// without a heap or whose heap cannot be mapped).
fn map_peer_heaps(store: &dyn Store, members: &[usize], rank: usize, namespace: &str, timeout: Duration) -> Result<Vec<Option<PeerHeap>>> {
    let me = members[rank];
    let mut peer_heaps = Vec::with_capacity(members.len());
    for (peer, &member) in members.iter().enumerate() {
        if peer == rank {
            peer_heaps.push(None);
            continue;
        }
        let name = store.get(&Key::ShmHeap { namespace, rank: peer }.text(), timeout).map_err(|e| rendezvous_error(me, member, e))?;
        let name = String::from_utf8_lossy(&name);
        // A peer's heap that cannot be mapped here (an address-space limit, say) leaves the
        // group without zero-copy: this rank then says so in `agree`, and every rank agrees.
        peer_heaps.push(match name.is_empty() {
            true => None,
            false => PeerHeap::open(&name)
                .map_err(|e| tracing::warn!("rank {me}: rank {member}'s heap is not mapped, so no zero-copy collectives: {}", e.message))
                .ok(),
        });
    }
    Ok(peer_heaps)
}

/// Whether this rank can open every peer's files through /proc, as it would a peer's staging
/// arena (transport/shm/arena.rs): each peer's segment, opened so, is the file mapped here.
fn opens_peers_files(segments: &[Segment], rank: usize) -> bool {
    segments.iter().enumerate().filter(|&(peer, _)| peer != rank).all(|(_, segment)| {
        let header = segment.header();
        let (pid, fd) = (header.pid.0.load(Ordering::Relaxed), header.segment_fd.0.load(Ordering::Relaxed));
        let opened = open_peer_fd(pid, fd).is_ok_and(|file| same_file(&file, segment.file()));
        if !opened {
            tracing::debug!("cannot open the files of process {pid} through /proc: staged broadcasts copy on the host");
        }
        opened
    })
}

/// What this rank can do, for [`agree`].
struct Said {
    /// It has a heap and mapped every peer's.
    all_heaps: bool,
    /// It can read every peer by cross-memory attach.
    reads_peers: bool,
    /// It would for ordinary tensors too (`XCCL_RS_CMA=1`).
    reads_ordinary: bool,
    /// It may use staging arenas and can open every peer's (`opens_peers_files`).
    opens_peers: bool,
}

/// What every rank of the group can do, the same on every rank ([`agree`]).
struct Agreed {
    /// Every rank has a heap and mapped every peer's.
    zero_copy: bool,
    /// Every rank can read every peer by cross-memory attach.
    all_read: bool,
    /// And every rank reads ordinary tensors that way too (`XCCL_RS_CMA=1`).
    ordinary: bool,
    /// Every rank may use staging arenas and can open every peer's.
    open_peers: bool,
}

/// Publishes what this rank can do ([`Said`]) and reads every rank's: the group does what
/// all can.
fn agree(store: &dyn Store, members: &[usize], rank: usize, namespace: &str, said: Said, timeout: Duration) -> Result<Agreed> {
    let me = members[rank];
    // "h": this rank can take part in zero-copy collectives; then "c": it can read every peer
    // by cross-memory attach; "o": of ordinary tensors too; "f": it can open peers' files.
    let mut flags = vec![if said.all_heaps { b'h' } else { b'1' }];
    if said.reads_peers {
        flags.push(b'c');
        if said.reads_ordinary {
            flags.push(b'o');
        }
    }
    if said.opens_peers {
        flags.push(b'f');
    }
    store.set(&Key::ShmMapped { namespace, rank }.text(), &flags)?;
    let mut agreed = Agreed { zero_copy: true, all_read: true, ordinary: true, open_peers: true };
    for (peer, &member) in members.iter().enumerate() {
        let mapped = store.get(&Key::ShmMapped { namespace, rank: peer }.text(), timeout).map_err(|e| rendezvous_error(me, member, e))?;
        let (first, rest) = mapped.split_first().map_or((None, &[][..]), |(f, r)| (Some(*f), r));
        agreed.zero_copy &= first == Some(b'h');
        agreed.all_read &= rest.contains(&b'c');
        agreed.ordinary &= rest.contains(&b'o');
        agreed.open_peers &= rest.contains(&b'f');
    }
    agreed.ordinary &= agreed.all_read;
    Ok(agreed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rendezvous::MemoryStore;

    /// Sets up a group of as many ranks as `heap_bytes` has entries (threads of this process),
    /// rank r with a heap of `heap_bytes[r]`; returns, per rank, whether it has a heap and
    /// whether it reads its peers' heaps.
    fn heaps_of(heap_bytes: &[usize]) -> Vec<(bool, bool)> {
        let store = Arc::new(MemoryStore::default());
        let members: Vec<usize> = (0..heap_bytes.len()).collect();
        let ranks: Vec<_> = heap_bytes
            .iter()
            .enumerate()
            .map(|(rank, &heap_bytes)| {
                let (store, members) = (store.clone(), members.clone());
                std::thread::spawn(move || {
                    let settings = ShmSettings {
                        slot_bytes: 4096,
                        spin: Duration::ZERO,
                        timeout: Duration::from_secs(20),
                        heap_bytes,
                        cma: CmaUse::Never,
                        registered_staging: true,
                        oneshot_bytes: 0,
                        pipeline_chunk_log: 20,
                    };
                    let group = ShmGroup::setup(store.as_ref(), &members, rank, "/test", settings).unwrap();
                    assert!(group.cma().is_none(), "cross-memory attach with XCCL_RS_CMA=0");
                    (group.heaps().is_some(), group.heaps().is_some_and(|h| h.zero_copy()))
                })
            })
            .collect();
        ranks.into_iter().map(|t| t.join().unwrap()).collect()
    }

    #[test]
    fn zero_copy_only_where_every_rank_has_a_heap() {
        assert_eq!(heaps_of(&[16 * HEAP_PAGE, 16 * HEAP_PAGE, 16 * HEAP_PAGE]), vec![(true, true); 3]);
        // A rank without a heap leaves the others theirs (to allocate from), but no rank reads
        // a peer's.
        assert_eq!(heaps_of(&[16 * HEAP_PAGE, 0, 16 * HEAP_PAGE]), vec![(true, false), (false, false), (true, false)]);
    }
}

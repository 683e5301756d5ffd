//! Registered shared staging: a broadcast's root stages its accelerator tensor in its *arena*,
//! shared memory registered with the device runtime, and each receiver copies it onto its own
//! device straight from there (the root's arena, mapped in the receiver's process and registered
//! there too). No host copy is left between the root's copy off its device and the receivers'
//! copies onto theirs: the broadcast runs at its link's speed.
//!
//! An arena is a file of [`WINDOW_SETS`] pipeline chunks (transport/shm/arena.rs) that peers
//! open through /proc. Registering memory costs about as much as touching every page, and a
//! sync that builds a new group every round (verl's rebuild_group) would pay that each round.
//! So arenas belong to the process, not to a group:
//! - a group takes an arena the first time one of its jobs can use it, holds it for its life
//!   (nothing else writes it meanwhile), and gives it back when it ends; the next group takes
//!   it again, registered;
//! - a receiver keeps the peers' arenas it mapped, registered, for the next groups too, which is
//!   sound because an arena never moves and its memory is never handed out for anything else.
//!
//! A root says with each op whether its buffer lies in its arena (`Placement::arena`), and where
//! the arena's file is (`RankHeader::arena`). Where the runtime cannot register host memory
//! (XPU in torch today), or a peer's /proc is out of reach (setup.rs), nothing changes: pinned
//! blocks from the runtime's allocator, and a host copy per receiver.

use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;

use super::plan::WINDOW_SETS;
use super::DeviceCopies;
use crate::buf::RawBuf;
use crate::error::Result;
use crate::transport::shm::arena::{ArenaFile, PeerArena};
use crate::transport::shm::layout::ArenaId;

/// Arenas that no group holds now, still registered, for this process's next groups.
static IDLE_ARENAS: Mutex<Vec<Arena>> = Mutex::new(Vec::new());
/// How many idle arenas stay registered (a process roots one broadcast at a time per group).
const IDLE_ARENAS_KEPT: usize = 1;
/// Peers' arenas mapped in this process, registered where the runtime can.
static PEER_ARENAS: Mutex<Vec<Arc<MappedArena>>> = Mutex::new(Vec::new());
/// How many peers' arenas stay mapped once no group reads them.
const PEER_ARENAS_KEPT: usize = 4;

/// Host memory registered with a device runtime; unregistered when dropped, which must happen
/// before the memory is unmapped.
pub struct HostRegistration {
    address: usize,
    unregister: fn(usize),
}

impl HostRegistration {
    /// Memory at `address`, registered; `unregister(address)` ends the registration.
    pub fn new(address: usize, unregister: fn(usize)) -> HostRegistration {
        HostRegistration { address, unregister }
    }
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        (self.unregister)(self.address);
    }
}

/// The bytes of a rank's arena at pipeline chunks of `chunk_bytes`: a window's sets of one
/// slot (plan.rs), which also holds a tensor of up to two chunks whole.
pub fn arena_bytes(chunk_bytes: usize) -> usize {
    WINDOW_SETS.saturating_mul(chunk_bytes)
}

/// This process's arena, registered.
struct Arena {
    // Declared first: dropped, so unregistered, before the file is unmapped.
    _registration: HostRegistration,
    /// The runtime it is registered with (`DeviceCopies::registrar`).
    registrar: fn(usize),
    file: ArenaFile,
}

/// A peer's arena mapped here, and its registration in this process once asked for.
pub struct MappedArena {
    // Declared first: dropped, so unregistered, before the arena is unmapped.
    registration: Mutex<Registration>,
    pid: u64,
    arena: PeerArena,
}

enum Registration {
    NotAsked,
    /// With the runtime of that registrar (`DeviceCopies::registrar`).
    Registered(fn(usize), #[allow(dead_code)] HostRegistration),
    /// The runtime failed to register it.
    Refused,
}

impl MappedArena {
    /// `len` bytes of the arena's data from `offset`, if they lie inside it.
    pub fn range(&self, offset: u64, len: usize) -> Option<RawBuf> {
        self.arena.range(offset, len)
    }

    /// Whether the arena is registered in this process with `device`'s runtime: registered
    /// through it the first time. False where the runtime cannot register host memory.
    pub fn registered(&self, device: &mut dyn DeviceCopies) -> Result<bool> {
        let Some(registrar) = device.registrar() else {
            return Ok(false);
        };
        let mut registration = self.registration.lock();
        if let Registration::NotAsked = *registration {
            let (address, bytes) = self.arena.data();
            let started = Instant::now();
            *registration = match device.register(address, bytes)? {
                Some(r) => {
                    tracing::debug!(bytes, ms = started.elapsed().as_secs_f64() * 1e3, "registered a peer's staging arena");
                    Registration::Registered(registrar, r)
                }
                None => Registration::Refused,
            };
        }
        Ok(matches!(*registration, Registration::Registered(with, _) if std::ptr::fn_addr_eq(with, registrar)))
    }

    fn is(&self, pid: u64, id: ArenaId) -> bool {
        self.pid == pid && self.arena.id() == id
    }
}

/// A group's part in registered shared staging, kept by its heaps (transport/shm/heap.rs
/// `Heaps`): the arena it holds as a root, and the peers' arenas it read from.
pub struct SharedStaging {
    arena: Option<Arena>,
    /// Not to be asked for an arena: `XCCL_RS_REGISTERED_STAGING=0`, a peer's /proc out of
    /// reach, or the runtime refused one once.
    refused: bool,
    peers: Vec<Arc<MappedArena>>,
}

impl SharedStaging {
    /// `enabled`: whether a root may stage in an arena (`XCCL_RS_REGISTERED_STAGING`, and every
    /// rank can open every peer's files: setup.rs).
    pub fn new(enabled: bool) -> SharedStaging {
        SharedStaging { arena: None, refused: !enabled, peers: Vec::new() }
    }

    /// The address of the arena this group holds, of `bytes`: the first time, an idle arena of
    /// the process registered with `device`'s runtime, or a new one registered through it. None
    /// where the runtime cannot register host memory (then later jobs stage through pinned
    /// blocks).
    pub fn arena(&mut self, bytes: usize, device: &mut dyn DeviceCopies) -> Result<Option<usize>> {
        if self.arena.is_none() && !self.refused {
            self.refused = true;
            let Some(registrar) = device.registrar() else {
                return Ok(None);
            };
            let idle = {
                let mut idle = IDLE_ARENAS.lock();
                let at = idle.iter().position(|a| a.file.bytes() == bytes && std::ptr::fn_addr_eq(a.registrar, registrar));
                at.map(|at| idle.swap_remove(at))
            };
            self.arena = match idle {
                Some(arena) => Some(arena),
                None => new_arena(bytes, registrar, device)?,
            };
            self.refused = self.arena.is_none();
        }
        Ok(self.arena.as_ref().map(|a| a.file.data()))
    }

    /// What peers open this group's arena by, once it holds one.
    pub fn id(&self) -> Option<ArenaId> {
        self.arena.as_ref().map(|a| a.file.id())
    }

    /// Where `views` lie in this group's arena: the offset of the one view and its length (a
    /// broadcast root's buffer), or None if they are not one view inside it.
    pub fn placement(&self, views: &[RawBuf]) -> Option<(u64, u64)> {
        let (arena, [view]) = (self.arena.as_ref()?, views) else {
            return None;
        };
        let offset = (view.ptr() as usize).checked_sub(arena.file.data())?;
        (offset.checked_add(view.len())? <= arena.file.bytes()).then_some((offset as u64, view.len() as u64))
    }

    /// The arena that process `pid` published as `id`, mapped here: the one this group or an
    /// earlier one mapped, or mapped now.
    pub fn peer(&mut self, pid: u64, id: ArenaId) -> Result<Arc<MappedArena>> {
        if let Some(mapped) = self.peers.iter().find(|m| m.is(pid, id)) {
            return Ok(mapped.clone());
        }
        let mapped = {
            let mut cache = PEER_ARENAS.lock();
            match cache.iter().find(|m| m.is(pid, id)) {
                Some(mapped) => mapped.clone(),
                None => {
                    let mapped = Arc::new(MappedArena { registration: Mutex::new(Registration::NotAsked), pid, arena: PeerArena::open(pid, id)? });
                    forget_unused(&mut cache);
                    cache.push(mapped.clone());
                    mapped
                }
            }
        };
        self.peers.push(mapped.clone());
        Ok(mapped)
    }
}

impl Drop for SharedStaging {
    fn drop(&mut self) {
        if let Some(arena) = self.arena.take() {
            let mut idle = IDLE_ARENAS.lock();
            if idle.len() < IDLE_ARENAS_KEPT {
                idle.push(arena);
            }
        }
    }
}

fn new_arena(bytes: usize, registrar: fn(usize), device: &mut dyn DeviceCopies) -> Result<Option<Arena>> {
    let file = match ArenaFile::create(bytes) {
        Ok(file) => file,
        Err(e) => {
            tracing::warn!("no staging arena, so staged broadcasts copy on the host: {}", e.message);
            return Ok(None);
        }
    };
    let started = Instant::now();
    let registration = device.register(file.data(), bytes)?;
    if registration.is_some() {
        tracing::debug!(bytes, ms = started.elapsed().as_secs_f64() * 1e3, "registered the staging arena");
    }
    Ok(registration.map(|r| Arena { _registration: r, registrar, file }))
}

/// Unmaps the peers' arenas that no group reads and whose process is gone, then, past
/// [`PEER_ARENAS_KEPT`], the oldest unread ones.
fn forget_unused(cache: &mut Vec<Arc<MappedArena>>) {
    let unread = |m: &Arc<MappedArena>| Arc::strong_count(m) == 1;
    // SAFETY: kill with signal 0 only checks whether the process exists.
    let gone = |m: &Arc<MappedArena>| i32::try_from(m.pid).is_ok_and(|p| unsafe { libc::kill(p, 0) } != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH));
    cache.retain(|m| !(unread(m) && gone(m)));
    while cache.len() >= PEER_ARENAS_KEPT {
        let Some(oldest) = cache.iter().position(unread) else { break };
        cache.remove(oldest);
    }
}

/// Unregisters and frees the arenas that no group holds, and unmaps the peers' arenas that no
/// group reads. The next group registers anew.
pub fn release_idle_arenas() {
    IDLE_ARENAS.lock().clear();
    PEER_ARENAS.lock().retain(|m| Arc::strong_count(m) > 1);
}

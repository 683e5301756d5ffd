//! Endpoints outlive their groups: a group that ends cleanly gives its endpoint back to its
//! process, and the next group of the process on the same provider and domain takes it instead
//! of opening one (opening a `tcp;ofi_rxm` endpoint costs about 55 ms of CPU and 33 MiB of
//! buffers; verl builds a group for every weight sync).
//!
//! A reused endpoint serves its next group one *generation* later, and every tag to it carries
//! its generation (tags.rs): a message a peer sent to the group before, still in flight or
//! unmatched in the provider's queue, can never match the next group's receives. An endpoint
//! is closed instead of reused once its generations run out (16 at 20 tag bits, 256 from 28),
//! so a generation never repeats. Only a clean end gives an endpoint back: no post of the
//! group outstanding (held sends delivered, look-aheads cancelled and read back), no failed
//! phase, no abort. Anything else closes it, or gives it up (exchange.rs), as before.
//!
//! One idle endpoint is kept per provider, domain and setting (several where ranks of one
//! process, as in tests, end groups together), at most [`MAX_IDLE`] in all. A process forked
//! from one that kept idle endpoints never takes them: their sockets are its parent's too.

use std::collections::HashMap;

use parking_lot::Mutex;

use super::shim::Endpoint;

/// The most idle endpoints a process keeps.
const MAX_IDLE: usize = 4;

/// What an endpoint was opened for: a group takes an idle endpoint only if all of it matches.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PoolKey {
    pub provider: String,
    pub domain: String,
    pub wait_fd: bool,
    pub tag_bits: u32,
}

/// An endpoint with what it keeps between groups.
pub struct Pooled {
    pub ep: Endpoint,
    pub key: PoolKey,
    /// The generation of the group it serves (tags to it carry it).
    pub generation: u32,
    /// Peers' addresses already in its address vector, and their handles: a peer met again
    /// is not inserted again.
    pub known: HashMap<Vec<u8>, u64>,
}

/// Idle endpoints, with the process that gave each back.
static IDLE: Mutex<Vec<(u32, Pooled)>> = Mutex::new(Vec::new());

/// An idle endpoint for `key`, its generation already advanced for the new group.
pub fn take(key: &PoolKey) -> Option<Pooled> {
    let mut idle = IDLE.lock();
    forget_inherited(&mut idle);
    let at = idle.iter().position(|(_, p)| p.key == *key)?;
    let (_, mut p) = idle.swap_remove(at);
    p.generation += 1;
    Some(p)
}

/// Drops, without closing them, endpoints a parent process gave back before it forked this one:
/// closing them here would close connections the parent still uses.
fn forget_inherited(idle: &mut Vec<(u32, Pooled)>) {
    let me = std::process::id();
    for (_, p) in idle.extract_if(.., |(pid, _)| *pid != me) {
        std::mem::forget(p);
    }
}

/// Gives back the endpoint of a group that ended cleanly, unless its generations are spent
/// (`generations`: how many its tag layout has), in which case it closes.
pub fn give_back(p: Pooled, generations: u32) {
    if p.generation + 1 >= generations {
        return;
    }
    let mut idle = IDLE.lock();
    forget_inherited(&mut idle);
    if idle.len() >= MAX_IDLE {
        idle.remove(0);
    }
    idle.push((std::process::id(), p));
}

/// The generations of the idle endpoints, oldest first (tests).
pub fn idle_generations() -> Vec<u32> {
    IDLE.lock().iter().map(|(_, p)| p.generation).collect()
}

/// Closes every idle endpoint (tests).
pub fn release_idle() {
    let mut idle = IDLE.lock();
    forget_inherited(&mut idle);
    idle.clear();
}

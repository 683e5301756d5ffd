//! The shared-memory transport, used when every rank of a group runs on the same host. Each
//! rank owns one segment (segment.rs) with a header of counters (layout.rs) and two data slots;
//! collectives (algorithms/host/) move data through the slots in blocks, reading peers' slots
//! directly, and synchronize through the counters (group.rs), spinning briefly and then
//! sleeping on a futex (futex.rs). What a group can do besides the slots is set up with it
//! (setup.rs) and reported by it: reading tensors in the ranks' heaps (heap.rs), reading
//! peers' memory by cross-memory attach (cma.rs), and opening their staging arenas (arena.rs).

pub mod arena;
pub mod cma;
pub mod desc;
pub mod files;
pub mod futex;
pub mod group;
pub mod heap;
pub mod layout;
pub mod segment;
pub mod settings;
mod setup;

pub use desc::Desc;
pub use group::{Counter, ShmGroup};
pub use settings::ShmSettings;

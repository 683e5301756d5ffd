//! The shared-memory transport, used when every rank of a group runs on the same host. Each
//! rank owns one segment (segment.rs) with a header of counters (layout.rs) and two data slots;
//! collectives (algorithms/*_shm.rs) move data through the slots in blocks, reading peers'
//! slots directly, and synchronize through the counters (group.rs), spinning briefly and then
//! sleeping on a futex (futex.rs).

pub mod cma;
pub mod futex;
pub mod group;
pub mod heap;
pub mod layout;
pub mod segment;
pub mod settings;

pub use group::{Counter, ShmGroup};
pub use layout::Desc;
pub use settings::ShmSettings;

//! The algorithms over the mesh (fabric.rs): TCP between every pair of ranks, or a `Subset`
//! of it. Each is written against [`Phase`](super::Phase): it lists the sends and receives of
//! one step and lets the transport complete them together. They are *direct*: a rank
//! exchanges with each peer itself. Point-to-point messages (p2p.rs) take this path too.
//! rooted.rs is not an algorithm but the step that broadcast, gather and scatter share.

pub mod allgather_direct;
pub mod allreduce_direct;
pub mod allreduce_ring;
pub mod alltoall_pairwise;
pub mod barrier_direct;
pub mod broadcast_direct;
pub mod gather_direct;
pub mod p2p;
pub mod reduce_direct;
pub mod reduce_scatter_direct;
mod rooted;
pub mod scatter_direct;

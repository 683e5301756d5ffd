//! The algorithms over one host's shared memory (`ShmGroup`, transport/shm/group.rs): data
//! moves through each rank's two slots in blocks, synchronized by counters. The steps every
//! one of them repeats per block are in blocks.rs. Buffers that every rank allocated in its
//! shared-memory heap skip the slots: the `*_zero_copy.rs` algorithms (zero_copy.rs).

pub mod allgather_shm;
pub mod allgather_zero_copy;
pub mod allreduce_cma;
pub mod allreduce_shm;
pub mod allreduce_zero_copy;
pub mod barrier_shm;
pub mod blocks;
pub mod broadcast_shm;
pub mod broadcast_zero_copy;
pub mod gather_shm;
pub mod reduce_scatter_shm;
pub mod reduce_scatter_zero_copy;
pub mod reduce_shm;
pub mod scatter_shm;
pub mod zero_copy;

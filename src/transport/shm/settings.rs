//! A shared-memory group's settings. Fabric::build reads them from the group's configuration
//! (config.rs) and hands them to the group at set-up; the group keeps what its collectives and
//! the selection table read later (the one-shot limit, the pipeline's chunk size), so that every
//! shared-memory setting reaches the code that uses it through the group alone.

use std::time::Duration;

use crate::config::{CmaUse, Config};

#[derive(Clone, Copy, Debug)]
pub struct ShmSettings {
    /// A slot's size (`XCCL_RS_SHM_CHUNK_BYTES`).
    pub slot_bytes: usize,
    /// How long a waiting rank spins before it sleeps on the futex (`XCCL_RS_SPIN_US`).
    pub spin: Duration,
    /// How long set-up waits for the peers (the group's timeout).
    pub timeout: Duration,
    /// The size of this rank's heap; 0 for none (`XCCL_RS_SHM_HEAP_BYTES` where the group
    /// reads tensors in place).
    pub heap_bytes: usize,
    /// What ranks read of each other by cross-memory attach (`XCCL_RS_CMA`).
    pub cma: CmaUse,
    /// Whether a broadcast root may stage in a registered arena (`XCCL_RS_REGISTERED_STAGING`).
    pub registered_staging: bool,
    /// What each rank of a one-shot all-reduce may read (`XCCL_RS_SHM_ONESHOT_BYTES`): a
    /// capability the selection table compares (select.rs `ShmCaps`).
    pub oneshot_bytes: usize,
    /// log2 of the pipeline's chunk size (pipeline.rs), written in every op's description so
    /// that ranks configured differently fail instead of exchanging different ranges.
    pub pipeline_chunk_log: u8,
}

impl ShmSettings {
    /// The settings `config` gives a group with a heap of `heap_bytes`.
    pub fn of(config: &Config, heap_bytes: usize) -> ShmSettings {
        ShmSettings {
            slot_bytes: config.shm_slot_bytes,
            spin: config.spin,
            timeout: config.timeout,
            heap_bytes,
            cma: config.cma,
            registered_staging: config.registered_staging,
            oneshot_bytes: config.shm_oneshot_bytes,
            pipeline_chunk_log: config.pipeline_chunk_bytes.trailing_zeros() as u8,
        }
    }
}

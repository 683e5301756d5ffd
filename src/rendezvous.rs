//! Exchange of addresses and tokens through a key-value store. In production the store is the
//! c10d Store the backend creator receives (reached through the C++ bridge); in tests it is
//! [`MemoryStore`]. Keys are already scoped to one group by the caller's prefix store.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::error::{CommError, ErrorKind, Result};

/// The two calls rendezvous needs from a c10d-like store.
pub trait Store: Send + Sync {
    fn set(&self, key: &str, value: &[u8]) -> Result<()>;
    /// Blocks until `key` exists or `timeout` passes.
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>>;
}

/// An in-process store for tests: ranks as threads share one `Arc<MemoryStore>`.
#[derive(Default)]
pub struct MemoryStore {
    map: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
}

impl MemoryStore {
    pub fn new() -> Arc<MemoryStore> {
        Arc::new(MemoryStore::default())
    }
}

impl Store for MemoryStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let mut map = self.map.lock().map_err(|_| CommError::io("store lock poisoned"))?;
        map.insert(key.to_string(), value.to_vec());
        self.changed.notify_all();
        Ok(())
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let deadline = Instant::now() + timeout;
        let mut map = self.map.lock().map_err(|_| CommError::io("store lock poisoned"))?;
        loop {
            if let Some(v) = map.get(key) {
                return Ok(v.clone());
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(CommError::new(
                    ErrorKind::Timeout,
                    format!("timed out after {timeout:?} waiting for store key '{key}'"),
                ));
            }
            map = self
                .changed
                .wait_timeout(map, deadline - now)
                .map_err(|_| CommError::io("store lock poisoned"))?
                .0;
        }
    }
}

impl<S: Store + ?Sized> Store for Arc<S> {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        (**self).set(key, value)
    }
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        (**self).get(key, timeout)
    }
}

/// Key under which `rank` publishes how to reach it.
pub fn address_key(rank: usize) -> String {
    format!("xccl_rs/addr/{rank}")
}

/// Key of the group token: a random number from rank 0 that every connection must present, so a
/// stray connection from another group or an earlier run is refused rather than mistaken for a peer.
pub const TOKEN_KEY: &str = "xccl_rs/token";

/// Rank 0 draws the token and publishes it; the others read it.
pub fn agree_on_token(store: &dyn Store, rank: usize, timeout: Duration) -> Result<u64> {
    if rank == 0 {
        let mut bytes = [0u8; 8];
        getrandom::fill(&mut bytes).map_err(|e| CommError::io(format!("getrandom failed: {e}")))?;
        store.set(TOKEN_KEY, &bytes)?;
        Ok(u64::from_le_bytes(bytes))
    } else {
        let v = store.get(TOKEN_KEY, timeout).map_err(|e| rendezvous_error(rank, 0, e))?;
        let bytes: [u8; 8] = v
            .as_slice()
            .try_into()
            .map_err(|_| CommError::io(format!("group token has {} bytes, expected 8", v.len())))?;
        Ok(u64::from_le_bytes(bytes))
    }
}

/// A store error during set-up, reworded to say which rank never showed up.
pub fn rendezvous_error(rank: usize, waiting_for: usize, e: CommError) -> CommError {
    CommError::new(
        e.kind.clone(),
        format!(
            "xccl_rs: rank {rank} could not reach rank {waiting_for} during connection set-up \
             (did every rank create the group?): {}",
            e.message
        ),
    )
}

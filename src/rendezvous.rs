//! Exchange of addresses and the group's secret through a key-value store. In production the store is the
//! c10d Store the backend creator receives (reached through the C++ bridge); in tests it is
//! [`MemoryStore`]. Keys are already scoped to one group by the caller's prefix store.

use std::collections::HashMap;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::error::{CommError, Result};
use crate::keys::Key;
use crate::transport::tcp::handshake::{SECRET_LEN, Secret};

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
                return Err(CommError::timeout(format!("timed out after {timeout:?} waiting for store key '{key}'")));
            }
            map = self.changed.wait_timeout(map, deadline - now).map_err(|_| CommError::io("store lock poisoned"))?.0;
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

/// Rank 0 draws the group's secret and publishes it ([`Key::Secret`]); the others read it. The
/// secret is 32 random bytes with which every TCP connection of the group authenticates
/// (transport/tcp/handshake.rs). The Store is the trust root, as it is for every c10d backend:
/// whoever can read the group's keys can join its links.
pub fn agree_on_secret(store: &dyn Store, rank: usize, timeout: Duration) -> Result<Secret> {
    if rank == 0 {
        let mut bytes = [0u8; SECRET_LEN];
        getrandom::fill(&mut bytes).map_err(|e| CommError::io(format!("getrandom failed: {e}")))?;
        store.set(&Key::Secret.text(), &bytes)?;
        Ok(Secret(bytes))
    } else {
        let v = store.get(&Key::Secret.text(), timeout).map_err(|e| rendezvous_error(rank, 0, e))?;
        parse_secret(&v).map_err(CommError::io)
    }
}

/// The secret as read from the store: exactly SECRET_LEN bytes.
pub fn parse_secret(value: &[u8]) -> std::result::Result<Secret, String> {
    let bytes: [u8; SECRET_LEN] =
        value.try_into().map_err(|_| format!("the group secret in the store has {} bytes, expected {SECRET_LEN}", value.len()))?;
    Ok(Secret(bytes))
}

/// The longest `host:port` a rank may publish (a DNS name is at most 253 bytes).
pub const MAX_ADDRESS_LEN: usize = 300;

/// A peer's published `host:port`: bounded, UTF-8, and resolvable to a socket address.
pub fn parse_address(value: &[u8]) -> std::result::Result<SocketAddr, String> {
    if value.len() > MAX_ADDRESS_LEN {
        return Err(format!("{} bytes, more than {MAX_ADDRESS_LEN}", value.len()));
    }
    let text = std::str::from_utf8(value).map_err(|_| "not UTF-8".to_string())?;
    let (host, port) = text.rsplit_once(':').ok_or_else(|| format!("'{text}' is not host:port"))?;
    let port: u16 = port.parse().map_err(|_| format!("'{text}' has no valid port"))?;
    if host.is_empty() || port == 0 {
        return Err(format!("'{text}' is not host:port"));
    }
    let host = host.trim_start_matches('[').trim_end_matches(']');
    (host, port).to_socket_addrs().ok().and_then(|mut a| a.next()).ok_or_else(|| format!("'{text}' does not resolve"))
}

/// A store error during set-up, reworded to say which rank never showed up.
pub fn rendezvous_error(rank: usize, waiting_for: usize, e: CommError) -> CommError {
    e.within(format_args!("rank {rank} could not reach rank {waiting_for} during connection set-up (did every rank create the group?)"))
}

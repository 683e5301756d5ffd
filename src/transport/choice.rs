//! Every rank of a group must move its data the same way: a rank on libfabric (`ofi`) and one
//! on TCP would each wait for messages the other never sends. Each rank publishes its
//! `XCCL_RS_TRANSPORT`; rank 0 reads them all and publishes a verdict, which every other rank
//! reads, so that a mismatch fails set-up on every rank with the same message, naming the
//! ranks and their settings.

use std::time::Duration;

use crate::config::TransportChoice;
use crate::error::{CommError, Result};
use crate::keys::Key;
use crate::rendezvous::{Store, rendezvous_error};

/// The longest setting (or verdict) read from the Store that an error repeats.
const MAX_SHOWN: usize = 1024;

/// A peer's published bytes, bounded and printable.
fn shown(value: &[u8]) -> String {
    String::from_utf8_lossy(&value[..value.len().min(MAX_SHOWN)]).into_owned()
}

fn mismatch(ours: (usize, &str), theirs: &[(usize, String)]) -> String {
    let listed: Vec<String> = theirs.iter().map(|(r, v)| format!("rank {r} has `{v}`")).collect();
    format!(
        "XCCL_RS_TRANSPORT differs between the ranks of the group: rank {} has `{}`, {} (every rank must use the same setting)",
        ours.0,
        ours.1,
        listed.join(", ")
    )
}

/// Publishes this rank's `choice` and fails unless every rank of the group has the same.
pub fn agree_on_transport(store: &dyn Store, rank: usize, size: usize, choice: TransportChoice, timeout: Duration) -> Result<()> {
    if size < 2 {
        return Ok(());
    }
    let name = choice.name();
    store.set(&Key::Transport(rank).text(), name.as_bytes())?;
    if rank == 0 {
        let mut differ = Vec::new();
        for peer in 1..size {
            let value = store.get(&Key::Transport(peer).text(), timeout).map_err(|e| rendezvous_error(rank, peer, e))?;
            if value != name.as_bytes() {
                differ.push((peer, shown(&value)));
            }
        }
        let verdict = if differ.is_empty() { "ok".to_string() } else { mismatch((0, name), &differ) };
        store.set(&Key::TransportVerdict.text(), verdict.as_bytes())?;
        return if differ.is_empty() { Ok(()) } else { Err(CommError::invalid(verdict)) };
    }
    let verdict = store.get(&Key::TransportVerdict.text(), timeout).map_err(|e| rendezvous_error(rank, 0, e))?;
    match verdict.as_slice() {
        b"ok" => Ok(()),
        _ => Err(CommError::invalid(shown(&verdict))),
    }
}

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
            let value = match store.get(&Key::Transport(peer).text(), timeout).map_err(|e| waited_too_long(e, timeout)) {
                Ok(value) => value,
                Err(e) => {
                    // A rank that never joined: say so to the others, who wait for the verdict,
                    // so that every rank names it rather than rank 0.
                    let e = rendezvous_error(rank, peer, e);
                    store.set(&Key::TransportVerdict.text(), format!("{ABSENT}{}", e.message).as_bytes())?;
                    return Err(e);
                }
            };
            if value != name.as_bytes() {
                differ.push((peer, shown(&value)));
            }
        }
        let verdict = if differ.is_empty() { "ok".to_string() } else { mismatch((0, name), &differ) };
        store.set(&Key::TransportVerdict.text(), verdict.as_bytes())?;
        return if differ.is_empty() { Ok(()) } else { Err(CommError::invalid(verdict)) };
    }
    // Rank 0 gives its verdict within `timeout` even when a rank never joins; the grace lets it
    // arrive before this rank's own wait ends.
    let verdict = store
        .get(&Key::TransportVerdict.text(), timeout + VERDICT_GRACE)
        .map_err(|e| rendezvous_error(rank, 0, waited_too_long(e, timeout + VERDICT_GRACE)))?;
    match verdict.as_slice() {
        b"ok" => Ok(()),
        v if v.starts_with(ABSENT.as_bytes()) => Err(CommError::timeout(shown(&v[ABSENT.len()..]))),
        _ => Err(CommError::invalid(shown(&verdict))),
    }
}

/// A Store's failed wait as the timeout it is, in one line: torch's stores answer a wait that
/// ran out with their own text ("Wait timeout") and a stack trace.
fn waited_too_long(e: CommError, timeout: Duration) -> CommError {
    let first_line = e.message.lines().next().unwrap_or_default();
    CommError::timeout(format!("timed out after {timeout:?} waiting for its XCCL_RS_TRANSPORT ({first_line})"))
}

/// How a verdict says that a rank never published its setting (the rest is rank 0's error).
const ABSENT: &str = "absent: ";

/// How much longer than the group's timeout the other ranks wait for rank 0's verdict.
const VERDICT_GRACE: Duration = Duration::from_millis(500);

//! Every rank's published endpoint, in O(N) Store traffic for the whole group: each rank sets
//! its own value, rank 0 reads them all and sets one combined value, and every other rank reads
//! only that one (two round trips, and N values' bytes, per rank; N reads on rank 0), where
//! each rank reading every other's would cost N² reads in all (about a million Store reads at
//! 1,000 ranks). A rank that never publishes makes rank 0 publish why instead, so that every
//! rank fails at once, naming it, rather than each at its own timeout.

use std::time::Duration;

use crate::error::{CommError, Result};
use crate::keys::Key;
use crate::rendezvous::{Store, rendezvous_error};

/// How much longer than the group's timeout the other ranks wait for rank 0's combined value:
/// rank 0 gives it, or its error, within the timeout.
const GATHER_GRACE: Duration = Duration::from_millis(500);

/// Publishes `own` (at most `max_len` bytes) and returns every rank's value, in rank order.
pub fn all_published(store: &dyn Store, rank: usize, size: usize, own: &[u8], max_len: usize, timeout: Duration) -> Result<Vec<Vec<u8>>> {
    store.set(&Key::OfiAddress(rank).text(), own)?;
    if rank == 0 {
        let mut values = vec![own.to_vec()];
        for peer in 1..size {
            match store.get(&Key::OfiAddress(peer).text(), timeout) {
                Ok(v) => values.push(v),
                Err(e) => {
                    let e = rendezvous_error(rank, peer, e);
                    store.set(&Key::OfiAddresses.text(), &absent(&e.message))?;
                    return Err(e);
                }
            }
        }
        store.set(&Key::OfiAddresses.text(), &combine(&values))?;
        return Ok(values);
    }
    let combined = store.get(&Key::OfiAddresses.text(), timeout + GATHER_GRACE).map_err(|e| rendezvous_error(rank, 0, e))?;
    split(&combined, size, max_len).map_err(|why| CommError::peer(format!("rank {rank}: rank 0's gathered libfabric addresses: {why}")))
}

/// `1`, then each value as its length (4 bytes, little-endian) and its bytes.
fn combine(values: &[Vec<u8>]) -> Vec<u8> {
    let mut out = vec![1u8];
    for v in values {
        out.extend_from_slice(&(v.len() as u32).to_le_bytes());
        out.extend_from_slice(v);
    }
    out
}

/// `0`, then why rank 0 could not gather every value.
fn absent(why: &str) -> Vec<u8> {
    let mut out = vec![0u8];
    out.extend_from_slice(why.as_bytes());
    out
}

/// The `size` values of a combined value, each at most `max_len` bytes; or why it is none.
fn split(combined: &[u8], size: usize, max_len: usize) -> std::result::Result<Vec<Vec<u8>>, String> {
    let (&kind, mut rest) = combined.split_first().ok_or("an empty value")?;
    match kind {
        0 => return Err(String::from_utf8_lossy(&rest[..rest.len().min(1024)]).into_owned()),
        1 => {}
        k => return Err(format!("a value of unknown kind {k}")),
    }
    let mut values = Vec::with_capacity(size);
    for r in 0..size {
        let (len, after) = rest.split_first_chunk::<4>().ok_or_else(|| format!("cut short at rank {r}"))?;
        let len = u32::from_le_bytes(*len) as usize;
        if len > max_len || len > after.len() {
            return Err(format!("rank {r}'s value has {len} bytes, of at most {max_len} with {} left", after.len()));
        }
        values.push(after[..len].to_vec());
        rest = &after[len..];
    }
    if !rest.is_empty() {
        return Err(format!("{} bytes past the last rank's value", rest.len()));
    }
    Ok(values)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemoryStore;

    #[test]
    fn combined_values_round_trip_and_bad_ones_are_refused() {
        let values = vec![b"a".to_vec(), vec![], vec![7; 300]];
        let c = combine(&values);
        assert_eq!(split(&c, 3, 4096), Ok(values.clone()));
        assert!(split(&c, 4, 4096).unwrap_err().contains("cut short at rank 3"));
        assert!(split(&c, 2, 4096).unwrap_err().contains("past the last"));
        assert!(split(&c, 3, 100).unwrap_err().contains("rank 2's value has 300 bytes"));
        assert!(split(&c[..c.len() - 1], 3, 4096).is_err());
        assert_eq!(split(&absent("rank 2 never came"), 3, 4096), Err("rank 2 never came".to_string()));
        assert!(split(&[], 1, 1).is_err() && split(&[9], 0, 1).is_err());
    }

    #[test]
    fn every_rank_gets_every_value_and_a_missing_rank_fails_all() {
        let store = MemoryStore::new();
        let gathered: Vec<_> = (0..4)
            .map(|r| {
                let store = store.clone();
                std::thread::spawn(move || all_published(&*store, r, 4, &[r as u8; 3], 16, Duration::from_secs(5)).unwrap())
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|h| h.join().unwrap())
            .collect();
        for g in &gathered {
            assert_eq!(g, &(0..4u8).map(|r| vec![r; 3]).collect::<Vec<_>>());
        }
        // Rank 2 of 3 never publishes: ranks 0 and 1 fail at the timeout, both naming it.
        let store = MemoryStore::new();
        let errors: Vec<_> = (0..2)
            .map(|r| {
                let store = store.clone();
                std::thread::spawn(move || all_published(&*store, r, 3, b"x", 16, Duration::from_millis(300)).unwrap_err())
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|h| h.join().unwrap())
            .collect();
        for e in errors {
            assert!(e.message.contains("rank 2"), "{}", e.message);
        }
    }
}

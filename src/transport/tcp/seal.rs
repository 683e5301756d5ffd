//! Sealed frame headers: every header on an authenticated connection carries a 16-byte tag,
//! HMAC-SHA256 under the connection's key (handshake.rs) of its direction, its position in the
//! stream and the header itself. A header injected into the stream, replayed from another
//! connection, group or earlier operation, or altered, is refused before it is acted upon.
//!
//! The payload is not sealed: hashing gigabytes would cost more than the links move. What the
//! tag protects is everything the receiver acts on (kind, op, sizes, lengths); a payload can only
//! be altered by someone who can rewrite a TCP stream in flight, which is what TLS is for
//! (docs/security.md).

use hmac::Mac;

use super::handshake::{HmacSha256, MAC_LEN};

pub const TAG_LEN: usize = 16;

/// One direction of a connection: its keyed MAC and the number of the next header.
#[derive(Clone)]
pub struct Seal {
    keyed: HmacSha256,
    direction: u8,
    next: u64,
}

impl Seal {
    /// The seal of frames going from `from` to `to` on a connection with `key`.
    pub fn new(key: &[u8; MAC_LEN], from: usize, to: usize) -> Seal {
        let keyed = <HmacSha256 as Mac>::new_from_slice(key).expect("HMAC takes a key of any length");
        Seal { keyed, direction: if from < to { 1 } else { 2 }, next: 0 }
    }

    fn mac(&self, header: &[u8]) -> HmacSha256 {
        let mut m = self.keyed.clone();
        m.update(&[self.direction]);
        m.update(&self.next.to_le_bytes());
        m.update(header);
        m
    }

    /// The tag of the next header sent; counts it.
    pub fn seal(&mut self, header: &[u8]) -> [u8; TAG_LEN] {
        let full: [u8; MAC_LEN] = self.mac(header).finalize().into_bytes().into();
        self.next += 1;
        let mut tag = [0u8; TAG_LEN];
        tag.copy_from_slice(&full[..TAG_LEN]);
        tag
    }

    /// Whether `tag` seals `header` as the next header of the stream (constant time). Does not
    /// count it: a header may be peeked at before it is read ([`Seal::consumed`]).
    pub fn verify(&self, header: &[u8], tag: &[u8]) -> bool {
        tag.len() == TAG_LEN && self.mac(header).verify_truncated_left(tag).is_ok()
    }

    /// The next header has been read: the stream moves on.
    pub fn consumed(&mut self) {
        self.next += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tag_fits_one_place_of_one_direction_of_one_connection() {
        let key = [1u8; MAC_LEN];
        let mut tx = Seal::new(&key, 0, 1);
        let mut rx = Seal::new(&key, 0, 1);
        let first = tx.seal(b"header one");
        let second = tx.seal(b"header one");
        assert_ne!(first, second, "the same header twice gets two tags");
        assert!(rx.verify(b"header one", &first));
        assert!(!rx.verify(b"header one", &second), "not yet its turn");
        assert!(!rx.verify(b"header 0ne", &first), "altered");
        rx.consumed();
        assert!(rx.verify(b"header one", &second));
        assert!(!rx.verify(b"header one", &first), "replayed");
        let back = Seal::new(&key, 1, 0);
        assert!(!back.verify(b"header one", &first), "reflected to its sender");
        let other = Seal::new(&[2u8; MAC_LEN], 0, 1);
        assert!(!other.verify(b"header one", &first), "another connection's key");
        assert!(!Seal::new(&key, 0, 1).verify(b"header one", &first[..8]), "a short tag");
    }
}

//! The header message: before each payload a sender sends, on the header tag, what the payload
//! is ([`MessageId`] and its length), so that the receiver checks it in full, as TCP's frame
//! header lets it; the payload itself travels on the message's own tag (tags.rs). Headers
//! between a pair match in send order (FI_ORDER_SAS), so the k-th header a rank receives from a
//! peer describes the k-th payload that peer sent it.

use crate::transport::MessageId;

/// Bytes of an encoded header.
pub const HEADER_LEN: usize = 40;

/// What a header says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub id: MessageId,
    pub payload_len: u64,
}

impl Header {
    /// Little-endian: op, dtype, reduce, 5 zero bytes, seq, count, key, payload length.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0] = self.id.op;
        b[1] = self.id.dtype;
        b[2] = self.id.reduce;
        b[8..16].copy_from_slice(&self.id.seq.to_le_bytes());
        b[16..24].copy_from_slice(&self.id.count.to_le_bytes());
        b[24..32].copy_from_slice(&self.id.key.to_le_bytes());
        b[32..40].copy_from_slice(&self.payload_len.to_le_bytes());
        b
    }

    /// A received header of `len` bytes (the completion's length): exactly HEADER_LEN, with
    /// its padding zero.
    pub fn decode(bytes: &[u8], len: usize) -> Result<Header, String> {
        if len != HEADER_LEN || bytes.len() < HEADER_LEN {
            return Err(format!("a header message of {len} bytes, expected {HEADER_LEN}"));
        }
        if bytes[3..8].iter().any(|&b| b != 0) {
            return Err("a corrupt header message".into());
        }
        let u64_at = |i: usize| u64::from_le_bytes(bytes[i..i + 8].try_into().expect("8 bytes"));
        Ok(Header {
            id: MessageId { op: bytes[0], dtype: bytes[1], reduce: bytes[2], seq: u64_at(8), count: u64_at(16), key: u64_at(24) as i64 },
            payload_len: u64_at(32),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_header_survives_the_round_trip_and_bad_ones_are_refused() {
        let h = Header { id: MessageId { op: 3, dtype: 7, reduce: 2, seq: 1 << 60, count: 12345, key: -4 }, payload_len: 49380 };
        let b = h.encode();
        assert_eq!(Header::decode(&b, HEADER_LEN), Ok(h));
        assert!(Header::decode(&b, HEADER_LEN - 1).is_err());
        let mut bad = b;
        bad[5] = 1;
        assert!(Header::decode(&bad, HEADER_LEN).is_err());
    }
}

//! The frame: every message on a connection is a fixed 56-byte header (40 bytes of fields, then
//! the 16-byte tag that seals them to the connection: seal.rs) followed by `payload_len` bytes. The header carries the message's identity (`MessageId`, transport/mod.rs), so a
//! receiver can check that both ranks are in the same collective with the same sizes before it
//! writes a byte of the payload; an abort frame carries the failed operation's kind and number,
//! and a timeout notice the ranks its sender was still waiting for (timeout_round.rs).
//!
//! Layout (little endian):
//! ```text
//! 0  magic  u32   "XCRS"
//! 4  kind   u8    FrameKind
//! 5  op     u8    OpKind code
//! 6  dtype  u8    DType code
//! 7  reduce u8    ReduceOp code of a reduction (checked), else 0
//! 8  seq    u64   collective sequence number, or the per-pair point-to-point number
//! 16 count  u64   elements the sender's operation agreed on for this pair (checked)
//! 24 key    i64   root of a rooted collective, tag of a point-to-point message, else 0
//! 32 len    u64   payload bytes that follow
//! 40 tag    [16]  seal.rs: HMAC of direction, position in the stream and bytes 0..40
//! ```
//!
//! Op and dtype codes are kept as sent, unknown ones too: the receiver compares every field
//! with what it expects (exchange.rs: check_header) and names a peer's unknown code in its
//! error. Nothing of a header is used before its tag is verified and its lengths are bounded.

use super::seal::{Seal, TAG_LEN};
use crate::transport::MessageId;

/// The fields of a header.
pub const FIELDS_LEN: usize = 40;
/// A header on the wire: its fields and their tag.
pub const HEADER_LEN: usize = FIELDS_LEN + TAG_LEN;
pub const MAGIC: u32 = u32::from_le_bytes(*b"XCRS");
/// An abort frame's payload is a message; anything longer is refused as corrupt.
pub const MAX_ABORT_MESSAGE: u64 = 64 * 1024;

#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrameKind {
    Data = 1,
    /// The sender failed this operation; the payload says why (UTF-8).
    Abort = 2,
    /// The sender's operation timed out, or it heard of a timeout; the payload lists the ranks
    /// it was still waiting for (u32 LE each). It sends no more data frames on the connection.
    TimeoutNotice = 3,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub kind: FrameKind,
    pub id: MessageId,
    pub payload_len: u64,
}

impl Header {
    /// The header of a data frame.
    pub fn data(id: MessageId, payload_len: u64) -> Header {
        Header { kind: FrameKind::Data, id, payload_len }
    }

    /// The header as sent: its fields, sealed as the next header of `seal`'s direction.
    pub fn seal(&self, seal: &mut Seal) -> [u8; HEADER_LEN] {
        let fields = self.encode_fields();
        let mut b = [0u8; HEADER_LEN];
        b[..FIELDS_LEN].copy_from_slice(&fields);
        b[FIELDS_LEN..].copy_from_slice(&seal.seal(&fields));
        b
    }

    /// Parses a received header whose tag `seal` must accept as the stream's next; the caller
    /// calls `seal.consumed()` once it has read it.
    pub fn open(b: &[u8; HEADER_LEN], seal: &Seal) -> Result<Header, String> {
        let fields: &[u8; FIELDS_LEN] = b[..FIELDS_LEN].try_into().expect("a header starts with its fields");
        let header = Header::decode(fields)?;
        if !seal.verify(fields, &b[FIELDS_LEN..]) {
            return Err("a frame header whose tag does not match this connection (injected, replayed or corrupt)".into());
        }
        Ok(header)
    }

    pub fn encode_fields(&self) -> [u8; FIELDS_LEN] {
        let id = &self.id;
        let mut b = [0u8; FIELDS_LEN];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4] = self.kind as u8;
        b[5] = id.op;
        b[6] = id.dtype;
        b[7] = id.reduce;
        b[8..16].copy_from_slice(&id.seq.to_le_bytes());
        b[16..24].copy_from_slice(&id.count.to_le_bytes());
        b[24..32].copy_from_slice(&id.key.to_le_bytes());
        b[32..40].copy_from_slice(&self.payload_len.to_le_bytes());
        b
    }

    /// Parses a header; `Err` describes what is wrong with bytes that are not one.
    pub fn decode(b: &[u8; FIELDS_LEN]) -> Result<Header, String> {
        let magic = u32::from_le_bytes(b[0..4].try_into().unwrap_or_default());
        if magic != MAGIC {
            return Err(format!("bad frame magic {magic:#010x} (corrupt stream)"));
        }
        let kind = match b[4] {
            1 => FrameKind::Data,
            2 => FrameKind::Abort,
            3 => FrameKind::TimeoutNotice,
            k => return Err(format!("unknown frame kind {k}")),
        };
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or_default());
        let id = MessageId { op: b[5], dtype: b[6], reduce: b[7], seq: u64_at(8), count: u64_at(16), key: u64_at(24) as i64 };
        Ok(Header { kind, id, payload_len: u64_at(32) })
    }

    /// Whether the first bytes of a stream (at least 5) start a failure frame: an abort or a
    /// timeout notice, which end the sender's data on the connection.
    pub fn peek_is_abort(prefix: &[u8]) -> bool {
        prefix.len() >= 5
            && prefix[0..4] == MAGIC.to_le_bytes()
            && (prefix[4] == FrameKind::Abort as u8 || prefix[4] == FrameKind::TimeoutNotice as u8)
    }
}

/// A timeout notice's payload: the ranks its sender waits for.
pub fn encode_waits(ranks: &[usize]) -> Vec<u8> {
    ranks.iter().flat_map(|&r| (r as u32).to_le_bytes()).collect()
}

/// The longest timeout-notice payload a group of `size` ranks can send (each rank once).
pub fn max_waits_len(size: usize) -> u64 {
    4 * size as u64
}

/// Parses a timeout notice's payload from a peer of a group of `size`: whole u32s, each a rank
/// of the group.
pub fn decode_waits(payload: &[u8], size: usize) -> Result<Vec<usize>, String> {
    if payload.len() % 4 != 0 || payload.len() as u64 > max_waits_len(size) {
        return Err(format!("a timeout notice of {} bytes (a group of {size} ranks)", payload.len()));
    }
    let ranks: Vec<usize> = payload.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as usize).collect();
    match ranks.iter().find(|&&r| r >= size) {
        Some(r) => Err(format!("a timeout notice names rank {r} of a group of {size}")),
        None => Ok(ranks),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let id = MessageId { op: 3, dtype: 7, reduce: 5, seq: 42, count: 1 << 40, key: -1 };
        let h = Header::data(id, 99);
        assert_eq!(Header::decode(&h.encode_fields()).unwrap(), h);
        // The wire format: magic, kind, op, dtype, reduce, then seq, count, key, len (LE).
        let b = h.encode_fields();
        assert_eq!((&b[0..4], b[4], b[5], b[6], b[7]), (&b"XCRS"[..], 1, 3, 7, 5));
        assert_eq!((&b[8..16], &b[24..32], &b[32..40]), (&42u64.to_le_bytes()[..], &(-1i64).to_le_bytes()[..], &99u64.to_le_bytes()[..]));
        assert!(!Header::peek_is_abort(&h.encode_fields()));
        let a = Header { kind: FrameKind::Abort, ..h };
        assert!(Header::peek_is_abort(&a.encode_fields()));
    }

    #[test]
    fn timeout_notice_round_trip_and_bounds() {
        assert_eq!(decode_waits(&encode_waits(&[3, 0]), 4).unwrap(), vec![3, 0]);
        assert_eq!(decode_waits(&[], 4).unwrap(), Vec::<usize>::new());
        assert!(decode_waits(&encode_waits(&[4]), 4).is_err(), "a rank outside the group");
        assert!(decode_waits(&[1, 0, 0], 4).is_err(), "not whole u32s");
        assert!(decode_waits(&encode_waits(&[0, 1, 0]), 2).is_err(), "longer than one entry per rank");
        let n = Header { kind: FrameKind::TimeoutNotice, id: MessageId::default(), payload_len: 4 };
        assert_eq!(Header::decode(&n.encode_fields()).unwrap(), n);
        assert!(Header::peek_is_abort(&n.encode_fields()));
    }

    #[test]
    fn sealed_headers_open_once_in_order_on_their_connection() {
        let key = [3u8; 32];
        let (mut tx, mut rx) = (Seal::new(&key, 1, 0), Seal::new(&key, 1, 0));
        let h = Header::data(MessageId { op: 0, dtype: 2, reduce: 0, seq: 7, count: 4, key: 0 }, 16);
        let first = h.seal(&mut tx);
        let second = h.seal(&mut tx);
        assert_eq!(Header::open(&first, &rx).unwrap(), h);
        assert_eq!(Header::open(&first, &rx).unwrap(), h, "peeking does not consume");
        rx.consumed();
        assert!(Header::open(&first, &rx).is_err(), "a replayed header");
        assert_eq!(Header::open(&second, &rx).unwrap(), h);
        let mut altered = second;
        altered[32] ^= 1; // the payload length
        assert!(Header::open(&altered, &rx).is_err());
        assert!(Header::open(&second, &Seal::new(&[4u8; 32], 1, 0)).is_err(), "another connection");
    }

    #[test]
    fn rejects_garbage() {
        assert!(Header::decode(&[0u8; FIELDS_LEN]).is_err());
        let mut b = Header::data(MessageId::default(), 0).encode_fields();
        b[4] = 9;
        assert!(Header::decode(&b).is_err());
    }
}

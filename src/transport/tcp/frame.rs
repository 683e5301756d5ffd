//! The frame: every message on a connection is a fixed 40-byte header followed by `payload_len`
//! bytes. The header says which operation the bytes belong to, so a receiver can check that both
//! ranks are in the same collective with the same sizes before it writes a byte of the payload.
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
//! ```

pub const HEADER_LEN: usize = 40;
pub const MAGIC: u32 = u32::from_le_bytes(*b"XCRS");
/// An abort frame's payload is a message; anything longer is refused as corrupt.
pub const MAX_ABORT_MESSAGE: u64 = 64 * 1024;

#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrameKind {
    Data = 1,
    /// The sender failed this operation; the payload says why (UTF-8).
    Abort = 2,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub kind: FrameKind,
    pub op: u8,
    pub dtype: u8,
    /// The reduction's ReduceOp code (all-reduce, reduce, reduce-scatter), else 0.
    pub reduce: u8,
    pub seq: u64,
    pub count: u64,
    pub key: i64,
    pub payload_len: u64,
}

impl Header {
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4] = self.kind as u8;
        b[5] = self.op;
        b[6] = self.dtype;
        b[7] = self.reduce;
        b[8..16].copy_from_slice(&self.seq.to_le_bytes());
        b[16..24].copy_from_slice(&self.count.to_le_bytes());
        b[24..32].copy_from_slice(&self.key.to_le_bytes());
        b[32..40].copy_from_slice(&self.payload_len.to_le_bytes());
        b
    }

    /// Parses a header; `Err` describes what is wrong with bytes that are not one.
    pub fn decode(b: &[u8; HEADER_LEN]) -> Result<Header, String> {
        let magic = u32::from_le_bytes(b[0..4].try_into().unwrap_or_default());
        if magic != MAGIC {
            return Err(format!("bad frame magic {magic:#010x} (corrupt stream)"));
        }
        let kind = match b[4] {
            1 => FrameKind::Data,
            2 => FrameKind::Abort,
            k => return Err(format!("unknown frame kind {k}")),
        };
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or_default());
        Ok(Header {
            kind,
            op: b[5],
            dtype: b[6],
            reduce: b[7],
            seq: u64_at(8),
            count: u64_at(16),
            key: u64_at(24) as i64,
            payload_len: u64_at(32),
        })
    }

    /// Whether the first bytes of a stream (at least 5) start an abort frame.
    pub fn peek_is_abort(prefix: &[u8]) -> bool {
        prefix.len() >= 5 && prefix[0..4] == MAGIC.to_le_bytes() && prefix[4] == FrameKind::Abort as u8
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let h = Header { kind: FrameKind::Data, op: 3, dtype: 7, reduce: 5, seq: 42, count: 1 << 40, key: -1, payload_len: 99 };
        assert_eq!(Header::decode(&h.encode()).unwrap(), h);
        assert!(!Header::peek_is_abort(&h.encode()));
        let a = Header { kind: FrameKind::Abort, ..h };
        assert!(Header::peek_is_abort(&a.encode()));
    }

    #[test]
    fn rejects_garbage() {
        assert!(Header::decode(&[0u8; HEADER_LEN]).is_err());
        let mut b = Header { kind: FrameKind::Data, op: 0, dtype: 0, reduce: 0, seq: 0, count: 0, key: 0, payload_len: 0 }.encode();
        b[4] = 9;
        assert!(Header::decode(&b).is_err());
    }
}

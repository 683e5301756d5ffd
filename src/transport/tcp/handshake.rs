//! Mutual authentication of a TCP connection with the group's secret, before any frame is read.
//!
//! The secret (32 random bytes) reaches every rank through the group's c10d Store
//! (rendezvous.rs) and never crosses a link. The rank that connects (whichever needs the link
//! first: linker.rs) and the rank that accepts each draw a fresh 32-byte nonce; each proves that it knows the secret with
//! an HMAC-SHA256 over both nonces and both ranks, under a label of its role:
//!
//! ```text
//! connector -> acceptor  HELLO      "XCH2" version:u16 flags_c:u16 from:u32 to:u32 nonce_c[32]  48 bytes
//! acceptor -> connector  CHALLENGE  "XCCH" flags_a:u16 0:u16 nonce_a[32] mac_a[32]              72 bytes
//! connector -> acceptor  PROOF      "XCPR" mac_c[32]                                           36 bytes
//! acceptor -> connector  VERDICT    accept (0xA5) or keep-mine (0x5A)                           1 byte
//!
//! t     = from | to | flags_c | flags_a | nonce_c | nonce_a
//! mac_a = HMAC(secret, "xccl_rs/v2/acceptor" | t)
//! mac_c = HMAC(secret, "xccl_rs/v2/connector" | t)
//! key   = HMAC(secret, "xccl_rs/v2/frames" | t)
//! ```
//!
//! A recorded handshake is useless elsewhere: the other side's nonce is new each time, so
//! neither MAC can be replayed, and the labels keep an acceptor's answer from serving as a
//! connector's proof. `key` then seals every frame header of the connection (seal.rs), which
//! binds frames to this connection and to their place in its stream.
//!
//! The verdict settles two ranks dialing each other at once: an acceptor that is itself dialing
//! the connector, and is the higher of the two, keeps its own connection (keep-mine) and closes
//! this one; every other proven connection is accepted. So each pair ends with exactly one link,
//! and both sides know which, before a frame crosses it.
//!
//! The flags say how each side wants the link: [`FLAG_TLS`] for TLS (tls.rs). Both MACs cover
//! both sides' flags, so no one on the path can strip TLS from a link (a downgrade), and two
//! ranks configured differently learn it from an authenticated answer and fail with a clear
//! error, instead of one side reading the other's TLS records as frames.

use hmac::{Hmac, Mac};
use sha2::Sha256;

pub type HmacSha256 = Hmac<Sha256>;

pub const SECRET_LEN: usize = 32;
pub const NONCE_LEN: usize = 32;
pub const MAC_LEN: usize = 32;
pub const HELLO_LEN: usize = 48;
pub const CHALLENGE_LEN: usize = 8 + NONCE_LEN + MAC_LEN;
pub const PROOF_LEN: usize = 4 + MAC_LEN;
/// The acceptor keeps this connection as the pair's link.
pub const VERDICT_ACCEPT: u8 = 0xA5;
/// The acceptor is dialing the connector itself and, being the higher rank, keeps its own
/// connection: the connector drops this one and takes the acceptor's.
pub const VERDICT_KEEP_MINE: u8 = 0x5A;

/// An authenticated connection to one peer (what either side of the handshake ends with) and
/// the key that seals its frame headers.
pub struct Link {
    pub stream: std::net::TcpStream,
    pub frame_key: [u8; MAC_LEN],
}
pub const VERSION: u16 = 3;

/// The link is to run TLS after the handshake (`XCCL_RS_TLS=1`).
pub const FLAG_TLS: u16 = 1;
/// Every flag this version knows; a hello or challenge with others is refused.
const KNOWN_FLAGS: u16 = FLAG_TLS;

const HELLO_MAGIC: [u8; 4] = *b"XCH2";
const CHALLENGE_MAGIC: [u8; 4] = *b"XCCH";
const PROOF_MAGIC: [u8; 4] = *b"XCPR";

/// The group's shared secret. Its `Debug` prints nothing of it.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(pub [u8; SECRET_LEN]);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

pub fn random_nonce() -> Result<[u8; NONCE_LEN], String> {
    let mut n = [0u8; NONCE_LEN];
    getrandom::fill(&mut n).map_err(|e| format!("getrandom failed: {e}"))?;
    Ok(n)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hello {
    pub from: u32,
    pub to: u32,
    pub flags: u16,
    pub nonce: [u8; NONCE_LEN],
}

impl Hello {
    pub fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[0..4].copy_from_slice(&HELLO_MAGIC);
        b[4..6].copy_from_slice(&VERSION.to_le_bytes());
        b[6..8].copy_from_slice(&self.flags.to_le_bytes());
        b[8..12].copy_from_slice(&self.from.to_le_bytes());
        b[12..16].copy_from_slice(&self.to.to_le_bytes());
        b[16..48].copy_from_slice(&self.nonce);
        b
    }

    /// Parses a hello; the ranks are checked by the caller, who knows the group.
    pub fn decode(b: &[u8; HELLO_LEN]) -> Result<Hello, String> {
        if b[0..4] != HELLO_MAGIC {
            return Err("not an xccl_rs hello".into());
        }
        let version = u16::from_le_bytes([b[4], b[5]]);
        if version != VERSION {
            return Err(format!("hello of protocol version {version}, this is version {VERSION}"));
        }
        let flags = u16::from_le_bytes([b[6], b[7]]);
        if flags & !KNOWN_FLAGS != 0 {
            return Err(format!("hello with unknown flags {flags:#x}"));
        }
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let mut nonce = [0u8; NONCE_LEN];
        nonce.copy_from_slice(&b[16..48]);
        Ok(Hello { from: u32_at(8), to: u32_at(12), flags, nonce })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Challenge {
    pub flags: u16,
    pub nonce: [u8; NONCE_LEN],
    pub mac: [u8; MAC_LEN],
}

impl Challenge {
    pub fn encode(&self) -> [u8; CHALLENGE_LEN] {
        let mut b = [0u8; CHALLENGE_LEN];
        b[0..4].copy_from_slice(&CHALLENGE_MAGIC);
        b[4..6].copy_from_slice(&self.flags.to_le_bytes());
        b[8..40].copy_from_slice(&self.nonce);
        b[40..72].copy_from_slice(&self.mac);
        b
    }

    pub fn decode(b: &[u8; CHALLENGE_LEN]) -> Result<Challenge, String> {
        if b[0..4] != CHALLENGE_MAGIC {
            return Err("not an xccl_rs challenge".into());
        }
        let flags = u16::from_le_bytes([b[4], b[5]]);
        if flags & !KNOWN_FLAGS != 0 || b[6..8] != [0, 0] {
            return Err(format!("challenge with unknown flags {flags:#x}"));
        }
        let (mut nonce, mut mac) = ([0u8; NONCE_LEN], [0u8; MAC_LEN]);
        nonce.copy_from_slice(&b[8..40]);
        mac.copy_from_slice(&b[40..72]);
        Ok(Challenge { flags, nonce, mac })
    }
}

pub fn encode_proof(mac: &[u8; MAC_LEN]) -> [u8; PROOF_LEN] {
    let mut b = [0u8; PROOF_LEN];
    b[0..4].copy_from_slice(&PROOF_MAGIC);
    b[4..].copy_from_slice(mac);
    b
}

pub fn decode_proof(b: &[u8; PROOF_LEN]) -> Result<[u8; MAC_LEN], String> {
    if b[0..4] != PROOF_MAGIC {
        return Err("not an xccl_rs proof".into());
    }
    let mut mac = [0u8; MAC_LEN];
    mac.copy_from_slice(&b[4..]);
    Ok(mac)
}

/// The error of two authenticated ranks whose links are configured differently.
pub fn flags_mismatch(rank: usize, flags: u16, peer: usize, peer_flags: u16) -> String {
    let tls = |f: u16| if f & FLAG_TLS != 0 { "XCCL_RS_TLS=1" } else { "no TLS" };
    format!(
        "rank {peer} wants {} on its link to rank {rank}, which has {}: set XCCL_RS_TLS alike on every rank",
        tls(peer_flags),
        tls(flags)
    )
}

/// What both sides of one handshake know once the nonces have crossed.
#[derive(Clone, Copy)]
pub struct Transcript {
    pub from: u32,
    pub to: u32,
    /// The connector's flags (from its hello) and the acceptor's (from its challenge).
    pub flags_c: u16,
    pub flags_a: u16,
    pub nonce_c: [u8; NONCE_LEN],
    pub nonce_a: [u8; NONCE_LEN],
}

#[derive(Clone, Copy)]
enum Label {
    Acceptor,
    Connector,
    Frames,
}

impl Label {
    fn bytes(self) -> &'static [u8] {
        match self {
            Label::Acceptor => b"xccl_rs/v2/acceptor",
            Label::Connector => b"xccl_rs/v2/connector",
            Label::Frames => b"xccl_rs/v2/frames",
        }
    }
}

impl Transcript {
    fn keyed(&self, secret: &Secret, label: Label) -> HmacSha256 {
        let mut m = <HmacSha256 as Mac>::new_from_slice(&secret.0).expect("HMAC takes a key of any length");
        m.update(label.bytes());
        m.update(&self.from.to_le_bytes());
        m.update(&self.to.to_le_bytes());
        m.update(&self.flags_c.to_le_bytes());
        m.update(&self.flags_a.to_le_bytes());
        m.update(&self.nonce_c);
        m.update(&self.nonce_a);
        m
    }

    fn mac(&self, secret: &Secret, label: Label) -> [u8; MAC_LEN] {
        self.keyed(secret, label).finalize().into_bytes().into()
    }

    /// The acceptor's answer to the hello.
    pub fn acceptor_mac(&self, secret: &Secret) -> [u8; MAC_LEN] {
        self.mac(secret, Label::Acceptor)
    }

    /// The connector's proof.
    pub fn connector_mac(&self, secret: &Secret) -> [u8; MAC_LEN] {
        self.mac(secret, Label::Connector)
    }

    /// Checks the acceptor's answer in constant time.
    pub fn verify_acceptor(&self, secret: &Secret, mac: &[u8; MAC_LEN]) -> bool {
        self.keyed(secret, Label::Acceptor).verify_slice(mac).is_ok()
    }

    /// Checks the connector's proof in constant time.
    pub fn verify_connector(&self, secret: &Secret, mac: &[u8; MAC_LEN]) -> bool {
        self.keyed(secret, Label::Connector).verify_slice(mac).is_ok()
    }

    /// The key that seals this connection's frame headers.
    pub fn frame_key(&self, secret: &Secret) -> [u8; MAC_LEN] {
        self.mac(secret, Label::Frames)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn transcript() -> Transcript {
        Transcript { from: 3, to: 1, flags_c: 0, flags_a: 0, nonce_c: [7; 32], nonce_a: [9; 32] }
    }

    #[test]
    fn messages_round_trip_and_refuse_other_magic() {
        let h = Hello { from: 5, to: 2, flags: FLAG_TLS, nonce: [1; 32] };
        assert_eq!(Hello::decode(&h.encode()).unwrap(), h);
        let c = Challenge { flags: FLAG_TLS, nonce: [2; 32], mac: [3; 32] };
        assert_eq!(Challenge::decode(&c.encode()).unwrap(), c);
        assert_eq!(decode_proof(&encode_proof(&[4; 32])).unwrap(), [4; 32]);
        let mut bad = h.encode();
        bad[4] = 1; // version 1, before the flags
        assert!(Hello::decode(&bad).is_err(), "another version");
        bad = h.encode();
        bad[0] = b'Y';
        assert!(Hello::decode(&bad).is_err());
        bad = h.encode();
        bad[6] = 2;
        assert!(Hello::decode(&bad).is_err(), "an unknown flag");
        let mut bad_challenge = c.encode();
        bad_challenge[5] = 1;
        assert!(Challenge::decode(&bad_challenge).is_err(), "an unknown flag");
        let mut p = encode_proof(&[4; 32]);
        p[3] = 0;
        assert!(decode_proof(&p).is_err());
    }

    #[test]
    fn macs_depend_on_secret_role_ranks_and_both_nonces() {
        let s = Secret([5; 32]);
        let t = transcript();
        let a = t.acceptor_mac(&s);
        assert!(t.verify_acceptor(&s, &a));
        assert!(!t.verify_connector(&s, &a), "an acceptor's answer is no connector's proof");
        assert!(!t.verify_acceptor(&Secret([6; 32]), &a), "another group's secret");
        for changed in [
            Transcript { from: 4, ..t },
            Transcript { to: 0, ..t },
            Transcript { flags_c: FLAG_TLS, ..t },
            Transcript { flags_a: FLAG_TLS, ..t },
            Transcript { nonce_c: [8; 32], ..t },
            Transcript { nonce_a: [8; 32], ..t },
        ] {
            assert!(!changed.verify_acceptor(&s, &a));
            assert!(!changed.verify_connector(&s, &t.connector_mac(&s)));
        }
        assert_ne!(t.frame_key(&s), a);
        assert_ne!(t.frame_key(&s), t.connector_mac(&s));
    }
}

//! Every decoder of bytes that come from a peer or from the Store, on arbitrary input: frame
//! headers and their seals, timeout notices, the three handshake messages, published addresses,
//! the group secret, TLS certificates, host identities and shared-memory segment names. None may panic, and none
//! may accept what it should not: a header opens only with its own tag, a notice names only
//! ranks of the group, a segment name is only one that `Segment::create` makes. The live
//! accepting loop is fuzzed too: arbitrary byte streams against a listening rank, which must
//! still admit the real peer afterwards.
//!
//! Cases are bounded (PROPTEST_CASES overrides), so the file runs in seconds; a failing case
//! that proptest finds is kept in `tests/fuzz_decoders.proptest-regressions` and rerun first.

use std::io::Write;
use std::net::TcpStream;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use proptest::prelude::*;

use xccl_rs::hosts::HostMap;
use xccl_rs::rendezvous::{MAX_ADDRESS_LEN, parse_address, parse_secret};
use xccl_rs::transport::MessageId;
use xccl_rs::transport::shm::segment::is_segment_name;
use xccl_rs::transport::tcp::accept::{AcceptSpec, accept_peers};
use xccl_rs::transport::tcp::connect::{MeshSpec, connect_mesh};
use xccl_rs::transport::tcp::frame::{FIELDS_LEN, FrameKind, HEADER_LEN, Header, decode_waits, encode_waits, max_waits_len};
use xccl_rs::transport::tcp::handshake::{CHALLENGE_LEN, Challenge, HELLO_LEN, Hello, PROOF_LEN, Secret, decode_proof, encode_proof};
use xccl_rs::transport::tcp::seal::{Seal, TAG_LEN};
use xccl_rs::transport::tcp::tls::{MAX_CERT_LEN, parse_cert};
use xccl_rs::{MemoryStore, Store};

fn cases(n: u32) -> ProptestConfig {
    ProptestConfig { cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(n), ..ProptestConfig::default() }
}

fn arb_id() -> impl Strategy<Value = MessageId> {
    (any::<u8>(), any::<u8>(), any::<u8>(), any::<u64>(), any::<u64>(), any::<i64>())
        .prop_map(|(op, dtype, reduce, seq, count, key)| MessageId { op, dtype, reduce, seq, count, key })
}

proptest! {
    #![proptest_config(cases(40_000))]

    #[test]
    fn header_fields_decode_without_panic(bytes in prop::array::uniform32(any::<u8>()), tail in prop::array::uniform8(any::<u8>())) {
        let mut b = [0u8; FIELDS_LEN];
        b[..32].copy_from_slice(&bytes);
        b[32..].copy_from_slice(&tail);
        if let Ok(h) = Header::decode(&b) {
            prop_assert_eq!(&b[0..4], b"XCRS");
            prop_assert!(matches!(h.kind, FrameKind::Data | FrameKind::Abort | FrameKind::TimeoutNotice));
            prop_assert_eq!(h.encode_fields(), b, "decoding keeps every field as sent");
        }
    }

    #[test]
    fn headers_round_trip_and_open_only_with_their_tag(
        id in arb_id(), len in any::<u64>(), kind in 1u8..=3, key in prop::array::uniform32(any::<u8>()),
        flip in 0usize..HEADER_LEN, bit in 0u8..8, skip in 0u64..3,
    ) {
        let kind = match kind { 1 => FrameKind::Data, 2 => FrameKind::Abort, _ => FrameKind::TimeoutNotice };
        let h = Header { kind, id, payload_len: len };
        let mut tx = Seal::new(&key, 0, 1);
        let mut rx = Seal::new(&key, 0, 1);
        for _ in 0..skip {
            let _ = h.seal(&mut tx);
            rx.consumed();
        }
        let wire = h.seal(&mut tx);
        prop_assert_eq!(Header::open(&wire, &rx).unwrap(), h);
        let mut altered = wire;
        altered[flip] ^= 1 << bit;
        prop_assert!(Header::open(&altered, &rx).is_err(), "a header altered at byte {} still opened", flip);
        rx.consumed();
        prop_assert!(Header::open(&wire, &rx).is_err(), "a replayed header opened");
    }

    #[test]
    fn arbitrary_sealed_headers_never_open(bytes in prop::collection::vec(any::<u8>(), HEADER_LEN), key in prop::array::uniform32(any::<u8>())) {
        let b: [u8; HEADER_LEN] = bytes.try_into().unwrap();
        // A random tag matches with probability 2^-128.
        prop_assert!(Header::open(&b, &Seal::new(&key, 1, 0)).is_err());
        prop_assert_eq!(TAG_LEN, HEADER_LEN - FIELDS_LEN);
    }

    #[test]
    fn timeout_notices_name_only_ranks_of_the_group(
        words in prop::collection::vec(prop_oneof![0u32..24, any::<u32>()], 0..24), junk in prop::collection::vec(any::<u8>(), 0..4),
        size in 1usize..20,
    ) {
        // Mostly rank-sized numbers (near the group's bound), some huge, some trailing bytes.
        let mut payload: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        payload.extend_from_slice(&junk);
        match decode_waits(&payload, size) {
            Ok(ranks) => {
                prop_assert!(payload.len() as u64 <= max_waits_len(size));
                prop_assert!(ranks.iter().all(|&r| r < size));
                prop_assert_eq!(encode_waits(&ranks), payload);
            }
            Err(m) => prop_assert!(!m.is_empty()),
        }
    }

    #[test]
    fn handshake_messages_decode_without_panic(bytes in prop::collection::vec(any::<u8>(), CHALLENGE_LEN)) {
        let hello: [u8; HELLO_LEN] = bytes[..HELLO_LEN].try_into().unwrap();
        if let Ok(h) = Hello::decode(&hello) {
            prop_assert_eq!(h.encode(), hello);
        }
        let challenge: [u8; CHALLENGE_LEN] = bytes[..].try_into().unwrap();
        if let Ok(c) = Challenge::decode(&challenge) {
            prop_assert_eq!(c.encode(), challenge);
        }
        let proof: [u8; PROOF_LEN] = bytes[..PROOF_LEN].try_into().unwrap();
        if let Ok(mac) = decode_proof(&proof) {
            prop_assert_eq!(encode_proof(&mac), proof);
        }
    }

    #[test]
    fn store_values_are_bounded(value in prop::collection::vec(any::<u8>(), 0..400), ids in prop::collection::vec(prop::collection::vec(0u8..3, 0..3), 1..12)) {
        if let Ok(addr) = parse_address(&value) {
            prop_assert!(value.len() <= MAX_ADDRESS_LEN);
            prop_assert!(addr.port() != 0);
        }
        prop_assert_eq!(parse_secret(&value).is_ok(), value.len() == 32);
        prop_assert_eq!(parse_cert(&value).is_ok(), !value.is_empty() && value.len() <= MAX_CERT_LEN);
        // Host maps from arbitrary identities: every rank is placed once, on a valid host.
        let map = HostMap::from_ids(&ids);
        prop_assert_eq!(map.world_size(), ids.len());
        let placed: usize = (0..map.host_count()).map(|h| map.ranks(h).len()).sum();
        prop_assert_eq!(placed, ids.len());
        for r in 0..ids.len() {
            prop_assert!(map.ranks(map.host_of(r)).contains(&r));
        }
    }

    #[test]
    fn only_our_segment_names_are_mapped(name in "\\PC{0,70}", pid in 1u32..u32::MAX, token in prop::array::uniform16(any::<u8>())) {
        if is_segment_name(&name) {
            prop_assert!(!name.contains('/') && name.starts_with("xccl_rs-") && name.len() <= 8 + 10 + 1 + 32);
        }
        let ours = format!("xccl_rs-{pid}-{}", token.iter().map(|b| format!("{b:02x}")).collect::<String>());
        prop_assert!(is_segment_name(&ours));
        let (escaped, climbing) = (format!("{ours}/../x"), format!("../{ours}"));
        prop_assert!(!is_segment_name(&escaped));
        prop_assert!(!is_segment_name(&climbing));
    }
}

/// Arbitrary byte streams against a listening rank 0 (some starting with a valid hello), each
/// connection then closed; afterwards the real rank 1 must still get in, within its deadline.
#[test]
fn the_accepting_loop_survives_arbitrary_streams() {
    let secret = Secret([3; 32]);
    let store = MemoryStore::new();
    let timeout = Duration::from_secs(60);
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let stop = AtomicBool::new(false);
    let spec = AcceptSpec {
        rank: 0,
        size: 2,
        secret: &secret,
        deadline: Instant::now() + timeout,
        handshake_timeout: Duration::from_secs(5),
        stop: &stop,
        flags: 0,
    };
    std::thread::scope(|s| {
        let (listener, spec) = (&listener, &spec);
        let acceptor = s.spawn(move || accept_peers(listener, spec));
        let mut runner = proptest::test_runner::TestRunner::new(cases(3000));
        let stream = (prop::collection::vec(any::<u8>(), 0..200), any::<bool>(), 0u32..4);
        runner
            .run(&stream, |(bytes, hello_first, from)| {
                let mut s = TcpStream::connect(addr).unwrap();
                if hello_first {
                    let _ = s.write_all(&Hello { from, to: 0, flags: 0, nonce: [1; 32] }.encode());
                }
                let _ = s.write_all(&bytes);
                Ok(())
            })
            .unwrap();
        prop_assert_no_links_yet(&acceptor);
        // The real rank 1, through the normal path (its address lookup included).
        store.set("xccl_rs/addr/0", addr.to_string().as_bytes()).unwrap();
        let spec1 = MeshSpec { store: &*store, rank: 1, size: 2, secret: &secret, socket_host: Some("127.0.0.1"), timeout, tls: false };
        let mine = connect_mesh(&spec1).expect("rank 1 connects after the fuzzing");
        assert!(mine[0].is_some());
        let links = acceptor.join().unwrap().expect("rank 0 accepted rank 1");
        assert!(links[1].is_some());
    });
}

fn prop_assert_no_links_yet<T>(acceptor: &std::thread::ScopedJoinHandle<'_, T>) {
    assert!(!acceptor.is_finished(), "a fuzzed stream was taken for rank 1");
}

//! What authentication costs on the TCP links: (1) building a 4-rank mesh over loopback with
//! the authenticated handshake, against the same mesh with the unauthenticated 24-byte hello of
//! before (emulated here: connect, one write); (2) the whole TCP transport's set-up with and
//! without TLS (`XCCL_RS_TLS`: certificates drawn and published, a TLS 1.3 handshake per link);
//! (3) sealing and checking one frame header, the cost each message pays.
//! `cargo bench --bench tcp_auth`; figures in docs/security.md.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use xccl_rs::MemoryStore;
use xccl_rs::transport::MessageId;
use xccl_rs::transport::tcp::TcpTransport;
use xccl_rs::transport::tcp::connect::{MeshSpec, connect_mesh};
use xccl_rs::transport::tcp::frame::Header;
use xccl_rs::transport::tcp::handshake::Secret;
use xccl_rs::transport::tcp::seal::Seal;

const RANKS: usize = 4;
const ROUNDS: usize = 40;

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// One authenticated mesh of RANKS threads: the slowest rank's time. With `transport`, the
/// whole TCP transport (TLS on the links if `tls`); without, the mesh alone.
fn authenticated_mesh() -> Duration {
    mesh_of(false, false)
}

fn mesh_of(transport: bool, tls: bool) -> Duration {
    let store = MemoryStore::new();
    let secret = Secret([7; 32]);
    std::thread::scope(|s| {
        let ranks: Vec<_> = (0..RANKS)
            .map(|rank| {
                let (store, secret) = (&store, &secret);
                s.spawn(move || {
                    let t = Instant::now();
                    let spec = MeshSpec {
                        store: &**store,
                        rank,
                        size: RANKS,
                        secret,
                        socket_host: Some("127.0.0.1"),
                        timeout: Duration::from_secs(10),
                        tls,
                    };
                    // Timed up to the links being ready, not their closing.
                    if transport {
                        let links = TcpTransport::connect(&spec, &xccl_rs::peers::PeerSet::all_but(rank, RANKS)).expect("transport");
                        let ready = t.elapsed();
                        drop(links);
                        ready
                    } else {
                        let links = connect_mesh(&spec).expect("mesh");
                        let ready = t.elapsed();
                        drop(links);
                        ready
                    }
                })
            })
            .collect();
        ranks.into_iter().map(|h| h.join().unwrap()).max().unwrap()
    })
}

/// The same topology with the old protocol: every rank listens, connects to the lower ranks and
/// writes a 24-byte hello; the acceptor reads it.
fn plain_mesh() -> Duration {
    let listeners: Vec<TcpListener> = (0..RANKS).map(|_| TcpListener::bind("127.0.0.1:0").unwrap()).collect();
    let addrs: Vec<_> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
    std::thread::scope(|s| {
        let ranks: Vec<_> = listeners
            .into_iter()
            .enumerate()
            .map(|(rank, listener)| {
                let addrs = &addrs;
                s.spawn(move || {
                    let t = Instant::now();
                    let mut keep = Vec::new();
                    for peer in 0..rank {
                        let mut c = TcpStream::connect(addrs[peer]).unwrap();
                        c.write_all(&[1u8; 24]).unwrap();
                        keep.push(c);
                    }
                    for _ in rank + 1..RANKS {
                        let (mut a, _) = listener.accept().unwrap();
                        let mut hello = [0u8; 24];
                        a.read_exact(&mut hello).unwrap();
                        keep.push(a);
                    }
                    t.elapsed()
                })
            })
            .collect();
        ranks.into_iter().map(|h| h.join().unwrap()).max().unwrap()
    })
}

fn main() {
    // Alternate the two, so that drift of the machine hits both alike.
    let (mut auth, mut plain) = (Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        auth.push(authenticated_mesh());
        plain.push(plain_mesh());
    }
    let (a, p) = (median(auth), median(plain));
    println!(
        "{RANKS}-rank mesh over loopback, median of {ROUNDS}: authenticated {a:?}, unauthenticated hello {p:?}, added {:?}",
        a.saturating_sub(p)
    );

    let (mut plain, mut tls) = (Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        plain.push(mesh_of(true, false));
        tls.push(mesh_of(true, true));
    }
    let (p, t) = (median(plain), median(tls));
    println!("{RANKS}-rank TCP transport set-up, median of {ROUNDS}: without TLS {p:?}, with TLS {t:?}, added {:?}", t.saturating_sub(p));

    let key = [9u8; 32];
    let (mut tx, mut rx) = (Seal::new(&key, 0, 1), Seal::new(&key, 0, 1));
    let h = Header::data(MessageId { op: 0, dtype: 2, reduce: 0, seq: 1, count: 2, key: 0 }, 8);
    let n = 200_000;
    let t = Instant::now();
    for _ in 0..n {
        let wire = std::hint::black_box(h.seal(&mut tx));
        assert!(Header::open(&wire, &rx).is_ok());
        rx.consumed();
    }
    println!("seal + open of one frame header: {:.0} ns", t.elapsed().as_nanos() as f64 / n as f64);
}

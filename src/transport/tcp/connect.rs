//! Building the full mesh: one authenticated TCP connection per pair of ranks. Every rank
//! listens on an ephemeral port of the address it advertises (not on every interface) and
//! publishes `host:port` in the store; rank r then connects to every lower rank while a thread
//! accepts the higher ones (accept.rs). Each connection is authenticated both ways with the
//! group's secret before it carries a frame (handshake.rs); a connection that fails is closed
//! and the mesh goes on.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::accept::{AcceptSpec, accept_peers};
use super::handshake::{
    CHALLENGE_LEN, Challenge, FLAG_TLS, Hello, Link, Secret, Transcript, encode_proof, flags_mismatch, random_nonce,
};
use crate::error::{CommError, Result};
use crate::keys::Key;
use crate::rendezvous::{Store, parse_address, rendezvous_error};

/// How long one connection may take to authenticate (less when the group's timeout is shorter).
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The address this rank advertises: `XCCL_RS_SOCKET_HOST`, else what the hostname resolves to
/// (any IPv4 address), else loopback.
fn advertised_host(configured: Option<&str>) -> String {
    if let Some(h) = configured {
        return h.to_string();
    }
    let mut buf = [0u8; 256];
    // SAFETY: `buf` is writable for its whole length, which is what we pass.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc == 0 {
        let len = buf.iter().position(|&c| c == 0).unwrap_or(buf.len());
        if let Ok(name) = std::str::from_utf8(&buf[..len]) {
            if let Ok(addrs) = (name, 0u16).to_socket_addrs() {
                if let Some(a) = addrs.into_iter().find(|a| a.is_ipv4()) {
                    return a.ip().to_string();
                }
            }
        }
    }
    "127.0.0.1".to_string()
}

/// Listens on the advertised address only, so the mesh's port is not open on every interface.
/// An address this host cannot bind (behind NAT, say) falls back to all interfaces, with a
/// warning: the handshake still keeps strangers out.
fn listen_on(host: &str) -> Result<TcpListener> {
    let ip: Option<IpAddr> = (host, 0u16).to_socket_addrs().ok().and_then(|mut a| a.next()).map(|a| a.ip());
    if let Some(ip) = ip {
        match TcpListener::bind((ip, 0)) {
            Ok(l) => return Ok(l),
            Err(e) => tracing::warn!("cannot listen on the advertised address {ip} ({e}); listening on all interfaces"),
        }
    }
    TcpListener::bind((Ipv4Addr::UNSPECIFIED, 0)).map_err(|e| CommError::io(format!("bind failed: {e}")))
}

/// What a rank needs to join its group's mesh.
#[derive(Clone, Copy)]
pub struct MeshSpec<'a> {
    /// Where the ranks publish their addresses.
    pub store: &'a dyn Store,
    pub rank: usize,
    pub size: usize,
    /// The group's secret (rendezvous.rs), which every connection proves it knows.
    pub secret: &'a Secret,
    /// `XCCL_RS_SOCKET_HOST`: the address to advertise.
    pub socket_host: Option<&'a str>,
    /// `XCCL_RS_TLS`: every link runs TLS after its handshake (tls.rs).
    pub tls: bool,
    pub timeout: Duration,
}

impl MeshSpec<'_> {
    /// The flags this rank's handshakes carry.
    pub fn flags(&self) -> u16 {
        if self.tls { FLAG_TLS } else { 0 }
    }
}

/// Connects this rank to every other rank. Returns `links[r]` = the connection to rank r
/// (`None` for this rank itself).
pub fn connect_mesh(spec: &MeshSpec<'_>) -> Result<Vec<Option<Link>>> {
    let MeshSpec { store, rank, size, secret, socket_host, timeout, .. } = *spec;
    let deadline = Instant::now() + timeout;
    if size == 1 {
        return Ok(vec![None]);
    }
    let host = advertised_host(socket_host);
    let listener = listen_on(&host)?;
    let port = listener.local_addr().map_err(|e| CommError::io(e.to_string()))?.port();
    let handshake_timeout = HANDSHAKE_TIMEOUT.min(timeout);
    let stop = AtomicBool::new(false);
    let accept_spec = AcceptSpec { rank, size, secret, flags: spec.flags(), deadline, handshake_timeout, stop: &stop };
    let (outgoing, incoming) = std::thread::scope(|s| {
        let acceptor = (rank + 1 < size).then(|| s.spawn(|| accept_peers(&listener, &accept_spec)));
        let outgoing = store
            .set(&Key::Address(rank).text(), format!("{host}:{port}").as_bytes())
            .and_then(|_| (0..rank).map(|peer| connect_to(spec, peer, deadline, handshake_timeout)).collect::<Result<Vec<Link>>>());
        if outgoing.is_err() {
            stop.store(true, Ordering::Release);
        }
        let incoming = match acceptor {
            Some(handle) => handle.join().unwrap_or_else(|_| Err(CommError::io("the accepting thread panicked"))),
            None => Ok((0..size).map(|_| None).collect()),
        };
        (outgoing, incoming)
    });
    // The connecting side's error first: after it fails, the acceptor only says "cancelled".
    let outgoing = outgoing?;
    let mut links = incoming?;
    for (peer, link) in outgoing.into_iter().enumerate() {
        links[peer] = Some(link);
    }
    for link in links.iter_mut().flatten() {
        let stream = &link.stream;
        stream.set_read_timeout(None).ok();
        stream.set_write_timeout(None).ok();
        stream.set_nodelay(true).map_err(|e| CommError::io(e.to_string()))?;
        stream.set_nonblocking(true).map_err(|e| CommError::io(e.to_string()))?;
    }
    Ok(links)
}

fn remaining(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now())
}

/// Connects to `peer` (a lower rank) and authenticates both ways. Connection failures and
/// handshakes cut short are retried until the deadline (the peer may be flooded by strangers);
/// a peer that answers but cannot prove it knows the secret is an error at once.
fn connect_to(spec: &MeshSpec<'_>, peer: usize, deadline: Instant, handshake_timeout: Duration) -> Result<Link> {
    let rank = spec.rank;
    let raw = spec.store.get(&Key::Address(peer).text(), remaining(deadline)).map_err(|e| rendezvous_error(rank, peer, e))?;
    let addr = parse_address(&raw).map_err(|m| CommError::io(format!("rank {peer} published an unusable address: {m}")))?;
    let mut backoff = Duration::from_millis(1);
    loop {
        let left = remaining(deadline);
        let attempt = TcpStream::connect_timeout(&addr, left.max(Duration::from_millis(1)))
            .map_err(|e| format!("could not connect: {e}"))
            .and_then(|stream| authenticate(stream, spec, peer, handshake_timeout.min(left)));
        match attempt {
            Ok(Ok(link)) => return Ok(link),
            Ok(Err(Refusal::NotThePeer(why))) => {
                return Err(CommError::io(format!("rank {rank} could not authenticate rank {peer} at {addr}: {why}")));
            }
            Ok(Err(Refusal::Mismatch(why))) => return Err(CommError::invalid(why)),
            Err(e) if Instant::now() < deadline => {
                tracing::debug!(%addr, error = %e, "connect retry");
                std::thread::sleep(backoff.min(remaining(deadline)));
                backoff = (backoff * 2).min(Duration::from_millis(100));
            }
            Err(e) => {
                return Err(CommError::timeout(format!("rank {rank} could not connect to rank {peer} at {addr}: {e}")));
            }
        }
    }
}

/// Why the connector gives up on a peer that answered.
enum Refusal {
    /// It does not know the secret, or does not speak the protocol.
    NotThePeer(String),
    /// It is the peer, but its links are configured differently.
    Mismatch(String),
}

/// The connector's half of the handshake. `Err` is worth a retry (the connection failed);
/// `Ok(Err)` is a peer that cannot be linked to.
fn authenticate(
    mut stream: TcpStream,
    spec: &MeshSpec<'_>,
    peer: usize,
    limit: Duration,
) -> std::result::Result<std::result::Result<Link, Refusal>, String> {
    let limit = Some(limit.max(Duration::from_millis(1)));
    stream.set_read_timeout(limit).and_then(|_| stream.set_write_timeout(limit)).map_err(|e| e.to_string())?;
    let nonce_c = random_nonce()?;
    let hello = Hello { from: spec.rank as u32, to: peer as u32, flags: spec.flags(), nonce: nonce_c };
    stream.write_all(&hello.encode()).map_err(|e| format!("hello failed: {e}"))?;
    let mut b = [0u8; CHALLENGE_LEN];
    stream.read_exact(&mut b).map_err(|e| format!("no challenge came back: {e}"))?;
    let challenge = match Challenge::decode(&b) {
        Ok(c) => c,
        Err(m) => return Ok(Err(Refusal::NotThePeer(m))),
    };
    let transcript =
        Transcript { from: hello.from, to: hello.to, flags_c: hello.flags, flags_a: challenge.flags, nonce_c, nonce_a: challenge.nonce };
    if !transcript.verify_acceptor(spec.secret, &challenge.mac) {
        return Ok(Err(Refusal::NotThePeer("its answer does not match the group's secret (is another process on that port?)".into())));
    }
    // The proof goes even to a peer configured differently, so that it too learns why.
    stream.write_all(&encode_proof(&transcript.connector_mac(spec.secret))).map_err(|e| format!("proof failed: {e}"))?;
    if challenge.flags != hello.flags {
        return Ok(Err(Refusal::Mismatch(flags_mismatch(spec.rank, hello.flags, peer, challenge.flags))));
    }
    Ok(Ok(Link { stream, frame_key: transcript.frame_key(spec.secret) }))
}

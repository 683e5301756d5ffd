//! Building the full mesh: one TCP connection per pair of ranks. Every rank listens on an
//! ephemeral port and publishes `host:port` in the store; rank r then connects to every lower
//! rank and accepts a connection from every higher one. A connecting rank first sends a hello
//! (magic, group token, its rank, the rank it meant to reach), so the acceptor knows who called
//! and refuses connections that belong to another group.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use crate::error::{CommError, ErrorKind, Result};
use crate::rendezvous::{Store, address_key, rendezvous_error};

const HELLO_MAGIC: u32 = u32::from_le_bytes(*b"XCHI");
const HELLO_LEN: usize = 24;

fn hello(token: u64, from: usize, to: usize) -> [u8; HELLO_LEN] {
    let mut b = [0u8; HELLO_LEN];
    b[0..4].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
    b[8..16].copy_from_slice(&token.to_le_bytes());
    b[16..20].copy_from_slice(&(from as u32).to_le_bytes());
    b[20..24].copy_from_slice(&(to as u32).to_le_bytes());
    b
}

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

/// What a rank needs to join its group's mesh.
#[derive(Clone, Copy)]
pub struct MeshSpec<'a> {
    /// Where the ranks publish their addresses.
    pub store: &'a dyn Store,
    pub rank: usize,
    pub size: usize,
    /// The group's token (rendezvous.rs), carried in every hello.
    pub token: u64,
    /// `XCCL_RS_SOCKET_HOST`: the address to advertise.
    pub socket_host: Option<&'a str>,
    pub timeout: Duration,
}

/// Connects this rank to every other rank. Returns `peers[r]` = the connection to rank r
/// (`None` for this rank itself).
pub fn connect_mesh(spec: &MeshSpec<'_>) -> Result<Vec<Option<TcpStream>>> {
    let MeshSpec { store, rank, size, token, socket_host, timeout } = *spec;
    let deadline = Instant::now() + timeout;
    let mut peers: Vec<Option<TcpStream>> = (0..size).map(|_| None).collect();
    if size == 1 {
        return Ok(peers);
    }
    let listener = TcpListener::bind("0.0.0.0:0").map_err(|e| CommError::io(format!("xccl_rs: bind failed: {e}")))?;
    let port = listener.local_addr().map_err(|e| CommError::io(e.to_string()))?.port();
    let host = advertised_host(socket_host);
    store.set(&address_key(rank), format!("{host}:{port}").as_bytes())?;

    for peer in 0..rank {
        let raw = store
            .get(&address_key(peer), remaining(deadline))
            .map_err(|e| rendezvous_error(rank, peer, e))?;
        let text = String::from_utf8_lossy(&raw).to_string();
        let addr: SocketAddr = text
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next())
            .ok_or_else(|| CommError::io(format!("xccl_rs: rank {peer} published an unusable address '{text}'")))?;
        let mut stream = connect_with_retry(addr, peer, rank, deadline)?;
        stream
            .write_all(&hello(token, rank, peer))
            .map_err(|e| CommError::io(format!("xccl_rs: rank {rank} could not greet rank {peer} at {addr}: {e}")))?;
        peers[peer] = Some(stream);
    }

    let mut missing = size - rank - 1;
    listener.set_nonblocking(true).map_err(|e| CommError::io(e.to_string()))?;
    while missing > 0 {
        match listener.accept() {
            Ok((mut stream, from_addr)) => {
                stream.set_nonblocking(false).map_err(|e| CommError::io(e.to_string()))?;
                stream.set_read_timeout(Some(remaining(deadline).max(Duration::from_millis(1)))).ok();
                let mut b = [0u8; HELLO_LEN];
                if stream.read_exact(&mut b).is_err() {
                    continue; // Not one of ours, or it gave up: keep waiting for the real peers.
                }
                let magic = u32::from_le_bytes(b[0..4].try_into().unwrap_or_default());
                let their_token = u64::from_le_bytes(b[8..16].try_into().unwrap_or_default());
                let from = u32::from_le_bytes(b[16..20].try_into().unwrap_or_default()) as usize;
                let to = u32::from_le_bytes(b[20..24].try_into().unwrap_or_default()) as usize;
                if magic != HELLO_MAGIC || their_token != token || to != rank || from <= rank || from >= size {
                    tracing::warn!(%from_addr, "refused a connection that does not belong to this group");
                    continue;
                }
                if peers[from].is_some() {
                    return Err(CommError::io(format!("xccl_rs: rank {from} connected to rank {rank} twice")));
                }
                peers[from] = Some(stream);
                missing -= 1;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let absent: Vec<usize> = (rank + 1..size).filter(|&r| peers[r].is_none()).collect();
                    return Err(CommError::new(
                        ErrorKind::Timeout,
                        format!("xccl_rs: rank {rank} timed out after {timeout:?} waiting for ranks {absent:?} to connect"),
                    ));
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => return Err(CommError::io(format!("xccl_rs: accept failed on rank {rank}: {e}"))),
        }
    }

    for stream in peers.iter().flatten() {
        stream.set_read_timeout(None).ok();
        stream.set_nodelay(true).map_err(|e| CommError::io(e.to_string()))?;
        stream.set_nonblocking(true).map_err(|e| CommError::io(e.to_string()))?;
    }
    Ok(peers)
}

fn remaining(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now())
}

fn connect_with_retry(addr: SocketAddr, peer: usize, rank: usize, deadline: Instant) -> Result<TcpStream> {
    let mut backoff = Duration::from_millis(1);
    loop {
        let left = remaining(deadline);
        match TcpStream::connect_timeout(&addr, left.max(Duration::from_millis(1))) {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() < deadline => {
                tracing::debug!(%addr, error = %e, "connect retry");
                std::thread::sleep(backoff.min(left));
                backoff = (backoff * 2).min(Duration::from_millis(100));
            }
            Err(e) => {
                return Err(CommError::new(
                    ErrorKind::Timeout,
                    format!("xccl_rs: rank {rank} could not connect to rank {peer} at {addr}: {e}"),
                ));
            }
        }
    }
}

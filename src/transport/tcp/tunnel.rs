//! A TLS tunnel for one link: a thread moves bytes between the TCP connection (TLS records)
//! and one end of a local socket pair (plain bytes), whose other end the transport uses as it
//! would use the TCP socket. So `poll`, peeks, EOF and shutdown mean the same with TLS, and
//! the frame engine (exchange.rs) has one code path. The price is a copy through the socket
//! pair and a thread wake-up per burst: docs/security.md measures it.
//!
//! The thread ends when either side closes: the transport's end (close, drop) makes it send
//! TLS's close_notify and shut the connection; the peer's close, or a TLS error (a record that
//! fails its authentication tag, say), makes it shut the transport's end, which the transport
//! then sees as the peer closing.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, OnceLock, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rustls::Connection;

use super::socket;
use crate::error::{CommError, Result};

/// Plain bytes moved per read on either side, and the cap on what rustls buffers. Small enough
/// to stay in the core's cache, where encryption runs fastest (`tunnel_speed` below measures
/// other sizes; docs/security.md has the figures).
const CHUNK: usize = 64 << 10;
/// Socket-pair buffers: large enough that a burst does not stall on the local hop.
const PAIR_BUFFER: libc::c_int = 4 << 20;
/// How long a closing tunnel tries to deliver its last records (close_notify).
const FLUSH_LIMIT: Duration = Duration::from_secs(1);

/// A link's TLS tunnel: the end the transport uses, and the thread behind it.
pub struct Tunnel {
    pub local: UnixStream,
    pump: Option<JoinHandle<()>>,
    /// Set by the thread, before it closes `local`, when the link failed.
    failure: Arc<OnceLock<String>>,
}

impl Tunnel {
    /// Why the link failed, once the thread has stopped on a failure.
    pub fn failure(&self) -> Option<String> {
        self.failure.get().cloned()
    }
}

impl Drop for Tunnel {
    fn drop(&mut self) {
        let _ = self.local.shutdown(Shutdown::Both);
        if let Some(pump) = self.pump.take() {
            let _ = pump.join();
        }
    }
}

fn set_buffers(s: &UnixStream) {
    for opt in [libc::SO_SNDBUF, libc::SO_RCVBUF] {
        // SAFETY: a valid socket, and a pointer to an int of the size we pass.
        unsafe {
            libc::setsockopt(
                s.as_raw_fd(),
                libc::SOL_SOCKET,
                opt,
                (&PAIR_BUFFER as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            );
        }
    }
}

/// A tunnel whose TLS handshake is under way.
pub struct Opening {
    tunnel: Tunnel,
    ready: mpsc::Receiver<std::result::Result<(), String>>,
    rank: usize,
    peer: usize,
    deadline: Instant,
}

impl Opening {
    /// Waits until the TLS handshake with the peer is done (or fails, or the deadline passes).
    pub fn finish(self) -> Result<Tunnel> {
        let Opening { tunnel, ready, rank, peer, deadline } = self;
        match ready.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(Ok(())) => Ok(tunnel),
            Ok(Err(why)) => Err(CommError::io(format!("rank {rank}: TLS with rank {peer} failed: {why}"))),
            Err(_) => {
                Err(CommError::timeout(format!("rank {rank}: the TLS handshake with rank {peer} timed out")))
            }
        }
    }
}

/// Starts the tunnel's thread, which runs the TLS handshake with `peer` (at most until
/// `deadline`), then moves the link's bytes. The TCP stream must be non-blocking.
pub fn open(tcp: TcpStream, conn: Connection, rank: usize, peer: usize, deadline: Instant) -> Result<Opening> {
    let (local, remote) = UnixStream::pair().map_err(|e| CommError::io(format!("socketpair failed: {e}")))?;
    set_buffers(&local);
    set_buffers(&remote);
    remote.set_nonblocking(true).map_err(|e| CommError::io(e.to_string()))?;
    let (ready_tx, ready_rx) = mpsc::channel();
    let failure = Arc::new(OnceLock::new());
    let failed = failure.clone();
    let pump = std::thread::Builder::new()
        .name(format!("xccl_rs-tls-{peer}"))
        .spawn(move || Pump::new(tcp, remote, conn, ready_tx, deadline).run(rank, peer, &failed))
        .map_err(|e| CommError::io(format!("cannot start a TLS thread: {e}")))?;
    Ok(Opening { tunnel: Tunnel { local, pump: Some(pump), failure }, ready: ready_rx, rank, peer, deadline })
}

struct Pump {
    tcp: TcpStream,
    local: UnixStream,
    conn: Connection,
    /// Told once: the handshake is done, or why it failed.
    ready: Option<mpsc::Sender<std::result::Result<(), String>>>,
    handshake_deadline: Instant,
    /// Plain bytes from the peer, not yet taken by the local end.
    inbound: Vec<u8>,
    inbound_at: usize,
    /// Plain bytes from the local end, not yet taken by rustls.
    outbound: Vec<u8>,
    outbound_at: usize,
    /// No more records will come: the peer sent close_notify or closed TCP.
    peer_done: bool,
    /// rustls has handed over the last plain byte the peer sent (it said so: end of stream).
    plaintext_end: bool,
}

/// Why the pump stops.
enum Stop {
    /// The local end closed: say goodbye to the peer.
    LocalClosed,
    /// The peer closed, or its connection failed (why, for the log): close the local end.
    PeerGone(Option<String>),
    /// TLS refused what came (a record that fails its check, an alert, a handshake that does
    /// not finish): close the local end, and tell the transport why.
    Broken(String),
}

fn would_block(e: &io::Error) -> bool {
    socket::would_block(e)
}

impl Pump {
    fn new(
        tcp: TcpStream,
        local: UnixStream,
        mut conn: Connection,
        ready: mpsc::Sender<std::result::Result<(), String>>,
        deadline: Instant,
    ) -> Pump {
        conn.set_buffer_limit(Some(CHUNK));
        Pump {
            tcp,
            local,
            conn,
            ready: Some(ready),
            handshake_deadline: deadline,
            inbound: Vec::with_capacity(2 * CHUNK),
            inbound_at: 0,
            outbound: vec![0; CHUNK],
            outbound_at: CHUNK,
            peer_done: false,
            plaintext_end: false,
        }
    }

    fn run(mut self, rank: usize, peer: usize, failure: &OnceLock<String>) {
        let stop = self.pump();
        match stop {
            Stop::LocalClosed => {
                self.conn.send_close_notify();
                self.flush_for(FLUSH_LIMIT);
            }
            Stop::PeerGone(why) => {
                if let Some(why) = &why {
                    tracing::debug!("rank {rank}: the connection under the TLS link to rank {peer} failed: {why}");
                }
                if let Some(ready) = self.ready.take() {
                    let _ = ready.send(Err(why.unwrap_or_else(|| "the peer closed the connection".into())));
                }
            }
            Stop::Broken(why) => {
                tracing::warn!("rank {rank}: TLS link to rank {peer} failed: {why}");
                let _ = failure.set(why.clone());
                if let Some(ready) = self.ready.take() {
                    let _ = ready.send(Err(why));
                }
                self.flush_for(Duration::ZERO);
            }
        }
        let _ = self.tcp.shutdown(Shutdown::Both);
        let _ = self.local.shutdown(Shutdown::Both);
    }

    /// Writes queued TLS records for at most `limit`.
    fn flush_for(&mut self, limit: Duration) {
        let until = Instant::now() + limit;
        while self.conn.wants_write() {
            match self.conn.write_tls(&mut self.tcp) {
                Ok(_) => {}
                Err(e) if would_block(&e) && Instant::now() < until => {
                    let mut fds = [libc::pollfd { fd: self.tcp.as_raw_fd(), events: libc::POLLOUT, revents: 0 }];
                    let left = until.saturating_duration_since(Instant::now()).as_millis().max(1) as i32;
                    let _ = socket::poll(&mut fds, left);
                }
                Err(_) => return,
            }
        }
    }

    /// Moves bytes both ways until one side stops.
    fn pump(&mut self) -> Stop {
        loop {
            let stepped = self.step();
            // Ready first: a peer may finish its handshake and close at once (a rank that
            // exits right after set-up); the link was still made, and its closing is the
            // transport's to see.
            if self.ready.is_some() && !self.conn.is_handshaking() {
                let _ = self.ready.take().map(|r| r.send(Ok(())));
            }
            if let Err(why) = stepped {
                return why;
            }
            let mut fds = [
                libc::pollfd { fd: self.tcp.as_raw_fd(), events: 0, revents: 0 },
                libc::pollfd { fd: self.local.as_raw_fd(), events: 0, revents: 0 },
            ];
            if self.conn.wants_read() && !self.peer_done && self.inbound_pending() < CHUNK {
                fds[0].events |= libc::POLLIN;
            }
            if self.conn.wants_write() {
                fds[0].events |= libc::POLLOUT;
            }
            if fds[0].events == 0 {
                // Not waited on: a hung-up connection would otherwise wake poll at once, forever.
                fds[0].fd = -1;
            }
            if self.outbound_at == self.outbound.len() && !self.conn.is_handshaking() {
                fds[1].events |= libc::POLLIN;
            }
            if self.inbound_at < self.inbound.len() {
                fds[1].events |= libc::POLLOUT;
            }
            let wait = if self.ready.is_some() {
                let left = self.handshake_deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Stop::Broken("the TLS handshake did not finish in time".into());
                }
                left.as_millis().clamp(1, i32::MAX as u128) as i32
            } else {
                -1
            };
            if let Err(e) = socket::poll(&mut fds, wait) {
                return Stop::PeerGone(Some(format!("poll failed: {e}")));
            }
            let readable = fds[0].revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0 && fds[0].events & libc::POLLIN != 0;
            if readable && let Err(stop) = self.read_records() {
                return stop;
            }
            // The local end hung up (the transport closed or dropped it).
            if fds[1].revents & (libc::POLLHUP | libc::POLLERR) != 0 && fds[1].events & libc::POLLIN == 0 {
                return Stop::LocalClosed;
            }
        }
    }

    /// One round of every move that needs no waiting.
    fn step(&mut self) -> std::result::Result<(), Stop> {
        // Records out.
        while self.conn.wants_write() {
            match self.conn.write_tls(&mut self.tcp) {
                Ok(_) => {}
                Err(e) if would_block(&e) => break,
                Err(e) => return Err(Stop::PeerGone(Some(format!("sending failed: {e}")))),
            }
        }
        // Plain bytes from the peer to the local end.
        self.drain_plaintext();
        while self.inbound_at < self.inbound.len() {
            match self.local.write(&self.inbound[self.inbound_at..]) {
                Ok(n) => self.inbound_at += n,
                Err(e) if would_block(&e) => break,
                Err(_) => return Err(Stop::LocalClosed),
            }
        }
        if self.inbound_at == self.inbound.len() {
            self.inbound.clear();
            self.inbound_at = 0;
            if self.plaintext_end {
                let _ = self.local.shutdown(Shutdown::Write);
                return Err(Stop::PeerGone(None));
            }
        }
        // Plain bytes from the local end to rustls (which encrypts them into records).
        if self.conn.is_handshaking() {
            return Ok(());
        }
        loop {
            if self.outbound_at == self.outbound.len() {
                self.outbound.resize(CHUNK, 0);
                match self.local.read(&mut self.outbound) {
                    Ok(0) => return Err(Stop::LocalClosed),
                    Ok(n) => {
                        self.outbound.truncate(n);
                        self.outbound_at = 0;
                    }
                    Err(e) if would_block(&e) => {
                        self.outbound.truncate(0);
                        self.outbound_at = 0;
                        return Ok(());
                    }
                    Err(_) => return Err(Stop::LocalClosed),
                }
            }
            match self.conn.writer().write(&self.outbound[self.outbound_at..]) {
                Ok(0) => return Ok(()),
                Ok(n) => self.outbound_at += n,
                Err(e) => return Err(Stop::Broken(format!("TLS refused data: {e}"))),
            }
            while self.conn.wants_write() {
                match self.conn.write_tls(&mut self.tcp) {
                    Ok(_) => {}
                    Err(e) if would_block(&e) => return Ok(()),
                    Err(e) => return Err(Stop::PeerGone(Some(format!("sending failed: {e}")))),
                }
            }
        }
    }

    /// Plain bytes waiting in `inbound` for the local end.
    fn inbound_pending(&self) -> usize {
        self.inbound.len() - self.inbound_at
    }

    /// Moves what rustls has decrypted into `inbound`, up to [`CHUNK`] pending there. (rustls
    /// holds only about 16 KiB of plaintext, and reads no more records while it holds any; so
    /// it is drained after every record read, and the local end gets the bytes in large writes.)
    fn drain_plaintext(&mut self) {
        if self.inbound_at >= CHUNK {
            self.inbound.drain(..self.inbound_at);
            self.inbound_at = 0;
        }
        while self.inbound_pending() < CHUNK && !self.plaintext_end {
            let old = self.inbound.len();
            self.inbound.resize(old + CHUNK, 0);
            let got = self.conn.reader().read(&mut self.inbound[old..]);
            self.inbound.truncate(old + *got.as_ref().unwrap_or(&0));
            match got {
                Ok(0) => self.plaintext_end = true, // close_notify, and everything before it read
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                // TCP closed without close_notify (the peer died), after the last byte before it.
                Err(_) => self.plaintext_end = true,
            }
        }
    }

    /// Reads records from TCP and decrypts them, until the socket is empty or [`CHUNK`] bytes
    /// wait for the local end.
    fn read_records(&mut self) -> std::result::Result<(), Stop> {
        loop {
            self.drain_plaintext();
            if self.inbound_pending() >= CHUNK || self.peer_done || !self.conn.wants_read() {
                return Ok(());
            }
            match self.conn.read_tls(&mut self.tcp) {
                Ok(0) => {
                    // Records already read still count: rustls reports the end (and a missing
                    // close_notify) once its plaintext is drained.
                    self.peer_done = true;
                    return self.process();
                }
                Ok(_) => self.process()?,
                Err(e) if would_block(&e) => return Ok(()),
                Err(e) => return Err(Stop::PeerGone(Some(format!("receiving failed: {e}")))),
            }
        }
    }

    fn process(&mut self) -> std::result::Result<(), Stop> {
        match self.conn.process_new_packets() {
            Ok(state) => {
                if state.peer_has_closed() {
                    self.peer_done = true;
                }
                Ok(())
            }
            Err(e) => {
                // Tell the peer why before closing (rustls queued an alert).
                self.flush_for(Duration::ZERO);
                Err(Stop::Broken(e.to_string()))
            }
        }
    }
}

#[cfg(test)]
mod speed {
    use super::*;
    use crate::transport::tcp::tls::{Identity, connection};

    /// `cargo test --release --lib tunnel_speed -- --ignored --nocapture`: one tunnel pair over
    /// loopback, 1 GiB one way, with the transport's ends read and written in 1 MiB pieces.
    #[test]
    #[ignore]
    fn tunnel_speed() {
        let (a, b) = (Identity::generate().unwrap(), Identity::generate().unwrap());
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        for s in [&client, &server] {
            s.set_nonblocking(true).unwrap();
            s.set_nodelay(true).unwrap();
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        let s = open(server, connection(&a, 0, 1, b.cert_for_tests()).unwrap(), 0, 1, deadline).unwrap();
        let c = open(client, connection(&b, 1, 0, a.cert_for_tests()).unwrap(), 1, 0, deadline).unwrap();
        let (s, c) = (s.finish().unwrap(), c.finish().unwrap());
        let total = 1usize << 30;
        let t = Instant::now();
        let writer = std::thread::spawn(move || {
            let mut local = &c.local;
            let piece = vec![5u8; 1 << 20];
            for _ in 0..total / piece.len() {
                local.write_all(&piece).unwrap();
            }
            c
        });
        let mut got = 0;
        let mut piece = vec![0u8; 1 << 20];
        let mut local = &s.local;
        while got < total {
            got += local.read(&mut piece).unwrap();
        }
        let secs = t.elapsed().as_secs_f64();
        drop(writer.join().unwrap());
        println!("tunnel: {:.2} GB/s", total as f64 / secs / 1e9);
    }
}

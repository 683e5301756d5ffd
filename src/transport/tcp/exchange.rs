//! The engine of the TCP transport: completes a phase's transfers with non-blocking sockets
//! and `poll(2)`.
//!
//! Terms: a peer's *send queue* and *receive queue* are the phase's transfers to and from it,
//! in list order. A peer is *watched* when the phase needs nothing from it but we still listen:
//! if it reports an abort, we fail now instead of at the timeout. A watched peer whose next
//! frame is ordinary data (for a later operation) or that closed its end is left alone: that is
//! not this phase's business.
//!
//! Every received header is checked against what this rank expects before a byte of payload
//! is written, and the payload length must match exactly: a peer can never make us write
//! outside the buffer the algorithm chose.

use std::os::fd::{AsRawFd, RawFd};
use std::time::Instant;

use super::frame::{FrameKind, HEADER_LEN, Header, MAX_ABORT_MESSAGE};
use super::{Peer, TcpTransport, socket};
use crate::error::{CommError, ErrorKind, Result};
use crate::transport::{Direction, MessageId, OpCtx, RawBuf, Transfer, Transport};
use crate::types::{dtype_code_name, op_code_name};

/// Progress of the frame being read from one peer.
enum Reading {
    Header { got: usize },
    Body { got: usize },
    Abort { message: Vec<u8>, got: usize },
}

/// One peer's share of a phase.
struct PeerPhase {
    sends: Vec<usize>,
    next_send: usize,
    /// Bytes of the current send frame (header + payload) already written.
    sent: usize,
    send_header: [u8; HEADER_LEN],
    recvs: Vec<usize>,
    next_recv: usize,
    header: [u8; HEADER_LEN],
    reading: Reading,
    /// Reading a frame we learned (by peeking) is an abort, though no receive is pending.
    abort_pending: bool,
    watch: bool,
}

impl PeerPhase {
    fn new() -> Self {
        PeerPhase {
            sends: Vec::new(),
            next_send: 0,
            sent: 0,
            send_header: [0; HEADER_LEN],
            recvs: Vec::new(),
            next_recv: 0,
            header: [0; HEADER_LEN],
            reading: Reading::Header { got: 0 },
            abort_pending: false,
            watch: true,
        }
    }
    fn sending(&self) -> bool {
        self.next_send < self.sends.len()
    }
    fn receiving(&self) -> bool {
        self.next_recv < self.recvs.len() || self.abort_pending
    }
}

/// A read-only view of a transfer's buffer.
///
/// # Safety
/// `buf` must satisfy `RawBuf::new`'s contract and not be written during the returned borrow.
unsafe fn bytes<'a>(buf: &RawBuf) -> &'a [u8] {
    if buf.is_empty() {
        return &[];
    }
    // SAFETY: non-empty RawBufs point to `len` valid bytes (the caller's contract).
    unsafe { std::slice::from_raw_parts(buf.ptr(), buf.len()) }
}

/// A writable view of a transfer's buffer.
///
/// # Safety
/// As [`bytes`], and no other view of the memory may be alive during the returned borrow.
unsafe fn bytes_mut<'a>(buf: &RawBuf) -> &'a mut [u8] {
    if buf.is_empty() {
        return &mut [];
    }
    // SAFETY: non-empty RawBufs point to `len` valid, exclusively ours bytes (the caller's contract).
    unsafe { std::slice::from_raw_parts_mut(buf.ptr(), buf.len()) }
}

fn closed_error(ctx: &OpCtx, peer: usize, detail: &str) -> CommError {
    CommError::peer(format!(
        "{}: rank {peer} closed its connection{detail} (did it exit or crash?)",
        ctx.describe()
    ))
}

/// Compares a received header with the expectation (`expect`, and a payload of `expect_len`
/// bytes); the message says what differs.
fn check_header(expect: &MessageId, expect_len: u64, got: &Header, peer: usize, ctx: &OpCtx) -> Result<()> {
    let (got, got_len) = (&got.id, got.payload_len);
    let me = ctx.rank;
    let what = ctx.describe();
    if got.op != expect.op || got.seq != expect.seq {
        return Err(CommError::mismatch(format!(
            "{what}: rank {peer} sent data for {} #{}, but rank {me} is in {} #{} \
             (ranks must call the same collectives in the same order)",
            op_code_name(got.op),
            got.seq,
            op_code_name(expect.op),
            expect.seq
        )));
    }
    if got.dtype != expect.dtype {
        return Err(CommError::mismatch(format!(
            "{what}: rank {peer} sent {} elements, rank {me} expected {} (dtype mismatch)",
            dtype_code_name(got.dtype),
            dtype_code_name(expect.dtype)
        )));
    }
    if got.reduce != expect.reduce {
        let name = |code: u8| crate::types::ReduceOp::from_code(code).map_or("an unknown op", |r| r.name());
        return Err(CommError::mismatch(format!(
            "{what}: rank {peer} reduces with {}, rank {me} with {} (reduce op mismatch)",
            name(got.reduce),
            name(expect.reduce)
        )));
    }
    if got.key != expect.key {
        let is_p2p = crate::types::OpKind::from_code(expect.op).is_some_and(|k| k.is_p2p());
        let name = if is_p2p { "tag" } else { "root" };
        return Err(CommError::mismatch(format!(
            "{what}: rank {peer} used {name} {}, rank {me} used {name} {} ({name} mismatch)",
            got.key, expect.key
        )));
    }
    if got.count != expect.count {
        return Err(CommError::mismatch(format!(
            "{what}: rank {peer} sent {} elements of {}, rank {me} expected {} (size mismatch)",
            got.count,
            dtype_code_name(got.dtype),
            expect.count
        )));
    }
    if got_len != expect_len {
        return Err(CommError::mismatch(format!(
            "{what}: rank {peer} sent {got_len} bytes, rank {me} expected {expect_len} (size mismatch)"
        )));
    }
    Ok(())
}

fn peer_abort_error(ctx: &OpCtx, peer: usize, message: &[u8]) -> CommError {
    CommError::peer(format!(
        "{}: rank {peer} failed and aborted the group: {}",
        ctx.describe(),
        String::from_utf8_lossy(message)
    ))
}

impl TcpTransport {
    fn fd(&self, peer: usize) -> RawFd {
        self.peers[peer].as_ref().map(|p| p.stream.as_raw_fd()).unwrap_or(-1)
    }

    fn peer_mut(&mut self, peer: usize) -> &mut Peer {
        self.peers[peer].as_mut().expect("peer index checked by the caller")
    }

    /// Writes as much of `peer`'s send queue as the socket takes.
    fn pump_send(&mut self, peer: usize, st: &mut PeerPhase, transfers: &[Transfer], ctx: &OpCtx) -> Result<()> {
        let fd = self.fd(peer);
        while st.sending() {
            let t = &transfers[st.sends[st.next_send]];
            if st.sent == 0 {
                st.send_header = Header::data(t.id, t.buf.len() as u64).encode();
            }
            // SAFETY: send buffers are only read during a phase (the algorithms never receive
            // into memory they send from in the same phase).
            let body = unsafe { bytes(&t.buf) };
            let total = HEADER_LEN + body.len();
            let (first, second) = if st.sent < HEADER_LEN {
                (&st.send_header[st.sent..], body)
            } else {
                (&[][..], &body[st.sent - HEADER_LEN..])
            };
            match socket::send2(fd, first, second) {
                Ok(n) => {
                    st.sent += n;
                    let done = st.sent == total;
                    self.peer_mut(peer).broken_out = !done;
                    if done {
                        st.sent = 0;
                        st.next_send += 1;
                    }
                }
                Err(e) if socket::would_block(&e) => return Ok(()),
                Err(e) => {
                    // A peer that failed sends an abort frame, then may exit before we read it:
                    // its reason explains more than the broken pipe it left.
                    if let Some(message) = self.queued_abort(peer) {
                        return Err(peer_abort_error(ctx, peer, &message));
                    }
                    return Err(closed_error(ctx, peer, &format!(" while rank {} was sending ({e})", ctx.rank)));
                }
            }
        }
        Ok(())
    }

    /// The message of an abort frame that is the next thing queued on `peer`'s socket, if it
    /// is there whole (read without consuming it; bounded by MAX_ABORT_MESSAGE).
    fn queued_abort(&self, peer: usize) -> Option<Vec<u8>> {
        let fd = self.fd(peer);
        let mut header = [0u8; HEADER_LEN];
        if socket::peek(fd, &mut header).ok()? != HEADER_LEN || !Header::peek_is_abort(&header) {
            return None;
        }
        let h = Header::decode(&header).ok()?;
        if h.kind != FrameKind::Abort || h.payload_len > MAX_ABORT_MESSAGE {
            return None;
        }
        let mut frame = vec![0u8; HEADER_LEN + h.payload_len as usize];
        (socket::peek(fd, &mut frame).ok()? == frame.len()).then(|| frame.split_off(HEADER_LEN))
    }

    /// Reads `peer`'s frames into the pending receives, stopping after the last one so that
    /// bytes of later operations stay in the socket.
    fn pump_recv(&mut self, peer: usize, st: &mut PeerPhase, transfers: &[Transfer], ctx: &OpCtx) -> Result<()> {
        let fd = self.fd(peer);
        while st.receiving() {
            let step = match &mut st.reading {
                Reading::Header { got } => socket::recv(fd, &mut st.header[*got..]),
                Reading::Body { got } => {
                    let t = &transfers[st.recvs[st.next_recv]];
                    // SAFETY: receive buffers of a phase are disjoint from each other and from
                    // every send buffer of the phase; this is the only live view of this one.
                    let dst = unsafe { bytes_mut(&t.buf) };
                    socket::recv(fd, &mut dst[*got..])
                }
                Reading::Abort { message, got } => socket::recv(fd, &mut message[*got..]),
            };
            let n = match step {
                Ok(0) => {
                    self.peer_mut(peer).closed = true;
                    return Err(closed_error(ctx, peer, &format!(" while rank {} waited for its data", ctx.rank)));
                }
                Ok(n) => n,
                Err(e) if socket::would_block(&e) => return Ok(()),
                Err(e) => {
                    self.peer_mut(peer).closed = true;
                    return Err(closed_error(ctx, peer, &format!(" ({e})")));
                }
            };
            match &mut st.reading {
                Reading::Header { got } => {
                    *got += n;
                    if *got < HEADER_LEN {
                        continue;
                    }
                    let h = Header::decode(&st.header)
                        .map_err(|m| CommError::io(format!("{}: from rank {peer}: {m}", ctx.describe())))?;
                    if h.kind == FrameKind::Abort {
                        if h.payload_len > MAX_ABORT_MESSAGE {
                            return Err(CommError::io(format!("{}: rank {peer} sent a corrupt abort frame", ctx.describe())));
                        }
                        st.reading = Reading::Abort { message: vec![0; h.payload_len as usize], got: 0 };
                        if h.payload_len == 0 {
                            return Err(peer_abort_error(ctx, peer, b""));
                        }
                        continue;
                    }
                    let Some(&idx) = st.recvs.get(st.next_recv) else {
                        return Err(CommError::io(format!("{}: unexpected frame from rank {peer}", ctx.describe())));
                    };
                    check_header(&transfers[idx].id, transfers[idx].buf.len() as u64, &h, peer, ctx)?;
                    st.reading = Reading::Body { got: 0 };
                    if transfers[idx].buf.is_empty() {
                        st.reading = Reading::Header { got: 0 };
                        st.next_recv += 1;
                    }
                }
                Reading::Body { got } => {
                    *got += n;
                    if *got == transfers[st.recvs[st.next_recv]].buf.len() {
                        st.reading = Reading::Header { got: 0 };
                        st.next_recv += 1;
                    }
                }
                Reading::Abort { message, got } => {
                    *got += n;
                    if *got == message.len() {
                        return Err(peer_abort_error(ctx, peer, message));
                    }
                }
            }
        }
        Ok(())
    }

    /// Looks at a watched peer's next bytes: an abort is read (and fails the phase), anything
    /// else ends the watch.
    fn inspect_watched(&mut self, peer: usize, st: &mut PeerPhase) {
        let mut prefix = [0u8; HEADER_LEN];
        match socket::peek(self.fd(peer), &mut prefix) {
            Ok(0) => {
                self.peer_mut(peer).closed = true;
                st.watch = false;
            }
            Ok(n) if Header::peek_is_abort(&prefix[..n]) => st.abort_pending = true,
            Ok(_) => st.watch = false,
            Err(e) if socket::would_block(&e) => {}
            Err(_) => {
                self.peer_mut(peer).closed = true;
                st.watch = false;
            }
        }
    }

    fn timeout_error(&self, phases: &[PeerPhase], ctx: &OpCtx) -> CommError {
        let silent: Vec<usize> = (0..self.size).filter(|&p| p != self.rank && phases[p].next_recv < phases[p].recvs.len()).collect();
        let blocked: Vec<usize> = (0..self.size).filter(|&p| p != self.rank && phases[p].sending()).collect();
        let mut msg = format!("{}: timed out after {} ms", ctx.describe(), ctx.timeout.as_millis());
        if !silent.is_empty() {
            msg += &format!("; ranks not heard from: {silent:?}");
        }
        if !blocked.is_empty() {
            msg += &format!("; ranks not accepting data: {blocked:?}");
        }
        msg += " (is a rank stuck, dead, or in a different collective?)";
        CommError::new(ErrorKind::Timeout, msg)
    }

    fn poll_timeout_ms(deadline: Instant) -> Option<i32> {
        let left = deadline.checked_duration_since(Instant::now())?;
        if left.is_zero() {
            return None;
        }
        Some(left.as_millis().clamp(1, i32::MAX as u128) as i32)
    }
}

impl Transport for TcpTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn exchange(&mut self, transfers: &[Transfer], ctx: &OpCtx) -> Result<()> {
        let mut phases: Vec<PeerPhase> = (0..self.size).map(|_| PeerPhase::new()).collect();
        for (i, t) in transfers.iter().enumerate() {
            if t.peer >= self.size || t.peer == self.rank {
                return Err(CommError::invalid(format!("{}: transfer to invalid peer {}", ctx.describe(), t.peer)));
            }
            match t.dir {
                Direction::Send => phases[t.peer].sends.push(i),
                Direction::Recv => phases[t.peer].recvs.push(i),
            }
        }
        for p in (0..self.size).filter(|&p| p != self.rank) {
            let peer = self.peers[p].as_ref().expect("every other rank has a connection");
            let involved = !phases[p].sends.is_empty() || !phases[p].recvs.is_empty();
            if peer.closed {
                if involved {
                    return Err(closed_error(ctx, p, " earlier"));
                }
                phases[p].watch = false;
            }
        }

        let mut fds: Vec<libc::pollfd> = Vec::with_capacity(self.size);
        let mut owners: Vec<usize> = Vec::with_capacity(self.size);
        loop {
            fds.clear();
            owners.clear();
            let mut busy = false;
            for (p, st) in phases.iter().enumerate() {
                if p == self.rank {
                    continue;
                }
                let mut events = 0;
                if st.sending() {
                    events |= libc::POLLOUT;
                    busy = true;
                }
                if st.receiving() {
                    events |= libc::POLLIN;
                    busy = true;
                } else if st.watch {
                    events |= libc::POLLIN;
                }
                if events != 0 {
                    fds.push(libc::pollfd { fd: self.fd(p), events, revents: 0 });
                    owners.push(p);
                }
            }
            if !busy {
                return Ok(());
            }
            if let Some(e) = ctx.aborted() {
                return Err(e);
            }
            let Some(wait_ms) = Self::poll_timeout_ms(ctx.deadline) else {
                return Err(self.timeout_error(&phases, ctx));
            };
            if let Some(fd) = ctx.abort.as_ref().and_then(|a| a.fd()) {
                fds.push(libc::pollfd { fd, events: libc::POLLIN, revents: 0 });
            }
            socket::poll(&mut fds, wait_ms).map_err(|e| CommError::io(format!("{}: poll failed: {e}", ctx.describe())))?;
            // (The switch's entry, if any, is last and has no owner: zip skips it.)
            for (fd, &p) in fds.iter().zip(owners.iter()) {
                let ev = fd.revents;
                if ev == 0 {
                    continue;
                }
                let mut st = std::mem::replace(&mut phases[p], PeerPhase::new());
                let result = (|| {
                    if st.sending() && ev & (libc::POLLOUT | libc::POLLERR | libc::POLLHUP) != 0 {
                        self.pump_send(p, &mut st, transfers, ctx)?;
                    }
                    if ev & (libc::POLLIN | libc::POLLERR | libc::POLLHUP) != 0 {
                        if st.receiving() {
                            self.pump_recv(p, &mut st, transfers, ctx)?;
                        } else if st.watch {
                            self.inspect_watched(p, &mut st);
                            if st.abort_pending {
                                self.pump_recv(p, &mut st, transfers, ctx)?;
                            }
                        }
                    }
                    Ok(())
                })();
                phases[p] = st;
                result?;
            }
        }
    }

    fn probe_any(&mut self, accept: &dyn Fn(usize, &MessageId) -> bool, ctx: &OpCtx) -> Result<usize> {
        let mut excluded = vec![false; self.size];
        excluded[self.rank] = true;
        loop {
            let mut fds: Vec<libc::pollfd> = Vec::new();
            let mut owners = Vec::new();
            for p in 0..self.size {
                let Some(peer) = self.peers[p].as_ref() else { continue };
                if excluded[p] || peer.closed {
                    continue;
                }
                fds.push(libc::pollfd { fd: peer.stream.as_raw_fd(), events: libc::POLLIN, revents: 0 });
                owners.push(p);
            }
            if let Some(e) = ctx.aborted() {
                return Err(e);
            }
            let Some(wait_ms) = Self::poll_timeout_ms(ctx.deadline) else {
                return Err(CommError::new(
                    ErrorKind::Timeout,
                    format!(
                        "{}: timed out after {} ms: no rank sent a matching message",
                        ctx.describe(),
                        ctx.timeout.as_millis()
                    ),
                ));
            };
            if fds.is_empty() {
                // Nobody can still send us a match; sleep out the deadline to report it.
                std::thread::sleep(std::time::Duration::from_millis(wait_ms.min(50) as u64));
                continue;
            }
            if let Some(fd) = ctx.abort.as_ref().and_then(|a| a.fd()) {
                fds.push(libc::pollfd { fd, events: libc::POLLIN, revents: 0 });
            }
            socket::poll(&mut fds, wait_ms).map_err(|e| CommError::io(format!("{}: poll failed: {e}", ctx.describe())))?;
            for (fd, &p) in fds.iter().zip(owners.iter()) {
                if fd.revents == 0 {
                    continue;
                }
                let mut prefix = [0u8; HEADER_LEN];
                match socket::peek(fd.fd, &mut prefix) {
                    Ok(0) | Err(_) => {
                        self.peer_mut(p).closed = true;
                    }
                    Ok(n) if Header::peek_is_abort(&prefix[..n]) => {
                        let mut st = PeerPhase::new();
                        st.abort_pending = true;
                        // Read the abort to completion (it arrives whole; retry until it has).
                        loop {
                            self.pump_recv(p, &mut st, &[], ctx)?;
                            if Self::poll_timeout_ms(ctx.deadline).is_none() {
                                return Err(closed_error(ctx, p, " in the middle of an abort message"));
                            }
                            std::thread::sleep(std::time::Duration::from_millis(1));
                        }
                    }
                    Ok(HEADER_LEN) => match Header::decode(&prefix) {
                        // Not an abort (peeked above), so a data frame.
                        Ok(h) if accept(p, &h.id) => return Ok(p),
                        _ => excluded[p] = true,
                    },
                    // A header still arriving: look again shortly.
                    Ok(_) => std::thread::sleep(std::time::Duration::from_micros(200)),
                }
            }
        }
    }

    fn close(&mut self) {
        for peer in self.peers.iter_mut().flatten() {
            let _ = peer.stream.shutdown(std::net::Shutdown::Both);
            peer.closed = true;
        }
        self.peers.iter_mut().for_each(|p| *p = None);
    }

    fn abort(&mut self, ctx: &OpCtx, message: &str) {
        let text = &message.as_bytes()[..message.len().min(MAX_ABORT_MESSAGE as usize)];
        let id = MessageId { op: ctx.op as u8, seq: ctx.seq, ..MessageId::default() };
        let header = Header { kind: FrameKind::Abort, id, payload_len: text.len() as u64 }.encode();
        for peer in self.peers.iter_mut().flatten() {
            if peer.closed {
                continue;
            }
            let fd = peer.stream.as_raw_fd();
            let whole = !peer.broken_out && matches!(socket::send2(fd, &header, text), Ok(n) if n == HEADER_LEN + text.len());
            if !whole {
                // The stream cannot carry a clean abort: close our side so the peer sees EOF now
                // rather than waiting for its timeout.
                let _ = peer.stream.shutdown(std::net::Shutdown::Write);
            }
            peer.broken_out = true;
        }
    }
}

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
//!
//! A phase that times out, or hears a peer's timeout notice, does not fail at once: it runs a
//! *timeout round* (timeout_round.rs) to find out which ranks are stuck, so that every rank
//! names them rather than whom it happened to wait for.

use std::os::fd::{AsRawFd, RawFd};
use std::time::Instant;

use super::frame::{FrameKind, HEADER_LEN, Header, MAX_ABORT_MESSAGE, decode_waits, encode_waits, max_waits_len};
use super::timeout_round::TimeoutRound;
use super::{Peer, TcpTransport, socket};
use crate::error::{CommError, Result};
use crate::transport::{Direction, MessageId, OpCtx, RawBuf, Transfer, Transport, check_message};

/// Progress of the frame being read from one peer.
enum Reading {
    Header { got: usize },
    Body { got: usize },
    Abort { message: Vec<u8>, got: usize },
    Notice { payload: Vec<u8>, got: usize },
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
    /// In a timeout round: our notice to this peer, and how much of it is written.
    outbox: Vec<u8>,
    outbox_sent: usize,
    /// The ranks this peer's timeout notice listed, once read.
    notice: Option<Vec<usize>>,
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
            outbox: Vec::new(),
            outbox_sent: 0,
            notice: None,
        }
    }
    /// A peer this phase is done with: nothing to send, receive or watch.
    fn idle() -> Self {
        PeerPhase { watch: false, ..PeerPhase::new() }
    }
    fn sending(&self) -> bool {
        self.next_send < self.sends.len()
    }
    fn receiving(&self) -> bool {
        self.next_recv < self.recvs.len() || self.abort_pending
    }
    fn notice_pending(&self) -> bool {
        self.outbox_sent < self.outbox.len()
    }
    /// In a timeout round only a data frame already begun is finished, then the notice goes.
    fn wants_out(&self, in_round: bool) -> bool {
        if in_round { (self.sending() && self.sent > 0) || self.notice_pending() } else { self.sending() }
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
    CommError::peer(format!("{}: rank {peer} closed its connection{detail} (did it exit or crash?)", ctx.describe()))
}

/// The error for a link whose TLS tunnel failed (a record that fails its check, say): the
/// transport saw its end close, but the peer did not go away.
fn tls_failed_error(ctx: &OpCtx, peer: usize, why: &str) -> CommError {
    CommError::peer(format!("{}: the TLS link to rank {peer} failed: {why}", ctx.describe()))
}

/// Compares a received header with the expectation (`expect`, and a payload of `expect_len`
/// bytes); the message says what differs.
fn check_header(expect: &MessageId, expect_len: u64, got: &Header, peer: usize, ctx: &OpCtx) -> Result<()> {
    check_message(expect, expect_len, &got.id, got.payload_len, peer, ctx)
}

fn peer_abort_error(ctx: &OpCtx, peer: usize, message: &[u8]) -> CommError {
    CommError::peer(format!("{}: rank {peer} failed and aborted the group: {}", ctx.describe(), String::from_utf8_lossy(message)))
}

impl TcpTransport {
    fn fd(&self, peer: usize) -> RawFd {
        self.peers[peer].as_ref().map(|p| p.stream.as_raw_fd()).unwrap_or(-1)
    }

    /// Why `peer`'s link is closed: its TLS tunnel's failure where there is one.
    fn closed_error(&self, ctx: &OpCtx, peer: usize, detail: &str) -> CommError {
        match self.peers[peer].as_ref().and_then(|p| p.stream.failure()) {
            Some(why) => tls_failed_error(ctx, peer, &why),
            None => closed_error(ctx, peer, detail),
        }
    }

    /// Whether an involved peer has closed its control connection (EOF: it exited or died, as
    /// opposed to sending an abort frame).
    pub fn closed_among(&self, involved: &[bool]) -> bool {
        involved.iter().enumerate().any(|(p, &inv)| inv && self.peers.get(p).and_then(|x| x.as_ref()).is_some_and(|peer| peer.closed))
    }

    fn peer_mut(&mut self, peer: usize) -> &mut Peer {
        self.peers[peer].as_mut().expect("peer index checked by the caller")
    }

    /// Writes as much of `peer`'s send queue as the socket takes; in a timeout round, only the
    /// rest of a frame already begun, then the notice.
    fn pump_send(&mut self, peer: usize, st: &mut PeerPhase, transfers: &[Transfer], ctx: &OpCtx, in_round: bool) -> Result<()> {
        let fd = self.fd(peer);
        while st.sending() && !(in_round && st.sent == 0) {
            let t = &transfers[st.sends[st.next_send]];
            if st.sent == 0 {
                st.send_header = Header::data(t.id, t.buf.len() as u64).seal(&mut self.peer_mut(peer).seal_out);
            }
            // SAFETY: send buffers are only read during a phase (the algorithms never receive
            // into memory they send from in the same phase).
            let body = unsafe { bytes(&t.buf) };
            let total = HEADER_LEN + body.len();
            let (first, second) =
                if st.sent < HEADER_LEN { (&st.send_header[st.sent..], body) } else { (&[][..], &body[st.sent - HEADER_LEN..]) };
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
                    return Err(self.closed_error(ctx, peer, &format!(" while rank {} was sending ({e})", ctx.rank)));
                }
            }
        }
        if in_round && st.sent == 0 && st.notice_pending() {
            match socket::send2(fd, &st.outbox[st.outbox_sent..], &[]) {
                Ok(n) => st.outbox_sent += n,
                Err(e) if socket::would_block(&e) => {}
                Err(e) => return Err(self.closed_error(ctx, peer, &format!(" while rank {} sent its timeout notice ({e})", ctx.rank))),
            }
            // Half a notice leaves the stream unframed: a later abort closes it instead.
            self.peer_mut(peer).broken_out = st.notice_pending();
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
        let h = Header::open(&header, &self.peers[peer].as_ref()?.seal_in).ok()?;
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
                Reading::Notice { payload, got } => socket::recv(fd, &mut payload[*got..]),
            };
            let n = match step {
                Ok(0) => {
                    self.peer_mut(peer).closed = true;
                    return Err(self.closed_error(ctx, peer, &format!(" while rank {} waited for its data", ctx.rank)));
                }
                Ok(n) => n,
                Err(e) if socket::would_block(&e) => return Ok(()),
                Err(e) => {
                    self.peer_mut(peer).closed = true;
                    return Err(self.closed_error(ctx, peer, &format!(" ({e})")));
                }
            };
            match &mut st.reading {
                Reading::Header { got } => {
                    *got += n;
                    if *got < HEADER_LEN {
                        continue;
                    }
                    let h = Header::open(&st.header, &self.peer_mut(peer).seal_in)
                        .map_err(|m| CommError::io(format!("{}: from rank {peer}: {m}", ctx.describe())))?;
                    self.peer_mut(peer).seal_in.consumed();
                    if h.kind == FrameKind::TimeoutNotice {
                        if h.payload_len > max_waits_len(self.size) {
                            return Err(CommError::io(format!("{}: rank {peer} sent a corrupt timeout notice", ctx.describe())));
                        }
                        st.reading = Reading::Notice { payload: vec![0; h.payload_len as usize], got: 0 };
                        if h.payload_len == 0 {
                            self.finish_notice(peer, st, ctx)?;
                        }
                        continue;
                    }
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
                Reading::Notice { payload, got } => {
                    *got += n;
                    if *got == payload.len() {
                        self.finish_notice(peer, st, ctx)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// A whole timeout notice was read: the peer sends no more data, so nothing more is read
    /// from it in this phase.
    fn finish_notice(&self, peer: usize, st: &mut PeerPhase, ctx: &OpCtx) -> Result<()> {
        let payload = match std::mem::replace(&mut st.reading, Reading::Header { got: 0 }) {
            Reading::Notice { payload, .. } => payload,
            _ => Vec::new(),
        };
        let waits = decode_waits(&payload, self.size).map_err(|m| CommError::io(format!("{}: from rank {peer}: {m}", ctx.describe())))?;
        st.notice = Some(waits);
        st.next_recv = st.recvs.len();
        st.abort_pending = false;
        st.watch = false;
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

    /// What this rank's own timeout says: whom it waited for.
    fn timeout_message(&self, phases: &[PeerPhase], ctx: &OpCtx) -> String {
        let unlinked: Vec<usize> = (0..self.size)
            .filter(|&p| p != self.rank && !self.is_linked(p) && (phases[p].sending() || phases[p].receiving()))
            .collect();
        let silent: Vec<usize> = (0..self.size).filter(|&p| p != self.rank && phases[p].next_recv < phases[p].recvs.len()).collect();
        let blocked: Vec<usize> = (0..self.size).filter(|&p| p != self.rank && phases[p].sending()).collect();
        let mut msg = format!("{}: timed out after {} ms", ctx.describe(), ctx.timeout.as_millis());
        if !silent.is_empty() {
            msg += &format!("; ranks not heard from: {silent:?}");
        }
        if !blocked.is_empty() {
            msg += &format!("; ranks not accepting data: {blocked:?}");
        }
        if !unlinked.is_empty() {
            let why: Vec<String> = unlinked.iter().map(|&p| self.why_unlinked(p)).collect();
            msg += &format!("; ranks never connected: {unlinked:?} ({})", why.join("; "));
        }
        msg
    }

    /// Begins a timeout round: after this rank's own timeout (`notice` None), or after `notice`
    /// = (peer, the ranks it waits for). Every open peer gets this rank's notice.
    fn begin_round(&mut self, phases: &mut [PeerPhase], ctx: &OpCtx, notice: Option<(usize, Vec<usize>)>) -> TimeoutRound {
        let now = Instant::now();
        let from = notice.as_ref().map(|(p, _)| *p);
        let mine: Vec<usize> = (0..self.size)
            .filter(|&p| p != self.rank && Some(p) != from && (phases[p].next_recv < phases[p].recvs.len() || phases[p].sending()))
            .collect();
        let mut round = match notice {
            None => TimeoutRound::after_timeout(self.rank, self.size, mine, self.timeout_message(phases, ctx), now),
            Some((p, waits)) => TimeoutRound::after_notice(self.rank, self.size, mine, p, &waits, ctx, now),
        };
        let payload = encode_waits(round.waits());
        let id = MessageId { op: ctx.op as u8, seq: ctx.seq, ..MessageId::default() };
        let notice = Header { kind: FrameKind::TimeoutNotice, id, payload_len: payload.len() as u64 };
        for p in (0..self.size).filter(|&p| p != self.rank) {
            // A peer with no link cannot hear the notice, nor answer it.
            let Some(peer) = self.peers[p].as_mut() else { continue };
            if peer.closed {
                round.closed(p);
                phases[p] = PeerPhase::idle();
                continue;
            }
            // A stream left half written by an earlier phase cannot carry a frame.
            if !peer.broken_out || phases[p].sent > 0 {
                let mut frame = notice.seal(&mut peer.seal_out).to_vec();
                frame.extend_from_slice(&payload);
                phases[p].outbox = frame;
            }
            phases[p].watch = !round.answered(p);
        }
        round
    }

    fn poll_timeout_ms(deadline: Instant) -> Option<i32> {
        let left = deadline.checked_duration_since(Instant::now())?;
        if left.is_zero() {
            return None;
        }
        Some(left.as_millis().clamp(1, i32::MAX as u128) as i32)
    }
}

/// Milliseconds until `t` (0 when it has passed), as poll(2) takes them.
fn ms_until(t: Instant) -> i32 {
    t.saturating_duration_since(Instant::now()).as_millis().min(i32::MAX as u128) as i32
}

/// What [`TcpTransport::watch_control`] saw.
pub struct ControlWatch {
    /// One of the extra descriptors became readable.
    pub extra_ready: bool,
}

impl TcpTransport {
    /// For a transport that moves the data elsewhere (OFI) and keeps only control frames on
    /// these connections: waits up to `wait_ms` (0: only looks) for one of `extra` to become
    /// readable or a peer's connection to have something, without blocking longer. Fails if a
    /// peer sent an abort (or a timeout notice), or if a peer with `involved[peer]` set has
    /// closed its connection; an uninvolved peer's close is remembered for later. An involved
    /// peer without a link gets one, made on first use as this transport's own links are, so
    /// that its abort or death ends the wait; the links peers dial are taken here too.
    pub fn watch_control(&mut self, involved: &[bool], extra: &[RawFd], wait_ms: i32, ctx: &OpCtx) -> Result<ControlWatch> {
        for (p, _) in involved.iter().enumerate().filter(|(_, i)| **i) {
            self.want_link(p);
        }
        let mut fds: Vec<libc::pollfd> = Vec::with_capacity(self.size + extra.len());
        let mut owners = Vec::with_capacity(self.size);
        for p in 0..self.size {
            let Some(peer) = self.peers[p].as_ref() else { continue };
            if peer.closed {
                if involved.get(p).copied().unwrap_or(false) {
                    return Err(self.closed_error(ctx, p, " earlier"));
                }
                continue;
            }
            fds.push(libc::pollfd { fd: peer.stream.as_raw_fd(), events: libc::POLLIN, revents: 0 });
            owners.push(p);
        }
        fds.extend(extra.iter().filter(|&&fd| fd >= 0).map(|&fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 }));
        let watched = fds.len();
        let wait_ms = self.push_link_fds(&mut fds).map_or(wait_ms, |wake| wait_ms.min(ms_until(wake)));
        socket::poll(&mut fds, wait_ms).map_err(|e| CommError::io(format!("{}: poll failed: {e}", ctx.describe())))?;
        self.progress_links(&fds, ctx)?;
        let mut watch = ControlWatch { extra_ready: false };
        for (i, fd) in fds[..watched].iter().enumerate() {
            if fd.revents == 0 {
                continue;
            }
            let Some(&p) = owners.get(i) else {
                watch.extra_ready = true;
                continue;
            };
            let mut prefix = [0u8; HEADER_LEN];
            match socket::peek(fd.fd, &mut prefix) {
                Err(e) if socket::would_block(&e) => {}
                Ok(0) | Err(_) => {
                    self.peer_mut(p).closed = true;
                    if involved.get(p).copied().unwrap_or(false) {
                        return Err(self.closed_error(ctx, p, &format!(" while rank {} waited for it", ctx.rank)));
                    }
                }
                Ok(n) if Header::peek_is_abort(&prefix[..n]) => {
                    // Read the frame whole (a peer writes it in one call; it arrives at once).
                    let mut st = PeerPhase::new();
                    st.abort_pending = true;
                    loop {
                        self.pump_recv(p, &mut st, &[], ctx)?;
                        if let Some(waits) = st.notice {
                            return Err(CommError::peer(format!(
                                "{}: rank {p} timed out waiting for ranks {waits:?} and failed the group",
                                ctx.describe()
                            )));
                        }
                        if Self::poll_timeout_ms(ctx.deadline).is_none() {
                            return Err(self.closed_error(ctx, p, " in the middle of an abort message"));
                        }
                        std::thread::sleep(std::time::Duration::from_micros(100));
                    }
                }
                Ok(n) if n >= 5 => {
                    return Err(CommError::io(format!(
                        "{}: rank {p} sent data over the control connection (do all ranks use the same XCCL_RS_TRANSPORT?)",
                        ctx.describe()
                    )));
                }
                // A frame's first bytes: look again shortly.
                Ok(_) => std::thread::sleep(std::time::Duration::from_micros(100)),
            }
        }
        Ok(watch)
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
        let rank = self.rank;
        for p in (0..self.size).filter(|&p| p != rank) {
            let involved = !phases[p].sends.is_empty() || !phases[p].recvs.is_empty();
            let Some(peer) = self.peers[p].as_ref() else {
                // First use: the link is made inside this phase's loop.
                phases[p].watch = false;
                if involved {
                    self.want_link(p);
                }
                continue;
            };
            if peer.closed {
                if involved {
                    return Err(self.closed_error(ctx, p, " earlier"));
                }
                phases[p].watch = false;
            }
        }

        let mut fds: Vec<libc::pollfd> = Vec::with_capacity(self.size);
        let mut owners: Vec<usize> = Vec::with_capacity(self.size);
        let mut round: Option<TimeoutRound> = None;
        loop {
            fds.clear();
            owners.clear();
            let in_round = round.is_some();
            let mut busy = false;
            for (p, st) in phases.iter().enumerate() {
                if p == self.rank {
                    continue;
                }
                if self.peers[p].is_none() {
                    busy |= st.sending() || st.receiving();
                    continue;
                }
                let mut events = 0;
                if st.wants_out(in_round) {
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
            if let Some(r) = &round {
                if r.settled() || Instant::now() >= r.until {
                    return Err(r.error());
                }
            } else if !busy {
                return Ok(());
            }
            if let Some(e) = ctx.aborted() {
                return Err(e);
            }
            let Some(wait_ms) = Self::poll_timeout_ms(round.as_ref().map_or(ctx.deadline, |r| r.until)) else {
                if round.is_none() {
                    round = Some(self.begin_round(&mut phases, ctx, None));
                }
                continue;
            };
            let wait_ms = self.push_link_fds(&mut fds).map_or(wait_ms, |wake| wait_ms.min(ms_until(wake)));
            if let Some(fd) = ctx.abort.as_ref().and_then(|a| a.fd()) {
                fds.push(libc::pollfd { fd, events: libc::POLLIN, revents: 0 });
            }
            socket::poll(&mut fds, wait_ms).map_err(|e| CommError::io(format!("{}: poll failed: {e}", ctx.describe())))?;
            // The linker's entries follow the peers' (zip below stops at the owners).
            self.progress_links(&fds, ctx)?;
            // (The switch's entry, if any, is last and has no owner: zip skips it.)
            for (fd, &p) in fds.iter().zip(owners.iter()) {
                let ev = fd.revents;
                if ev == 0 {
                    continue;
                }
                let in_round = round.is_some();
                let mut st = std::mem::replace(&mut phases[p], PeerPhase::new());
                let mut moved_on = false;
                let result = (|| {
                    if st.wants_out(in_round) && ev & (libc::POLLOUT | libc::POLLERR | libc::POLLHUP) != 0 {
                        self.pump_send(p, &mut st, transfers, ctx, in_round)?;
                    }
                    if ev & (libc::POLLIN | libc::POLLERR | libc::POLLHUP) != 0 {
                        if st.receiving() {
                            self.pump_recv(p, &mut st, transfers, ctx)?;
                        } else if st.watch {
                            self.inspect_watched(p, &mut st);
                            moved_on = !st.watch && !self.peer_mut(p).closed;
                            if st.abort_pending {
                                self.pump_recv(p, &mut st, transfers, ctx)?;
                            }
                        }
                    }
                    Ok(())
                })();
                let notice = st.notice.take();
                phases[p] = st;
                match (round.as_mut(), result) {
                    (None, Err(e)) => return Err(e),
                    // In a round a peer's failure or its data for a later op is an answer: it
                    // is dead (closed) or alive.
                    (Some(r), Err(_)) => {
                        if self.peer_mut(p).closed {
                            r.closed(p);
                        } else if !r.answered(p) {
                            r.hear(p, Vec::new());
                        }
                        phases[p] = PeerPhase::idle();
                    }
                    (Some(r), Ok(())) if moved_on || self.peer_mut(p).closed => {
                        if self.peer_mut(p).closed {
                            r.closed(p)
                        } else {
                            r.hear(p, Vec::new())
                        }
                    }
                    _ => {}
                }
                if let Some(waits) = notice {
                    match round.as_mut() {
                        Some(r) => r.hear(p, waits),
                        None => round = Some(self.begin_round(&mut phases, ctx, Some((p, waits)))),
                    }
                }
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
                return Err(CommError::timeout(format!(
                    "{}: timed out after {} ms: no rank sent a matching message",
                    ctx.describe(),
                    ctx.timeout.as_millis()
                )));
            };
            // Peers not linked yet dial this rank when they have a message for it.
            let wait_ms = self.push_link_fds(&mut fds).map_or(wait_ms, |wake| wait_ms.min(ms_until(wake)));
            if fds.is_empty() {
                // Nobody can still send us a match; sleep out the deadline to report it.
                std::thread::sleep(std::time::Duration::from_millis(wait_ms.min(50) as u64));
                continue;
            }
            if let Some(fd) = ctx.abort.as_ref().and_then(|a| a.fd()) {
                fds.push(libc::pollfd { fd, events: libc::POLLIN, revents: 0 });
            }
            socket::poll(&mut fds, wait_ms).map_err(|e| CommError::io(format!("{}: poll failed: {e}", ctx.describe())))?;
            self.progress_links(&fds, ctx)?;
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
                            if let Some(waits) = st.notice {
                                return Err(CommError::peer(format!(
                                    "{}: rank {p} timed out waiting for ranks {waits:?} and failed the group",
                                    ctx.describe()
                                )));
                            }
                            if Self::poll_timeout_ms(ctx.deadline).is_none() {
                                return Err(self.closed_error(ctx, p, " in the middle of an abort message"));
                            }
                            std::thread::sleep(std::time::Duration::from_millis(1));
                        }
                    }
                    Ok(HEADER_LEN) => match Header::open(&prefix, &self.peer_mut(p).seal_in) {
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
        self.linker = None;
        for peer in self.peers.iter_mut().flatten() {
            let _ = peer.stream.shutdown(std::net::Shutdown::Both);
            peer.closed = true;
        }
        self.peers.iter_mut().for_each(|p| *p = None);
    }

    fn abort(&mut self, ctx: &OpCtx, message: &str) {
        let text = &message.as_bytes()[..message.len().min(MAX_ABORT_MESSAGE as usize)];
        let id = MessageId { op: ctx.op as u8, seq: ctx.seq, ..MessageId::default() };
        let abort = Header { kind: FrameKind::Abort, id, payload_len: text.len() as u64 };
        for peer in self.peers.iter_mut().flatten() {
            if peer.closed {
                continue;
            }
            let header = abort.seal(&mut peer.seal_out);
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

//! How the OFI transport cuts a payload into libfabric messages, the same on every rank (set-up
//! checks it: setup.rs).
//!
//! `ofi_rxm` sends a message larger than its eager limit by rendezvous: the receiver reads it
//! from the sender's memory. Over the `tcp` provider that read is served only while the sender
//! reads its completion queue, a round trip later, and every round trip waits behind the data
//! queued on the link; for messages of a few MiB that is a large part of their time. So over
//! `tcp;ofi_rxm` a payload goes as messages of the eager limit, which leave at once and land in
//! the posted receive. Only up to a point: a receive must be posted for each of them, and the
//! endpoint holds a bounded number posted at once, past which `ofi_rxm` queues the rest as
//! unexpected messages and copies them later. A payload needing more than half of those
//! receives goes as whole messages instead, where the rendezvous's round trips are a small part
//! of the time. RDMA providers keep whole messages: their NIC serves the reads.

/// `ofi_rxm`'s bounce buffer size where `FI_OFI_RXM_BUFFER_SIZE` does not set it.
const RXM_BUFFER_SIZE: usize = 16384;

/// A transport's rule for cutting payloads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cutting {
    /// The message size of a small payload (the eager limit).
    pub piece: usize,
    /// The largest payload cut into `piece`s.
    pub small_up_to: usize,
    /// The message size of a larger payload (the provider's largest message).
    pub largest: usize,
}

impl Cutting {
    pub const ENCODED_LEN: usize = 24;

    /// The rule for `provider`, whose largest message is `max_msg_size` and whose endpoint holds
    /// `rx_size` receives; `env` reads libfabric's variables. Over `tcp;ofi_rxm` the eager
    /// limit is the one `ofi_rxm` takes there: `FI_OFI_RXM_EAGER_LIMIT`, but at least the bounce
    /// buffers' size (and never less than its default here, below which the pieces would be
    /// too many to be worth it).
    pub fn for_provider(provider: &str, max_msg_size: usize, rx_size: usize, env: impl Fn(&str) -> Option<String>) -> Cutting {
        let largest = max_msg_size.max(1);
        if provider != "tcp;ofi_rxm" {
            return Cutting { piece: largest, small_up_to: 0, largest };
        }
        let size = |name: &str| env(name).and_then(|v| parse_size(&v));
        let eager = size("FI_OFI_RXM_BUFFER_SIZE").unwrap_or(RXM_BUFFER_SIZE).max(size("FI_OFI_RXM_EAGER_LIMIT").unwrap_or(0));
        let piece = eager.max(RXM_BUFFER_SIZE).min(largest);
        Cutting { piece, small_up_to: piece.saturating_mul(rx_size / 2), largest }
    }

    /// A payload of `len` bytes as `(offset, length)` messages, in order, all on the
    /// transfer's tag. Sender and receiver cut alike, and the provider keeps a pair's messages
    /// of one tag in their order (FI_ORDER_SAS), so message k lands in receive k. None for an
    /// empty payload.
    pub fn pieces(&self, len: usize) -> impl Iterator<Item = (usize, usize)> + use<> {
        let size = if len <= self.small_up_to { self.piece } else { self.largest }.max(1);
        (0..len).step_by(size).map(move |at| (at, size.min(len - at)))
    }

    pub fn encode(&self) -> [u8; Self::ENCODED_LEN] {
        let mut out = [0u8; Self::ENCODED_LEN];
        for (i, v) in [self.piece, self.small_up_to, self.largest].into_iter().enumerate() {
            out[8 * i..8 * i + 8].copy_from_slice(&(v as u64).to_le_bytes());
        }
        out
    }

    /// A peer's rule as it published it (compared with this rank's, never used to cut).
    pub fn decode(bytes: &[u8; Self::ENCODED_LEN]) -> Cutting {
        let at = |i: usize| u64::from_le_bytes(bytes[8 * i..8 * i + 8].try_into().expect("8 bytes")) as usize;
        Cutting { piece: at(0), small_up_to: at(1), largest: at(2) }
    }
}

impl std::fmt::Display for Cutting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let beyond = if self.largest == usize::MAX { "whole".to_string() } else { format!("in messages of {} bytes", self.largest) };
        if self.small_up_to == 0 {
            return write!(f, "payloads {beyond}");
        }
        write!(f, "payloads up to {} bytes in messages of {} bytes, larger ones {beyond}", self.small_up_to, self.piece)
    }
}

/// A size as libfabric reads its variables (strtol of base 0): decimal, or hexadecimal after
/// `0x`. None for anything else, which then leaves the default.
fn parse_size(v: &str) -> Option<usize> {
    let v = v.trim();
    match v.strip_prefix("0x").or_else(|| v.strip_prefix("0X")) {
        Some(hex) => usize::from_str_radix(hex, 16).ok(),
        None => v.parse().ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(vars: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |name: &str| vars.iter().find(|(k, _)| *k == name).map(|(_, v)| v.to_string())
    }

    #[test]
    fn small_payloads_over_tcp_are_cut_at_the_eager_limit() {
        let c = Cutting::for_provider("tcp;ofi_rxm", usize::MAX, 2048, env(&[]));
        assert_eq!(c, Cutting { piece: 16384, small_up_to: 16 << 20, largest: usize::MAX });
        let rx = |vars| Cutting::for_provider("tcp;ofi_rxm", usize::MAX, 2048, env(vars)).piece;
        assert_eq!(rx(&[("FI_OFI_RXM_BUFFER_SIZE", "65536")]), 65536);
        assert_eq!(rx(&[("FI_OFI_RXM_EAGER_LIMIT", "0x100000")]), 1 << 20);
        assert_eq!(rx(&[("FI_OFI_RXM_EAGER_LIMIT", "1024")]), 16384, "at least the bounce buffer");
        assert_eq!(rx(&[("FI_OFI_RXM_BUFFER_SIZE", "128")]), 16384, "never below the default");
        assert_eq!(rx(&[("FI_OFI_RXM_BUFFER_SIZE", "lots")]), 16384);
        assert_eq!(Cutting::for_provider("tcp;ofi_rxm", 4096, 2048, env(&[])).piece, 4096, "never above the largest message");
        let verbs = Cutting::for_provider("verbs;ofi_rxm", 1 << 30, 2048, env(&[]));
        assert_eq!(verbs.pieces(3 << 30).collect::<Vec<_>>(), vec![(0, 1 << 30), (1 << 30, 1 << 30), (2 << 30, 1 << 30)]);
    }

    #[test]
    fn pieces_cover_the_payload_in_order() {
        let c = Cutting { piece: 10, small_up_to: 25, largest: 100 };
        assert_eq!(c.pieces(0).count(), 0);
        assert_eq!(c.pieces(25).collect::<Vec<_>>(), vec![(0, 10), (10, 10), (20, 5)]);
        assert_eq!(c.pieces(26).collect::<Vec<_>>(), vec![(0, 26)], "past small_up_to: whole");
        assert_eq!(c.pieces(250).collect::<Vec<_>>(), vec![(0, 100), (100, 100), (200, 50)]);
        assert_eq!(Cutting::decode(&c.encode()), c);
    }
}

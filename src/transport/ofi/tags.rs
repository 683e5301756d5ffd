//! The tag layout: how a message's tag fits in the bits the provider matches on.
//!
//! Providers differ in tag width: `ofi_rxm`, `efa` and `verbs` match all 64 bits, `cxi`
//! (Slingshot) 48 and refuses a wider tag with `-FI_EINVAL`. Each reports its width in
//! `mem_tag_format`, whose highest set bit is the highest usable one (aws-ofi-nccl and oneCCL
//! read it the same way); `XCCL_RS_OFI_TAG_BITS` narrows it further, as MPICH's
//! `MPIR_CVAR_CH4_OFI_TAG_BITS` does, so that tests run the narrow layouts on any provider.
//! Of a width of `W` bits:
//!
//! - bit `W-1` marks a *header* message (header.rs);
//! - the next `G` bits hold the receiving endpoint's *generation* (pool.rs: an endpoint serves
//!   one group after another, each a generation later, so that a message sent to an earlier
//!   group never matches a later group's receive); `G` is 8 from 28 bits up, 4 at 20;
//! - for a payload, the next [`OP_BITS`] bits hold the op code (OpKind's, below 16), so that a
//!   payload of one kind of op never fills a receive of another (point-to-point messages count
//!   their own sequence, apart from the collectives'), and the bits below the op's sequence
//!   number, wrapping around; a header has none of these.
//!
//! Why wrap-around cannot swap two messages: two payloads between one pair share a tag only if
//! their sequence numbers differ by a multiple of `2^(W-1-G-OP_BITS)` (at 20 bits, 2048 ops
//! apart). The provider matches a pair's messages of one tag in the order they were sent
//! (FI_ORDER_SAS, asked for at set-up), and a receiver posts its receives in sequence order, the
//! order its peer sends them in: so the earlier op's message always meets the earlier receive,
//! however many times the number wrapped. A program whose ranks skipped an op is caught by the
//! header check (check_message) before a payload it received is used.

use crate::transport::MessageId;

/// The narrowest layout accepted: the header bit, 2 bits of generation, the op code and 9 bits
/// of sequence number.
pub const MIN_BITS: u32 = 16;
/// Bits of the op code: OpKind's codes are below 16.
pub const OP_BITS: u32 = 4;
/// The most bits of generation a layout takes.
const MAX_GENERATION_BITS: u32 = 8;

/// How this transport's tags use the provider's tag bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TagLayout {
    bits: u32,
}

impl TagLayout {
    /// The layout for a provider reporting `mem_tag_format`, narrowed to `requested` bits
    /// (`XCCL_RS_OFI_TAG_BITS`) if set. An error names what does not fit.
    pub fn for_provider(mem_tag_format: u64, requested: Option<u32>) -> Result<TagLayout, String> {
        let provider = provider_bits(mem_tag_format);
        let bits = match requested {
            Some(b) if b > provider => {
                return Err(format!("XCCL_RS_OFI_TAG_BITS={b} is wider than the provider's tags ({provider} bits)"));
            }
            Some(b) => b,
            None => provider,
        };
        if bits < MIN_BITS {
            return Err(format!("the provider's tags have {bits} bits; xccl_rs needs at least {MIN_BITS}"));
        }
        Ok(TagLayout { bits })
    }

    /// The width in use.
    pub fn bits(&self) -> u32 {
        self.bits
    }

    /// Every bit a tag of this layout may have set (the shim refuses any other).
    pub fn mask(&self) -> u64 {
        u64::MAX >> (64 - self.bits)
    }

    fn generation_bits(&self) -> u32 {
        ((self.bits - 12) / 2).min(MAX_GENERATION_BITS)
    }

    /// How many generations an endpoint can serve before a tag would repeat: pool.rs closes
    /// an endpoint rather than reuse it past that.
    pub fn generations(&self) -> u32 {
        1 << self.generation_bits()
    }

    fn seq_bits(&self) -> u32 {
        self.bits - 1 - self.generation_bits() - OP_BITS
    }

    /// The generation field of a tag for an endpoint of `generation` (below
    /// [`generations`](Self::generations)).
    fn generation_field(&self, generation: u32) -> u64 {
        debug_assert!(generation < self.generations());
        (generation as u64 & (self.generations() as u64 - 1)) << (self.bits - 1 - self.generation_bits())
    }

    /// The tag of a header message to an endpoint of `generation`.
    pub fn header(&self, generation: u32) -> u64 {
        1 << (self.bits - 1) | self.generation_field(generation)
    }

    /// The tag of the payload of message `id` to an endpoint of `generation`: its op code above
    /// the low bits of its sequence number (wrapping, see the module's comment).
    pub fn payload(&self, generation: u32, id: &MessageId) -> u64 {
        let seq_bits = self.seq_bits();
        self.generation_field(generation) | ((id.op as u64 & ((1 << OP_BITS) - 1)) << seq_bits) | (id.seq & ((1 << seq_bits) - 1))
    }

    /// What a rank publishes so that its peers check they use the same layout.
    pub fn encode(&self) -> u8 {
        self.bits as u8
    }

    /// A peer's published layout, if it is one.
    pub fn decode(byte: u8) -> Option<TagLayout> {
        (MIN_BITS..=64).contains(&(byte as u32)).then_some(TagLayout { bits: byte as u32 })
    }
}

/// The width a provider's `mem_tag_format` allows: up to its highest set bit (0, a provider
/// that does not say, allows 64).
fn provider_bits(mem_tag_format: u64) -> u32 {
    if mem_tag_format == 0 { 64 } else { 64 - mem_tag_format.leading_zeros() }
}

impl std::fmt::Display for TagLayout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} tag bits (header bit, {} generation bits, {OP_BITS} op bits, {} sequence bits)", self.bits, self.generation_bits(), self.seq_bits())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::OpKind;

    /// libfabric's FI_TAG_GENERIC, which providers with 64-bit tags report.
    const GENERIC: u64 = 0xAAAA_AAAA_AAAA_AAAA;

    #[test]
    fn the_width_comes_from_the_provider_and_the_override() {
        assert_eq!(TagLayout::for_provider(GENERIC, None).unwrap().bits(), 64);
        assert_eq!(TagLayout::for_provider(0, None).unwrap().bits(), 64);
        // cxi: FI_TAG_GENERIC shifted down to its 48 bits.
        let cxi = GENERIC >> 16;
        assert_eq!(TagLayout::for_provider(cxi, None).unwrap().bits(), 48);
        assert_eq!(TagLayout::for_provider(cxi, Some(20)).unwrap().bits(), 20);
        let e = TagLayout::for_provider(cxi, Some(64)).unwrap_err();
        assert!(e.contains("XCCL_RS_OFI_TAG_BITS=64") && e.contains("48 bits"), "{e}");
        assert!(TagLayout::for_provider(GENERIC, Some(15)).unwrap_err().contains("at least 16"));
        assert!(TagLayout::for_provider(0xff, None).is_err(), "8 bits");
    }

    #[test]
    fn every_tag_fits_the_width_and_headers_never_meet_payloads() {
        let largest_op = (0..=u8::MAX).filter(|&c| OpKind::from_code(c).is_some()).max().unwrap();
        assert!((largest_op as u32) < (1 << OP_BITS), "an op code does not fit the tag's op field");
        for (bits, generations) in [(16, 4), (20, 16), (28, 256), (48, 256), (64, 256)] {
            let l = TagLayout::for_provider(0, Some(bits)).unwrap();
            assert_eq!(l.generations(), generations, "{bits} bits");
            let last = generations - 1;
            for g in [0, 1, last] {
                assert_eq!(l.header(g) & !l.mask(), 0);
                assert_ne!(l.header(g) & (1 << (bits - 1)), 0, "a header has the header bit");
                for op in 0..=largest_op {
                    for seq in [0, 1, (1 << 9) - 1, 1 << 40, u64::MAX] {
                        let t = l.payload(g, &MessageId { op, seq, ..MessageId::default() });
                        assert_eq!(t & !l.mask(), 0, "{bits} bits: op {op} seq {seq}");
                        assert_eq!(t & (1 << (bits - 1)), 0, "{bits} bits: a payload tag with the header bit");
                    }
                }
            }
            // Consecutive ops, the same sequence number of different ops, and the same message
            // to different generations differ; a header differs from every payload.
            let tag = |g, op, seq| l.payload(g, &MessageId { op, seq, ..MessageId::default() });
            assert_ne!(tag(0, 0, 5), tag(0, 0, 6));
            assert_ne!(tag(0, OpKind::Send as u8, 5), tag(0, OpKind::AllReduce as u8, 5));
            assert_ne!(tag(0, 0, 5), tag(1, 0, 5));
            assert_ne!(tag(last, 0, 5), tag(0, 0, 5));
            assert_ne!(l.header(0), l.header(1));
            assert_eq!(tag(1, 0, 3), tag(1, 0, 3 + (1 << l.seq_bits())), "wraps after 2^seq_bits ops");
            assert_eq!(TagLayout::decode(l.encode()), Some(l));
        }
        assert_eq!(TagLayout::decode(8), None);
        assert_eq!(TagLayout::decode(65), None);
    }
}

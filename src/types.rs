//! The plain vocabulary shared by the C++ bridge and the Rust core: element types and
//! reduction operators. Their numeric values are part of the FFI contract with
//! `csrc/backend.cc` (`to_wire_dtype`, `to_wire_op`); never renumber them.

use std::fmt;

/// Declares a wire enum once: each variant with its code and its name in messages. Generates
/// the enum (`#[repr(u8)]`, the codes as its discriminants), `ALL` (every variant, in code
/// order), `from_code` (a peer's or the bridge's byte; `None` for a code this build does not
/// know), `name` and `Display`.
macro_rules! wire_enum {
    (
        $(#[$meta:meta])*
        pub enum $name:ident {
            $( $(#[$vmeta:meta])* $variant:ident = $code:literal => $text:literal, )+
        }
    ) => {
        $(#[$meta])*
        #[repr(u8)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum $name {
            $( $(#[$vmeta])* $variant = $code, )+
        }

        impl $name {
            /// Every variant, in code order.
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            pub fn from_code(code: u8) -> Option<$name> {
                match code {
                    $( $code => Some($name::$variant), )+
                    _ => None,
                }
            }

            /// The name used in every message.
            pub fn name(self) -> &'static str {
                match self {
                    $( $name::$variant => $text, )+
                }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.name())
            }
        }
    };
}

wire_enum! {
    /// Element type of a buffer, named as torch names it. Values are stable wire codes (they
    /// travel in frame headers).
    pub enum DType {
        Float64 = 0 => "float64",
        Float32 = 1 => "float32",
        Float16 = 2 => "float16",
        BFloat16 = 3 => "bfloat16",
        Int8 = 4 => "int8",
        UInt8 = 5 => "uint8",
        Int16 = 6 => "int16",
        Int32 = 7 => "int32",
        Int64 = 8 => "int64",
        Bool = 9 => "bool",
        UInt16 = 10 => "uint16",
        UInt32 = 11 => "uint32",
        UInt64 = 12 => "uint64",
        Float8E4M3FN = 13 => "float8_e4m3fn",
        Float8E5M2 = 14 => "float8_e5m2",
        Float8E4M3FNUZ = 15 => "float8_e4m3fnuz",
        Float8E5M2FNUZ = 16 => "float8_e5m2fnuz",
        /// Any other torch dtype: moved as opaque bytes, never reduced.
        Bytes = 17 => "bytes",
    }
}

impl DType {
    /// Size of one element in bytes (`Bytes` counts single bytes).
    pub fn size(self) -> usize {
        match self {
            DType::Float64 | DType::Int64 | DType::UInt64 => 8,
            DType::Float32 | DType::Int32 | DType::UInt32 => 4,
            DType::Float16 | DType::BFloat16 | DType::Int16 | DType::UInt16 => 2,
            DType::Int8
            | DType::UInt8
            | DType::Bool
            | DType::Float8E4M3FN
            | DType::Float8E5M2
            | DType::Float8E4M3FNUZ
            | DType::Float8E5M2FNUZ
            | DType::Bytes => 1,
        }
    }

    pub fn is_floating(self) -> bool {
        matches!(
            self,
            DType::Float64
                | DType::Float32
                | DType::Float16
                | DType::BFloat16
                | DType::Float8E4M3FN
                | DType::Float8E5M2
                | DType::Float8E4M3FNUZ
                | DType::Float8E5M2FNUZ
        )
    }
}

wire_enum! {
    /// Reduction operator, numbered like `c10d::ReduceOp::RedOpType` so the bridge passes it
    /// through, named as torch names it.
    pub enum ReduceOp {
        Sum = 0 => "SUM",
        Avg = 1 => "AVG",
        Product = 2 => "PRODUCT",
        Min = 3 => "MIN",
        Max = 4 => "MAX",
        BAnd = 5 => "BAND",
        BOr = 6 => "BOR",
        BXor = 7 => "BXOR",
        PreMulSum = 8 => "PREMUL_SUM",
    }
}

wire_enum! {
    /// The collective or point-to-point operation a request asks for, named as c10d names it.
    /// The code travels in frame headers so that ranks in different operations notice it.
    pub enum OpKind {
        AllReduce = 0 => "allreduce",
        Broadcast = 1 => "broadcast",
        Reduce = 2 => "reduce",
        AllGather = 3 => "allgather",
        Gather = 4 => "gather",
        Scatter = 5 => "scatter",
        ReduceScatter = 6 => "reduce_scatter",
        AllToAll = 7 => "alltoall",
        Barrier = 8 => "barrier",
        Send = 9 => "send",
        Recv = 10 => "recv",
        RecvAnySource = 11 => "recv (any source)",
    }
}

impl OpKind {
    /// Point-to-point operations do not take a collective sequence number.
    pub fn is_p2p(self) -> bool {
        matches!(self, OpKind::Send | OpKind::Recv | OpKind::RecvAnySource)
    }
}

/// The name of an op code as it appears in a peer's frame header.
pub fn op_code_name(code: u8) -> &'static str {
    OpKind::from_code(code).map(OpKind::name).unwrap_or("an unknown operation")
}

/// The name of a dtype code as it appears in a peer's frame header.
pub fn dtype_code_name(code: u8) -> &'static str {
    DType::from_code(code).map(DType::name).unwrap_or("an unknown dtype")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every code this build knows decodes to the variant that has it, and the codes are dense
    /// from 0 (frame headers and the bridge rely on both).
    #[test]
    fn codes_round_trip() {
        for (i, d) in DType::ALL.iter().enumerate() {
            assert_eq!((*d as u8, DType::from_code(i as u8)), (i as u8, Some(*d)));
        }
        for (i, r) in ReduceOp::ALL.iter().enumerate() {
            assert_eq!((*r as u8, ReduceOp::from_code(i as u8)), (i as u8, Some(*r)));
        }
        for (i, k) in OpKind::ALL.iter().enumerate() {
            assert_eq!((*k as u8, OpKind::from_code(i as u8)), (i as u8, Some(*k)));
        }
        assert_eq!((DType::from_code(18), ReduceOp::from_code(9), OpKind::from_code(12)), (None, None, None));
        assert_eq!((DType::BFloat16.name(), ReduceOp::PreMulSum.to_string(), OpKind::AllToAll.name()), ("bfloat16", "PREMUL_SUM".into(), "alltoall"));
    }
}

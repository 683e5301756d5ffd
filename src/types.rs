//! The plain vocabulary shared by the C++ bridge and the Rust core: element types and
//! reduction operators. Their numeric values are part of the FFI contract with
//! `csrc/backend.cc` (`to_wire_dtype`, `to_wire_op`); never renumber them.

use std::fmt;

/// Element type of a buffer. Values are stable wire codes (they travel in frame headers).
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    Float64 = 0,
    Float32 = 1,
    Float16 = 2,
    BFloat16 = 3,
    Int8 = 4,
    UInt8 = 5,
    Int16 = 6,
    Int32 = 7,
    Int64 = 8,
    Bool = 9,
    UInt16 = 10,
    UInt32 = 11,
    UInt64 = 12,
    Float8E4M3FN = 13,
    Float8E5M2 = 14,
    Float8E4M3FNUZ = 15,
    Float8E5M2FNUZ = 16,
    /// Any other torch dtype: moved as opaque bytes, never reduced.
    Bytes = 17,
}

impl DType {
    pub const ALL: [DType; 18] = [
        DType::Float64,
        DType::Float32,
        DType::Float16,
        DType::BFloat16,
        DType::Int8,
        DType::UInt8,
        DType::Int16,
        DType::Int32,
        DType::Int64,
        DType::Bool,
        DType::UInt16,
        DType::UInt32,
        DType::UInt64,
        DType::Float8E4M3FN,
        DType::Float8E5M2,
        DType::Float8E4M3FNUZ,
        DType::Float8E5M2FNUZ,
        DType::Bytes,
    ];

    pub fn from_code(code: u8) -> Option<DType> {
        DType::ALL.get(code as usize).copied()
    }

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

    /// torch's name for the type, used in every error message.
    pub fn name(self) -> &'static str {
        match self {
            DType::Float64 => "float64",
            DType::Float32 => "float32",
            DType::Float16 => "float16",
            DType::BFloat16 => "bfloat16",
            DType::Int8 => "int8",
            DType::UInt8 => "uint8",
            DType::Int16 => "int16",
            DType::Int32 => "int32",
            DType::Int64 => "int64",
            DType::Bool => "bool",
            DType::UInt16 => "uint16",
            DType::UInt32 => "uint32",
            DType::UInt64 => "uint64",
            DType::Float8E4M3FN => "float8_e4m3fn",
            DType::Float8E5M2 => "float8_e5m2",
            DType::Float8E4M3FNUZ => "float8_e4m3fnuz",
            DType::Float8E5M2FNUZ => "float8_e5m2fnuz",
            DType::Bytes => "bytes",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Reduction operator, numbered like `c10d::ReduceOp::RedOpType` so the bridge passes it through.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    Sum = 0,
    Avg = 1,
    Product = 2,
    Min = 3,
    Max = 4,
    BAnd = 5,
    BOr = 6,
    BXor = 7,
    PreMulSum = 8,
}

impl ReduceOp {
    pub fn from_code(code: u8) -> Option<ReduceOp> {
        Some(match code {
            0 => ReduceOp::Sum,
            1 => ReduceOp::Avg,
            2 => ReduceOp::Product,
            3 => ReduceOp::Min,
            4 => ReduceOp::Max,
            5 => ReduceOp::BAnd,
            6 => ReduceOp::BOr,
            7 => ReduceOp::BXor,
            8 => ReduceOp::PreMulSum,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "SUM",
            ReduceOp::Avg => "AVG",
            ReduceOp::Product => "PRODUCT",
            ReduceOp::Min => "MIN",
            ReduceOp::Max => "MAX",
            ReduceOp::BAnd => "BAND",
            ReduceOp::BOr => "BOR",
            ReduceOp::BXor => "BXOR",
            ReduceOp::PreMulSum => "PREMUL_SUM",
        }
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The collective or point-to-point operation a request asks for. The code travels in frame
/// headers so that ranks in different operations notice it.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OpKind {
    AllReduce = 0,
    Broadcast = 1,
    Reduce = 2,
    AllGather = 3,
    Gather = 4,
    Scatter = 5,
    ReduceScatter = 6,
    AllToAll = 7,
    Barrier = 8,
    Send = 9,
    Recv = 10,
    RecvAnySource = 11,
}

impl OpKind {
    pub fn from_code(code: u8) -> Option<OpKind> {
        use OpKind::*;
        [AllReduce, Broadcast, Reduce, AllGather, Gather, Scatter, ReduceScatter, AllToAll, Barrier, Send, Recv, RecvAnySource]
            .get(code as usize)
            .copied()
    }

    /// c10d's name of the operation, used in every message.
    pub fn name(self) -> &'static str {
        match self {
            OpKind::AllReduce => "allreduce",
            OpKind::Broadcast => "broadcast",
            OpKind::Reduce => "reduce",
            OpKind::AllGather => "allgather",
            OpKind::Gather => "gather",
            OpKind::Scatter => "scatter",
            OpKind::ReduceScatter => "reduce_scatter",
            OpKind::AllToAll => "alltoall",
            OpKind::Barrier => "barrier",
            OpKind::Send => "send",
            OpKind::Recv => "recv",
            OpKind::RecvAnySource => "recv (any source)",
        }
    }

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

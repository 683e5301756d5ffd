//! One point of a data-movement sweep, shared by the sweeps over world sizes
//! (tests/collectives.rs) and over host layouts (tests/mixed.rs): run one operation on this
//! rank and check what it must have done here.

use super::*;

/// How the per-rank views of a list collective are laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// Views of one buffer (`*_into_tensor`, `*_base`).
    Contiguous,
    /// Contiguous, and this rank's view is also its input or output.
    InPlace,
    /// Separate, differently misaligned allocations (c10d's list APIs).
    Separate,
}

pub const VIEW_LAYOUTS: [Layout; 3] = [Layout::Contiguous, Layout::InPlace, Layout::Separate];

/// A broadcast of `n` elements of `dtype` from `root`, whose data is `pattern(root, salt, ..)`;
/// the other ranks start with other bytes. The buffer is misaligned by `n % 4`.
pub fn broadcast_point(f: &mut Failures, comm: &Communicator, rank: usize, dtype: DType, n: usize, root: usize, salt: u64, what: &str) -> Result<(), Stop> {
    let len = n * dtype.size();
    let mut data = Guarded::new(&pattern(if rank == root { root } else { rank + 100 }, salt, len), n % 4);
    f.op(run(comm, vec![rooted_op(OpKind::Broadcast, dtype, vec![], vec![data.raw()], root)]), what)?;
    let bytes = data.data(f, what);
    f.result(same_bytes(bytes, &pattern(root, salt, len)), format!("{what}: wrong data"));
    Ok(())
}

/// An all-gather among `size` ranks of `n` elements of `dtype`, rank r's being
/// `pattern(r, salt, ..)`, into outputs laid out as `layout`; the input must stay unchanged.
#[allow(clippy::too_many_arguments)]
pub fn allgather_point(
    f: &mut Failures,
    comm: &Communicator,
    rank: usize,
    size: usize,
    dtype: DType,
    n: usize,
    layout: Layout,
    salt: u64,
    what: &str,
) -> Result<(), Stop> {
    let len = n * dtype.size();
    let mut input = Guarded::new(&pattern(rank, salt, len), 3);
    let mut init = vec![0x5Au8; size * len];
    if layout == Layout::InPlace {
        init[rank * len..(rank + 1) * len].copy_from_slice(input.bytes());
    }
    let mut out = Guarded::new(&init, 0);
    let mut pieces = separate(&init, size, len);
    let outs = match layout {
        Layout::Separate => raws(&mut pieces),
        _ => (0..size).map(|r| out.raw().sub(r * len, len)).collect::<Vec<_>>(),
    };
    let inp = if layout == Layout::InPlace { outs[rank] } else { input.raw() };
    f.op(run(comm, vec![op_with(OpKind::AllGather, dtype, vec![inp], outs)]), what)?;
    let got = if layout == Layout::Separate { joined(f, &pieces, what) } else { out.data(f, what).to_vec() };
    check_blocks(f, &got, size, salt, len, what);
    let bytes = input.data(f, what);
    f.result(same_bytes(bytes, &pattern(rank, salt, len)), format!("{what}: input changed"));
    Ok(())
}

/// An all-reduce under `rop` of this rank's `n` inputs of T for `salt`, in a guarded buffer
/// misaligned by `n % 3` (the kernels must not assume alignment); the result's bytes.
pub fn allreduce_point<T: TestElem>(f: &mut Failures, comm: &Communicator, rank: usize, n: usize, salt: u64, rop: ReduceOp, what: &str) -> Result<Vec<u8>, Stop> {
    let mut data = guarded_inputs::<T>(rank, n, salt, rop, n % 3);
    let o = reduction_with(OpKind::AllReduce, T::DTYPE, vec![], vec![data.raw()], rop);
    f.op(run(comm, vec![o]), what)?;
    Ok(data.data(f, what).to_vec())
}

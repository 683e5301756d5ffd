//! Tests: every dtype × op × count × source count × placement against an independent scalar
//! reference, on both the AVX2 and the portable loop, plus the corner cases torch users notice
//! (NaN in MIN/MAX, integer AVG truncation, half types rounding once, bool normalization) and
//! every validate() error.
//!
//! The reference decodes each element on its own and combines with plain scalar code: floats in
//! f64, rounded to the accumulation type after each step (for +, *, / that equals computing in
//! the accumulation type, since f64 has more than twice f32's precision); integers in i128,
//! truncated to the element type (wrapping arithmetic is the same modulo 2^n).
//!
//! Every sweep reports all its failing points (crate::failures), each named by its parameters.

use half::{bf16, f16};

use super::kernels::{Level, MAX_LEVEL};
use super::{Reduction, reduce_raw, reduce_slices};
use crate::failures::{Failures, each_element};
use crate::types::{DType, ReduceOp};

const OPS: [ReduceOp; 9] = [
    ReduceOp::Sum,
    ReduceOp::Avg,
    ReduceOp::Product,
    ReduceOp::Min,
    ReduceOp::Max,
    ReduceOp::BAnd,
    ReduceOp::BOr,
    ReduceOp::BXor,
    ReduceOp::PreMulSum,
];
const COUNTS: [usize; 6] = [0, 1, 7, 1023, 1025, 4099];
const FLOAT8: [DType; 4] = [
    DType::Float8E4M3FN,
    DType::Float8E5M2,
    DType::Float8E4M3FNUZ,
    DType::Float8E5M2FNUZ,
];
const FACTOR: f64 = 0.3;

fn reducible() -> impl Iterator<Item = DType> {
    DType::ALL
        .iter()
        .copied()
        .filter(|d| !FLOAT8.contains(d) && *d != DType::Bytes)
}

fn red(dtype: DType, op: ReduceOp, world_size: usize) -> Reduction {
    Reduction {
        dtype,
        op,
        world_size,
        premul_factor: FACTOR,
    }
}

/// splitmix64: deterministic test data without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

// ---- element codecs: the reference's own view of memory ----

#[derive(Clone, Copy, Debug)]
enum Val {
    F(f64),
    I(i128),
    B(bool),
}

fn is_signed(d: DType) -> bool {
    matches!(d, DType::Int8 | DType::Int16 | DType::Int32 | DType::Int64)
}

fn decode(d: DType, bytes: &[u8]) -> Val {
    let mut b8 = [0u8; 8];
    b8[..bytes.len()].copy_from_slice(bytes);
    let u = u64::from_le_bytes(b8);
    match d {
        DType::Float64 => Val::F(f64::from_bits(u)),
        DType::Float32 => Val::F(f64::from(f32::from_bits(u as u32))),
        DType::Float16 => Val::F(f64::from(f16::from_bits(u as u16).to_f32())),
        DType::BFloat16 => Val::F(f64::from(bf16::from_bits(u as u16).to_f32())),
        DType::Bool => Val::B(u != 0),
        _ if is_signed(d) => {
            let shift = 64 - 8 * bytes.len();
            Val::I(i128::from(((u << shift) as i64) >> shift))
        }
        _ => Val::I(i128::from(u)),
    }
}

fn encode(d: DType, v: Val, out: &mut [u8]) {
    match v {
        Val::F(x) => match d {
            DType::Float64 => out.copy_from_slice(&x.to_le_bytes()),
            DType::Float32 => out.copy_from_slice(&(x as f32).to_le_bytes()),
            DType::Float16 => out.copy_from_slice(&f16::from_f32(x as f32).to_le_bytes()),
            DType::BFloat16 => out.copy_from_slice(&bf16::from_f32(x as f32).to_le_bytes()),
            _ => unreachable!(),
        },
        Val::I(x) => out.copy_from_slice(&x.to_le_bytes()[..out.len()]),
        Val::B(x) => out[0] = u8::from(x),
    }
}

/// Rounds an f64 to the accumulation type of `d` (f32 for every float but float64).
fn round_acc(d: DType, x: f64) -> f64 {
    if d == DType::Float64 {
        x
    } else {
        f64::from(x as f32)
    }
}

/// Truncates an i128 to the element type (two's complement wrap), keeping its signedness.
fn wrap(d: DType, x: i128) -> i128 {
    let bits = 8 * d.size() as u32;
    let low = (x as u128) & (u128::MAX >> (128 - bits));
    if is_signed(d) && low >> (bits - 1) == 1 {
        (low as i128) - (1i128 << bits)
    } else {
        low as i128
    }
}

fn combine(d: DType, op: ReduceOp, a: Val, b: Val) -> Val {
    match (a, b) {
        (Val::F(a), Val::F(b)) => Val::F(match op {
            ReduceOp::Sum | ReduceOp::Avg | ReduceOp::PreMulSum => round_acc(d, a + b),
            ReduceOp::Product => round_acc(d, a * b),
            ReduceOp::Min if a.is_nan() || b.is_nan() => f64::NAN,
            ReduceOp::Max if a.is_nan() || b.is_nan() => f64::NAN,
            ReduceOp::Min => a.min(b),
            ReduceOp::Max => a.max(b),
            _ => unreachable!(),
        }),
        (Val::I(a), Val::I(b)) => Val::I(wrap(
            d,
            match op {
                ReduceOp::Sum | ReduceOp::Avg => a + b,
                ReduceOp::Product => a.wrapping_mul(b),
                ReduceOp::Min => a.min(b),
                ReduceOp::Max => a.max(b),
                ReduceOp::BAnd => a & b,
                ReduceOp::BOr => a | b,
                ReduceOp::BXor => a ^ b,
                ReduceOp::PreMulSum => unreachable!(),
            },
        )),
        (Val::B(a), Val::B(b)) => Val::B(match op {
            ReduceOp::Sum | ReduceOp::Max | ReduceOp::BOr => a || b,
            ReduceOp::Product | ReduceOp::Min | ReduceOp::BAnd => a && b,
            ReduceOp::BXor => a != b,
            _ => unreachable!(),
        }),
        _ => unreachable!(),
    }
}

fn finish(r: &Reduction, v: Val) -> Val {
    match (r.op, v) {
        (ReduceOp::Avg, Val::F(x)) => Val::F(round_acc(r.dtype, x / r.world_size as f64)),
        (ReduceOp::PreMulSum, Val::F(x)) => {
            Val::F(round_acc(r.dtype, x * round_acc(r.dtype, r.premul_factor)))
        }
        (ReduceOp::Avg, Val::I(x)) => Val::I(x / r.world_size as i128),
        _ => v,
    }
}

fn reference(r: &Reduction, srcs: &[Vec<u8>], apply_finish: bool) -> Vec<u8> {
    let size = r.dtype.size();
    let mut out = vec![0u8; srcs[0].len()];
    for (i, o) in out.chunks_exact_mut(size).enumerate() {
        let at = |s: &Vec<u8>| decode(r.dtype, &s[i * size..(i + 1) * size]);
        let mut v = at(&srcs[0]);
        for s in &srcs[1..] {
            v = combine(r.dtype, r.op, v, at(s));
        }
        if apply_finish {
            v = finish(r, v);
        }
        encode(r.dtype, v, o);
    }
    out
}

fn random_buffer(d: DType, count: usize, rng: &mut Rng) -> Vec<u8> {
    let size = d.size();
    let mut out = vec![0u8; count * size];
    for o in out.chunks_exact_mut(size) {
        let bits = rng.next();
        if d.is_floating() {
            // Mostly values in [-8, 8) (products of 5 stay finite even in float16), with rare
            // NaN and infinities so their propagation is covered everywhere.
            let x = match bits % 512 {
                0 => f64::NAN,
                1 => f64::INFINITY,
                2 => f64::NEG_INFINITY,
                3 => -0.0,
                _ => ((bits >> 11) as f64 / (1u64 << 53) as f64) * 16.0 - 8.0,
            };
            encode(d, Val::F(x), o);
        } else if d == DType::Bool {
            // Includes non-canonical true bytes, which must read as true.
            o[0] = [0, 1, 0, 1, 2, 0x80, 0xFF][(bits % 7) as usize];
        } else {
            o.copy_from_slice(&bits.to_le_bytes()[..size]);
        }
    }
    out
}

/// Ok if every element of `got` equals `want`'s; else how many differ, the first and the last.
fn same(d: DType, got: &[u8], want: &[u8]) -> Result<(), String> {
    let size = d.size();
    let (got, want): (Vec<&[u8]>, Vec<&[u8]>) = (
        got.chunks_exact(size).collect(),
        want.chunks_exact(size).collect(),
    );
    each_element(got.len(), |k| {
        let (g, w) = (decode(d, got[k]), decode(d, want[k]));
        let ok = match (g, w) {
            // == rather than bits: the sign of a zero MIN/MAX result is unspecified.
            (Val::F(g), Val::F(w)) => g == w || (g.is_nan() && w.is_nan()),
            _ => got[k] == want[k],
        };
        (!ok).then(|| format!("element {k} is {g:?}, expected {w:?}"))
    })
}

#[derive(Clone, Copy, Debug)]
enum Placement {
    Separate,
    InPlaceFirst,
    InPlaceLast,
}

/// Runs one case through reduce_raw, with every buffer deliberately misaligned by one byte.
fn run_case(r: &Reduction, srcs: &[Vec<u8>], placement: Placement, apply_finish: bool) -> Vec<u8> {
    let len = srcs[0].len();
    let mut storage: Vec<Vec<u8>> = srcs
        .iter()
        .map(|s| {
            let mut v = vec![0u8; len + 1];
            v[1..].copy_from_slice(s);
            v
        })
        .collect();
    let mut separate = vec![0xA5u8; len + 1];
    let ptrs: Vec<*const u8> = storage.iter_mut().map(|v| v[1..].as_ptr()).collect();
    let dst: *mut u8 = match placement {
        Placement::Separate => separate[1..].as_mut_ptr(),
        Placement::InPlaceFirst => storage[0][1..].as_mut_ptr(),
        Placement::InPlaceLast => storage[srcs.len() - 1][1..].as_mut_ptr(),
    };
    // SAFETY: each pointer addresses `len` initialized bytes = count elements inside a live Vec;
    // dst is either the separate buffer or exactly one source; r validated (checked by callers).
    unsafe { reduce_raw(r, dst, &ptrs, len / r.dtype.size(), apply_finish) };
    match placement {
        Placement::Separate => separate[1..].to_vec(),
        Placement::InPlaceFirst => storage[0][1..].to_vec(),
        Placement::InPlaceLast => storage[srcs.len() - 1][1..].to_vec(),
    }
}

fn full_matrix(level: &str) {
    let mut rng = Rng(0x5EED);
    let mut cases = 0;
    let mut failures = Failures::new();
    for dtype in reducible() {
        for op in OPS {
            // Up to two passes of four sources after the first, and every remainder after one.
            for nsrc in [1, 2, 3, 4, 5, 6, 7, 8, 10] {
                // world_size != nsrc on purpose: the divisor must come from world_size.
                let r = red(dtype, op, nsrc + 1);
                if r.validate().is_err() {
                    continue;
                }
                for count in COUNTS {
                    let srcs: Vec<Vec<u8>> = (0..nsrc)
                        .map(|_| random_buffer(dtype, count, &mut rng))
                        .collect();
                    let finishes: &[bool] = match op {
                        ReduceOp::Avg | ReduceOp::PreMulSum => &[true, false],
                        _ => &[true],
                    };
                    for &apply_finish in finishes {
                        let want = reference(&r, &srcs, apply_finish);
                        for placement in [
                            Placement::Separate,
                            Placement::InPlaceFirst,
                            Placement::InPlaceLast,
                        ] {
                            let got = run_case(&r, &srcs, placement, apply_finish);
                            failures.result(
                                same(dtype, &got, &want),
                                format!(
                                    "{dtype} {op} count={count} nsrc={nsrc} {placement:?} \
                                     finish={apply_finish}"
                                ),
                            );
                            cases += 1;
                        }
                    }
                }
            }
        }
    }
    failures.check(cases > 4000, || format!("only {cases} cases ran"));
    failures.finish(&format!("reduce_raw ({level}) vs the reference"));
}

#[test]
fn matches_reference_dispatched() {
    full_matrix("dispatched");
}

#[test]
fn matches_reference_portable() {
    MAX_LEVEL.with(|l| l.set(Level::Portable));
    full_matrix("portable");
    MAX_LEVEL.with(|l| l.set(Level::Avx512));
}

/// The AVX2 build, also on machines with AVX-512 (where the dispatched test runs AVX-512).
#[test]
fn matches_reference_avx2() {
    MAX_LEVEL.with(|l| l.set(Level::Avx2));
    full_matrix("avx2");
    MAX_LEVEL.with(|l| l.set(Level::Avx512));
}

#[test]
fn every_supported_combination_is_covered() {
    // 4 floats × 6 ops + 8 ints × 8 ops + bool × 7 ops.
    let ok = reducible()
        .flat_map(|d| OPS.map(|op| red(d, op, 2)))
        .filter(|r| r.validate().is_ok())
        .count();
    assert_eq!(ok, 4 * 6 + 8 * 8 + 7);
}

// ---- helpers for hand-written cases ----

/// `vals` encoded as elements of `d`.
fn encoded(d: DType, vals: impl ExactSizeIterator<Item = Val>) -> Vec<u8> {
    let mut out = vec![0u8; vals.len() * d.size()];
    for (v, o) in vals.zip(out.chunks_exact_mut(d.size())) {
        encode(d, v, o);
    }
    out
}

fn f32s(d: DType, xs: &[f32]) -> Vec<u8> {
    encoded(d, xs.iter().map(|&x| Val::F(f64::from(x))))
}

fn to_f64s(d: DType, bytes: &[u8]) -> Vec<f64> {
    bytes
        .chunks_exact(d.size())
        .map(|c| match decode(d, c) {
            Val::F(x) => x,
            _ => unreachable!(),
        })
        .collect()
}

fn ints(d: DType, xs: &[i128]) -> Vec<u8> {
    encoded(d, xs.iter().map(|&x| Val::I(x)))
}

fn reduce_vec(r: &Reduction, srcs: &[Vec<u8>], apply_finish: bool) -> Vec<u8> {
    let mut dst = vec![0u8; srcs[0].len()];
    let views: Vec<&[u8]> = srcs.iter().map(|s| s.as_slice()).collect();
    reduce_slices(r, &mut dst, &views, apply_finish);
    dst
}

#[test]
fn min_max_propagate_nan_from_any_position() {
    let nan = f32::NAN;
    let mut failures = Failures::new();
    for d in [
        DType::Float64,
        DType::Float32,
        DType::Float16,
        DType::BFloat16,
    ] {
        for op in [ReduceOp::Min, ReduceOp::Max] {
            let srcs = vec![
                f32s(d, &[nan, 1.0, 1.0, 1.0, 2.0]),
                f32s(d, &[1.0, nan, 1.0, nan, -2.0]),
                f32s(d, &[1.0, 1.0, nan, 1.0, 0.5]),
            ];
            let got = to_f64s(d, &reduce_vec(&red(d, op, 3), &srcs, true));
            failures.check(got[..4].iter().all(|x| x.is_nan()), || {
                format!("{d} {op}: {got:?} should start with 4 NaN")
            });
            let want = if op == ReduceOp::Min { -2.0 } else { 2.0 };
            failures.eq(got[4], want, format!("{d} {op}: element 4"));
        }
    }
    failures.finish("MIN/MAX propagate NaN");
}

#[test]
fn integer_avg_truncates_toward_zero_after_wrapping_sum() {
    let r = red(DType::Int32, ReduceOp::Avg, 2);
    let got = reduce_vec(
        &r,
        &[
            ints(DType::Int32, &[-7, 7, -1]),
            ints(DType::Int32, &[0, 0, 0]),
        ],
        true,
    );
    assert_eq!(got, ints(DType::Int32, &[-3, 3, 0]));

    // int8: 100 + 100 wraps to -56 before the division (NCCL sums in the element type).
    let r = red(DType::Int8, ReduceOp::Avg, 2);
    let got = reduce_vec(
        &r,
        &[
            ints(DType::Int8, &[100, -128]),
            ints(DType::Int8, &[100, 0]),
        ],
        true,
    );
    assert_eq!(got, ints(DType::Int8, &[-28, -64]));

    let r = red(DType::UInt8, ReduceOp::Avg, 2);
    let got = reduce_vec(
        &r,
        &[ints(DType::UInt8, &[200]), ints(DType::UInt8, &[100])],
        true,
    );
    assert_eq!(got, ints(DType::UInt8, &[22]));

    // A world bigger than the type's range: every quotient truncates to 0.
    let r = red(DType::Int8, ReduceOp::Avg, 1000);
    let got = reduce_vec(&r, &[ints(DType::Int8, &[-128, 127])], true);
    assert_eq!(got, ints(DType::Int8, &[0, 0]));
    let r = red(DType::Int64, ReduceOp::Avg, usize::MAX);
    let got = reduce_vec(
        &r,
        &[ints(DType::Int64, &[i64::MIN.into(), i64::MAX.into()])],
        true,
    );
    assert_eq!(got, ints(DType::Int64, &[0, 0]));
}

/// One source holding 1.0 and `k` sources holding `tiny`, as elements of `d`.
fn one_then_tiny(d: DType, tiny: f32, k: usize) -> Vec<Vec<u8>> {
    std::iter::once(1.0).chain(std::iter::repeat_n(tiny, k)).map(|x| f32s(d, &[x])).collect()
}

#[test]
fn half_types_accumulate_in_f32_and_round_once() {
    // bfloat16 has 8 significant bits: 1 + 2^-9 rounds back to 1 (tie to even), so a per-step
    // bfloat16 sum would stay 1.0; the f32 sum is 1 + 2^-7, which bfloat16 holds exactly.
    // float16 has 11 significant bits: the same effect with 2^-11.
    for (d, tiny) in [(DType::BFloat16, 2f32.powi(-9)), (DType::Float16, 2f32.powi(-11))] {
        let srcs = one_then_tiny(d, tiny, 4);
        let sum = 1.0 + 4.0 * f64::from(tiny);
        assert_eq!(to_f64s(d, &reduce_vec(&red(d, ReduceOp::Sum, 5), &srcs, true)), [sum], "{d} SUM");
        // AVG divides the f32 sum: (1 + 4 tiny) / 4 is exact too.
        assert_eq!(to_f64s(d, &reduce_vec(&red(d, ReduceOp::Avg, 4), &srcs, true)), [sum / 4.0], "{d} AVG");
    }

    // PREMUL_SUM scales the f32 sum before the single rounding: (1 + 3·2^-9)·0.5 in bfloat16.
    let d = DType::BFloat16;
    let t = 2f32.powi(-9);
    let srcs = one_then_tiny(d, t, 3);
    let r = Reduction {
        premul_factor: 0.5,
        ..red(d, ReduceOp::PreMulSum, 4)
    };
    let want = f64::from(bf16::from_f32((1.0 + 3.0 * t) * 0.5).to_f32());
    assert_eq!(to_f64s(d, &reduce_vec(&r, &srcs, true)), [want]);
}

#[test]
fn finish_only_when_asked() {
    let d = DType::Float32;
    let srcs = vec![f32s(d, &[3.0]), f32s(d, &[5.0])];
    assert_eq!(
        to_f64s(d, &reduce_vec(&red(d, ReduceOp::Avg, 2), &srcs, false)),
        [8.0]
    );
    assert_eq!(
        to_f64s(d, &reduce_vec(&red(d, ReduceOp::Avg, 2), &srcs, true)),
        [4.0]
    );
    let r = Reduction {
        premul_factor: 0.25,
        ..red(d, ReduceOp::PreMulSum, 2)
    };
    assert_eq!(to_f64s(d, &reduce_vec(&r, &srcs, true)), [2.0]);
    assert_eq!(to_f64s(d, &reduce_vec(&r, &srcs, false)), [8.0]);
}

#[test]
fn bool_is_logical_and_normalized() {
    let d = DType::Bool;
    let a = vec![2u8, 0xFF, 0, 0, 0x80];
    let b = vec![1u8, 0x01, 0, 7, 0];
    let cases = [
        (ReduceOp::Sum, [1, 1, 0, 1, 1]),
        (ReduceOp::Max, [1, 1, 0, 1, 1]),
        (ReduceOp::BOr, [1, 1, 0, 1, 1]),
        (ReduceOp::Product, [1, 1, 0, 0, 0]),
        (ReduceOp::Min, [1, 1, 0, 0, 0]),
        (ReduceOp::BAnd, [1, 1, 0, 0, 0]),
        // Logical, not bitwise: 2 ^ 1 would be 3, true ^ true is false.
        (ReduceOp::BXor, [0, 0, 0, 1, 1]),
    ];
    let mut failures = Failures::new();
    for (op, want) in cases {
        failures.eq(
            reduce_vec(&red(d, op, 2), &[a.clone(), b.clone()], true),
            want.to_vec(),
            format!("bool {op}"),
        );
    }
    // A single source is normalized too.
    failures.eq(
        reduce_vec(&red(d, ReduceOp::Sum, 1), &[a], true),
        vec![1, 1, 0, 0, 1],
        "bool SUM of one source",
    );
    failures.finish("bool reductions");
}

#[test]
fn dst_may_equal_several_sources() {
    let d = DType::Float32;
    let mut buf = f32s(d, &[1.0, 2.0, 3.0]);
    let other = f32s(d, &[10.0, 20.0, 30.0]);
    let p = buf.as_mut_ptr();
    let srcs = [p.cast_const(), other.as_ptr(), p.cast_const()];
    // SAFETY: both buffers hold 3 f32s; dst is exactly equal to srcs[0] and srcs[2].
    unsafe { reduce_raw(&red(d, ReduceOp::Sum, 3), p, &srcs, 3, true) };
    assert_eq!(to_f64s(d, &buf), [12.0, 24.0, 36.0]);
}

#[test]
fn validate_rejects_every_unsupported_combination() {
    let mut failures = Failures::new();
    // One point: `r` must be rejected with exactly `want`.
    let mut rejects = |r: Reduction, want: &str| {
        let what = format!("{} {} world_size {}", r.dtype, r.op, r.world_size);
        match r.validate() {
            Ok(()) => failures.fail(format!("{what}: accepted, expected {want:?}")),
            Err(e) => {
                failures.eq(e.as_str(), want, &what);
            }
        }
    };
    for d in FLOAT8 {
        for op in OPS {
            rejects(
                red(d, op, 2),
                &format!(
                    "reductions on {d} are not supported (float8 tensors can be moved by broadcast, \
                     all_gather, all_to_all, scatter, gather, send and recv, but not reduced)"
                ),
            );
        }
    }
    for d in [
        DType::Float64,
        DType::Float32,
        DType::Float16,
        DType::BFloat16,
    ] {
        for op in [ReduceOp::BAnd, ReduceOp::BOr, ReduceOp::BXor] {
            rejects(
                red(d, op, 2),
                &format!(
                    "ReduceOp.{op} is not defined for {d} tensors (bitwise ops need integer or bool tensors)"
                ),
            );
        }
    }
    rejects(
        red(DType::Float32, ReduceOp::BAnd, 2),
        "ReduceOp.BAND is not defined for float32 tensors (bitwise ops need integer or bool tensors)",
    );
    rejects(
        red(DType::Bool, ReduceOp::Avg, 2),
        "ReduceOp.AVG is not defined for bool tensors",
    );
    for d in reducible().filter(|d| !d.is_floating()) {
        rejects(
            red(d, ReduceOp::PreMulSum, 2),
            &format!("ReduceOp.PREMUL_SUM needs a floating-point tensor, got {d}"),
        );
    }
    rejects(
        red(DType::Int32, ReduceOp::PreMulSum, 2),
        "ReduceOp.PREMUL_SUM needs a floating-point tensor, got int32",
    );
    for d in reducible().filter(|d| *d != DType::Bool) {
        rejects(
            red(d, ReduceOp::Avg, 0),
            "ReduceOp.AVG needs world_size >= 1, got 0",
        );
    }
    for op in OPS {
        let what = format!("bytes {op}");
        match red(DType::Bytes, op, 2).validate() {
            Ok(()) => failures.fail(format!("{what}: accepted")),
            Err(e) => {
                failures.check(
                    e.starts_with("reductions on bytes tensors are not supported"),
                    || format!("{what}: {e}"),
                );
            }
        }
    }
    // Everything else is accepted, including ints' bitwise ops and world_size 0 for non-AVG.
    failures.eq(
        red(DType::Int64, ReduceOp::BXor, 0).validate(),
        Ok(()),
        "int64 BXOR world_size 0",
    );
    failures.eq(
        red(DType::UInt8, ReduceOp::Avg, 1).validate(),
        Ok(()),
        "uint8 AVG world_size 1",
    );
    failures.finish("validate()");
}

/// reduce_slices refuses, with a panic naming the problem, what reduce_raw's contract forbids.
#[test]
fn reduce_slices_rejects_what_reduce_raw_forbids() {
    let sum = red(DType::Int32, ReduceOp::Sum, 2);
    let cases: [(&str, Reduction, usize, &[&[u8]], &str); 3] = [
        ("a source longer than the destination", sum, 4, &[&[0u8; 4], &[0u8; 8]], "source 1 has 8 bytes but the destination has 4"),
        ("partial elements", sum, 6, &[&[0u8; 6]], "not a multiple"),
        ("an invalid reduction", red(DType::Bool, ReduceOp::Avg, 2), 1, &[&[1u8]], "ReduceOp.AVG is not defined for bool tensors"),
    ];
    let mut failures = Failures::new();
    for (case, r, dst_len, srcs, want) in cases {
        let mut dst = vec![0u8; dst_len];
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| reduce_slices(&r, &mut dst, srcs, true))) {
            Ok(()) => failures.fail(format!("{case}: accepted, expected a panic mentioning {want:?}")),
            Err(p) => {
                let message = crate::failures::panic_text(p);
                failures.check(message.contains(want), || format!("{case}: panicked with {message:?}, expected {want:?}"));
            }
        }
    }
    failures.finish("reduce_slices rejections");
}

/// Records a failure unless widening `bits` gave `want` (the same bits, or both NaN).
fn check_widening(failures: &mut Failures, bits: u16, got: f32, want: f32) {
    let same = got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan());
    failures.check(same, || format!("widening {bits:#06x}: {got} vs {want}"));
}

/// float32 values whose narrowing to float16 covers every rounding case: every
/// sign/exponent/kept-mantissa pattern, with the dropped 13 bits exact, just below, at and just
/// above the tie, and at their maximum; then `random` random values, each also with its exponent
/// below float16's normal range (subnormal results round at other bit positions) and made an
/// exact tie.
fn f16_rounding_cases(random: usize, seed: u64) -> impl Iterator<Item = f32> {
    let patterns = (0..(1u32 << 19)).flat_map(|hi| [0u32, 1, 0x0FFF, 0x1000, 0x1001, 0x1FFF].map(|lo| (hi << 13) | lo));
    let mut rng = Rng(seed);
    let sampled = (0..random).flat_map(move |_| {
        let bits = rng.next() as u32;
        [bits, bits & 0x387F_FFFF, (bits & 0x3880_0000) | (bits & 0x8000_0000) | (1 << (bits % 23))]
    });
    patterns.chain(sampled).map(f32::from_bits)
}

#[test]
fn bf16_conversions_match_half() {
    use super::convert::{bf16_to_f32, f32_to_bf16};
    let mut failures = Failures::new();
    for hi in 0..=u16::MAX {
        check_widening(&mut failures, hi, bf16_to_f32(hi), bf16::from_bits(hi).to_f32());
        // Each rounding regime: exact, below/at/above the tie, and the largest dropped half.
        for lo in [0u32, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF] {
            let x = f32::from_bits((u32::from(hi) << 16) | lo);
            failures.eq(
                f32_to_bf16(x),
                bf16::from_f32(x).to_bits(),
                format_args!("narrowing {:#010x}", x.to_bits()),
            );
        }
    }
    failures.finish("bf16 conversions");
}

#[test]
fn f16_conversions_match_half() {
    use super::convert::{f16_to_f32, f32_to_f16};
    let mut failures = Failures::new();
    for h in 0..=u16::MAX {
        check_widening(&mut failures, h, f16_to_f32(h), f16::from_bits(h).to_f32());
    }
    for x in f16_rounding_cases(1_000_000, 7) {
        failures.eq(f32_to_f16(x), f16::from_f32(x).to_bits(), format_args!("narrowing {:#010x}", x.to_bits()));
    }
    failures.finish("f16 conversions");
}

/// F16C's conversions (the AVX2 and AVX-512 builds' float16) against `half`, over every float16
/// and the same float32 sweep as the software ones, through whole vectors and the scalar tail.
#[cfg(target_arch = "x86_64")]
#[test]
fn f16c_conversions_match_half() {
    use super::elem::Elem;
    use super::f16c::F16c;
    if !std::arch::is_x86_feature_detected!("f16c") {
        eprintln!("skipped: this CPU has no F16C");
        return;
    }
    let mut failures = Failures::new();
    // 13 elements: one vector of 8 and a tail of 5.
    let all: Vec<u16> = (0..=u16::MAX).collect();
    for chunk in all.chunks(13) {
        let mut wide = vec![0f32; chunk.len()];
        // SAFETY: the CPU has F16C (checked above); `chunk` holds wide.len() float16.
        unsafe { F16c::load(chunk.as_ptr().cast::<u8>(), &mut wide) };
        for (&h, &got) in chunk.iter().zip(&wide) {
            check_widening(&mut failures, h, got, f16::from_bits(h).to_f32());
        }
    }
    let inputs: Vec<f32> = f16_rounding_cases(300_000, 11).collect();
    for chunk in inputs.chunks(13) {
        let mut narrow = vec![0u16; chunk.len()];
        // SAFETY: the CPU has F16C; `narrow` has room for chunk.len() float16.
        unsafe { F16c::store(chunk, narrow.as_mut_ptr().cast::<u8>()) };
        for (&x, &got) in chunk.iter().zip(&narrow) {
            failures.eq(got, f16::from_f32(x).to_bits(), format_args!("narrowing {:#010x}", x.to_bits()));
        }
    }
    failures.finish("F16C conversions");
}

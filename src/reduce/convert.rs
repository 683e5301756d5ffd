//! Branch-free float16/bfloat16 <-> f32 conversions.
//!
//! They give the same values as `half`'s `to_f32`/`from_f32` (round to nearest, ties to even;
//! tests compare them exhaustively), but are plain integer/float arithmetic with selects
//! instead of branches, so the kernels' load and store loops stay vectorized with them inlined.
//! `half`'s slice helpers run bf16 as a branchy scalar loop and f16 through an indirect call per
//! 8 elements, several times slower inside the reduction loop.

/// bfloat16 is the upper half of an f32, so widening is a shift (as in torch's c10::BFloat16;
/// a signaling NaN stays a NaN, `half` would additionally set its quiet bit).
#[inline(always)]
pub(super) fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// Rounds to nearest, ties to even: adding 0x7FFF plus the kept part's lowest bit carries into
/// the kept part exactly when the dropped half is above the tie, or at the tie with an odd kept
/// part. Overflow rounds to infinity as it should. NaN must be special-cased (a carry could turn
/// it into infinity): it keeps its sign and top payload bits and is made quiet, as in `half`.
#[inline(always)]
pub(super) fn f32_to_bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    let rounded = (bits.wrapping_add(0x7FFF + ((bits >> 16) & 1)) >> 16) as u16;
    let nan = ((bits >> 16) | 0x0040) as u16;
    if x.is_nan() { nan } else { rounded }
}

/// f32 exponent field of 2^-14, float16's smallest normal.
const F16_MIN_NORMAL_EXP: u32 = 113 << 23;

/// float16 -> f32, exact. The magnitude bits are moved into f32's fields and rebiased; a
/// subnormal's value m·2^-24 is produced exactly as (1 + m/1024)·2^-14 - 2^-14.
#[inline(always)]
pub(super) fn f16_to_f32(bits: u16) -> f32 {
    let h = u32::from(bits);
    let sign = (h & 0x8000) << 16;
    let mag = (h & 0x7FFF) << 13;
    let exp = mag & 0x0F80_0000;
    let normal = mag + ((127 - 15) << 23);
    let inf_nan = normal + ((128 - 16) << 23);
    let subnormal =
        (f32::from_bits(mag + F16_MIN_NORMAL_EXP) - f32::from_bits(F16_MIN_NORMAL_EXP)).to_bits();
    let out = if exp == 0x0F80_0000 {
        inf_nan
    } else if exp == 0 {
        subnormal
    } else {
        normal
    };
    f32::from_bits(out | sign)
}

/// f32 -> float16, round to nearest, ties to even (F. Giesen's `float_to_half_fast3_rtne`).
/// Normal results round with the same carry trick as bfloat16 (a carry out of the mantissa
/// correctly bumps the exponent, up to infinity); subnormal results are rounded by the FPU
/// itself, by adding 0.5 so that the f32 ulp equals float16's subnormal step. NaN becomes a
/// quiet NaN keeping its top payload bits, as in `half`.
#[inline(always)]
pub(super) fn f32_to_f16(x: f32) -> u16 {
    const HALF: u32 = 126 << 23; // 0.5: its ulp is 2^-24, float16's subnormal step
    let bits = x.to_bits();
    let sign = (bits >> 16) & 0x8000;
    let abs = bits & 0x7FFF_FFFF;

    let nan = 0x7E00 | ((abs >> 13) & 0x03FF);
    let odd = (abs >> 13) & 1;
    let normal = abs
        .wrapping_sub((127 - 15) << 23)
        .wrapping_add(0x0FFF + odd)
        >> 13;
    let subnormal = (f32::from_bits(abs) + f32::from_bits(HALF))
        .to_bits()
        .wrapping_sub(HALF);

    let out = if abs > 0x7F80_0000 {
        nan
    } else if abs >= (127 + 16) << 23 {
        0x7C00 // at least 2^16: infinity (smaller overflows reach it through the carry)
    } else if abs < F16_MIN_NORMAL_EXP {
        subnormal
    } else {
        normal
    };
    (out | sign) as u16
}

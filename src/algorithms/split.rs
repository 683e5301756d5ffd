//! How the algorithms cut a tensor among ranks.

use crate::transport::RawBuf;

/// Splits `n` elements into `parts` near-equal consecutive ranges; returns range `i` as
/// (start, len). The first `n % parts` ranges get one element more.
pub fn split_range(n: usize, parts: usize, i: usize) -> (usize, usize) {
    let base = n / parts;
    let extra = n % parts;
    let start = i * base + i.min(extra);
    (start, base + usize::from(i < extra))
}

/// Rank `i`'s share of an `n`-element tensor, as a byte-range RawBuf of `buf`.
pub fn share(buf: RawBuf, n: usize, parts: usize, i: usize, esz: usize) -> RawBuf {
    let (s, l) = split_range(n, parts, i);
    buf.sub(s * esz, l * esz)
}

#[cfg(test)]
mod tests {
    use super::split_range;
    use crate::failures::Failures;

    #[test]
    fn split_covers_everything() {
        let mut failures = Failures::new();
        for n in [0usize, 1, 5, 7, 100, 1001] {
            for parts in 1..6 {
                let mut next = 0;
                for i in 0..parts {
                    let (s, l) = split_range(n, parts, i);
                    failures.eq(s, next, format_args!("n {n} parts {parts}: start of part {i}"));
                    next = s + l;
                }
                failures.eq(next, n, format_args!("n {n} parts {parts}: end of the last part"));
            }
        }
        failures.finish("split_range");
    }
}

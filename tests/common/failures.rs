//! Failing points of a sweep, collected instead of stopping at the first.
//!
//! A *sweep* runs one test body over many *points* (world size × dtype × op × count × root or
//! layout, on every rank). Each check of a point records a failure, one line naming the point,
//! in a [`Failures`] and the sweep keeps going; at the end [`Failures::finish`] panics once with
//! the count and every line. A wrong value does not stop a sweep: results are compared after
//! the operation completed, so the group is still in step. An operation that returns an error
//! does stop the rank that saw it, since its group may be broken: [`Failures::op`] records the
//! error and returns [`Stop`], which the rank's sweep body passes up with `?` (see [`sweep`]).
//!
//! This file uses std only: the integration tests include it from tests/common, the crate's
//! unit tests from src/lib.rs (by path).

#![allow(dead_code)]

use std::fmt::{Debug, Display};

/// The most lines a report lists (the count stays exact): more than the points of the largest
/// sweep, but no report of millions of lines when an exhaustive bit-pattern test breaks.
const MAX_LISTED: usize = 20_000;

/// The failing points recorded so far, in the order they were found, and how many checks ran.
#[derive(Debug, Default)]
pub struct Failures {
    lines: Vec<String>,
    count: usize,
    checks: usize,
}

/// A rank's sweep ends early: an operation failed (already recorded), so its group may be
/// broken and the points after it cannot be trusted to line up.
#[derive(Debug)]
pub struct Stop;

impl Failures {
    pub fn new() -> Failures {
        Failures::default()
    }

    /// Records a failing point (`line` names it and says what is wrong).
    pub fn fail(&mut self, line: impl Into<String>) {
        self.checks += 1;
        self.record(line.into());
    }

    fn record(&mut self, line: String) {
        self.count += 1;
        if self.lines.len() < MAX_LISTED {
            self.lines.push(line);
        }
    }

    /// Checks `ok`; records `line()` when it is false. Returns `ok`.
    pub fn check(&mut self, ok: bool, line: impl FnOnce() -> String) -> bool {
        self.checks += 1;
        if !ok {
            self.record(line());
        }
        ok
    }

    /// Checks `got == want`; the line names `what` and both values.
    pub fn eq<T: PartialEq + Debug>(&mut self, got: T, want: T, what: impl Display) -> bool {
        let ok = got == want;
        self.check(ok, || format!("{what}: got {got:?}, expected {want:?}"))
    }

    /// Records `r`'s error (a check written as a function), prefixed by `what`. Returns whether
    /// it was Ok.
    pub fn result(&mut self, r: Result<(), String>, what: impl Display) -> bool {
        self.checks += 1;
        match r {
            Ok(()) => true,
            Err(e) => {
                self.record(format!("{what}: {e}"));
                false
            }
        }
    }

    /// An operation's result: its value, or (an error) a recorded failing point and [`Stop`].
    pub fn op<T, E: Display>(&mut self, r: Result<T, E>, what: impl Display) -> Result<T, Stop> {
        self.checks += 1;
        r.map_err(|e| {
            self.record(format!("{what}: the operation failed (the rest of this rank's sweep is skipped): {e}"));
            Stop
        })
    }

    /// Each rank's value from a run of ranks that never panics (`Err`: why a rank has none: it
    /// panicked, or did not finish). A rank without a value is a failing point, named by `what`
    /// and its rank.
    pub fn ranks<T>(&mut self, results: Vec<Result<T, String>>, what: impl Display) -> Vec<Option<T>> {
        results
            .into_iter()
            .enumerate()
            .map(|(rank, r)| {
                self.checks += 1;
                r.map_err(|e| self.record(format!("{what} rank {rank}: {e}"))).ok()
            })
            .collect()
    }

    /// Adds `other`'s points after this one's.
    pub fn merge(&mut self, other: Failures) {
        self.checks += other.checks;
        self.count += other.count;
        let room = MAX_LISTED.saturating_sub(self.lines.len());
        self.lines.extend(other.lines.into_iter().take(room));
    }

    /// How many points failed.
    pub fn count(&self) -> usize {
        self.count
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// The report of `sweep` (what ran): the count, then every failing point on a line of its
    /// own. None when nothing failed.
    pub fn report(&self, sweep: &str) -> Option<String> {
        if self.count == 0 {
            return None;
        }
        let mut s = format!("{sweep}: {} failing point(s) in {} checks:\n", self.count, self.checks);
        for l in &self.lines {
            s.push_str("  ");
            s.push_str(l);
            s.push('\n');
        }
        if self.count > self.lines.len() {
            s.push_str(&format!("  ... and {} more, not listed\n", self.count - self.lines.len()));
        }
        Some(s)
    }

    /// Panics with the report of `sweep` if any point failed.
    pub fn finish(self, sweep: &str) {
        if let Some(r) = self.report(sweep) {
            panic!("{r}");
        }
    }
}

/// Runs one rank's (or one thread's) sweep: `body` records into a fresh [`Failures`], which is
/// returned; a [`Stop`] only ends the body early. A panic in `body` ends it too, and is one more
/// failing point (named by `name`), after the points recorded before it.
pub fn sweep(name: impl Display, body: impl FnOnce(&mut Failures) -> Result<(), Stop>) -> Failures {
    let mut f = Failures::new();
    if let Err(p) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| body(&mut f))) {
        f.fail(format!("{name}: panicked: {}", panic_text(p)));
    }
    f
}

/// The message of a panic payload.
pub fn panic_text(p: Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

/// Ok when `bad(k)` is None for every element k in 0..n; else one line for the whole point: how
/// many elements are wrong, the first and the last (`bad(k)` says how element k is wrong).
pub fn each_element(n: usize, bad: impl FnMut(usize) -> Option<String>) -> Result<(), String> {
    each_of(n, "elements", bad)
}

/// [`each_element`] over `n` things called `units` ("bytes", ...).
pub fn each_of(n: usize, units: &str, mut bad: impl FnMut(usize) -> Option<String>) -> Result<(), String> {
    let (mut count, mut first, mut last) = (0usize, None, None);
    for k in 0..n {
        if let Some(m) = bad(k) {
            count += 1;
            if first.is_none() {
                first = Some(m);
            } else {
                last = Some(m);
            }
        }
    }
    match (first, last) {
        (None, _) => Ok(()),
        (Some(f), None) => Err(format!("1 of {n} {units} wrong: {f}")),
        (Some(f), Some(l)) => Err(format!("{count} of {n} {units} wrong: first {f}, last {l}")),
    }
}

/// Ok when `got` equals `want` byte for byte; else how they differ (lengths, or how many bytes
/// and the first and last of them).
pub fn same_bytes(got: &[u8], want: &[u8]) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!("{} bytes, expected {}", got.len(), want.len()));
    }
    if got == want {
        return Ok(());
    }
    each_of(got.len(), "bytes", |k| (got[k] != want[k]).then(|| format!("byte {k} is {:#04x}, expected {:#04x}", got[k], want[k])))
}

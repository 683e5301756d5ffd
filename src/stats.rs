//! Per-op statistics: what each op of a group cost.
//!
//! Every group sums its ops per (op kind, algorithm): ops, bytes and time, which
//! `xccl_rs.stats(group)` returns. With `XCCL_RS_STATS=<path>`, every op also becomes one JSON
//! line in a file: the group, rank and sequence number, the op, dtype and bytes, the algorithm
//! the selection table chose and the fabric it ran on, when it started, how long it took, and
//! its algorithm and bus bandwidth by nccl-tests' formulas. Lines are buffered and written at
//! most once a second (and when a group shuts down), and the file stops growing at
//! `XCCL_RS_STATS_MAX_BYTES`, with a last line that says so.
//!
//! Terms: an op's *size* is nccl-tests' (the larger of its total input and total output, so an
//! all-gather's size is what it gathers); *algbw* is size / time; *busbw* is algbw times the
//! op's factor of nccl-tests' PERFORMANCE.md (all-reduce 2(n-1)/n; all-gather, reduce-scatter,
//! all-to-all, gather and scatter (n-1)/n; broadcast, reduce and point-to-point 1).
//!
//! torch's flight recorder keeps the last N ops to explain a hang; this keeps the cost of all.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use once_cell::sync::Lazy;
use parking_lot::Mutex;

use crate::algorithms::select::Algorithm;
use crate::fabric::Shape;
use crate::types::{DType, OpKind};

/// One op that ran.
pub struct OpSample {
    pub seq: u64,
    pub op: OpKind,
    pub dtype: DType,
    /// nccl-tests' size, in bytes (module doc).
    pub bytes: usize,
    pub algorithm: Algorithm,
    /// `mesh`, `host` or `mixed`, with `+staged` for accelerator tensors staged through the host
    /// ([`fabric_name`]).
    pub fabric: &'static str,
    pub start: SystemTime,
    pub duration: Duration,
    /// The group's size, the `n` of the bandwidth factors.
    pub ranks: usize,
}

impl OpSample {
    /// Bytes per second of the op as a whole.
    pub fn algbw(&self) -> f64 {
        let secs = self.duration.as_secs_f64();
        if secs > 0.0 { self.bytes as f64 / secs } else { 0.0 }
    }

    /// nccl-tests' bus bandwidth (module doc).
    pub fn busbw(&self) -> f64 {
        self.algbw() * bus_factor(self.op, self.ranks)
    }
}

/// The op's name as torch's flight recorder and gloo's and NCCL's profiler ranges spell it
/// (`all_reduce`, `all_gather`, ...): statistics lines, `xccl_rs.stats` and our profiler ranges
/// use it.
pub fn op_label(op: OpKind) -> &'static str {
    match op {
        OpKind::AllReduce => "all_reduce",
        OpKind::Broadcast => "broadcast",
        OpKind::Reduce => "reduce",
        OpKind::AllGather => "all_gather",
        OpKind::Gather => "gather",
        OpKind::Scatter => "scatter",
        OpKind::ReduceScatter => "reduce_scatter",
        OpKind::AllToAll => "all_to_all",
        OpKind::Barrier => "barrier",
        OpKind::Send => "send",
        OpKind::Recv | OpKind::RecvAnySource => "recv",
    }
}

/// nccl-tests' factor from algorithm to bus bandwidth for `op` among `n` ranks.
pub fn bus_factor(op: OpKind, n: usize) -> f64 {
    let n = n.max(1) as f64;
    match op {
        OpKind::AllReduce => 2.0 * (n - 1.0) / n,
        OpKind::AllGather | OpKind::ReduceScatter | OpKind::AllToAll | OpKind::Gather | OpKind::Scatter => (n - 1.0) / n,
        OpKind::Broadcast | OpKind::Reduce | OpKind::Send | OpKind::Recv | OpKind::RecvAnySource => 1.0,
        OpKind::Barrier => 0.0,
    }
}

/// The fabric's name in a statistics line.
pub fn fabric_name(shape: Shape, staged: bool) -> &'static str {
    match (shape, staged) {
        (Shape::Mesh, false) => "mesh",
        (Shape::Host, false) => "host",
        (Shape::Mixed, false) => "mixed",
        (Shape::Mesh, true) => "mesh+staged",
        (Shape::Host, true) => "host+staged",
        (Shape::Mixed, true) => "mixed+staged",
    }
}

/// Sums of one (op kind, algorithm).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Totals {
    pub ops: u64,
    pub bytes: u64,
    pub nanos: u64,
}

/// A group's statistics.
pub struct GroupStats {
    /// The group's name as torch knows it (the communicator sets it when it learns it).
    group: Arc<Mutex<String>>,
    rank: usize,
    /// Few entries (the (op, algorithm) pairs a group runs): a scan beats hashing.
    totals: Vec<((OpKind, Algorithm), Totals)>,
    file: Option<Arc<StatsFile>>,
}

impl GroupStats {
    /// `path`: XCCL_RS_STATS (None: sums only); `cap`: XCCL_RS_STATS_MAX_BYTES.
    pub fn new(rank: usize, group: Arc<Mutex<String>>, path: Option<&str>, cap: u64) -> GroupStats {
        GroupStats { group, rank, totals: Vec::new(), file: path.and_then(|p| StatsFile::shared(p, cap)) }
    }

    pub fn record(&mut self, s: &OpSample) {
        let key = (s.op, s.algorithm);
        let i = match self.totals.iter().position(|(k, _)| *k == key) {
            Some(i) => i,
            None => {
                self.totals.push((key, Totals::default()));
                self.totals.len() - 1
            }
        };
        let t = &mut self.totals[i].1;
        t.ops += 1;
        t.bytes += s.bytes as u64;
        t.nanos += s.duration.as_nanos().min(u64::MAX as u128) as u64;
        if let Some(file) = &self.file {
            file.write_line(&self.line(s));
        }
    }

    /// The sums, one row per (op kind, algorithm) that ran.
    pub fn totals(&self) -> Vec<(OpKind, Algorithm, Totals)> {
        let mut rows: Vec<_> = self.totals.iter().map(|&((op, alg), t)| (op, alg, t)).collect();
        rows.sort_by_key(|&(op, alg, _)| (op as u8, format!("{alg:?}")));
        rows
    }

    /// Whether ops become lines in a file (XCCL_RS_STATS).
    pub fn writes_lines(&self) -> bool {
        self.file.is_some()
    }

    /// Writes out the lines buffered so far.
    pub fn flush(&self) {
        if let Some(file) = &self.file {
            file.flush();
        }
    }

    fn line(&self, s: &OpSample) -> String {
        let start_us = s.start.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros());
        format!(
            concat!(
                "{{\"group\":\"{}\",\"rank\":{},\"seq\":{},\"op\":\"{}\",\"dtype\":\"{}\",\"bytes\":{},",
                "\"path\":\"{:?}\",\"fabric\":\"{}\",\"start_us\":{},\"duration_us\":{:.3},",
                "\"algbw_gbps\":{:.6},\"busbw_gbps\":{:.6}}}\n"
            ),
            json_escape(&self.group.lock()),
            self.rank,
            s.seq,
            op_label(s.op),
            s.dtype.name(),
            s.bytes,
            s.algorithm,
            s.fabric,
            start_us,
            s.duration.as_secs_f64() * 1e6,
            s.algbw() / 1e9,
            s.busbw() / 1e9,
        )
    }
}

impl Drop for GroupStats {
    fn drop(&mut self) {
        self.flush();
    }
}

/// One statistics file, shared by every group of the process that writes to it.
struct StatsFile {
    inner: Mutex<FileState>,
}

struct FileState {
    out: Option<BufWriter<File>>,
    written: u64,
    cap: u64,
    last_flush: Instant,
}

/// Open statistics files by path.
static FILES: Lazy<Mutex<HashMap<String, Arc<StatsFile>>>> = Lazy::new(|| Mutex::new(HashMap::new()));

impl StatsFile {
    /// The file for `path` (`%p`: this process's id), opened once per process for appending;
    /// None, with a warning, when it cannot be opened: statistics must not stop a job.
    fn shared(path: &str, cap: u64) -> Option<Arc<StatsFile>> {
        let path = path.replace("%p", &std::process::id().to_string());
        let mut files = FILES.lock();
        if let Some(f) = files.get(&path) {
            return Some(f.clone());
        }
        match std::fs::OpenOptions::new().create(true).append(true).open(&path) {
            Ok(f) => {
                let file = Arc::new(StatsFile {
                    inner: Mutex::new(FileState { out: Some(BufWriter::new(f)), written: 0, cap, last_flush: Instant::now() }),
                });
                files.insert(path, file.clone());
                Some(file)
            }
            Err(e) => {
                tracing::warn!(%path, error = %e, "XCCL_RS_STATS: cannot open the statistics file; no statistics are written");
                None
            }
        }
    }

    fn write_line(&self, line: &str) {
        let mut guard = self.inner.lock();
        let s = &mut *guard;
        let Some(out) = s.out.as_mut() else { return };
        if s.written + line.len() as u64 > s.cap {
            let _ = out.write_all(b"{\"truncated\":\"XCCL_RS_STATS_MAX_BYTES reached; later ops are not written\"}\n");
            let _ = out.flush();
            s.out = None;
            return;
        }
        let ok = out.write_all(line.as_bytes()).is_ok();
        s.written += line.len() as u64;
        if !ok {
            s.out = None;
        } else if s.last_flush.elapsed() >= Duration::from_secs(1) {
            let _ = out.flush();
            s.last_flush = Instant::now();
        }
    }

    fn flush(&self) {
        let mut s = self.inner.lock();
        if let Some(out) = s.out.as_mut() {
            let _ = out.flush();
        }
        s.last_flush = Instant::now();
    }
}

fn json_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(op: OpKind, bytes: usize, micros: u64, ranks: usize) -> OpSample {
        OpSample {
            seq: 7,
            op,
            dtype: DType::Float32,
            bytes,
            algorithm: Algorithm::AllReduceShm,
            fabric: "host",
            start: UNIX_EPOCH + Duration::from_secs(1),
            duration: Duration::from_micros(micros),
            ranks,
        }
    }

    #[test]
    fn bandwidths_follow_nccl_tests() {
        let s = sample(OpKind::AllReduce, 1_000_000, 1000, 4);
        assert!((s.algbw() - 1e9).abs() < 1.0);
        assert!((s.busbw() - 1.5e9).abs() < 1.0, "2(n-1)/n at 4 ranks");
        assert!((sample(OpKind::AllGather, 1_000_000, 1000, 4).busbw() - 0.75e9).abs() < 1.0);
        assert!((sample(OpKind::Broadcast, 1_000_000, 1000, 4).busbw() - 1e9).abs() < 1.0);
    }

    #[test]
    fn totals_sum_per_op_and_path_and_lines_are_json() {
        let dir = std::env::temp_dir().join(format!("xccl_rs_stats_test_{}", std::process::id()));
        let path = dir.to_str().unwrap().to_string() + ".jsonl";
        let mut g = GroupStats::new(1, Arc::new(Mutex::new("train \"a\"".into())), Some(&path), 1 << 20);
        g.record(&sample(OpKind::AllReduce, 100, 10, 2));
        g.record(&sample(OpKind::AllReduce, 50, 5, 2));
        assert_eq!(g.totals(), vec![(OpKind::AllReduce, Algorithm::AllReduceShm, Totals { ops: 2, bytes: 150, nanos: 15_000 })]);
        g.flush();
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<_> = text.lines().collect();
        assert_eq!(lines.len(), 2);
        assert!(lines[0].starts_with("{\"group\":\"train \\\"a\\\"\",\"rank\":1,\"seq\":7,\"op\":\"all_reduce\""), "{}", lines[0]);
        assert!(lines[0].contains("\"path\":\"AllReduceShm\",\"fabric\":\"host\",\"start_us\":1000000,\"duration_us\":10.000"), "{}", lines[0]);
        let _ = std::fs::remove_file(&path);
    }

    /// What recording costs per op (run by hand: `cargo test --release --lib cost_per_op --
    /// --ignored --nocapture`; docs/debugging.md quotes it): the clocks read around an op plus
    /// the sums, and with a file, the line too.
    #[test]
    #[ignore]
    fn cost_per_op() {
        let n = 1_000_000u32;
        for path in [None, Some(std::env::temp_dir().join("xccl_rs_stats_cost.jsonl").to_str().unwrap().to_string())] {
            let mut g = GroupStats::new(0, Arc::default(), path.as_deref(), u64::MAX);
            let t0 = Instant::now();
            for i in 0..n {
                let started = Instant::now();
                let mut s = sample(OpKind::AllReduce, 8, 1, 2);
                s.seq = i as u64;
                s.duration = started.elapsed();
                if g.writes_lines() {
                    s.start = SystemTime::now() - s.duration;
                }
                g.record(&s);
            }
            println!("file {}: {:.0} ns per op", path.is_some(), t0.elapsed().as_nanos() as f64 / n as f64);
            if let Some(p) = path {
                let _ = std::fs::remove_file(p);
            }
        }
    }

    #[test]
    fn the_file_stops_at_its_cap() {
        let path = std::env::temp_dir().join(format!("xccl_rs_stats_cap_{}.jsonl", std::process::id()));
        let path = path.to_str().unwrap().to_string();
        let mut g = GroupStats::new(0, Arc::default(), Some(&path), 600);
        for _ in 0..20 {
            g.record(&sample(OpKind::AllReduce, 8, 1, 2));
        }
        g.flush();
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.len() <= 600 + 100, "{} bytes", text.len());
        assert!(text.lines().last().unwrap().contains("truncated"));
        assert_eq!(g.totals()[0].2.ops, 20, "the sums go on");
        let _ = std::fs::remove_file(&path);
    }
}

//! Every `XCCL_RS_*` runtime setting, declared once: one row of the `settings!` table below
//! gives a setting's field, variable, type, default, parser and doc (NCCL's `NCCL_PARAM`). The
//! macro derives the [`Config`] struct, its defaults ([`Config::with_timeout`]), the reading of
//! the environment ([`Config::from_env`]) and the list of names ([`SETTINGS`]), which a test
//! compares with `docs/env.md`.
//!
//! An unset or empty variable takes the default. A set one that does not parse is an error
//! naming the variable, its value and what is allowed, never a silent default: a typo in
//! `XCCL_RS_TRANSPORT=shm` must not quietly mean `auto`.

use std::time::Duration;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransportChoice {
    Auto,
    Tcp,
    /// Shared memory within a host, libfabric between hosts (transport/ofi/).
    Ofi,
}

impl TransportChoice {
    /// The setting's value as a user writes it.
    pub fn name(self) -> &'static str {
        match self {
            TransportChoice::Auto => "auto",
            TransportChoice::Tcp => "tcp",
            TransportChoice::Ofi => "ofi",
        }
    }
}

/// What ranks of one host read of each other by cross-memory attach (transport/shm/cma.rs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CmaUse {
    /// Nothing (`0`).
    Never,
    /// The root's pinned buffers in broadcasts of accelerator tensors, which they are staged
    /// through (staging/): the default.
    StagedBroadcasts,
    /// Also ordinary tensors, in all-reduces and broadcasts (`1`).
    Everything,
}

pub const DEFAULT_SHM_SLOT_BYTES: usize = 4 << 20;
pub const DEFAULT_ROUND_BYTES: usize = 1 << 20;
pub const DEFAULT_THREAD_MIN_BYTES: usize = 256 << 10;
pub const DEFAULT_PIPELINE_CHUNK_BYTES: usize = 16 << 20;

/// A setting whose value does not parse: names the variable, the value and what is allowed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidSetting {
    pub name: &'static str,
    pub value: String,
    pub allowed: String,
}

impl std::fmt::Display for InvalidSetting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}={:?} is not valid: expected {}", self.name, self.value, self.allowed)
    }
}

impl std::error::Error for InvalidSetting {}

impl From<InvalidSetting> for crate::error::CommError {
    fn from(e: InvalidSetting) -> Self {
        crate::error::CommError::invalid(e.to_string())
    }
}

/// A parser turns a variable's trimmed text into the setting's value, or says what is allowed.
type Parse<T> = fn(&str) -> Result<T, String>;

macro_rules! settings {
    ($( $(#[doc = $doc:literal])* $field:ident : $ty:ty = $name:literal, default $default:expr, parse $parse:expr; )*) => {
        /// Settings read once per communicator (the module doc says how).
        #[derive(Clone, Debug)]
        pub struct Config {
            /// The group timeout: every operation, and the connection set-up, must finish within it.
            pub timeout: Duration,
            $( $(#[doc = $doc])* pub $field: $ty, )*
        }

        /// The variable of every runtime setting, plus `XCCL_RS_LOG` ([`init_logging`]).
        pub const SETTINGS: &[&str] = &[$($name,)* "XCCL_RS_LOG"];

        impl Config {
            /// Defaults with the given timeout, for tests and embedders.
            pub fn with_timeout(timeout: Duration) -> Config {
                Config { timeout, $( $field: $default, )* }
            }

            /// Reads the environment; `timeout` comes from the group (`init_process_group(timeout=...)`).
            pub fn from_env(timeout: Duration) -> Result<Config, InvalidSetting> {
                Config::from_lookup(timeout, |name| std::env::var(name).ok())
            }

            /// [`Config::from_env`] over any source of variables (tests).
            pub fn from_lookup(timeout: Duration, lookup: impl Fn(&str) -> Option<String>) -> Result<Config, InvalidSetting> {
                let mut config = Config::with_timeout(timeout);
                $(
                    if let Some(value) = lookup($name).filter(|v| !v.trim().is_empty()) {
                        let parse: Parse<$ty> = $parse;
                        config.$field = parse(value.trim())
                            .map_err(|allowed| InvalidSetting { name: $name, value: value.clone(), allowed })?;
                    }
                )*
                Ok(config)
            }
        }
    };
}

settings! {
    /// `XCCL_RS_SEGMENT_BYTES` (default 1 MiB, at least 64): bytes a reduction receives from
    /// each peer per round over TCP. Bounds its scratch memory to `(world_size - 1)` rounds.
    round_bytes: usize = "XCCL_RS_SEGMENT_BYTES", default DEFAULT_ROUND_BYTES, parse |v| bytes_at_least(v, 64);
    /// `XCCL_RS_SOCKET_HOST` (default: this host's address as its hostname resolves, else
    /// 127.0.0.1): the address peers use to reach this rank.
    socket_host: Option<String> = "XCCL_RS_SOCKET_HOST", default None, parse |v| Ok(Some(v.to_string()));
    /// `XCCL_RS_TRANSPORT` (default `auto`): `auto` uses shared memory between ranks on the
    /// same host (same hostname and same /dev/shm) and TCP between hosts; `tcp` forces TCP
    /// between every pair; `ofi` uses shared memory within a host and libfabric between hosts
    /// (its data path is unauthenticated: opt-in only, docs/security.md). Must be the same on
    /// every rank.
    transport: TransportChoice = "XCCL_RS_TRANSPORT", default TransportChoice::Auto, parse transport;
    /// `XCCL_RS_OFI_WAIT_FD` (default 1): a rank waiting on the OFI transport sleeps on its
    /// completion queue's file descriptor, where the provider has one. `0`: never, as on a
    /// provider without one (efa): it polls the queue, yielding its core between looks
    /// (transport/ofi/exchange.rs). For tests and measurements of that path.
    ofi_wait_fd: bool = "XCCL_RS_OFI_WAIT_FD", default true, parse flag;
    /// `XCCL_RS_OFI_DOMAIN` (default unset: chosen per local rank, transport/ofi/nic.rs): the
    /// libfabric domains (NICs: `mlx5_0`, `cxi0`, `rdmap16s27-rdm`, or an interface for tcp)
    /// the OFI transport opens, comma-separated; local rank `i` takes entry `i % n`. A name
    /// the provider lacks fails set-up, listing the domains it has.
    ofi_domain: Vec<String> = "XCCL_RS_OFI_DOMAIN", default Vec::new(), parse |v| Ok(v.split(',').map(|d| d.trim().to_string()).filter(|d| !d.is_empty()).collect());
    /// `XCCL_RS_OFI_TAG_BITS` (default unset: the provider's width, from its `mem_tag_format`;
    /// 48 on `cxi`, 64 on most others): how many low tag bits the OFI transport uses, 16 to 64
    /// and at most the provider's (transport/ofi/tags.rs). For tests of the narrow layouts on
    /// any provider. Must be the same on every rank.
    ofi_tag_bits: Option<u32> = "XCCL_RS_OFI_TAG_BITS", default None, parse |v| match v.parse::<u32>() {
        Ok(b @ 16..=64) => Ok(Some(b)),
        _ => Err("a whole number of bits from 16 to 64".to_string()),
    };
    /// `XCCL_RS_TLS` (default 0): `1` runs TLS 1.3 on every TCP link of the group, with a
    /// certificate per rank published through the Store (transport/tcp/tls.rs). Must be the
    /// same on every rank. Shared memory is not affected.
    tls: bool = "XCCL_RS_TLS", default false, parse flag;
    /// `XCCL_RS_CMA` (default unset: broadcasts of accelerator tensors only): ranks of one host
    /// read each other's memory with cross-memory attach (`process_vm_readv`), where the kernel
    /// allows it (probed at set-up). By default the receivers of a broadcast of 1 MiB or more
    /// read the root's pinned buffer through which its accelerator tensor is staged (one copy
    /// instead of two through the slots). `1`: also ordinary tensors, in broadcasts and
    /// all-reduces of 1 MiB or more; off for those by default, because every rank reading every
    /// peer at once pins pages, which can cost more than the slots' copy it saves. `0`: never.
    cma: CmaUse = "XCCL_RS_CMA", default CmaUse::StagedBroadcasts, parse cma_use;
    /// `XCCL_RS_REGISTERED_STAGING` (default 1): a broadcast root stages its accelerator tensor
    /// in an arena of its heap registered with the device runtime, from which the receivers
    /// copy straight onto their devices (src/staging/shared.rs), where the runtime can register
    /// host memory (CUDA). Registering costs each rank of a group some milliseconds once, which
    /// a group that lives for a handful of broadcasts does not win back. `0`: never.
    registered_staging: bool = "XCCL_RS_REGISTERED_STAGING", default true, parse flag;
    /// `XCCL_RS_HOST_ID` (default unset: hostname and /dev/shm's device and inode): when set,
    /// replaces this rank's host identity. Ranks with equal ids count as one host: for
    /// containers that share /dev/shm under different hostnames, and for tests (one process
    /// posing as several hosts). A group whose ranks span several hosts uses shared memory
    /// within each host and TCP between hosts.
    host_id: Option<String> = "XCCL_RS_HOST_ID", default None, parse |v| Ok(Some(v.to_string()));
    /// `XCCL_RS_SHM_CHUNK_BYTES` (default 4 MiB, at least 4096, rounded down to a multiple of
    /// 64): bytes of each of the two data slots of a rank's shared-memory segment; a segment is
    /// `2 * slot + 4 KiB`. Collectives move larger tensors in blocks of this size, double-buffered.
    shm_slot_bytes: usize = "XCCL_RS_SHM_CHUNK_BYTES", default DEFAULT_SHM_SLOT_BYTES, parse |v| bytes_at_least(v, 4096).map(|b| b / 64 * 64);
    /// `XCCL_RS_SHM_HEAP_BYTES` (default 16 GiB; 0: no heap): the size of each rank's
    /// shared-memory heap, from which `xccl_rs.empty` and `Backend.allocate_tensor` allocate
    /// tensors that peers read in place (zero-copy collectives). Sparse: it takes address
    /// space, and memory only for the tensors allocated in it.
    shm_heap_bytes: usize = "XCCL_RS_SHM_HEAP_BYTES", default 16 << 30, parse |v| bytes_at_least(v, 0);
    /// `XCCL_RS_SHM_ONESHOT_BYTES` (default 64 KiB): all-reduces up to this size use the
    /// one-shot path (every rank reduces the whole tensor from every rank's slot: one
    /// synchronization instead of two).
    shm_oneshot_bytes: usize = "XCCL_RS_SHM_ONESHOT_BYTES", default 64 << 10, parse |v| bytes_at_least(v, 0);
    /// `XCCL_RS_SPIN_US` (default 50): how long a waiting rank spins before it sleeps on a futex.
    spin: Duration = "XCCL_RS_SPIN_US", default Duration::from_micros(50), parse |v| number(v, "microseconds").map(Duration::from_micros);
    /// `XCCL_RS_THREADS` (default 0: the cores available to this process divided by the ranks
    /// on this host, at most 8): threads a rank uses for the copies and reductions of large
    /// shared-memory blocks.
    threads: usize = "XCCL_RS_THREADS", default 0, parse |v| bytes_at_least(v, 0);
    /// `XCCL_RS_STREAMING_STORE_BYTES` (default unset: this host's last-level cache divided by
    /// the ranks on it): ops that write at least this many bytes on a rank do their copy-out
    /// steps (results it does not read again in the op) with streaming stores, which write
    /// memory without first reading it and leave the cache to data still needed. `0`: always.
    streaming_store_bytes: Option<usize> = "XCCL_RS_STREAMING_STORE_BYTES", default None, parse |v| bytes_at_least(v, 0).map(Some);
    /// `XCCL_RS_THREAD_MIN_BYTES` (default 256 KiB): the smallest piece of a block step a
    /// helper thread takes; smaller steps stay on one thread.
    thread_min_bytes: usize = "XCCL_RS_THREAD_MIN_BYTES", default DEFAULT_THREAD_MIN_BYTES, parse |v| bytes_at_least(v, 0);
    /// `XCCL_RS_FAILURE_HOOKS_WAIT_MS` (default 35000): how long the interpreter's exit waits
    /// for abort hooks still running (torch's flight recorder writes its trace from one), so
    /// that a script ending on a group's failure exits with the trace on disk. torch's own dump
    /// gives up after two attempts of `TORCH_FR_WAIT_TIMEOUT_DUMP_MILSEC` (15 s each); hooks
    /// that return sooner end the wait.
    failure_hooks_wait: Duration = "XCCL_RS_FAILURE_HOOKS_WAIT_MS", default Duration::from_secs(35), parse |v| number(v, "milliseconds").map(Duration::from_millis);
    /// `XCCL_RS_STATS` (default unset): a file to which every op of every group is written as
    /// one JSON line (src/stats.rs); `%p` in it stands for the process id. Unset: only the sums
    /// that `xccl_rs.stats(group)` returns are kept.
    stats_path: Option<String> = "XCCL_RS_STATS", default None, parse |v| Ok(Some(v.to_string()));
    /// `XCCL_RS_STATS_MAX_BYTES` (default 256 MiB): the size at which the statistics file stops
    /// growing, with a last line that says so.
    stats_max_bytes: u64 = "XCCL_RS_STATS_MAX_BYTES", default 256 << 20, parse |v| number(v, "bytes");
    /// `XCCL_RS_PIPELINE_CHUNK_BYTES` (default 16 MiB, a power of two, at least 64 KiB; other
    /// values are rounded down to one): larger collectives run in chunks of this many bytes
    /// per buffer (src/pipeline.rs), so that the copies of accelerator tensors to and from the
    /// host overlap the communication. Must be the same on every rank.
    pipeline_chunk_bytes: usize = "XCCL_RS_PIPELINE_CHUNK_BYTES", default DEFAULT_PIPELINE_CHUNK_BYTES, parse |v| bytes_at_least(v, 0).map(pipeline_chunk);
}

fn number(v: &str, what: &str) -> Result<u64, String> {
    v.parse().map_err(|_| format!("a whole number of {what}"))
}

fn bytes_at_least(v: &str, min: usize) -> Result<usize, String> {
    match v.parse::<usize>() {
        Ok(b) if b >= min => Ok(b),
        _ if min > 0 => Err(format!("a whole number of bytes, at least {min}")),
        _ => Err("a whole number".to_string()),
    }
}

fn flag(v: &str) -> Result<bool, String> {
    match v {
        "1" => Ok(true),
        "0" | "" => Ok(false),
        _ => Err("0 or 1".to_string()),
    }
}

fn cma_use(v: &str) -> Result<CmaUse, String> {
    match v {
        "0" => Ok(CmaUse::Never),
        "1" => Ok(CmaUse::Everything),
        _ => Err("0 or 1 (unset: broadcasts of accelerator tensors)".to_string()),
    }
}

fn transport(v: &str) -> Result<TransportChoice, String> {
    match v.to_ascii_lowercase().as_str() {
        "auto" => Ok(TransportChoice::Auto),
        "tcp" => Ok(TransportChoice::Tcp),
        "ofi" => Ok(TransportChoice::Ofi),
        _ => Err("one of `auto`, `tcp`, `ofi`".to_string()),
    }
}

/// The size of the last-level cache of the CPU this process runs on (Linux sysfs; 32 MiB where
/// it cannot be read).
fn last_level_cache_bytes() -> usize {
    let parse = |text: &str| -> Option<usize> {
        let t = text.trim();
        let (digits, unit) = t.split_at(t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len()));
        let n: usize = digits.parse().ok()?;
        Some(match unit {
            "K" => n << 10,
            "M" => n << 20,
            "G" => n << 30,
            "" => n,
            _ => return None,
        })
    };
    (0..8)
        .rev()
        .find_map(|i| {
            let dir = format!("/sys/devices/system/cpu/cpu0/cache/index{i}");
            let level = std::fs::read_to_string(format!("{dir}/level")).ok()?;
            let kind = std::fs::read_to_string(format!("{dir}/type")).ok()?;
            (level.trim() == "3" && kind.trim() != "Instruction").then(|| std::fs::read_to_string(format!("{dir}/size")).ok()).flatten()
        })
        .and_then(|size| parse(&size))
        .unwrap_or(32 << 20)
}

/// The largest power of two ≤ `bytes`, at least 64 KiB.
fn pipeline_chunk(bytes: usize) -> usize {
    let b = bytes.max(64 << 10);
    1usize << (usize::BITS - 1 - b.leading_zeros())
}

impl Config {
    /// The threads a rank uses when `local_ranks` ranks share this host (see `threads`).
    pub fn threads_for(&self, local_ranks: usize) -> usize {
        if self.threads > 0 {
            return self.threads;
        }
        let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        (cores / local_ranks.max(1)).clamp(1, 8)
    }

    /// The smallest copy-out step a rank writes with streaming stores when `local_ranks`
    /// ranks share this host (see `streaming_store_bytes`): by default its share of the
    /// last-level cache, beyond which its results would not stay in the cache anyway.
    pub fn streaming_min_for(&self, local_ranks: usize) -> usize {
        self.streaming_store_bytes.unwrap_or_else(|| last_level_cache_bytes() / local_ranks.max(1))
    }
}

/// `XCCL_RS_LOG` (default `xccl_rs=warn`): a `tracing` filter such as `info`, `xccl_rs=debug` or `off`; logs go to
/// stderr. Installed once per process.
pub fn init_logging() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // Warnings (a refused stranger on a port, say) are shown unless XCCL_RS_LOG says otherwise.
        let filter = std::env::var("XCCL_RS_LOG").unwrap_or_else(|_| "xccl_rs=warn".to_string());
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_writer(std::io::stderr)
            .with_ansi(false)
            .try_init();
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn from(vars: &[(&str, &str)]) -> Result<Config, InvalidSetting> {
        let vars: Vec<(String, String)> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Config::from_lookup(Duration::from_secs(1), |name| vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone()))
    }

    #[test]
    fn unset_and_empty_take_the_defaults() {
        let c = from(&[("XCCL_RS_TRANSPORT", " "), ("XCCL_RS_SPIN_US", "")]).unwrap();
        assert_eq!(c.transport, TransportChoice::Auto);
        assert_eq!(c.spin, Duration::from_micros(50));
        assert_eq!(c.round_bytes, DEFAULT_ROUND_BYTES);
        assert_eq!(c.pipeline_chunk_bytes, DEFAULT_PIPELINE_CHUNK_BYTES);
        assert_eq!(c.cma, CmaUse::StagedBroadcasts);
    }

    #[test]
    fn values_parse_and_round_as_documented() {
        let c = from(&[
            ("XCCL_RS_TRANSPORT", "TCP"),
            ("XCCL_RS_SHM_CHUNK_BYTES", "5000"),
            ("XCCL_RS_PIPELINE_CHUNK_BYTES", "100000"),
            ("XCCL_RS_SPIN_US", " 7 "),
            ("XCCL_RS_HOST_ID", "a"),
            ("XCCL_RS_CMA", "1"),
        ])
        .unwrap();
        assert_eq!(c.cma, CmaUse::Everything);
        assert_eq!(from(&[("XCCL_RS_CMA", "0")]).unwrap().cma, CmaUse::Never);
        assert_eq!(c.transport, TransportChoice::Tcp);
        assert_eq!(c.shm_slot_bytes, 4992);
        assert_eq!(c.pipeline_chunk_bytes, 65536);
        assert_eq!(c.spin, Duration::from_micros(7));
        assert_eq!(c.host_id.as_deref(), Some("a"));
    }

    #[test]
    fn invalid_values_name_the_variable_and_what_is_allowed() {
        let cases = [
            ("XCCL_RS_TRANSPORT", "shm", "one of `auto`, `tcp`"),
            ("XCCL_RS_SEGMENT_BYTES", "32", "at least 64"),
            ("XCCL_RS_SHM_CHUNK_BYTES", "4k", "at least 4096"),
            ("XCCL_RS_SPIN_US", "-1", "microseconds"),
            ("XCCL_RS_THREADS", "many", "a whole number"),
            ("XCCL_RS_CMA", "yes", "0 or 1"),
        ];
        let mut failures = crate::failures::Failures::new();
        for (name, value, allowed) in cases {
            let what = format!("{name}={value:?}");
            let Err(err) = from(&[(name, value)]) else {
                failures.fail(format!("{what}: accepted"));
                continue;
            };
            failures.eq((err.name, err.value.as_str()), (name, value), &what);
            let text = err.to_string();
            failures.check(text.contains(name) && text.contains(value) && text.contains(allowed), || {
                format!("{what}: {text:?} should name the variable, the value and {allowed:?}")
            });
        }
        failures.finish("invalid settings");
    }

    /// docs/env.md's runtime table lists exactly the declared settings.
    #[test]
    fn docs_list_exactly_the_declared_settings() {
        let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/env.md")).unwrap();
        let runtime = doc.split("## Runtime").nth(1).unwrap().split("\n## ").next().unwrap();
        let mut documented: Vec<&str> = runtime.lines().filter_map(|l| l.strip_prefix("| `")).filter_map(|l| l.split('`').next()).collect();
        let mut declared = SETTINGS.to_vec();
        documented.sort();
        declared.sort();
        assert_eq!(documented, declared, "docs/env.md's Runtime table vs config.rs's settings");
    }
}

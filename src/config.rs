//! Every `XCCL_RS_*` environment variable, its default and its meaning. `docs/env.md` lists the
//! same table for users; keep the two in step.
//!
//! | variable | default | field |
//! |---|---|---|
//! | `XCCL_RS_SEGMENT_BYTES` | 1 MiB | `segment_bytes` |
//! | `XCCL_RS_SOCKET_HOST` | this host's address | `socket_host` |
//! | `XCCL_RS_TRANSPORT` | `auto` | `transport` |
//! | `XCCL_RS_HOST_ID` | unset (hostname + /dev/shm identity) | `host_id`: ranks with equal ids count as one host |
//! | `XCCL_RS_SHM_CHUNK_BYTES` | 4 MiB | `shm_chunk_bytes` |
//! | `XCCL_RS_SHM_ONESHOT_BYTES` | 64 KiB | `shm_oneshot_bytes` |
//! | `XCCL_RS_SPIN_US` | 50 | `spin` |
//! | `XCCL_RS_THREADS` | 0 (auto) | `threads` |
//! | `XCCL_RS_THREAD_MIN_BYTES` | 256 KiB | `thread_min_bytes` |
//! | `XCCL_RS_LOG` | off | [`init_logging`] |

use std::time::Duration;

/// Settings read once per communicator.
#[derive(Clone, Debug)]
pub struct Config {
    /// `XCCL_RS_SEGMENT_BYTES` (default 1 MiB): bytes a reduction receives from each peer per
    /// round. Bounds the scratch memory of a reduction to `(world_size - 1) * segment`.
    pub segment_bytes: usize,
    /// `XCCL_RS_SOCKET_HOST` (default: this host's address as its hostname resolves, else
    /// 127.0.0.1): the address peers use to reach this rank.
    pub socket_host: Option<String>,
    /// The group timeout: every operation, and the connection set-up, must finish within it.
    pub timeout: Duration,
    /// `XCCL_RS_TRANSPORT` (default `auto`): `auto` uses shared memory between ranks on the
    /// same host (same hostname and same /dev/shm) and TCP between hosts; `tcp` forces TCP
    /// between every pair.
    pub transport: TransportChoice,
    /// `XCCL_RS_HOST_ID` (default unset: hostname and /dev/shm's device and inode): when set,
    /// replaces this rank's host identity. Ranks with equal ids count as one host: for
    /// containers that share /dev/shm under different hostnames, and for tests (one process
    /// posing as several hosts). A group whose ranks span several hosts uses shared memory
    /// within each host and TCP between hosts.
    pub host_id: Option<String>,
    /// `XCCL_RS_SHM_CHUNK_BYTES` (default 4 MiB): bytes of each of the two data slots of a
    /// rank's shared-memory segment; a segment is `2 * chunk + 4 KiB`. Collectives move larger
    /// tensors in blocks of this size, double-buffered.
    pub shm_chunk_bytes: usize,
    /// `XCCL_RS_SHM_ONESHOT_BYTES` (default 64 KiB): all-reduces up to this size use the
    /// one-shot path (every rank reduces the whole tensor from every rank's slot: one
    /// synchronization instead of two).
    pub shm_oneshot_bytes: usize,
    /// `XCCL_RS_SPIN_US` (default 50): how long a waiting rank spins before it sleeps on a futex.
    pub spin: Duration,
    /// `XCCL_RS_THREADS` (default 0: the cores available to this process divided by the ranks
    /// on this host, at most 8): threads a rank uses for the copies and reductions of large
    /// shared-memory blocks.
    pub threads: usize,
    /// `XCCL_RS_THREAD_MIN_BYTES` (default 256 KiB): the smallest piece of a block step a
    /// helper thread takes; smaller steps stay on one thread.
    pub thread_min_bytes: usize,
    /// `XCCL_RS_PIPELINE_CHUNK_BYTES` (default 16 MiB, a power of two, at least 64 KiB; other
    /// values are rounded down to one): larger collectives run in chunks of this many bytes
    /// per buffer (src/pipeline.rs), so that the copies of accelerator tensors to and from the
    /// host overlap the communication. Must be the same on every rank.
    pub pipeline_chunk_bytes: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransportChoice {
    Auto,
    Tcp,
}

pub const DEFAULT_SHM_CHUNK_BYTES: usize = 4 << 20;

pub const DEFAULT_SEGMENT_BYTES: usize = 1 << 20;

pub const DEFAULT_THREAD_MIN_BYTES: usize = 256 << 10;

pub const DEFAULT_PIPELINE_CHUNK_BYTES: usize = 16 << 20;

/// The largest power of two ≤ `bytes`, at least 64 KiB.
fn pipeline_chunk(bytes: usize) -> usize {
    let b = bytes.max(64 << 10);
    1usize << (usize::BITS - 1 - b.leading_zeros())
}

impl Config {
    /// Reads the environment; `timeout` comes from the group (`init_process_group(timeout=...)`).
    pub fn from_env(timeout: Duration) -> Config {
        Config {
            segment_bytes: env_usize("XCCL_RS_SEGMENT_BYTES")
                .filter(|&b| b >= 64)
                .unwrap_or(DEFAULT_SEGMENT_BYTES),
            socket_host: std::env::var("XCCL_RS_SOCKET_HOST").ok().filter(|s| !s.is_empty()),
            timeout,
            transport: match std::env::var("XCCL_RS_TRANSPORT").unwrap_or_default().trim().to_ascii_lowercase().as_str() {
                "tcp" => TransportChoice::Tcp,
                _ => TransportChoice::Auto,
            },
            host_id: std::env::var("XCCL_RS_HOST_ID").ok().filter(|s| !s.trim().is_empty()),
            shm_chunk_bytes: env_usize("XCCL_RS_SHM_CHUNK_BYTES")
                .filter(|&b| b >= 4096)
                .map(|b| b / 64 * 64)
                .unwrap_or(DEFAULT_SHM_CHUNK_BYTES),
            shm_oneshot_bytes: env_usize("XCCL_RS_SHM_ONESHOT_BYTES").unwrap_or(64 << 10),
            spin: Duration::from_micros(env_usize("XCCL_RS_SPIN_US").unwrap_or(50) as u64),
            threads: env_usize("XCCL_RS_THREADS").unwrap_or(0),
            thread_min_bytes: env_usize("XCCL_RS_THREAD_MIN_BYTES").unwrap_or(DEFAULT_THREAD_MIN_BYTES),
            pipeline_chunk_bytes: pipeline_chunk(env_usize("XCCL_RS_PIPELINE_CHUNK_BYTES").unwrap_or(DEFAULT_PIPELINE_CHUNK_BYTES)),
        }
    }

    /// The threads a rank uses when `local_ranks` ranks share this host (see `threads`).
    pub fn threads_for(&self, local_ranks: usize) -> usize {
        if self.threads > 0 {
            return self.threads;
        }
        let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        (cores / local_ranks.max(1)).clamp(1, 8)
    }

    /// Defaults with the given timeout, for tests and embedders.
    pub fn with_timeout(timeout: Duration) -> Config {
        Config {
            segment_bytes: DEFAULT_SEGMENT_BYTES,
            socket_host: None,
            timeout,
            transport: TransportChoice::Auto,
            host_id: None,
            shm_chunk_bytes: DEFAULT_SHM_CHUNK_BYTES,
            shm_oneshot_bytes: 64 << 10,
            spin: Duration::from_micros(50),
            threads: 0,
            thread_min_bytes: DEFAULT_THREAD_MIN_BYTES,
            pipeline_chunk_bytes: DEFAULT_PIPELINE_CHUNK_BYTES,
        }
    }
}

fn env_usize(name: &str) -> Option<usize> {
    std::env::var(name).ok()?.trim().parse().ok()
}

/// `XCCL_RS_LOG` (default off): a `tracing` filter such as `info` or `xccl_rs=debug`; logs go to
/// stderr. Installed once per process.
pub fn init_logging() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if let Ok(filter) = std::env::var("XCCL_RS_LOG") {
            let _ = tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
                .with_writer(std::io::stderr)
                .with_ansi(false)
                .try_init();
        }
    });
}

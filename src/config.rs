//! Every `XCCL_RS_*` environment variable, its default and its meaning. `docs/env.md` lists the
//! same table for users; keep the two in step.

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
}

pub const DEFAULT_SEGMENT_BYTES: usize = 1 << 20;

impl Config {
    /// Reads the environment; `timeout` comes from the group (`init_process_group(timeout=...)`).
    pub fn from_env(timeout: Duration) -> Config {
        Config {
            segment_bytes: env_usize("XCCL_RS_SEGMENT_BYTES")
                .filter(|&b| b >= 64)
                .unwrap_or(DEFAULT_SEGMENT_BYTES),
            socket_host: std::env::var("XCCL_RS_SOCKET_HOST").ok().filter(|s| !s.is_empty()),
            timeout,
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
                .try_init();
        }
    });
}

//! Opening a rank's endpoint and learning its peers'. The provider is the one `FI_PROVIDER`
//! names (libfabric applies it), else the best one found: a fabric's own (verbs, efa, cxi,
//! psm3, opx, psm2) before TCP's (tcp, net, sockets). Each rank publishes its provider and
//! address through the Store, or, when it could not open one, its error, so that its peers
//! fail with that message at once rather than at the timeout.

use super::OfiTransport;
use super::held::Held;
use super::shim::{self, Endpoint, Info, Library};
use crate::config::Config;
use crate::error::{CommError, Result};
use crate::keys::Key;
use crate::rendezvous::{Store, rendezvous_error};
use crate::transport::Transport;
use crate::transport::tcp::TcpTransport;

/// Providers in order of preference, by their core name (before `;`). Others (shm: one host
/// only; udp;ofi_rxd) are used only when FI_PROVIDER names them.
const PREFERENCE: [&str; 9] = ["verbs", "efa", "cxi", "psm3", "opx", "psm2", "tcp", "net", "sockets"];
/// The longest value a peer may publish (status, provider name, address).
const MAX_PUBLISHED: usize = 4096;

fn fi_provider() -> Option<String> {
    std::env::var("FI_PROVIDER").ok().filter(|v| !v.trim().is_empty())
}

/// Where `info` ranks: by provider, then a real interface before loopback.
fn rank_of(info: &Info<'_>, any: bool) -> Option<(usize, bool)> {
    let core = info.provider.split(';').next().unwrap_or("");
    let by_name = PREFERENCE.iter().position(|p| *p == core);
    let place = if any { Some(by_name.unwrap_or(PREFERENCE.len())) } else { by_name }?;
    Some((place, info.domain == "lo"))
}

/// The providers' list: with `source` (XCCL_RS_SOCKET_HOST, this rank's address), those that
/// can use it as the endpoint's own address, so that each rank of a host sends from its own NIC
/// (by default a provider takes its first interface for every rank); where none can (providers
/// without IP addresses), every provider.
fn providers(lib: &Library, source: Option<&str>) -> std::result::Result<shim::InfoList, i32> {
    if let Some(addr) = source {
        match lib.providers(Some(addr)) {
            Err(rc) if rc == -shim::FI_ENODATA || rc == -shim::FI_EINVAL => {
                tracing::info!(address = addr, "no libfabric provider can use this rank's address (XCCL_RS_SOCKET_HOST) as its own: using the provider's default");
            }
            r => return r,
        }
    }
    lib.providers(None)
}

/// `ofi_rxm`'s bounce buffer size where `FI_OFI_RXM_BUFFER_SIZE` does not set it.
const RXM_BUFFER_SIZE: usize = 16384;

/// The largest message the transport posts with `provider`. `ofi_rxm` sends a message larger
/// than its eager limit by rendezvous: the receiver reads it from the sender's memory. Over the
/// `tcp` provider that read moves at a fraction of the link's rate (it is served only while the
/// sender reads its completion queue, a round trip later), so there the transport cuts payloads
/// into messages of the eager limit, which go at once and straight into the posted receive.
/// The eager limit is what `ofi_rxm` over `tcp` takes: `FI_OFI_RXM_EAGER_LIMIT`, but at least
/// the bounce buffers' size. Elsewhere (RDMA providers, whose reads the NIC serves) it is the
/// provider's largest message.
fn largest_post(provider: &str, max_msg_size: usize, env: impl Fn(&str) -> Option<String>) -> usize {
    if provider != "tcp;ofi_rxm" {
        return max_msg_size;
    }
    let size = |name: &str| env(name).and_then(|v| parse_size(&v));
    let eager = size("FI_OFI_RXM_BUFFER_SIZE").unwrap_or(RXM_BUFFER_SIZE).max(size("FI_OFI_RXM_EAGER_LIMIT").unwrap_or(0));
    eager.max(RXM_BUFFER_SIZE).min(max_msg_size.max(1))
}

/// A size as libfabric reads its variables (strtol of base 0): decimal, or hexadecimal after
/// `0x`. None for anything else, which then leaves the default.
fn parse_size(v: &str) -> Option<usize> {
    let v = v.trim();
    match v.strip_prefix("0x").or_else(|| v.strip_prefix("0X")) {
        Some(hex) => usize::from_str_radix(hex, 16).ok(),
        None => v.parse().ok(),
    }
}

/// The endpoint of the best provider, with its provider name and largest post.
fn open(lib: &Library, source: Option<&str>) -> std::result::Result<(Endpoint, String, usize), String> {
    let wanted = fi_provider();
    let list = match providers(lib, source) {
        Ok(list) => list,
        Err(rc) if rc == -shim::FI_ENODATA => return Err(no_provider(lib, wanted.as_deref(), &[])),
        Err(rc) => return Err(format!("fi_getinfo failed: {}", lib.strerror(rc as i64))),
    };
    let entries = list.entries();
    // FI_PROVIDER already filtered the list: any of its entries will do.
    let best = entries.iter().filter_map(|i| rank_of(i, wanted.is_some()).map(|r| (r, i))).min_by_key(|(r, _)| *r).map(|(_, i)| i);
    let Some(info) = best else {
        let found: Vec<String> = entries.iter().map(|i| i.provider.clone()).collect();
        return Err(no_provider(lib, wanted.as_deref(), &found));
    };
    let ep = Endpoint::open(lib, info).map_err(|e| format!("libfabric provider {} (domain {}): {e}", info.provider, info.domain))?;
    let max_post = largest_post(&info.provider, info.max_msg_size, |name| std::env::var(name).ok());
    Ok((ep, info.provider.clone(), max_post))
}

fn no_provider(lib: &Library, wanted: Option<&str>, found: &[String]) -> String {
    let (major, minor) = lib.version;
    match wanted {
        Some(p) => format!(
            "libfabric {major}.{minor} has no provider FI_PROVIDER={p:?} with reliable tagged messages \
             (FI_EP_RDM, FI_TAGGED, FI_DIRECTED_RECV) on this machine; `fi_info -l` lists the installed providers"
        ),
        None => format!(
            "libfabric {major}.{minor} found no provider for messages between hosts (looked for {}; found {:?}); \
             set FI_PROVIDER, or use XCCL_RS_TRANSPORT=auto for TCP",
            PREFERENCE.join(", "),
            found
        ),
    }
}

/// What a rank publishes: `1`, the provider's name length (one byte), the name, its largest
/// post (8 bytes, little-endian) and the address; or `0` and why it has no endpoint.
fn published(opened: &std::result::Result<(Endpoint, String, usize, Vec<u8>), String>) -> Vec<u8> {
    match opened {
        Ok((_, provider, max_post, addr)) => {
            let name = &provider.as_bytes()[..provider.len().min(255)];
            let mut v = vec![1u8, name.len() as u8];
            v.extend_from_slice(name);
            v.extend_from_slice(&(*max_post as u64).to_le_bytes());
            v.extend_from_slice(addr);
            v
        }
        Err(why) => {
            let mut v = vec![0u8];
            v.extend_from_slice(&why.as_bytes()[..why.len().min(MAX_PUBLISHED - 1)]);
            v
        }
    }
}

/// A peer's endpoint as it published it.
#[derive(Debug, PartialEq)]
struct Published<'a> {
    provider: &'a str,
    max_post: u64,
    addr: &'a [u8],
}

/// A peer's published value: its endpoint, or its error.
fn parse(value: &[u8]) -> std::result::Result<Published<'_>, String> {
    if value.len() > MAX_PUBLISHED {
        return Err(format!("it published {} bytes, more than {MAX_PUBLISHED}", value.len()));
    }
    match value.split_first() {
        Some((1, rest)) => {
            let (&n, rest) = rest.split_first().ok_or("it published an empty address")?;
            if rest.len() < n as usize + 8 {
                return Err("it published a truncated address".into());
            }
            let (name, rest) = rest.split_at(n as usize);
            let (max_post, addr) = rest.split_at(8);
            Ok(Published {
                provider: std::str::from_utf8(name).map_err(|_| "its provider name is not UTF-8")?,
                max_post: u64::from_le_bytes(max_post.try_into().expect("8 bytes")),
                addr,
            })
        }
        Some((0, why)) => Err(format!("it could not open libfabric: {}", String::from_utf8_lossy(why))),
        _ => Err("it published a malformed address".into()),
    }
}

/// Opens this rank's endpoint over the group's TCP mesh `tcp` and inserts every peer's
/// address (blocks until each has published, or the timeout).
pub fn connect(store: &dyn Store, tcp: TcpTransport, config: &Config) -> Result<OfiTransport> {
    let (rank, size) = (tcp.rank(), tcp.size());
    let opened = shim::load().and_then(|lib| {
        let (mut ep, provider, max) = open(&lib, config.socket_host.as_deref())?;
        let addr = ep.name()?;
        Ok((ep, provider, max, addr))
    });
    store.set(&Key::OfiAddress(rank).text(), &published(&opened))?;
    let (mut ep, provider, max_post, own) = opened.map_err(|why| CommError::invalid(format!("rank {rank}: {why}")))?;
    let mut addrs = vec![u64::MAX; size];
    for peer in (0..size).filter(|&p| p != rank) {
        let value = store.get(&Key::OfiAddress(peer).text(), config.timeout).map_err(|e| rendezvous_error(rank, peer, e))?;
        let failed = |why: String| CommError::peer(format!("rank {rank} cannot reach rank {peer} over libfabric: {why}"));
        let theirs = parse(&value).map_err(failed)?;
        if theirs.provider != provider {
            return Err(CommError::invalid(format!(
                "the ranks use different libfabric providers: rank {peer} {:?}, rank {rank} {provider:?} (set FI_PROVIDER alike on every rank)",
                theirs.provider
            )));
        }
        if theirs.max_post != max_post as u64 {
            return Err(CommError::invalid(format!(
                "the ranks cut libfabric messages at different sizes: rank {peer} at {} bytes, rank {rank} at {max_post} \
                 (set FI_OFI_RXM_BUFFER_SIZE and FI_OFI_RXM_EAGER_LIMIT alike on every rank)",
                theirs.max_post
            )));
        }
        addrs[peer] = ep.insert(theirs.addr, own.len()).map_err(failed)?;
    }
    tracing::info!(rank, size, provider = %provider, max_post, version = ?ep.lib().version, wait_fd = ep.wait_fd().is_some(), "xccl_rs OFI endpoint ready");
    Ok(OfiTransport {
        rank,
        size,
        tcp,
        ep: Some(ep),
        held: Held::new(size),
        lookahead: (0..size).map(|_| None).collect(),
        linger: config.timeout,
        aborted: false,
        broken: None,
        addrs,
        max_post,
        stash: (0..size).map(|_| Default::default()).collect(),
        spin: config.spin,
        provider,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn published_values_from_peers_are_bounded_and_checked() {
        let mut value = vec![1, 3, b't', b'c', b'p'];
        value.extend_from_slice(&16384u64.to_le_bytes());
        value.extend_from_slice(&[9, 9]);
        assert_eq!(parse(&value), Ok(Published { provider: "tcp", max_post: 16384, addr: &[9u8, 9][..] }));
        assert!(parse(&value[..10]).is_err(), "a cut largest post");
        assert!(parse(&[1, 9, b't']).is_err());
        assert!(parse(&[]).is_err());
        assert!(parse(&[7]).is_err());
        assert!(parse(&vec![1; MAX_PUBLISHED + 1]).is_err());
        assert!(parse(b"\0no provider").unwrap_err().contains("no provider"));
    }

    #[test]
    fn payloads_over_tcp_are_cut_at_the_eager_limit() {
        let env = |vars: &'static [(&'static str, &'static str)]| move |name: &str| vars.iter().find(|(k, _)| *k == name).map(|(_, v)| v.to_string());
        assert_eq!(largest_post("tcp;ofi_rxm", usize::MAX, env(&[])), 16384);
        assert_eq!(largest_post("tcp;ofi_rxm", usize::MAX, env(&[("FI_OFI_RXM_BUFFER_SIZE", "65536")])), 65536);
        assert_eq!(largest_post("tcp;ofi_rxm", usize::MAX, env(&[("FI_OFI_RXM_BUFFER_SIZE", "128")])), 16384, "never below the default");
        assert_eq!(largest_post("tcp;ofi_rxm", usize::MAX, env(&[("FI_OFI_RXM_EAGER_LIMIT", "0x100000")])), 1 << 20);
        assert_eq!(largest_post("tcp;ofi_rxm", usize::MAX, env(&[("FI_OFI_RXM_EAGER_LIMIT", "1024")])), 16384, "at least the bounce buffer");
        assert_eq!(largest_post("tcp;ofi_rxm", 4096, env(&[])), 4096, "never above the provider's largest");
        assert_eq!(largest_post("tcp;ofi_rxm", usize::MAX, env(&[("FI_OFI_RXM_BUFFER_SIZE", "lots")])), 16384);
        assert_eq!(largest_post("verbs;ofi_rxm", 1 << 30, env(&[])), 1 << 30);
    }
}

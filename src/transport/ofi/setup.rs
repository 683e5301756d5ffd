//! Opening a rank's endpoint and learning its peers'. The provider is the one `FI_PROVIDER`
//! names (libfabric applies it), else the best one found: a fabric's own (verbs, efa, cxi,
//! psm3, opx, psm2) before TCP's (tcp, net, sockets). Each rank publishes its provider and
//! address through the Store, or, when it could not open one, its error, so that its peers
//! fail with that message at once rather than at the timeout.

use super::OfiTransport;
use super::cutting::Cutting;
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

/// The endpoint of the best provider, with its provider name and how it cuts payloads.
fn open(lib: &Library, source: Option<&str>) -> std::result::Result<(Endpoint, String, Cutting), String> {
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
    let cutting = Cutting::for_provider(&info.provider, info.max_msg_size, info.rx_size, |name| std::env::var(name).ok());
    Ok((ep, info.provider.clone(), cutting))
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

/// What a rank publishes: `1`, the provider's name length (one byte), the name, its cutting
/// rule ([`Cutting::encode`]) and the address; or `0` and why it has no endpoint.
fn published(opened: &std::result::Result<(Endpoint, String, Cutting, Vec<u8>), String>) -> Vec<u8> {
    match opened {
        Ok((_, provider, cutting, addr)) => {
            let name = &provider.as_bytes()[..provider.len().min(255)];
            let mut v = vec![1u8, name.len() as u8];
            v.extend_from_slice(name);
            v.extend_from_slice(&cutting.encode());
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
    cutting: Cutting,
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
            if rest.len() < n as usize + Cutting::ENCODED_LEN {
                return Err("it published a truncated address".into());
            }
            let (name, rest) = rest.split_at(n as usize);
            let (cutting, addr) = rest.split_at(Cutting::ENCODED_LEN);
            Ok(Published {
                provider: std::str::from_utf8(name).map_err(|_| "its provider name is not UTF-8")?,
                cutting: Cutting::decode(cutting.try_into().expect("ENCODED_LEN bytes")),
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
        let (mut ep, provider, cutting) = open(&lib, config.socket_host.as_deref())?;
        let addr = ep.name()?;
        Ok((ep, provider, cutting, addr))
    });
    store.set(&Key::OfiAddress(rank).text(), &published(&opened))?;
    let (mut ep, provider, cutting, own) = opened.map_err(|why| CommError::invalid(format!("rank {rank}: {why}")))?;
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
        if theirs.cutting != cutting {
            return Err(CommError::invalid(format!(
                "the ranks cut libfabric messages differently: rank {peer} {}, rank {rank} {cutting} \
                 (set FI_OFI_RXM_BUFFER_SIZE, FI_OFI_RXM_EAGER_LIMIT and FI_OFI_RXM_RX_SIZE alike on every rank)",
                theirs.cutting
            )));
        }
        addrs[peer] = ep.insert(theirs.addr, own.len()).map_err(failed)?;
    }
    tracing::info!(rank, size, provider = %provider, cutting = %cutting, version = ?ep.lib().version, wait_fd = ep.wait_fd().is_some(), "xccl_rs OFI endpoint ready");
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
        cutting,
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
        let cutting = Cutting { piece: 16384, small_up_to: 16 << 20, largest: usize::MAX };
        value.extend_from_slice(&cutting.encode());
        value.extend_from_slice(&[9, 9]);
        assert_eq!(parse(&value), Ok(Published { provider: "tcp", cutting, addr: &[9u8, 9][..] }));
        assert!(parse(&value[..20]).is_err(), "a cut rule");
        assert!(parse(&[1, 9, b't']).is_err());
        assert!(parse(&[]).is_err());
        assert!(parse(&[7]).is_err());
        assert!(parse(&vec![1; MAX_PUBLISHED + 1]).is_err());
        assert!(parse(b"\0no provider").unwrap_err().contains("no provider"));
    }
}

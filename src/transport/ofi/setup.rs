//! Opening a rank's endpoint and learning its peers'. Which provider and which of its domains
//! (NICs) a rank opens is nic.rs's choice; a provider that fails to open passes to the next
//! one, said in a warning on that rank, unless FI_PROVIDER named it. Each rank publishes its
//! provider and address through the Store (gather.rs: every rank reads one combined value), or,
//! when it could not open one, its error, so that its peers fail with that message at once
//! rather than at the timeout.

use std::collections::HashMap;

use super::OfiTransport;
use super::cutting::Cutting;
use super::gather::all_published;
use super::held::Held;
use super::nic::{self, Candidate, Wanted};
use super::pool::{self, PoolKey};
use super::shim::{self, Endpoint, Info, Library};
use super::tags::TagLayout;
use crate::config::Config;
use crate::error::{CommError, Result};
use crate::keys::Key;
use crate::rendezvous::Store;
use crate::transport::Transport;
use crate::transport::tcp::TcpTransport;

/// The longest value a peer may publish (status, provider name, address).
const MAX_PUBLISHED: usize = 4096;

fn fi_provider() -> Option<String> {
    std::env::var("FI_PROVIDER").ok().filter(|v| !v.trim().is_empty())
}

/// An endpoint opened (or taken from the process's pool), with what its peers must agree on.
struct Opened {
    ep: Endpoint,
    provider: String,
    domain: String,
    cutting: Cutting,
    tags: TagLayout,
    addr: Vec<u8>,
    key: PoolKey,
    /// The endpoint's generation (pool.rs), which peers put in their tags to it.
    generation: u32,
    /// Peers' addresses the endpoint has in its address vector already.
    known: HashMap<Vec<u8>, u64>,
}

/// Where this rank sits on its host: its index among the group's ranks there, and their number.
#[derive(Clone, Copy, Debug)]
pub struct Local {
    pub rank: usize,
    pub size: usize,
}

/// The entries of libfabric's list as the choice sees them; `source` is XCCL_RS_SOCKET_HOST,
/// which marks the entries that can open on that address.
fn candidates(lib: &Library, entries: &[Info<'_>], source: Option<&str>) -> Vec<Candidate> {
    let holding: Vec<(String, String)> = source
        .and_then(|addr| lib.providers(Some(addr)).ok())
        .map(|l| l.entries().iter().map(|i| (i.provider.clone(), i.domain.clone())).collect())
        .unwrap_or_default();
    entries
        .iter()
        .map(|i| Candidate {
            provider: i.provider.clone(),
            domain: i.domain.clone(),
            numa: nic::domain_numa(&i.domain),
            holds_source: holding.iter().any(|(p, d)| *p == i.provider && *d == i.domain),
        })
        .collect()
}

/// This rank's endpoint: the best provider that opens, on the domain its local rank takes.
fn open(lib: &Library, config: &Config, local: Local, rank: usize) -> std::result::Result<Opened, String> {
    let wanted = fi_provider();
    let list = match lib.providers(None) {
        Ok(list) => list,
        Err(rc) if rc == -shim::FI_ENODATA => return Err(no_provider(lib, wanted.as_deref(), &[])),
        Err(rc) => return Err(format!("fi_getinfo failed: {}", lib.strerror(rc as i64))),
    };
    let entries = list.entries();
    let list_seen = candidates(lib, &entries, config.socket_host.as_deref());
    // FI_PROVIDER already filtered the list: any of its entries will do.
    let order = nic::providers_in_order(&list_seen, wanted.is_some());
    if order.is_empty() {
        let found: Vec<String> = entries.iter().map(|i| i.provider.clone()).collect();
        return Err(no_provider(lib, wanted.as_deref(), &found));
    }
    let want = Wanted { provider_named: wanted.is_some(), domains: &config.ofi_domain, local_rank: local.rank, local_size: local.size, numa: nic::own_numa() };
    let mut why = String::new();
    // A domain that XCCL_RS_OFI_DOMAIN names wrongly is the user's error: no fall-back.
    let named = wanted.is_some() || !config.ofi_domain.is_empty();
    let (opened, passed_over) = nic::first_that_opens(&order, named, |provider| {
        let chosen = nic::choose(&list_seen, provider, &want)?;
        why = chosen.why;
        open_entry(lib, &entries[chosen.index], config)
    })?;
    if !passed_over.is_empty() {
        let over_tcp = if nic::is_tcp(&opened.provider) { " (over TCP/IP, not the fabric)" } else { "" };
        tracing::warn!(
            rank,
            "libfabric: rank {rank} uses provider {}{over_tcp}: the better ones present failed to open: {}; set FI_PROVIDER to fail instead",
            opened.provider,
            passed_over.join("; ")
        );
    }
    tracing::info!(rank, provider = %opened.provider, domain = %opened.domain, why = %why, "libfabric domain chosen");
    Ok(opened)
}

/// The endpoint of one entry of the provider list: an idle one of the process's (pool.rs),
/// else a new one.
fn open_entry(lib: &Library, info: &Info<'_>, config: &Config) -> std::result::Result<Opened, String> {
    let tags = TagLayout::for_provider(info.mem_tag_format, config.ofi_tag_bits).map_err(|e| format!("libfabric provider {}: {e}", info.provider))?;
    let key = PoolKey { provider: info.provider.clone(), domain: info.domain.clone(), wait_fd: config.ofi_wait_fd, tag_bits: tags.bits() };
    let (mut ep, generation, known) = match pool::take(&key) {
        Some(p) => {
            tracing::debug!(provider = %key.provider, domain = %key.domain, generation = p.generation, "libfabric endpoint reused");
            (p.ep, p.generation, p.known)
        }
        None => {
            let ep = Endpoint::open(lib, info, config.ofi_wait_fd).map_err(|e| format!("libfabric provider {} (domain {}): {e}", info.provider, info.domain))?;
            tracing::debug!(provider = %key.provider, domain = %key.domain, "libfabric endpoint opened");
            (ep, 0, HashMap::new())
        }
    };
    ep.set_tag_mask(tags.mask());
    let cutting = Cutting::for_provider(&info.provider, info.max_msg_size, info.rx_size, |name| std::env::var(name).ok());
    let addr = ep.name()?;
    Ok(Opened { ep, provider: info.provider.clone(), domain: info.domain.clone(), cutting, tags, addr, key, generation, known })
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
            nic::PREFERENCE.join(", "),
            found
        ),
    }
}

/// What a rank publishes: `1`, the provider's name length (one byte), the name, its cutting
/// rule ([`Cutting::encode`]), its tag width ([`TagLayout::encode`]), its endpoint's generation
/// (one byte: at most 256 of them) and the address; or `0` and why it has no endpoint.
fn published(opened: &std::result::Result<Opened, String>) -> Vec<u8> {
    match opened {
        Ok(o) => {
            let name = &o.provider.as_bytes()[..o.provider.len().min(255)];
            let mut v = vec![1u8, name.len() as u8];
            v.extend_from_slice(name);
            v.extend_from_slice(&o.cutting.encode());
            v.push(o.tags.encode());
            v.push(o.generation as u8);
            v.extend_from_slice(&o.addr);
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
    tags: TagLayout,
    generation: u32,
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
            if rest.len() < n as usize + Cutting::ENCODED_LEN + 2 {
                return Err("it published a truncated address".into());
            }
            let (name, rest) = rest.split_at(n as usize);
            let (cutting, rest) = rest.split_at(Cutting::ENCODED_LEN);
            let (&[tags, generation], addr) = rest.split_first_chunk::<2>().expect("checked above");
            let tags = TagLayout::decode(tags).ok_or_else(|| format!("it published a tag width of {tags} bits"))?;
            if generation as u32 >= tags.generations() {
                return Err(format!("it published generation {generation}, of {} its tags hold", tags.generations()));
            }
            Ok(Published {
                provider: std::str::from_utf8(name).map_err(|_| "its provider name is not UTF-8")?,
                cutting: Cutting::decode(cutting.try_into().expect("ENCODED_LEN bytes")),
                tags,
                generation: generation as u32,
                addr,
            })
        }
        Some((0, why)) => Err(format!("it could not open libfabric: {}", String::from_utf8_lossy(why))),
        _ => Err("it published a malformed address".into()),
    }
}

/// Opens this rank's endpoint over the group's TCP mesh `tcp` and inserts every peer's
/// address (blocks until each has published, or the timeout).
pub fn connect(store: &dyn Store, tcp: TcpTransport, config: &Config, local: Local) -> Result<OfiTransport> {
    let (rank, size) = (tcp.rank(), tcp.size());
    let opened = shim::load().and_then(|lib| open(&lib, config, local, rank));
    let mine = published(&opened);
    let values = match (&opened, rank) {
        // A rank that has no endpoint only says why; rank 0 still gathers, for the others.
        (Err(_), 1..) => {
            store.set(&Key::OfiAddress(rank).text(), &mine)?;
            Vec::new()
        }
        _ => all_published(store, rank, size, &mine, MAX_PUBLISHED, config.timeout)?,
    };
    let Opened { mut ep, provider, domain, cutting, tags, addr: own, key, generation, mut known } = opened.map_err(|why| CommError::invalid(format!("rank {rank}: {why}")))?;
    let mut addrs = vec![u64::MAX; size];
    let mut generations = vec![generation; size];
    for (peer, value) in values.iter().enumerate().filter(|(p, _)| *p != rank) {
        let failed = |why: String| CommError::peer(format!("rank {rank} cannot reach rank {peer} over libfabric: {why}"));
        let theirs = parse(value).map_err(failed)?;
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
        if theirs.tags != tags {
            return Err(CommError::invalid(format!(
                "the ranks lay libfabric tags out differently: rank {peer} {}, rank {rank} {tags} (set XCCL_RS_OFI_TAG_BITS alike on every rank)",
                theirs.tags
            )));
        }
        addrs[peer] = match known.get(theirs.addr) {
            Some(&handle) => handle,
            None => {
                let handle = ep.insert(theirs.addr, own.len()).map_err(failed)?;
                known.insert(theirs.addr.to_vec(), handle);
                handle
            }
        };
        generations[peer] = theirs.generation;
    }
    tracing::info!(rank, size, provider = %provider, domain = %domain, cutting = %cutting, tags = %tags, generation, version = ?ep.lib().version, wait_fd = ep.wait_fd().is_some(), "xccl_rs OFI endpoint ready");
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
        tags,
        generations,
        key,
        known,
        failed: false,
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
        value.push(48);
        value.push(3);
        value.extend_from_slice(&[9, 9]);
        let tags = TagLayout::for_provider(0, Some(48)).unwrap();
        assert_eq!(parse(&value), Ok(Published { provider: "tcp", cutting, tags, generation: 3, addr: &[9u8, 9][..] }));
        let mut spent = value.clone();
        spent[5 + Cutting::ENCODED_LEN] = 20;
        spent[6 + Cutting::ENCODED_LEN] = 16;
        assert!(parse(&spent).unwrap_err().contains("generation 16"), "a generation past the layout's");
        let mut narrow = value.clone();
        narrow[5 + Cutting::ENCODED_LEN] = 8;
        assert!(parse(&narrow).unwrap_err().contains("8 bits"), "a tag width below the minimum");
        assert!(parse(&value[..20]).is_err(), "a cut rule");
        assert!(parse(&[1, 9, b't']).is_err());
        assert!(parse(&[]).is_err());
        assert!(parse(&[7]).is_err());
        assert!(parse(&vec![1; MAX_PUBLISHED + 1]).is_err());
        assert!(parse(b"\0no provider").unwrap_err().contains("no provider"));
    }
}

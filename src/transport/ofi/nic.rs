//! Which provider, and which of its domains (NICs), a rank opens.
//!
//! The provider is the one `FI_PROVIDER` names (libfabric filters its list by it), else the
//! best one found: a fabric's own (verbs, efa, cxi, psm3, opx, psm2) before TCP's (tcp, net,
//! sockets). Of its domains, each local rank takes its own, as the anchors do (MPICH's
//! `ofi_nic.c`: the closest NIC, then `local_rank % nics`; oneCCL: `local_idx % nics`):
//!
//! 1. `XCCL_RS_OFI_DOMAIN`, a comma-separated list of domain names: local rank `i` takes entry
//!    `i % len`;
//! 2. else, for a provider that opens on an IP address (tcp, net, sockets, udp, verbs through
//!    its IPoIB or RoCE address), the domain that holds `XCCL_RS_SOCKET_HOST`, this rank's own
//!    address, where one does; efa and cxi take no IP address, and are never asked to;
//! 3. else the domains on the rank's NUMA node (from sysfs, where it tells both the NIC's node
//!    and the CPUs the rank may run on), or every domain if none is; local rank `i` takes the
//!    `i % n`-th. Loopback is a domain only where it is the only one.
//!
//! The choice is a pure function of a provider list ([`choose`]), so that lists of providers
//! this machine lacks are tested as the code sees them.

/// Providers in order of preference, by their core name (before `;`). Others (shm: one host
/// only; udp;ofi_rxd) are used only when FI_PROVIDER names them.
pub const PREFERENCE: [&str; 9] = ["verbs", "efa", "cxi", "psm3", "opx", "psm2", "tcp", "net", "sockets"];
/// Providers whose endpoints open on an IP address given as `FI_SOURCE`.
const IP_PROVIDERS: [&str; 5] = ["tcp", "net", "sockets", "udp", "verbs"];
/// Providers that carry data over the hosts' TCP/IP stack, not a fabric of their own.
const TCP_PROVIDERS: [&str; 4] = ["tcp", "net", "sockets", "udp"];

/// One entry of a provider list, as the choice sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Candidate {
    /// "tcp;ofi_rxm", "efa", "cxi", ...
    pub provider: String,
    /// The domain: a NIC ("mlx5_0", "cxi0", "rdmap16s27") or an interface ("eth0").
    pub domain: String,
    /// The NUMA node the domain's device sits on, where sysfs says.
    pub numa: Option<i32>,
    /// Whether this entry came back when libfabric was asked for `XCCL_RS_SOCKET_HOST` as the
    /// endpoint's own address (`FI_SOURCE`).
    pub holds_source: bool,
}

impl Candidate {
    fn core(&self) -> &str {
        self.provider.split(';').next().unwrap_or("")
    }
}

/// What a rank knows of itself and was told, for the choice.
#[derive(Clone, Debug, Default)]
pub struct Wanted<'a> {
    /// `FI_PROVIDER` was set: the list holds only its entries, whatever their names.
    pub provider_named: bool,
    /// `XCCL_RS_OFI_DOMAIN`, split at commas.
    pub domains: &'a [String],
    /// This rank's index among the group's ranks on its host, and how many they are.
    pub local_rank: usize,
    pub local_size: usize,
    /// The NUMA node of the CPUs this rank may run on, if they are all on one.
    pub numa: Option<i32>,
}

/// The entry a rank opens, and why, in words for the log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chosen {
    pub index: usize,
    pub why: String,
}

/// Where a provider ranks (lower is better); `None` for one never chosen unnamed.
fn place(c: &Candidate, provider_named: bool) -> Option<usize> {
    let by_name = PREFERENCE.iter().position(|p| *p == c.core());
    if provider_named { Some(by_name.unwrap_or(PREFERENCE.len())) } else { by_name }
}

/// The providers of `list` in the order they are tried: best first, each once.
pub fn providers_in_order(list: &[Candidate], provider_named: bool) -> Vec<String> {
    let mut named: Vec<(usize, usize, &str)> =
        list.iter().enumerate().filter_map(|(i, c)| place(c, provider_named).map(|p| (p, i, c.provider.as_str()))).collect();
    named.sort();
    let mut out: Vec<String> = Vec::new();
    for (_, _, p) in named {
        if !out.iter().any(|o| o == p) {
            out.push(p.to_string());
        }
    }
    out
}

/// Whether `provider` carries data over TCP/IP rather than a fabric of its own.
pub fn is_tcp(provider: &str) -> bool {
    TCP_PROVIDERS.contains(&provider.split(';').next().unwrap_or(""))
}

/// The entry of `provider` in `list` that this rank opens (the list in libfabric's order).
pub fn choose(list: &[Candidate], provider: &str, wanted: &Wanted<'_>) -> Result<Chosen, String> {
    let entries: Vec<usize> = (0..list.len()).filter(|&i| list[i].provider == provider).collect();
    let mut domains: Vec<&str> = Vec::new();
    for &i in &entries {
        if !domains.contains(&list[i].domain.as_str()) {
            domains.push(&list[i].domain);
        }
    }
    let every_domain = domains.clone();
    if domains.len() > 1 {
        domains.retain(|d| *d != "lo");
    }
    let first_of = |domain: &str| entries.iter().copied().find(|&i| list[i].domain == domain).expect("a domain of these entries");
    let slot = wanted.local_rank;
    if !wanted.domains.is_empty() {
        let name = wanted.domains[slot % wanted.domains.len()].as_str();
        if !entries.iter().any(|&i| list[i].domain == name) {
            return Err(format!("XCCL_RS_OFI_DOMAIN names {name:?} for local rank {slot}, but provider {provider} has the domains {every_domain:?}"));
        }
        return Ok(Chosen { index: first_of(name), why: format!("XCCL_RS_OFI_DOMAIN entry {} for local rank {slot}", slot % wanted.domains.len()) });
    }
    let core = provider.split(';').next().unwrap_or("");
    if let Some(&i) = entries.iter().find(|&&i| IP_PROVIDERS.contains(&core) && list[i].holds_source) {
        return Ok(Chosen { index: i, why: "the domain that holds XCCL_RS_SOCKET_HOST".into() });
    }
    let near: Vec<&str> = match wanted.numa {
        Some(node) => domains.iter().copied().filter(|d| entries.iter().any(|&i| list[i].domain == *d && list[i].numa == Some(node))).collect(),
        None => Vec::new(),
    };
    let (pool, whose) = if near.is_empty() { (&domains, "domains") } else { (&near, "domains on its NUMA node") };
    let domain = pool[slot % pool.len()];
    Ok(Chosen { index: first_of(domain), why: format!("local rank {slot} of {} takes {} of {} {whose}", wanted.local_size, slot % pool.len(), pool.len()) })
}

/// Opens the first provider of `order` (best first) that opens; with `named` (FI_PROVIDER set:
/// the user asked for it), only the first. The opened value, and each provider passed over
/// with why, best first.
pub fn first_that_opens<T>(order: &[String], named: bool, mut open: impl FnMut(&str) -> Result<T, String>) -> Result<(T, Vec<String>), String> {
    let mut passed_over = Vec::new();
    for provider in order {
        match open(provider) {
            Ok(t) => return Ok((t, passed_over)),
            Err(e) if named => return Err(e),
            Err(e) => passed_over.push(format!("{provider}: {e}")),
        }
    }
    Err(format!("no libfabric provider could be opened: {}", passed_over.join("; ")))
}

/// The NUMA node of a libfabric domain's device, from sysfs: an RDMA device (verbs, efa), a
/// Slingshot NIC (cxi) or a network interface (tcp).
pub fn domain_numa(domain: &str) -> Option<i32> {
    ["infiniband", "cxi", "net"].iter().find_map(|class| {
        let text = std::fs::read_to_string(format!("/sys/class/{class}/{domain}/device/numa_node")).ok()?;
        text.trim().parse().ok().filter(|n: &i32| *n >= 0)
    })
}

/// The NUMA node of every CPU this process may run on, if they share one.
pub fn own_numa() -> Option<i32> {
    // SAFETY: an all-zero cpu_set_t is valid; sched_getaffinity writes at most its size.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a writable cpu_set_t of the size passed.
    if unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) } != 0 {
        return None;
    }
    let mut node = None;
    for cpu in 0..libc::CPU_SETSIZE as usize {
        // SAFETY: `cpu` is below CPU_SETSIZE, the set's size.
        if !unsafe { libc::CPU_ISSET(cpu, &set) } {
            continue;
        }
        let of_cpu = std::fs::read_dir(format!("/sys/devices/system/cpu/cpu{cpu}"))
            .ok()?
            .filter_map(|e| e.ok()?.file_name().to_str()?.strip_prefix("node")?.parse::<i32>().ok())
            .next()?;
        match node {
            None => node = Some(of_cpu),
            Some(n) if n != of_cpu => return None,
            Some(_) => {}
        }
    }
    node
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(provider: &str, domain: &str, numa: Option<i32>) -> Candidate {
        Candidate { provider: provider.into(), domain: domain.into(), numa, holds_source: false }
    }

    fn wanted(local_rank: usize, local_size: usize) -> Wanted<'static> {
        Wanted { local_rank, local_size, ..Wanted::default() }
    }

    fn domain_of(list: &[Candidate], provider: &str, w: &Wanted<'_>) -> String {
        list[choose(list, provider, w).unwrap().index].domain.clone()
    }

    /// A p5-like EFA host: 4 EFA devices on two NUMA nodes, and tcp on its interfaces.
    fn efa_host() -> Vec<Candidate> {
        let mut list: Vec<Candidate> = (0..4).map(|i| entry("efa", &format!("rdmap{i}-rdm"), Some(i / 2))).collect();
        list.extend(["ens5", "lo"].map(|d| entry("tcp;ofi_rxm", d, None)));
        list
    }

    #[test]
    fn the_best_provider_present_comes_first() {
        assert_eq!(providers_in_order(&efa_host(), false), vec!["efa", "tcp;ofi_rxm"]);
        let cxi = vec![entry("tcp;ofi_rxm", "hsn0", None), entry("cxi", "cxi0", None), entry("shm", "shm", None)];
        assert_eq!(providers_in_order(&cxi, false), vec!["cxi", "tcp;ofi_rxm"], "shm only when named");
        assert_eq!(providers_in_order(&cxi[2..], true), vec!["shm"]);
        let verbs = vec![entry("verbs;ofi_rxm", "mlx5_0", None), entry("verbs;ofi_rxd", "mlx5_0", None), entry("tcp;ofi_rxm", "ib0", None)];
        assert_eq!(providers_in_order(&verbs, false)[0], "verbs;ofi_rxm", "libfabric's order among one core name");
        assert!(is_tcp("tcp;ofi_rxm") && is_tcp("sockets") && !is_tcp("verbs;ofi_rxm") && !is_tcp("cxi"));
    }

    #[test]
    fn each_local_rank_takes_its_own_nic() {
        let list = efa_host();
        let got: Vec<String> = (0..8).map(|r| domain_of(&list, "efa", &wanted(r, 8))).collect();
        assert_eq!(got, ["rdmap0-rdm", "rdmap1-rdm", "rdmap2-rdm", "rdmap3-rdm", "rdmap0-rdm", "rdmap1-rdm", "rdmap2-rdm", "rdmap3-rdm"]);
        // Slingshot: 4 NICs, 4 ranks.
        let cxi: Vec<Candidate> = (0..4).map(|i| entry("cxi", &format!("cxi{i}"), None)).collect();
        assert_eq!((0..4).map(|r| domain_of(&cxi, "cxi", &wanted(r, 4))).collect::<Vec<_>>(), ["cxi0", "cxi1", "cxi2", "cxi3"]);
    }

    #[test]
    fn a_rank_pinned_to_a_numa_node_takes_a_nic_on_it() {
        let list = efa_host();
        let on = |r, node| Wanted { numa: Some(node), ..wanted(r, 8) };
        assert_eq!(domain_of(&list, "efa", &on(0, 1)), "rdmap2-rdm");
        assert_eq!(domain_of(&list, "efa", &on(1, 1)), "rdmap3-rdm");
        assert_eq!(domain_of(&list, "efa", &on(2, 0)), "rdmap0-rdm");
        let c = choose(&list, "efa", &on(3, 0)).unwrap();
        assert_eq!(list[c.index].domain, "rdmap1-rdm");
        assert!(c.why.contains("NUMA"), "{}", c.why);
        // A node without NICs: every NIC is a candidate.
        assert_eq!(domain_of(&list, "efa", &on(1, 5)), "rdmap1-rdm");
    }

    #[test]
    fn an_ip_address_picks_a_domain_only_for_providers_that_take_one() {
        let mut list = efa_host();
        for c in list.iter_mut().filter(|c| c.domain == "ens5") {
            c.holds_source = true;
        }
        // efa never matches an IP address: the rank still gets its own EFA device.
        assert_eq!(domain_of(&list, "efa", &wanted(1, 2)), "rdmap1-rdm");
        assert_eq!(domain_of(&list, "tcp;ofi_rxm", &wanted(1, 2)), "ens5");
        // Two rails: the rank's own address decides, not its local rank.
        let mut rails = vec![entry("tcp;ofi_rxm", "rail0", None), entry("tcp;ofi_rxm", "rail1", None), entry("tcp;ofi_rxm", "lo", None)];
        rails[0].holds_source = true;
        assert_eq!(domain_of(&rails, "tcp;ofi_rxm", &wanted(1, 2)), "rail0");
        rails[0].holds_source = false;
        assert_eq!(domain_of(&rails, "tcp;ofi_rxm", &wanted(1, 2)), "rail1", "loopback is no rail");
        assert_eq!(domain_of(&rails[2..], "tcp;ofi_rxm", &wanted(1, 2)), "lo", "unless it is the only domain");
    }

    #[test]
    fn a_provider_that_fails_to_open_passes_to_the_next_unless_it_was_named() {
        let order = providers_in_order(&efa_host(), false);
        let efa_broken = |p: &str| if p == "efa" { Err("fi_domain failed: no device".to_string()) } else { Ok(p.to_string()) };
        let (opened, passed_over) = first_that_opens(&order, false, efa_broken).unwrap();
        assert_eq!(opened, "tcp;ofi_rxm");
        assert_eq!(passed_over, ["efa: fi_domain failed: no device"]);
        let e = first_that_opens(&order, true, efa_broken).unwrap_err();
        assert_eq!(e, "fi_domain failed: no device", "FI_PROVIDER named it: no fall-back");
        let e = first_that_opens::<()>(&order, false, |p| Err(format!("{p} broken"))).unwrap_err();
        assert!(e.contains("efa: efa broken") && e.contains("tcp;ofi_rxm: tcp;ofi_rxm broken"), "{e}");
    }

    #[test]
    fn xccl_rs_ofi_domain_overrides_and_a_wrong_name_is_an_error() {
        let list = efa_host();
        let names = ["rdmap3-rdm".to_string(), "rdmap2-rdm".to_string()];
        let w = |r| Wanted { domains: &names, ..wanted(r, 4) };
        assert_eq!((0..4).map(|r| domain_of(&list, "efa", &w(r))).collect::<Vec<_>>(), ["rdmap3-rdm", "rdmap2-rdm", "rdmap3-rdm", "rdmap2-rdm"]);
        let bad = ["mlx5_9".to_string()];
        let e = choose(&list, "efa", &Wanted { domains: &bad, ..wanted(0, 1) }).unwrap_err();
        assert!(e.contains("XCCL_RS_OFI_DOMAIN") && e.contains("mlx5_9") && e.contains("rdmap0-rdm"), "{e}");
        let e = choose(&list, "tcp;ofi_rxm", &Wanted { domains: &bad, ..wanted(0, 1) }).unwrap_err();
        assert!(e.contains("\"ens5\", \"lo\""), "loopback is listed too: {e}");
    }
}

//! TLS on the TCP links (`Config::tls`, `XCCL_RS_TLS=1`): groups of 2 to 4 ranks give exact
//! results through the tunnels; ranks configured differently fail set-up on every rank with a
//! message that names the setting; and a proxy placed on rank 1's link to rank 0 sees no
//! tensor byte in clear, and a byte it alters makes the op fail instead of changing a result.
//! Each proxy test first runs without TLS, to show that the proxy sees (and alters) what TLS
//! then hides (and guards).

mod common;
use common::*;

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use xccl_rs::config::TransportChoice;
use xccl_rs::keys::Key;
use xccl_rs::rendezvous::{Store, parse_address};
use xccl_rs::{Communicator, Config, DType, MemoryStore, OpKind, ReduceOp};

fn tcp_config(tls: bool) -> Config {
    Config { transport: TransportChoice::Tcp, tls, ..config(Duration::from_secs(30), 64 << 10) }
}

fn all_reduce(comm: &Communicator, data: &mut [u8]) -> Result<(), String> {
    let mut o = reduce_op(OpKind::AllReduce, ReduceOp::Sum);
    o.outputs = vec![buf(data)];
    run(comm, vec![o]).map(|_| ()).map_err(|e| e.to_string())
}

fn broadcast(comm: &Communicator, root: usize, data: &mut [u8]) -> Result<(), String> {
    let mut o = op(OpKind::Broadcast, DType::UInt8);
    o.root = root as i64;
    o.outputs = vec![buf(data)];
    run(comm, vec![o]).map(|_| ()).map_err(|e| e.to_string())
}

/// All-reduces of 1 element to 8 MiB (many TLS records, and back-pressure through the
/// tunnels), then 200 small ones back to back, each compared with the sum computed here.
#[test]
fn tls_groups_give_exact_results() {
    for size in [2, 3, 4] {
        let store = MemoryStore::new();
        let results = spawn_ranks_with(store, vec![tcp_config(true); size], Duration::from_secs(120), move |rank, comm, _| {
            let mut counts = vec![1, 3001, 2 << 20];
            counts.extend(std::iter::repeat_n(17, 200));
            for (k, &n) in counts.iter().enumerate() {
                let mut data = f32_bytes(&(0..n).map(|i| value(rank, i + k)).collect::<Vec<_>>());
                all_reduce(&comm, &mut data)?;
                for (i, v) in bytes_f32(&data).into_iter().enumerate() {
                    let want: f32 = (0..size).map(|r| value(r, i + k)).sum();
                    if v != want {
                        return Err(format!("size {size} rank {rank} op {k} (n {n}) element {i}: {v} != {want}"));
                    }
                }
            }
            Ok(())
        });
        for r in results {
            r.unwrap();
        }
    }
}

/// One rank with TLS and one without: both fail within the timeout, and both say which
/// setting differs, whichever side (acceptor or connector) has TLS.
#[test]
fn ranks_that_disagree_on_tls_fail_on_every_rank() {
    for tls_rank in [0, 1] {
        let store = MemoryStore::new();
        let cfgs: Vec<Config> = (0..2).map(|r| Config { timeout: Duration::from_secs(10), ..tcp_config(r == tls_rank) }).collect();
        let start = Instant::now();
        let ranks: Vec<_> = cfgs
            .into_iter()
            .enumerate()
            .map(|(rank, cfg)| {
                let store = store.clone();
                thread::spawn(move || Communicator::new(&*store, rank, 2, cfg).err().map(|e| e.to_string()))
            })
            .collect();
        for (rank, r) in ranks.into_iter().enumerate() {
            let err = r.join().unwrap().unwrap_or_else(|| panic!("TLS on rank {tls_rank} only: rank {rank} connected"));
            assert!(err.contains("XCCL_RS_TLS"), "TLS on rank {tls_rank} only: rank {rank} says: {err}");
        }
        assert!(start.elapsed() < Duration::from_secs(8), "the mismatch took {:?} to report", start.elapsed());
    }
}

/// Forwards one connection to the address `to` yields once the client has come (rank 0
/// publishes it only after every rank has joined), both ways. What the client sends is
/// recorded; the byte at `flip_at` of it (if any) is inverted on the way.
fn proxy(listener: TcpListener, to: impl FnOnce() -> SocketAddr + Send + 'static, flip_at: Option<usize>) -> thread::JoinHandle<Vec<u8>> {
    thread::spawn(move || {
        let (mut client, _) = listener.accept().unwrap();
        let mut server = TcpStream::connect(to()).unwrap();
        let (mut client_back, mut server_back) = (client.try_clone().unwrap(), server.try_clone().unwrap());
        let back = thread::spawn(move || {
            let _ = std::io::copy(&mut server_back, &mut client_back);
            let _ = client_back.shutdown(Shutdown::Write);
        });
        let mut recorded = Vec::new();
        let mut chunk = vec![0u8; 64 << 10];
        loop {
            let n = match client.read(&mut chunk) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let start = recorded.len();
            recorded.extend_from_slice(&chunk[..n]);
            if let Some(at) = flip_at.filter(|&at| (start..start + n).contains(&at)) {
                chunk[at - start] ^= 0xFF;
            }
            if server.write_all(&chunk[..n]).is_err() {
                break;
            }
        }
        let _ = server.shutdown(Shutdown::Write);
        let _ = back.join();
        recorded
    })
}

/// 1 MiB of a marker the proxy can look for.
fn marked(len: usize) -> Vec<u8> {
    b"xccl_rs-marker!!".iter().copied().cycle().take(len).collect()
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// Rank 1 broadcasts 1 MiB of the marker to rank 0 through the proxy, then both all-reduce
/// once. Returns each rank's outcome (the broadcast data rank 0 got, or the first error) and
/// what the proxy recorded.
fn through_proxy(tls: bool, flip_at: Option<usize>) -> (Vec<Result<Vec<u8>, String>>, Vec<u8>) {
    let store = MemoryStore::new();
    let timeout = Duration::from_secs(10);
    let rank0 = {
        let (store, cfg) = (store.clone(), Config { timeout, ..tcp_config(tls) });
        thread::spawn(move || {
            let comm = Communicator::new(&*store, 0, 2, cfg).map_err(|e| e.to_string())?;
            let mut data = vec![0u8; 1 << 20];
            broadcast(&comm, 1, &mut data)?;
            all_reduce(&comm, &mut f32_bytes(&[1.0; 4]))?;
            Ok(data)
        })
    };
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let via = listener.local_addr().unwrap().to_string();
    let rank0_addr = {
        let store = store.clone();
        move || parse_address(&store.get(&Key::Address(0).text(), timeout).unwrap()).unwrap()
    };
    let recorder = proxy(listener, rank0_addr, flip_at);
    let rank1 = {
        let store = Redirect { inner: store, rank0_via: via };
        let cfg = Config { timeout, ..tcp_config(tls) };
        thread::spawn(move || {
            let comm = Communicator::new(&store, 1, 2, cfg).map_err(|e| e.to_string())?;
            let mut data = marked(1 << 20);
            broadcast(&comm, 1, &mut data)?;
            all_reduce(&comm, &mut f32_bytes(&[1.0; 4]))?;
            Ok(data)
        })
    };
    let outcomes = vec![rank0.join().unwrap(), rank1.join().unwrap()];
    (outcomes, recorder.join().unwrap())
}

#[test]
fn tls_hides_the_tensors_from_the_path() {
    let needle = &marked(64)[..];
    let (plain, seen) = through_proxy(false, None);
    assert_eq!(plain[0].as_deref().unwrap(), marked(1 << 20), "rank 0's data without TLS");
    assert!(contains(&seen, needle), "without TLS the proxy should see the tensor (the test cannot see it otherwise)");

    let (secured, seen) = through_proxy(true, None);
    assert_eq!(secured[0].as_deref().unwrap(), marked(1 << 20), "rank 0's data with TLS");
    assert!(seen.len() > 1 << 20, "the proxy saw only {} bytes", seen.len());
    assert!(!contains(&seen, needle), "with TLS the tensor crossed the proxy in clear");
}

#[test]
fn a_byte_altered_on_the_path_fails_the_op_under_tls() {
    // 512 KiB into rank 1's stream: past both handshakes, inside the broadcast's payload.
    let flip_at = Some(512 << 10);
    let (plain, _) = through_proxy(false, flip_at);
    let got = plain[0].as_deref().expect("without TLS a payload byte is not checked: the op succeeds");
    assert_ne!(got, marked(1 << 20), "the proxy's change should reach rank 0 without TLS");

    let start = Instant::now();
    let (secured, _) = through_proxy(true, flip_at);
    for (rank, r) in secured.iter().enumerate() {
        let err = r.as_ref().err().unwrap_or_else(|| panic!("rank {rank} finished despite an altered record"));
        let why = if rank == 0 { "the TLS link to rank 1 failed" } else { "rank 0" };
        assert!(err.contains(why), "rank {rank}: {err}");
    }
    assert!(start.elapsed() < Duration::from_secs(9), "the failure took {:?}", start.elapsed());
}

//! The TCP mesh against strangers: connections that say nothing, say garbage, or replay a real
//! handshake recorded on the wire must never join a group, never delay it, and never change a
//! result; a peer with another secret fails set-up with a message that says so.

mod common;
use common::*;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use xccl_rs::config::TransportChoice;
use xccl_rs::keys::Key;
use xccl_rs::rendezvous::{Store, parse_address};
use xccl_rs::transport::tcp::connect::{MeshSpec, connect_mesh};
use xccl_rs::transport::tcp::handshake::Link;
use xccl_rs::transport::tcp::handshake::{CHALLENGE_LEN, HELLO_LEN, Hello, PROOF_LEN, Secret};
use xccl_rs::{Communicator, Config, MemoryStore, OpKind, ReduceOp};

fn mesh(store: &dyn Store, rank: usize, size: usize, secret: &Secret, timeout: Duration) -> xccl_rs::error::Result<Vec<Option<Link>>> {
    connect_mesh(&MeshSpec { store, rank, size, secret, socket_host: Some("127.0.0.1"), timeout, tls: false })
}

/// Every way of being a stranger, against one listening address; returns the silent
/// connections, to be held open by the caller.
fn harass(addr: SocketAddr, to: u32) -> Vec<TcpStream> {
    let mut silent = Vec::new();
    for i in 0..40 {
        let Ok(mut s) = TcpStream::connect(addr) else { continue };
        match i % 5 {
            0 => silent.push(s),
            1 => {
                let _ = s.write_all(&[0xAB; 200]); // garbage
            }
            2 => {
                let hello = Hello { from: to + 1, to, flags: 0, nonce: [i as u8; 32] }.encode();
                let _ = s.write_all(&hello[..HELLO_LEN / 2]); // a truncated hello, then nothing
                silent.push(s);
            }
            3 => {
                // A well-formed hello and a proof that cannot be right (no secret).
                let _ = s.write_all(&Hello { from: to + 1, to, flags: 0, nonce: [7; 32] }.encode());
                let mut challenge = [0u8; CHALLENGE_LEN];
                if s.read_exact(&mut challenge).is_ok() {
                    let mut proof = [0u8; PROOF_LEN];
                    proof[..4].copy_from_slice(b"XCPR");
                    let _ = s.write_all(&proof);
                    // The rank closes it: nothing more is read or written.
                    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
                    let mut rest = [0u8; 1];
                    assert!(matches!(s.read(&mut rest), Ok(0) | Err(_)), "a connection with a wrong proof stayed open");
                }
            }
            _ => drop(s), // connect and close
        }
    }
    silent
}

/// 4 ranks over TCP, rank 3 late by 1.5 s so the listeners stay open, while a stranger opens
/// 40 connections of every kind to each listener as soon as it is published (and holds the
/// silent ones until the group is up). The group must connect as soon as the late rank is
/// there, and an all-reduce must be exact.
#[test]
fn strangers_neither_join_nor_delay_the_mesh() {
    let size = 4;
    let store = MemoryStore::new();
    let cfg = Config { transport: TransportChoice::Tcp, ..config(Duration::from_secs(30), 4096) };
    let attacker = {
        let store = store.clone();
        thread::spawn(move || {
            let mut held = Vec::new();
            for rank in 0..size - 1 {
                let raw = store.get(&Key::Address(rank).text(), Duration::from_secs(30)).expect("rank published its address");
                held.extend(harass(parse_address(&raw).unwrap(), rank as u32));
            }
            held
        })
    };
    let start = Instant::now();
    let ranks: Vec<_> = (0..size)
        .map(|rank| {
            let (store, cfg) = (store.clone(), cfg.clone());
            thread::spawn(move || {
                if rank == size - 1 {
                    thread::sleep(Duration::from_millis(1500));
                }
                let comm = Communicator::new(&*store, rank, size, cfg).map_err(|e| e.to_string())?;
                let connected = start.elapsed();
                let n = 3001;
                let mut data = f32_bytes(&(0..n).map(|i| value(rank, i)).collect::<Vec<_>>());
                let mut o = reduce_op(OpKind::AllReduce, ReduceOp::Sum);
                o.outputs = vec![buf(&mut data)];
                run(&comm, vec![o]).map_err(|e| e.to_string())?;
                Ok::<_, String>((connected, bytes_f32(&data)))
            })
        })
        .collect();
    let held = attacker.join().expect("attacker");
    for (rank, r) in ranks.into_iter().enumerate() {
        let (connected, got) = r.join().expect("rank thread").unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        // The late rank comes at 1.5 s; a stranger holding set-up would take the handshake
        // timeout (10 s) or the group's (30 s).
        assert!(connected < Duration::from_secs(6), "rank {rank} connected after {connected:?}");
        for (i, &v) in got.iter().enumerate() {
            let want: f32 = (0..size).map(|r| value(r, i)).sum();
            assert_eq!(v, want, "rank {rank} element {i}");
        }
    }
    drop(held);
}

/// Forwards one connection from `listener` to `to`, recording the client's bytes.
fn recording_proxy(listener: TcpListener, to: SocketAddr) -> thread::JoinHandle<Vec<u8>> {
    thread::spawn(move || {
        let (mut client, _) = listener.accept().unwrap();
        let mut server = TcpStream::connect(to).unwrap();
        let mut recorded = Vec::new();
        let mut hello = [0u8; HELLO_LEN];
        client.read_exact(&mut hello).unwrap();
        server.write_all(&hello).unwrap();
        let mut challenge = [0u8; CHALLENGE_LEN];
        server.read_exact(&mut challenge).unwrap();
        client.write_all(&challenge).unwrap();
        let mut proof = [0u8; PROOF_LEN];
        client.read_exact(&mut proof).unwrap();
        server.write_all(&proof).unwrap();
        let mut verdict = [0u8; 1];
        server.read_exact(&mut verdict).unwrap();
        client.write_all(&verdict).unwrap();
        recorded.extend_from_slice(&hello);
        recorded.extend_from_slice(&proof);
        recorded
    })
}

/// A handshake recorded on the wire of one mesh, replayed to a new mesh of the same group (the
/// same secret), is refused: the new acceptor's nonce differs. The real rank 1 still gets in.
#[test]
fn a_replayed_handshake_is_refused() {
    let secret = Secret([42; 32]);
    let timeout = Duration::from_secs(20);

    // The first mesh, with a recording proxy between rank 1 and rank 0.
    let store = MemoryStore::new();
    let s0 = store.clone();
    let sec = secret.clone();
    let rank0 = thread::spawn(move || mesh(&*s0, 0, 2, &sec, timeout).map(|_| ()));
    let rank0_addr = parse_address(&store.get(&Key::Address(0).text(), timeout).unwrap()).unwrap();
    let proxy = TcpListener::bind("127.0.0.1:0").unwrap();
    let via = proxy.local_addr().unwrap().to_string();
    let recorder = recording_proxy(proxy, rank0_addr);
    let redirect = Redirect { inner: store.clone(), rank0_via: via };
    mesh(&redirect, 1, 2, &secret, timeout).expect("rank 1 through the proxy");
    rank0.join().unwrap().expect("rank 0");
    let recorded = recorder.join().unwrap();

    // The same group meets again; the replay reaches its rank 0 first.
    let store = MemoryStore::new();
    let s0 = store.clone();
    let sec = secret.clone();
    let rank0 = thread::spawn(move || mesh(&*s0, 0, 2, &sec, timeout).map(|links| links[1].is_some()));
    let addr = parse_address(&store.get(&Key::Address(0).text(), timeout).unwrap()).unwrap();
    let mut replay = TcpStream::connect(addr).unwrap();
    replay.write_all(&recorded[..HELLO_LEN]).unwrap();
    let mut challenge = [0u8; CHALLENGE_LEN];
    replay.read_exact(&mut challenge).expect("a challenge for the replayed hello");
    replay.write_all(&recorded[HELLO_LEN..]).unwrap();
    replay.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut rest = [0u8; 1];
    assert!(matches!(replay.read(&mut rest), Ok(0) | Err(_)), "the replayed handshake was not refused");
    assert!(!rank0.is_finished(), "rank 0 took the replay for rank 1");

    mesh(&*store, 1, 2, &secret, timeout).expect("the real rank 1");
    assert!(rank0.join().unwrap().expect("rank 0"), "rank 0 has its link to rank 1");
}

/// Two ranks that were given different secrets (a store that lies, or two groups sharing
/// keys) do not connect; the connecting rank says why, the accepting one times out.
#[test]
fn a_peer_with_another_secret_is_an_error_on_both_sides() {
    let store = MemoryStore::new();
    let timeout = Duration::from_secs(3);
    let s0 = store.clone();
    let rank0 = thread::spawn(move || mesh(&*s0, 0, 2, &Secret([1; 32]), timeout).map(|_| ()));
    let err = mesh(&*store, 1, 2, &Secret([2; 32]), timeout).err().expect("rank 1 must fail").to_string();
    assert!(err.contains("could not authenticate rank 0") && err.contains("secret"), "{err}");
    let err = rank0.join().unwrap().err().expect("rank 0 must fail").to_string();
    assert!(err.contains("timed out") && err.contains("[1]"), "{err}");
}

/// A rank in the middle (it both connects and accepts) reports why its connecting side failed,
/// not that its accepting side was cancelled.
#[test]
fn a_middle_rank_with_another_secret_says_why() {
    let store = MemoryStore::new();
    let timeout = Duration::from_secs(3);
    let others: Vec<_> = [0usize, 2]
        .into_iter()
        .map(|rank| {
            let s = store.clone();
            thread::spawn(move || mesh(&*s, rank, 3, &Secret([1; 32]), timeout).map(|_| ()))
        })
        .collect();
    let err = mesh(&*store, 1, 3, &Secret([2; 32]), timeout).err().expect("rank 1 must fail").to_string();
    assert!(err.contains("could not authenticate rank 0") && err.contains("secret"), "{err}");
    for h in others {
        assert!(h.join().unwrap().is_err(), "a rank connected to a peer with another secret");
    }
}

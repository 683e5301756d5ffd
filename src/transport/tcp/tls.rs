//! Optional TLS 1.3 on every link of the mesh (`XCCL_RS_TLS=1`, off by default), for links
//! between hosts that cross networks the group does not trust with its tensors.
//!
//! Trust comes from the Store, as for the handshake (handshake.rs): each rank draws an
//! ephemeral key pair and a self-signed certificate for this group only and publishes the
//! certificate under [`Key::TlsCert`]. Each side of a link then accepts exactly the certificate its
//! peer published, and nothing else (mutual TLS, pinned certificates: no certificate
//! authority, no names, no expiry to manage). The authenticated handshake runs first, on the
//! plain connection, and both sides' flags are part of its MACs, so TLS cannot be stripped
//! from a link without the handshake failing.
//!
//! The lower rank of a pair (the acceptor) is the TLS server. The records flow through a
//! tunnel (tunnel.rs), so the rest of the transport is the same with TLS or without.

use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, WebPkiSupportedAlgorithms, verify_tls12_signature, verify_tls13_signature};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{ClientConfig, ClientConnection, Connection, DigitallySignedStruct, DistinguishedName, ServerConfig, ServerConnection};

use crate::error::{CommError, Result};
use crate::keys::Key;
use crate::rendezvous::{Store, rendezvous_error};

/// The name in every certificate. Names are not checked (certificates are pinned), but TLS
/// needs one for the client's hello.
const NAME: &str = "xccl-rs";

/// The longest certificate a rank may publish; ours are about 400 bytes.
pub const MAX_CERT_LEN: usize = 16 << 10;

/// This rank's key pair and certificate for one group.
pub struct Identity {
    cert: CertificateDer<'static>,
    key: PrivatePkcs8KeyDer<'static>,
}

impl Identity {
    /// A fresh ECDSA P-256 key pair and a self-signed certificate for it.
    pub fn generate() -> Result<Identity> {
        let certified = rcgen::generate_simple_self_signed(vec![NAME.to_string()])
            .map_err(|e| CommError::io(format!("cannot make a TLS certificate: {e}")))?;
        Ok(Identity { cert: certified.cert.der().clone(), key: PrivatePkcs8KeyDer::from(certified.signing_key.serialize_der()) })
    }

    #[cfg(test)]
    pub fn cert_for_tests(&self) -> CertificateDer<'static> {
        self.cert.clone()
    }

    /// Publishes the certificate for the group's other ranks.
    pub fn publish(&self, store: &dyn Store, rank: usize) -> Result<()> {
        store.set(&Key::TlsCert(rank).text(), self.cert.as_ref())
    }
}

/// A peer's published certificate as read from the store: bounded and not empty. (rustls
/// parses it only when it is compared with what the peer presents.)
pub fn parse_cert(value: &[u8]) -> std::result::Result<CertificateDer<'static>, String> {
    if value.is_empty() || value.len() > MAX_CERT_LEN {
        return Err(format!("a TLS certificate of {} bytes (expected 1 to {MAX_CERT_LEN})", value.len()));
    }
    Ok(CertificateDer::from(value.to_vec()))
}

/// Reads `peer`'s certificate from the store.
pub fn peer_cert(store: &dyn Store, rank: usize, peer: usize, timeout: std::time::Duration) -> Result<CertificateDer<'static>> {
    let raw = store.get(&Key::TlsCert(peer).text(), timeout).map_err(|e| rendezvous_error(rank, peer, e))?;
    parse_cert(&raw).map_err(|m| CommError::io(format!("rank {peer} published an unusable certificate: {m}")))
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Accepts one certificate only: the one the peer published. Signatures are checked with the
/// provider's algorithms against that certificate's key.
#[derive(Debug)]
struct Pinned {
    cert: CertificateDer<'static>,
    algorithms: WebPkiSupportedAlgorithms,
}

impl Pinned {
    fn new(cert: CertificateDer<'static>) -> Pinned {
        Pinned { cert, algorithms: provider().signature_verification_algorithms }
    }

    fn check(&self, end_entity: &CertificateDer<'_>, intermediates: &[CertificateDer<'_>]) -> std::result::Result<(), rustls::Error> {
        if end_entity.as_ref() == self.cert.as_ref() && intermediates.is_empty() {
            Ok(())
        } else {
            Err(rustls::Error::General("not the certificate this peer published in the store".into()))
        }
    }
}

/// The signature checks both verifier traits declare alike: against the pinned certificate's
/// key, whatever certificate the message names.
macro_rules! pinned_signatures {
    () => {
        pinned_signatures!(@verify verify_tls12_signature, verify_tls13_signature);

        fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
            self.algorithms.supported_schemes()
        }
    };
    // Each TLS version's method calls rustls' function of the same name.
    (@verify $($version:ident),*) => {$(
        fn $version(
            &self,
            message: &[u8],
            _cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
            $version(message, &self.cert, dss, &self.algorithms)
        }
    )*};
}

impl ServerCertVerifier for Pinned {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        self.check(end_entity, intermediates).map(|_| ServerCertVerified::assertion())
    }

    pinned_signatures!();
}

impl ClientCertVerifier for Pinned {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _now: UnixTime,
    ) -> std::result::Result<ClientCertVerified, rustls::Error> {
        self.check(end_entity, intermediates).map(|_| ClientCertVerified::assertion())
    }

    pinned_signatures!();
}

fn tls_error(e: rustls::Error) -> CommError {
    CommError::io(format!("TLS set-up failed: {e}"))
}

/// The TLS side this rank takes on its link to `peer`: server towards higher ranks (it
/// accepted their connections), client towards lower ones.
pub fn connection(identity: &Identity, rank: usize, peer: usize, peer_cert: CertificateDer<'static>) -> Result<Connection> {
    let key = PrivateKeyDer::Pkcs8(identity.key.clone_key());
    let chain = vec![identity.cert.clone()];
    let pinned = Arc::new(Pinned::new(peer_cert));
    if peer > rank {
        let config = ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(tls_error)?
            .with_client_cert_verifier(pinned)
            .with_single_cert(chain, key)
            .map_err(tls_error)?;
        Ok(Connection::Server(ServerConnection::new(Arc::new(config)).map_err(tls_error)?))
    } else {
        let config = ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(tls_error)?
            .dangerous()
            .with_custom_certificate_verifier(pinned)
            .with_client_auth_cert(chain, key)
            .map_err(tls_error)?;
        let name = ServerName::try_from(NAME).expect("a valid DNS name");
        Ok(Connection::Client(ClientConnection::new(Arc::new(config), name).map_err(tls_error)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    /// Runs a TLS handshake between two connections in memory; the first error either side
    /// raises, or Ok once both are done.
    fn handshake(server: &mut Connection, client: &mut Connection) -> std::result::Result<(), rustls::Error> {
        fn deliver(from: &mut Connection, to: &mut Connection) -> std::result::Result<(), rustls::Error> {
            let mut wire = Vec::new();
            while from.wants_write() {
                from.write_tls(&mut wire).unwrap();
            }
            let mut rest = &wire[..];
            while !rest.is_empty() {
                to.read_tls(&mut rest).unwrap();
                to.process_new_packets()?;
            }
            Ok(())
        }
        for _ in 0..20 {
            deliver(client, server)?;
            deliver(server, client)?;
            if !server.is_handshaking() && !client.is_handshaking() {
                return Ok(());
            }
        }
        panic!("the handshake did not finish");
    }

    /// Rank 0 (server) and rank 1 (client), each pinning the certificate given for the other.
    fn pair(ids: &[Identity; 2], pinned_by_0: &Identity, pinned_by_1: &Identity) -> (Connection, Connection) {
        (connection(&ids[0], 0, 1, pinned_by_0.cert.clone()).unwrap(), connection(&ids[1], 1, 0, pinned_by_1.cert.clone()).unwrap())
    }

    #[test]
    fn peers_with_the_published_certificates_connect_and_talk() {
        let ids = [Identity::generate().unwrap(), Identity::generate().unwrap()];
        let (mut server, mut client) = pair(&ids, &ids[1], &ids[0]);
        handshake(&mut server, &mut client).unwrap();
        assert_eq!(client.protocol_version(), Some(rustls::ProtocolVersion::TLSv1_3));
        client.writer().write_all(b"tensor bytes").unwrap();
        let mut wire = Vec::new();
        client.write_tls(&mut wire).unwrap();
        server.read_tls(&mut &wire[..]).unwrap();
        server.process_new_packets().unwrap();
        let mut got = [0u8; 12];
        server.reader().read_exact(&mut got).unwrap();
        assert_eq!(&got, b"tensor bytes");
    }

    #[test]
    fn a_certificate_other_than_the_published_one_is_refused_by_either_side() {
        let ids = [Identity::generate().unwrap(), Identity::generate().unwrap()];
        let stranger = Identity::generate().unwrap();
        // The server expects the client's published certificate; a stranger presents its own.
        let (mut server, mut client) =
            pair(&[Identity { cert: ids[0].cert.clone(), key: ids[0].key.clone_key() }, stranger], &ids[1], &ids[0]);
        let err = handshake(&mut server, &mut client).expect_err("the server took a stranger's certificate");
        assert!(err.to_string().contains("not the certificate") || err.to_string().contains("alert"), "{err}");
        // The client expects the server's published certificate; a stranger serves another.
        let stranger = Identity::generate().unwrap();
        let (mut server, mut client) =
            pair(&[stranger, Identity { cert: ids[1].cert.clone(), key: ids[1].key.clone_key() }], &ids[1], &ids[0]);
        let err = handshake(&mut server, &mut client).expect_err("the client took a stranger's certificate");
        assert!(err.to_string().contains("not the certificate") || err.to_string().contains("alert"), "{err}");
    }

    #[test]
    fn a_published_certificate_that_is_empty_or_too_long_is_refused() {
        assert!(parse_cert(&[]).is_err());
        assert!(parse_cert(&vec![0x30; MAX_CERT_LEN + 1]).is_err());
        assert!(parse_cert(&[0x30; 400]).is_ok());
    }

    /// A client that presents the server's pinned certificate but signs with another key.
    /// (rustls refuses to configure such a pair, so this resolver hands it over directly.)
    #[derive(Debug)]
    struct Thief(Arc<rustls::sign::CertifiedKey>);

    impl rustls::client::ResolvesClientCert for Thief {
        fn resolve(&self, _hints: &[&[u8]], _schemes: &[rustls::SignatureScheme]) -> Option<Arc<rustls::sign::CertifiedKey>> {
            Some(self.0.clone())
        }
        fn has_certs(&self) -> bool {
            true
        }
    }

    impl rustls::server::ResolvesServerCert for Thief {
        fn resolve(&self, _hello: rustls::server::ClientHello<'_>) -> Option<Arc<rustls::sign::CertifiedKey>> {
            Some(self.0.clone())
        }
    }

    /// `cert` with a signing key that is not its own.
    fn stolen(cert: &CertificateDer<'static>) -> Arc<Thief> {
        let other_key = PrivateKeyDer::Pkcs8(Identity::generate().unwrap().key);
        let signer = provider().key_provider.load_private_key(other_key).unwrap();
        Arc::new(Thief(Arc::new(rustls::sign::CertifiedKey::new(vec![cert.clone()], signer))))
    }

    /// Pinning compares the whole certificate, and the signature is checked against the
    /// pinned certificate's key, so a stranger that copied the published certificate from
    /// the store but lacks its private key cannot complete the handshake.
    #[test]
    fn the_published_certificate_without_its_key_is_refused() {
        let ids = [Identity::generate().unwrap(), Identity::generate().unwrap()];
        // A client posing as rank 1.
        let mut server = connection(&ids[0], 0, 1, ids[1].cert.clone()).unwrap();
        let config = ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .unwrap()
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(Pinned::new(ids[0].cert.clone())))
            .with_client_cert_resolver(stolen(&ids[1].cert));
        let name = ServerName::try_from(NAME).unwrap();
        let mut client = Connection::Client(ClientConnection::new(Arc::new(config), name).unwrap());
        let err = handshake(&mut server, &mut client).expect_err("a client without the certificate's key got in");
        assert!(err.to_string().to_lowercase().contains("signature") || err.to_string().contains("alert"), "{err}");

        // A server posing as rank 0.
        let config = ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .unwrap()
            .with_client_cert_verifier(Arc::new(Pinned::new(ids[1].cert.clone())))
            .with_cert_resolver(stolen(&ids[0].cert));
        let mut server = Connection::Server(ServerConnection::new(Arc::new(config)).unwrap());
        let mut client = connection(&ids[1], 1, 0, ids[0].cert.clone()).unwrap();
        let err = handshake(&mut server, &mut client).expect_err("a server without the certificate's key got in");
        assert!(err.to_string().to_lowercase().contains("signature") || err.to_string().contains("alert"), "{err}");
    }

    /// `cargo test --release --lib tls_record_speed -- --ignored --nocapture`: rustls alone,
    /// in memory, one direction.
    #[test]
    #[ignore]
    fn tls_record_speed() {
        let ids = [Identity::generate().unwrap(), Identity::generate().unwrap()];
        let (mut server, mut client) = pair(&ids, &ids[1], &ids[0]);
        handshake(&mut server, &mut client).unwrap();
        println!("suite {:?}", client.negotiated_cipher_suite());
        client.set_buffer_limit(None);
        server.set_buffer_limit(None);
        let data = vec![7u8; 256 << 10];
        let mut out = vec![0u8; 256 << 10];
        let t = std::time::Instant::now();
        let total = 1usize << 30;
        let mut moved = 0;
        let mut wire = Vec::with_capacity(300 << 10);
        while moved < total {
            client.writer().write_all(&data).unwrap();
            wire.clear();
            while client.wants_write() {
                client.write_tls(&mut wire).unwrap();
            }
            let mut r = &wire[..];
            while !r.is_empty() {
                server.read_tls(&mut r).unwrap();
                server.process_new_packets().unwrap();
                loop {
                    match server.reader().read(&mut out) {
                        Ok(0) => break,
                        Ok(n) => moved += n,
                        Err(_) => break,
                    }
                }
            }
        }
        let s = t.elapsed().as_secs_f64();
        println!("{:.2} GB/s (encrypt + decrypt, one thread)", total as f64 / s / 1e9);
    }
}

//! TLS and mutual TLS for the gRPC port, with certificates reloaded when their files change.
//!
//! Certificate managers (cert-manager, Vault agents, Kubernetes Secret volumes) rotate files in
//! place; a restart to pick them up would drop connections. So the rustls server configuration
//! sits behind an `ArcSwap`: the files' directories are watched ([`crate::reload::Watch`]), a set
//! whose bytes changed is loaded and checked, and only a complete, valid configuration replaces
//! the old one. Each new connection
//! handshakes with the configuration current at its accept; established connections keep theirs.
//! With a client CA, every client must present a certificate it signed (mTLS), and with a client
//! name too, a certificate valid for that name (a DNS or IP subject alternative name), as
//! envoyproxy/ratelimit's `GRPC_CLIENT_TLS_SAN` pins it.
//!
//! Handshakes run on their own tasks within the opening deadline and budget of the port's gate
//! (`src/connections/gate.rs`), so a slow or silent client can stall neither the accept loop nor
//! other clients' connections.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;
use rustls::client::danger::HandshakeSignatureValid;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::WebPkiClientVerifier;
use rustls::{DigitallySignedStruct, DistinguishedName, RootCertStore, ServerConfig, SignatureScheme};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;
use tokio_stream::wrappers::ReceiverStream;

use crate::connections::{self, Admitted, Conn};
use crate::reload::{parent, Trigger, Watch};
use crate::telemetry::logs::{self, ErrorChain};

/// The PEM files of the server's identity and, for mTLS, of the CA its clients must use.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    /// Certificate chain, leaf first.
    pub cert: PathBuf,
    /// Private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// Client CA bundle; when set, clients must present a certificate it signed.
    pub client_ca: Option<PathBuf>,
    /// With a client CA: the name (DNS or IP) the client's certificate must be valid for.
    pub client_san: Option<String>,
}

/// Why the TLS configuration could not be built.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read or holds no usable PEM item.
    #[error("{}: {message}", path.display())]
    File {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// rustls refused the combination (e.g. a key that does not match the certificate).
    #[error("TLS configuration: {0}")]
    Config(String),
}

/// The current server configuration, reloadable.
pub struct ReloadingTls {
    files: TlsFiles,
    config: ArcSwap<ServerConfig>,
    // A digest of the bytes the configuration in force was built from.
    digest: Mutex<u64>,
}

// The bytes of the files, read once, and their digest.
struct Contents {
    cert: Vec<u8>,
    key: Vec<u8>,
    client_ca: Option<Vec<u8>>,
}

impl Contents {
    fn read(files: &TlsFiles) -> Result<Contents, TlsError> {
        let read = |path: &PathBuf| {
            std::fs::read(path).map_err(|e| TlsError::File { path: path.clone(), message: e.to_string() })
        };
        Ok(Contents {
            cert: read(&files.cert)?,
            key: read(&files.key)?,
            client_ca: files.client_ca.as_ref().map(read).transpose()?,
        })
    }

    fn digest(&self) -> u64 {
        let mut hasher = DefaultHasher::new();
        (&self.cert, &self.key, &self.client_ca).hash(&mut hasher);
        hasher.finish()
    }
}

impl ReloadingTls {
    /// Whether clients must present a certificate (mutual TLS).
    pub fn mutual(&self) -> bool {
        self.files.client_ca.is_some()
    }

    /// Loads `files`; fails if they do not make a valid configuration.
    pub fn load(files: TlsFiles) -> Result<Arc<ReloadingTls>, TlsError> {
        let contents = Contents::read(&files)?;
        let config = build(&files, &contents)?;
        Ok(Arc::new(ReloadingTls {
            files,
            config: ArcSwap::from_pointee(config),
            digest: Mutex::new(contents.digest()),
        }))
    }

    /// Rebuilds the configuration if the files' bytes changed; returns whether it did. On error
    /// the current one stays.
    pub fn reload(&self) -> Result<bool, TlsError> {
        let contents = Contents::read(&self.files)?;
        let digest = contents.digest();
        let mut current = self.digest.lock().unwrap_or_else(|p| p.into_inner());
        if *current == digest {
            return Ok(false);
        }
        self.config.store(Arc::new(build(&self.files, &contents)?));
        *current = digest;
        Ok(true)
    }

    /// Reloads whenever a file's directory changes, for as long as the returned watch lives.
    pub fn watch(self: &Arc<Self>) -> Result<Watch, notify::Error> {
        let mut dirs: Vec<PathBuf> =
            [Some(&self.files.cert), Some(&self.files.key), self.files.client_ca.as_ref()]
                .into_iter()
                .flatten()
                .map(|p| parent(p))
                .collect();
        dirs.sort();
        dirs.dedup();
        let this = self.clone();
        Watch::start("tls", &dirs, false, move |_: Trigger| match this.reload() {
            Ok(false) => {}
            Ok(true) => {
                metrics::counter!("tollgate_tls_reloads_total", "result" => "success").increment(1);
                tracing::info!(cert = %this.files.cert.display(), "TLS certificates reloaded");
            }
            Err(error) => {
                metrics::counter!("tollgate_tls_reloads_total", "result" => "failure").increment(1);
                tracing::error!(error = %ErrorChain(&error), "TLS files rejected; the previous certificates stay in use");
            }
        })
    }

    /// TLS connections accepted on `listener`, for the gRPC server; ends when the server stops
    /// taking them. A client that speaks plaintext here, or fails its handshake, is named in the
    /// log (at most once a second).
    pub fn incoming(
        self: &Arc<Self>,
        listener: TcpListener,
        admitted: Admitted,
    ) -> ReceiverStream<Result<Conn<TlsStream<TcpStream>>, std::io::Error>> {
        let this = self.clone();
        accept_each(listener, admitted, move |tcp, peer| {
            let acceptor = TlsAcceptor::from(this.config.load_full());
            async move {
                if opens_with(&tcp).await == Opening::Plaintext {
                    metrics::counter!("tollgate_tls_handshake_failures_total").increment(1);
                    if let Some(held_back) = logs::throttled("plaintext_on_tls_port") {
                        tracing::warn!(%peer, held_back, "a client spoke plaintext to the TLS gRPC port; it must use TLS (Envoy: a transport_socket on the tollgate cluster)");
                    }
                    return None;
                }
                // Within the opening deadline of accept_each (a timeout there is counted as a
                // slow opening and as a failed handshake).
                match acceptor.accept(tcp).await {
                    Ok(stream) => Some(stream),
                    Err(error) => {
                        metrics::counter!("tollgate_tls_handshake_failures_total").increment(1);
                        if let Some(held_back) = logs::throttled("tls_handshake_failed") {
                            tracing::warn!(%peer, %error, held_back, "TLS handshake failed");
                        }
                        None
                    }
                }
            }
        })
    }
}

/// Connections accepted on a plaintext `listener`, for the gRPC server; ends when the server stops
/// taking them. A client that opens with a TLS handshake is told nothing it could read, so
/// tollgate says it in its log (at most once a second) and closes the connection.
pub fn plaintext_incoming(
    listener: TcpListener,
    admitted: Admitted,
) -> ReceiverStream<Result<Conn<TcpStream>, std::io::Error>> {
    accept_each(listener, admitted, |tcp, peer| async move {
        if opens_with(&tcp).await == Opening::Tls {
            if let Some(held_back) = logs::throttled("tls_on_plaintext_port") {
                tracing::warn!(%peer, held_back, "a client opened TLS on the plaintext gRPC port; serve TLS with --tls-cert/--tls-key, or connect without TLS");
            }
            return None;
        }
        Some(tcp)
    })
}

// Accepts connections on `listener` until the server stops taking them, each within `admitted`'s
// cap (one past it is closed at once), and hands each, in a task of its own, to `admit`, which
// says what of it the server gets.
fn accept_each<T, F, Fut>(
    listener: TcpListener,
    admitted: Admitted,
    admit: F,
) -> ReceiverStream<Result<Conn<T>, std::io::Error>>
where
    T: Send + 'static,
    F: Fn(TcpStream, std::net::SocketAddr) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Option<T>> + Send + 'static,
{
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                accepted = listener.accept() => accepted,
                () = tx.closed() => return,
            };
            let (tcp, peer) = match accepted {
                Ok(conn) => conn,
                Err(error) => {
                    connections::accept_failed(&error).await;
                    continue;
                }
            };
            // Opening (the handshake, or the first byte in plaintext) holds only the opening
            // budget, for at most the opening deadline; then the connection takes its place.
            let Some(opening) = admitted.gate.open(peer.ip()) else { continue };
            let _ = tcp.set_nodelay(true);
            let (tx, idle, handshake) = (tx.clone(), admitted.idle, admit(tcp, peer));
            tokio::spawn(async move {
                if let Some((conn, admission)) = opening.complete(handshake).await {
                    let _ = tx.send(Ok(Conn::new(conn, admission, idle))).await;
                }
            });
        }
    });
    ReceiverStream::new(rx)
}

// How a connection opens: a TLS handshake record starts with 0x16; an HTTP/2 client starts with
// its preface ("PRI ..."). Decided from the first byte (accept_each bounds the wait); a peer that
// closes first is Unknown.
#[derive(Debug, PartialEq, Eq)]
enum Opening {
    Tls,
    Plaintext,
    Unknown,
}

async fn opens_with(tcp: &TcpStream) -> Opening {
    let mut first = [0u8; 1];
    match tcp.peek(&mut first).await {
        Ok(1) if first[0] == 0x16 => Opening::Tls,
        Ok(1) => Opening::Plaintext,
        _ => Opening::Unknown,
    }
}

// The CA's verdict, then the name: webpki's own check of a certificate against a subject name,
// as Go's `x509.VerifyOptions{DNSName}` does for envoyproxy/ratelimit.
#[derive(Debug)]
struct NamedClient {
    inner: Arc<dyn ClientCertVerifier>,
    name: ServerName<'static>,
}

impl NamedClient {
    fn new(inner: Arc<dyn ClientCertVerifier>, name: &str) -> Result<Self, TlsError> {
        let name = ServerName::try_from(name.to_owned())
            .map_err(|e| TlsError::Config(format!("client name '{name}': {e}")))?;
        Ok(NamedClient { inner, name })
    }
}

impl ClientCertVerifier for NamedClient {
    fn offer_client_auth(&self) -> bool {
        self.inner.offer_client_auth()
    }

    fn client_auth_mandatory(&self) -> bool {
        self.inner.client_auth_mandatory()
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.inner.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        let verified = self.inner.verify_client_cert(end_entity, intermediates, now)?;
        let cert = webpki::EndEntityCert::try_from(end_entity).map_err(|e| {
            rustls::Error::InvalidCertificate(rustls::CertificateError::Other(rustls::OtherError(Arc::new(
                e,
            ))))
        })?;
        cert.verify_is_valid_for_subject_name(&self.name)
            .map_err(|_| rustls::Error::InvalidCertificate(rustls::CertificateError::NotValidForName))?;
        Ok(verified)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

fn build(files: &TlsFiles, contents: &Contents) -> Result<ServerConfig, TlsError> {
    let file_error = |path: &PathBuf, message: String| TlsError::File { path: path.clone(), message };
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&contents.cert)
        .collect::<Result<_, _>>()
        .map_err(|e| file_error(&files.cert, e.to_string()))?;
    if certs.is_empty() {
        return Err(file_error(&files.cert, "no PEM certificate".into()));
    }
    let key =
        PrivateKeyDer::from_pem_slice(&contents.key).map_err(|e| file_error(&files.key, e.to_string()))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?;
    let builder = match (&files.client_ca, &contents.client_ca) {
        (Some(ca), Some(pem)) => {
            let mut roots = RootCertStore::empty();
            for cert in CertificateDer::pem_slice_iter(pem) {
                roots
                    .add(cert.map_err(|e| file_error(ca, e.to_string()))?)
                    .map_err(|e| file_error(ca, e.to_string()))?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| file_error(ca, e.to_string()))?;
            match &files.client_san {
                Some(name) => builder.with_client_cert_verifier(Arc::new(NamedClient::new(verifier, name)?)),
                None => builder.with_client_cert_verifier(verifier),
            }
        }
        _ => builder.with_no_client_auth(),
    };
    let mut config = builder.with_single_cert(certs, key).map_err(|e| TlsError::Config(e.to_string()))?;
    // gRPC is HTTP/2 only.
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(config)
}

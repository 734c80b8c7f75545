//! TLS and mutual TLS for the gRPC port, with certificates reloaded when their files change.
//!
//! Certificate managers (cert-manager, Vault agents, Kubernetes Secret volumes) rotate files in
//! place; a restart to pick them up would drop connections. So the rustls server configuration
//! sits behind an `ArcSwap`: the files' directories are watched, a changed set is loaded and
//! checked, and only a complete, valid configuration replaces the old one. Each new connection
//! handshakes with the configuration current at its accept; established connections keep theirs.
//! With a client CA, every client must present a certificate it signed (mTLS).
//!
//! Handshakes run on their own tasks with a deadline, so a slow or silent client cannot stall
//! the accept loop.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;
use tokio_stream::wrappers::ReceiverStream;

use crate::reload::{on_change, parent};

/// Longest a client may take to complete its handshake.
const HANDSHAKE_DEADLINE: Duration = Duration::from_secs(10);

/// The PEM files of the server's identity and, for mTLS, of the CA its clients must use.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    /// Certificate chain, leaf first.
    pub cert: PathBuf,
    /// Private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// Client CA bundle; when set, clients must present a certificate it signed.
    pub client_ca: Option<PathBuf>,
}

/// Why the TLS configuration could not be built.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read or holds no usable PEM item.
    #[error("{}: {message}", path.display())]
    File { path: PathBuf, message: String },
    /// rustls refused the combination (e.g. a key that does not match the certificate).
    #[error("TLS configuration: {0}")]
    Config(String),
}

/// The current server configuration, reloadable.
pub struct ReloadingTls {
    files: TlsFiles,
    config: ArcSwap<ServerConfig>,
}

impl ReloadingTls {
    /// Loads `files`; fails if they do not make a valid configuration.
    pub fn load(files: TlsFiles) -> Result<Arc<ReloadingTls>, TlsError> {
        let config = build(&files)?;
        Ok(Arc::new(ReloadingTls { files, config: ArcSwap::from_pointee(config) }))
    }

    /// Rebuilds the configuration from the files; on error the current one stays.
    pub fn reload(&self) -> Result<(), TlsError> {
        self.config.store(Arc::new(build(&self.files)?));
        Ok(())
    }

    /// Reloads whenever a file's directory changes, for as long as the task runs.
    pub fn watch(self: &Arc<Self>) -> Result<tokio::task::JoinHandle<()>, notify::Error> {
        let mut dirs: Vec<PathBuf> =
            [Some(&self.files.cert), Some(&self.files.key), self.files.client_ca.as_ref()]
                .into_iter()
                .flatten()
                .map(|p| parent(p))
                .collect();
        dirs.sort();
        dirs.dedup();
        let this = self.clone();
        on_change(dirs, move || match this.reload() {
            Ok(()) => {
                metrics::counter!("tollgate_tls_reloads_total", "result" => "success").increment(1);
                tracing::info!(cert = %this.files.cert.display(), "TLS certificates reloaded");
            }
            Err(error) => {
                metrics::counter!("tollgate_tls_reloads_total", "result" => "failure").increment(1);
                tracing::error!(%error, "TLS files rejected; the previous certificates stay in use");
            }
        })
    }

    /// TLS connections accepted on `listener`, for the gRPC server; ends when the server stops
    /// taking them.
    pub fn incoming(
        self: &Arc<Self>,
        listener: TcpListener,
    ) -> ReceiverStream<Result<TlsStream<TcpStream>, std::io::Error>> {
        let (tx, rx) = mpsc::channel(64);
        let this = self.clone();
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    accepted = listener.accept() => accepted,
                    () = tx.closed() => return,
                };
                let (tcp, peer) = match accepted {
                    Ok(conn) => conn,
                    Err(error) => {
                        // Out of file descriptors and the like: back off instead of spinning.
                        tracing::warn!(%error, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let _ = tcp.set_nodelay(true);
                let acceptor = TlsAcceptor::from(this.config.load_full());
                let tx = tx.clone();
                tokio::spawn(async move {
                    match tokio::time::timeout(HANDSHAKE_DEADLINE, acceptor.accept(tcp)).await {
                        Ok(Ok(stream)) => {
                            let _ = tx.send(Ok(stream)).await;
                        }
                        failed => {
                            metrics::counter!("tollgate_tls_handshake_failures_total").increment(1);
                            let error = match failed {
                                Ok(Err(e)) => e.to_string(),
                                _ => "handshake timed out".into(),
                            };
                            tracing::debug!(%peer, %error, "TLS handshake failed");
                        }
                    }
                });
            }
        });
        ReceiverStream::new(rx)
    }
}

fn build(files: &TlsFiles) -> Result<ServerConfig, TlsError> {
    let file_error = |path: &PathBuf, message: String| TlsError::File { path: path.clone(), message };
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&files.cert)
        .map_err(|e| file_error(&files.cert, e.to_string()))?
        .collect::<Result<_, _>>()
        .map_err(|e| file_error(&files.cert, e.to_string()))?;
    if certs.is_empty() {
        return Err(file_error(&files.cert, "no PEM certificate".into()));
    }
    let key = PrivateKeyDer::from_pem_file(&files.key).map_err(|e| file_error(&files.key, e.to_string()))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?;
    let builder = match &files.client_ca {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let mut roots = RootCertStore::empty();
            for cert in CertificateDer::pem_file_iter(ca).map_err(|e| file_error(ca, e.to_string()))? {
                roots
                    .add(cert.map_err(|e| file_error(ca, e.to_string()))?)
                    .map_err(|e| file_error(ca, e.to_string()))?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| file_error(ca, e.to_string()))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder.with_single_cert(certs, key).map_err(|e| TlsError::Config(e.to_string()))?;
    // gRPC is HTTP/2 only.
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(config)
}

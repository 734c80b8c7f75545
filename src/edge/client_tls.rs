//! TLS for tollgate's own gRPC clients: the xDS stream (`--xds-tls*`) and a region's link to the
//! global tier (`--global-tls*`). The files are read when the client is set up; the server is
//! verified with the CA given, else with the web's roots, under the name given, else its host's;
//! a client certificate, when given, is presented for a server that requires mutual TLS (the
//! global tier behind `--tls-client-ca`, a control plane that authenticates its clients).

use std::path::PathBuf;

use tonic::transport::{Certificate, ClientTlsConfig, Identity};

/// Where a client's TLS material is.
#[derive(Debug, Clone, Default)]
pub struct ClientTlsFiles {
    /// CA certificates (PEM) that signed the server's certificate; the web's roots when `None`.
    pub ca: Option<PathBuf>,
    /// This client's certificate chain and key (PEM), for a server that requires mutual TLS.
    pub client: Option<(PathBuf, PathBuf)>,
    /// The name the server's certificate must carry, when not the host of its address.
    pub server_name: Option<String>,
}

impl ClientTlsFiles {
    /// The TLS config these files make; the error names the file that could not be read.
    pub fn config(&self) -> Result<ClientTlsConfig, String> {
        let read =
            |path: &PathBuf| std::fs::read(path).map_err(|e| format!("reading {}: {e}", path.display()));
        let mut config = ClientTlsConfig::new();
        config = match &self.ca {
            Some(ca) => config.ca_certificate(Certificate::from_pem(read(ca)?)),
            None => config.with_webpki_roots(),
        };
        if let Some((cert, key)) = &self.client {
            config = config.identity(Identity::from_pem(read(cert)?, read(key)?));
        }
        if let Some(name) = &self.server_name {
            config = config.domain_name(name.clone());
        }
        Ok(config)
    }
}

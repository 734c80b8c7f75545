//! Certificates: a throwaway CA with server and client certificates.

use std::path::PathBuf;

use super::*;

/// A throwaway PKI for TLS tests: a CA, a server certificate for 127.0.0.1 and localhost, and a
/// client certificate, as PEM files in a temporary directory.
pub struct TestPki {
    pub dir: tempfile::TempDir,
}

impl TestPki {
    pub fn new() -> TestPki {
        use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};
        let dir = scratch_dir("tollgate-pki");
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params.distinguished_name.push(DnType::CommonName, "tollgate test CA");
        let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
        std::fs::write(dir.path().join("ca.pem"), ca.pem()).unwrap();
        for (name, sans) in
            [("server", vec!["127.0.0.1".to_string(), "localhost".into()]), ("client", vec!["client".into()])]
        {
            let key = KeyPair::generate().unwrap();
            let mut params = CertificateParams::new(sans).unwrap();
            params.distinguished_name.push(DnType::CommonName, name);
            let cert = params.signed_by(&key, &ca).unwrap();
            std::fs::write(dir.path().join(format!("{name}.pem")), cert.pem()).unwrap();
            std::fs::write(dir.path().join(format!("{name}.key")), key.serialize_pem()).unwrap();
        }
        TestPki { dir }
    }

    pub fn path(&self, file: &str) -> PathBuf {
        self.dir.path().join(file)
    }

    pub fn path_str(&self, file: &str) -> String {
        self.path(file).to_str().unwrap().to_owned()
    }

    /// tollgate's flags for gRPC over mutual TLS with this PKI's server certificate and CA.
    pub fn mtls_args(&self) -> Vec<String> {
        ["--tls-cert", "server.pem", "--tls-key", "server.key", "--tls-client-ca", "ca.pem"]
            .iter()
            .enumerate()
            .map(|(i, a)| if i % 2 == 0 { (*a).to_owned() } else { self.path_str(a) })
            .collect()
    }

    /// The built-in client's TLS for this PKI's server: its CA, and with `identity` the client
    /// certificate.
    pub fn client_tls(&self, identity: bool) -> tollgate::client::ClientTls {
        let read = |f: &str| std::fs::read(self.path(f)).unwrap();
        tollgate::client::ClientTls {
            ca_pem: read("ca.pem"),
            identity_pem: identity.then(|| (read("client.pem"), read("client.key"))),
            domain: Some("localhost".into()),
        }
    }
}

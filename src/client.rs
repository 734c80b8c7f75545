//! A small RateLimitService client: `tollgate ask`, and a way to try a server without grpcurl.

use std::fmt::Write as _;

use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

use crate::edge::rls::headers::{FAILURE_MODE_HEADER, GLOBAL_FALLBACK_HEADER};

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};

/// Why asking failed.
#[derive(Debug, thiserror::Error)]
pub enum AskError {
    /// No connection to the server.
    #[error("cannot connect to {addr}: {source}")]
    Connect {
        /// The address dialled.
        addr: String,
        /// Why it failed.
        #[source]
        source: tonic::transport::Error,
    },
    /// The connection closed before any answer: a TLS port spoken to in plaintext, or a TLS
    /// handshake the server refused (it found no client certificate it trusts).
    #[error("{addr} closed the connection without answering: {}", if *tls {
        "the TLS handshake failed (a server that requires mutual TLS needs --tls-cert and --tls-key)"
    } else {
        "the port may serve TLS (give --tls-ca, and --tls-cert/--tls-key for mutual TLS) or not be a gRPC port"
    })]
    Closed {
        /// The address dialled.
        addr: String,
        /// Whether the client spoke TLS.
        tls: bool,
    },
    /// The server answered with a gRPC error.
    #[error("the server answered {}: {}", .0.code(), .0.message())]
    Status(#[from] tonic::Status),
}

/// Parses `k=v,k=v` into descriptor entries; a value may contain `=` but not `,`.
pub fn parse_descriptor(text: &str) -> Result<Vec<(String, String)>, String> {
    text.split(',')
        .map(|pair| match pair.split_once('=') {
            Some((k, v)) if !k.is_empty() => Ok((k.to_owned(), v.to_owned())),
            _ => Err(format!("'{pair}' is not key=value")),
        })
        .collect()
}

/// A request for `domain` with one descriptor per entry list.
pub fn request(domain: &str, descriptors: &[Vec<(String, String)>], hits_addend: u32) -> RateLimitRequest {
    RateLimitRequest {
        domain: domain.to_owned(),
        descriptors: descriptors
            .iter()
            .map(|entries| RateLimitDescriptor {
                entries: entries
                    .iter()
                    .map(|(key, value)| Entry { key: key.clone(), value: value.clone() })
                    .collect(),
                ..Default::default()
            })
            .collect(),
        hits_addend,
    }
}

/// TLS settings for asking a server that serves gRPC over TLS.
#[derive(Debug, Clone, Default)]
pub struct ClientTls {
    /// CA certificates (PEM) that signed the server's certificate.
    pub ca_pem: Vec<u8>,
    /// Client certificate and key (PEM), for servers that require mTLS.
    pub identity_pem: Option<(Vec<u8>, Vec<u8>)>,
    /// The name to verify the server's certificate against (default: the address's host).
    pub domain: Option<String>,
}

/// Sends `request` to the server at `addr` (`host:port` or a URL), in plaintext.
pub async fn ask(addr: &str, request: RateLimitRequest) -> Result<RateLimitResponse, AskError> {
    ask_with(addr, request, None).await
}

/// Sends `request` to the server at `addr`, over TLS when `tls` is given.
pub async fn ask_with(
    addr: &str,
    request: RateLimitRequest,
    tls: Option<&ClientTls>,
) -> Result<RateLimitResponse, AskError> {
    let connect = |source| AskError::Connect { addr: addr.to_owned(), source };
    let scheme = if tls.is_some() { "https" } else { "http" };
    let url = if addr.contains("://") { addr.to_owned() } else { format!("{scheme}://{addr}") };
    let mut endpoint = Endpoint::from_shared(url).map_err(connect)?;
    if let Some(tls) = tls {
        let mut config = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(&tls.ca_pem));
        if let Some((cert, key)) = &tls.identity_pem {
            config = config.identity(Identity::from_pem(cert, key));
        }
        if let Some(domain) = &tls.domain {
            config = config.domain_name(domain.clone());
        }
        endpoint = endpoint.tls_config(config).map_err(connect)?;
    }
    let channel = endpoint.connect().await.map_err(connect)?;
    match RateLimitServiceClient::new(channel).should_rate_limit(request).await {
        Ok(response) => Ok(response.into_inner()),
        // A status the server sent has no source; one with a source is the client's own account
        // of a connection that ended under it.
        Err(status) if std::error::Error::source(&status).is_some() => {
            Err(AskError::Closed { addr: addr.to_owned(), tls: tls.is_some() })
        }
        Err(status) => Err(AskError::Status(status)),
    }
}

/// Whether `response` denies the request.
pub fn over_limit(response: &RateLimitResponse) -> bool {
    response.overall_code == Code::OverLimit as i32
}

/// A human-readable rendering of `response`.
pub fn render(request: &RateLimitRequest, response: &RateLimitResponse) -> String {
    let code = |c: i32| Code::try_from(c).map(|c| c.as_str_name()).unwrap_or("UNKNOWN");
    let mut out = format!("overall: {}\n", code(response.overall_code));
    let failure_mode =
        response.response_headers_to_add.iter().find(|h| h.key.eq_ignore_ascii_case(FAILURE_MODE_HEADER));
    if let Some(mode) = failure_mode {
        let _ =
            writeln!(out, "answered by the failure mode ({}): the server's store did not answer", mode.value);
    }
    let fallback =
        response.response_headers_to_add.iter().find(|h| h.key.eq_ignore_ascii_case(GLOBAL_FALLBACK_HEADER));
    if let Some(how) = fallback {
        let _ = writeln!(
            out,
            "decided by the global fallback ({}): this region holds no live share of a global bucket",
            how.value
        );
    }
    let unlimited = response.response_headers_to_add.is_empty()
        && response.statuses.iter().all(|s| s.current_limit.is_none());
    for (i, status) in response.statuses.iter().enumerate() {
        let entries = request
            .descriptors
            .get(i)
            .map(|d| d.entries.iter().map(|e| format!("{}={}", e.key, e.value)).collect::<Vec<_>>().join(","))
            .unwrap_or_default();
        let _ = write!(out, "descriptor {i} [{entries}]: {}", code(status.code));
        // An answer that names no limit at all and carries no header: nothing limited the request,
        // which a person debugging a config wants said rather than a bare OK.
        if status.code == Code::Ok as i32 && unlimited {
            out.push_str(
                "  (no limit applied: no rule matched, the rule is unlimited, or the domain is not loaded)",
            );
        }
        if let Some(limit) = &status.current_limit {
            let unit = Unit::try_from(limit.unit).map(|u| u.as_str_name()).unwrap_or("UNKNOWN");
            let _ = write!(out, "  limit={}/{unit}", limit.requests_per_unit);
            if !limit.name.is_empty() {
                let _ = write!(out, " name={}", limit.name);
            }
            let _ = write!(out, " remaining={}", status.limit_remaining);
            if let Some(reset) = &status.duration_until_reset {
                let _ = write!(out, " full_in={}.{:03}s", reset.seconds, reset.nanos / 1_000_000);
            }
        }
        out.push('\n');
    }
    if !response.response_headers_to_add.is_empty() {
        out.push_str("headers:\n");
        for h in &response.response_headers_to_add {
            let _ = writeln!(out, "  {}: {}", h.key, h.value);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptor_syntax() {
        assert_eq!(
            parse_descriptor("tenant=t42,class=a=b").unwrap(),
            vec![("tenant".into(), "t42".into()), ("class".into(), "a=b".into())]
        );
        assert!(parse_descriptor("tenant").is_err());
        assert!(parse_descriptor("=x").is_err());
    }
}

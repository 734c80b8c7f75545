//! Who may renew leases at the global tier: the regions, each by its own certificate.
//!
//! A renewal sets leases that take capacity and money from every other client of a global bucket
//! or budget, so the global tier serves `RegionLeases` only over mutual TLS (`--tls-client-ca`),
//! and only to a caller whose certificate is valid for the name its region is bound to
//! (`--global-region-san eu=eu.regions.example`): one region's certificate, or an Envoy's signed
//! by the same CA, cannot renew as another. The name is checked as `--tls-client-san` checks it
//! (a DNS or IP subject alternative name, by webpki). `--global-tier-insecure` serves any caller,
//! for a trial on one machine; it is logged loudly at start.

use tonic::{Request, Status};

/// The regions allowed, and how.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RegionAuth {
    /// Serve any caller, with or without a certificate.
    pub insecure: bool,
    /// Each region's name and the name its certificate must be valid for.
    pub regions: Vec<(String, String)>,
}

impl RegionAuth {
    /// Whether the caller of `request` may renew as `region` (`<region>/<replica>`, the region
    /// named before the first `/`): `PERMISSION_DENIED` with the reason otherwise.
    pub fn check<T>(&self, request: &Request<T>, region: &str) -> Result<(), Status> {
        if self.insecure {
            return Ok(());
        }
        // A region's replicas renew as `<region>/<replica>`.
        let region = region.split('/').next().unwrap_or(region);
        let Some((_, name)) = self.regions.iter().find(|(r, _)| r == region) else {
            return Err(refused(format!("region {region:?} is not one of --global-region-san")));
        };
        let certs = request
            .peer_certs()
            .ok_or_else(|| refused("the global tier serves regions over mutual TLS only".into()))?;
        let leaf = certs.first().ok_or_else(|| refused("no client certificate".into()))?;
        let valid = webpki::EndEntityCert::try_from(leaf).ok().is_some_and(|cert| {
            rustls::pki_types::ServerName::try_from(name.as_str())
                .is_ok_and(|name| cert.verify_is_valid_for_subject_name(&name).is_ok())
        });
        if !valid {
            return Err(refused(format!(
                "the client certificate is not valid for {name:?}, region {region:?}'s name"
            )));
        }
        Ok(())
    }
}

// Counted and logged (at most once a second): a refused caller may be an attack.
fn refused(why: String) -> Status {
    metrics::counter!("tollgate_global_renewals_refused_total").increment(1);
    if let Some(held_back) = crate::telemetry::logs::throttled("region_refused") {
        tracing::warn!(reason = %why, held_back, "a RegionLeases call refused");
    }
    Status::permission_denied(why)
}

//! Tenant records in PostgreSQL, the primary database where sales exceptions live.
//!
//! Two tables (`migrations/0001_tollgate_quotas.sql`): `tollgate_tenants` (tenant → tier) and
//! `tollgate_overrides` ((tenant, class) → bucket, optionally expiring). [`PostgresQuotas::fetch`]
//! reads one tenant in one round trip; the serving path never writes. The same type carries the
//! operator commands (`tollgate quota ...`), so the SQL lives in one place.
//!
//! Rows are validated on read like config buckets ([`BucketSpec::new`]); an invalid row (negative,
//! infinite or NaN capacity or rate) is skipped, logged with its tenant and class, and counted.

use std::str::FromStr;
use std::time::{Duration, SystemTime};

use std::path::Path;
use std::sync::Arc;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
use tokio_postgres_rustls::MakeRustlsConnect;

use super::TenantRecord;
use crate::bucket::BucketSpec;

/// The schema, applied in order by `tollgate quota migrate`: tenant quotas, then budget overrides
/// ([`super::budgets`]).
pub const MIGRATIONS: [&str; 2] = [
    include_str!("../../migrations/0001_tollgate_quotas.sql"),
    include_str!("../../migrations/0002_tollgate_budget_overrides.sql"),
];

/// Why the quota database could not be used.
#[derive(Debug, Clone, thiserror::Error)]
pub enum QuotaError {
    /// The `--quota-store` URL does not parse.
    #[error("invalid quota store URL: {0}")]
    Url(String),
    /// The database or the connection failed.
    #[error("quota database: {0}")]
    Db(String),
    /// A value given to an operator command is not acceptable.
    #[error("{0}")]
    Invalid(String),
}

/// One tenant as the database knows it.
#[derive(Debug, Clone, PartialEq)]
pub struct Fetched {
    /// `None` when the database has no row for the tenant.
    pub record: Option<TenantRecord>,
    /// When the first of the returned overrides expires; a cache must not outlive it.
    pub expires_at: Option<SystemTime>,
}

/// A tenant's rows, for listing.
#[derive(Debug, Clone, PartialEq)]
pub struct Listing {
    /// The tenant id.
    pub tenant: String,
    /// Its tier, if it has a row in `tollgate_tenants`.
    pub tier: Option<String>,
    /// Its per-class overrides.
    pub overrides: Vec<OverrideRow>,
}

/// One `tollgate_overrides` row.
#[derive(Debug, Clone, PartialEq)]
pub struct OverrideRow {
    /// The quota class it sizes.
    pub class: String,
    /// Bucket capacity (largest burst).
    pub capacity: f64,
    /// Sustained rate.
    pub refill_per_second: f64,
    /// When it lapses, if ever.
    pub expires_at: Option<SystemTime>,
}

/// A pool of connections to the quota database.
pub struct PostgresQuotas {
    pool: Pool,
    description: String,
}

const FETCH: &str = "\
    SELECT t.tier, o.class, o.capacity, o.refill_per_second, o.expires_at \
    FROM (SELECT $1::text AS id) q \
    LEFT JOIN tollgate_tenants t ON t.tenant_id = q.id \
    LEFT JOIN tollgate_overrides o ON o.tenant_id = q.id AND (o.expires_at IS NULL OR o.expires_at > now())";

impl PostgresQuotas {
    /// A pool for `url` (`postgres://user:password@host:port/db`); connects lazily, at most
    /// `max_connections` at a time. TLS follows the URL's `sslmode` (`prefer` by default,
    /// `require` to insist), verifying the server against the public web roots and, if given,
    /// the PEM certificates in `ca_file`.
    pub fn connect(
        url: &str,
        max_connections: usize,
        ca_file: Option<&Path>,
    ) -> Result<PostgresQuotas, QuotaError> {
        let config = tokio_postgres::Config::from_str(url).map_err(|e| QuotaError::Url(e.to_string()))?;
        let tls = tls_connector(ca_file)?;
        let hosts: Vec<String> = config
            .get_hosts()
            .iter()
            .zip(config.get_ports().iter().chain(std::iter::repeat(&5432)))
            .map(|(host, port)| match host {
                tokio_postgres::config::Host::Tcp(h) => format!("{h}:{port}"),
                tokio_postgres::config::Host::Unix(p) => p.display().to_string(),
            })
            .collect();
        let description =
            format!("postgres at {}/{}", hosts.join(","), config.get_dbname().unwrap_or_default());
        let manager =
            Manager::from_config(config, tls, ManagerConfig { recycling_method: RecyclingMethod::Fast });
        let pool = Pool::builder(manager)
            .max_size(max_connections)
            .runtime(Runtime::Tokio1)
            .create_timeout(Some(Duration::from_secs(5)))
            .wait_timeout(Some(Duration::from_secs(5)))
            .recycle_timeout(Some(Duration::from_secs(5)))
            .build()
            .map_err(|e| QuotaError::Db(e.to_string()))?;
        Ok(PostgresQuotas { pool, description })
    }

    /// Where the database is, without credentials.
    pub fn describe(&self) -> &str {
        &self.description
    }

    pub(super) async fn client(&self) -> Result<deadpool_postgres::Object, QuotaError> {
        self.pool.get().await.map_err(|e| match e {
            deadpool_postgres::PoolError::Backend(e) => db(e),
            other => QuotaError::Db(other.to_string()),
        })
    }

    /// Creates the tables that do not exist, in one transaction, and returns how many it
    /// created. Tables that exist are skipped silently: PostgreSQL's NOTICE for each would reach
    /// the log of every repeat.
    pub async fn migrate(&self) -> Result<u64, QuotaError> {
        let client = self.client().await?;
        // The tables the migrations create, read from them, so that a new migration is counted.
        let tables: Vec<&str> = MIGRATIONS
            .iter()
            .flat_map(|m| m.split("CREATE TABLE IF NOT EXISTS ").skip(1))
            .filter_map(|rest| rest.split_whitespace().next())
            .collect();
        let count =
            "SELECT count(*) FROM pg_tables WHERE schemaname = current_schema() AND tablename = ANY($1)";
        let before: i64 = client.query_one(count, &[&tables]).await.map_err(db)?.get(0);
        let batch =
            format!("BEGIN;\nSET LOCAL client_min_messages = warning;\n{}\nCOMMIT;", MIGRATIONS.join("\n"));
        client.batch_execute(&batch).await.map_err(db)?;
        let after: i64 = client.query_one(count, &[&tables]).await.map_err(db)?.get(0);
        Ok(u64::try_from(after - before).unwrap_or(0))
    }

    /// Everything the database says about `tenant`, with invalid override rows skipped.
    pub async fn fetch(&self, tenant: &str) -> Result<Fetched, QuotaError> {
        metrics::counter!("tollgate_quota_db_queries_total").increment(1);
        let client = self.client().await?;
        let statement = client.prepare_cached(FETCH).await.map_err(db)?;
        let rows = client.query(&statement, &[&tenant]).await.map_err(db)?;
        let tier: Option<String> = rows.first().and_then(|r| r.get(0));
        let mut record = TenantRecord { tier, ..Default::default() };
        let mut expires_at: Option<SystemTime> = None;
        let mut known = record.tier.is_some();
        for row in &rows {
            let Some(class) = row.get::<_, Option<String>>(1) else { continue };
            known = true;
            let (capacity, refill): (f64, f64) = (row.get(2), row.get(3));
            match BucketSpec::new(capacity, refill) {
                Ok(spec) => {
                    record.overrides.insert(class, spec);
                    if let Some(at) = row.get::<_, Option<SystemTime>>(4) {
                        expires_at = Some(expires_at.map_or(at, |e| e.min(at)));
                    }
                }
                Err(problem) => {
                    metrics::counter!("tollgate_quota_bad_rows_total").increment(1);
                    tracing::warn!(tenant, class, capacity, refill_per_second = refill, %problem,
                        "skipping invalid row in tollgate_overrides");
                }
            }
        }
        Ok(Fetched { record: known.then_some(record), expires_at })
    }

    /// Sets `tenant`'s tier.
    pub async fn set_tier(&self, tenant: &str, tier: &str) -> Result<(), QuotaError> {
        if tier.is_empty() {
            return Err(QuotaError::Invalid("the tier must not be empty".into()));
        }
        self.client()
            .await?
            .execute(
                "INSERT INTO tollgate_tenants (tenant_id, tier) VALUES ($1, $2) \
                 ON CONFLICT (tenant_id) DO UPDATE SET tier = EXCLUDED.tier, updated_at = now()",
                &[&tenant, &tier],
            )
            .await
            .map_err(db)?;
        Ok(())
    }

    /// Sets `tenant`'s bucket for `class`, replacing its tier's, until `expires_at` if given.
    pub async fn set_override(
        &self,
        tenant: &str,
        class: &str,
        spec: BucketSpec,
        expires_at: Option<SystemTime>,
    ) -> Result<(), QuotaError> {
        if class.is_empty() {
            return Err(QuotaError::Invalid("the class must not be empty".into()));
        }
        self.client()
            .await?
            .execute(
                "INSERT INTO tollgate_overrides (tenant_id, class, capacity, refill_per_second, expires_at) \
                 VALUES ($1, $2, $3, $4, $5) \
                 ON CONFLICT (tenant_id, class) DO UPDATE SET capacity = EXCLUDED.capacity, \
                 refill_per_second = EXCLUDED.refill_per_second, expires_at = EXCLUDED.expires_at, \
                 updated_at = now()",
                &[&tenant, &class, &spec.capacity(), &spec.refill_per_second(), &expires_at],
            )
            .await
            .map_err(db)?;
        Ok(())
    }

    /// Deletes `tenant`'s override for `class`, or with `None` the tenant and all its overrides.
    /// Returns the number of rows deleted.
    pub async fn delete(&self, tenant: &str, class: Option<&str>) -> Result<u64, QuotaError> {
        let client = self.client().await?;
        let deleted = match class {
            Some(class) => client
                .execute(
                    "DELETE FROM tollgate_overrides WHERE tenant_id = $1 AND class = $2",
                    &[&tenant, &class],
                )
                .await
                .map_err(db)?,
            None => {
                let overrides = client
                    .execute("DELETE FROM tollgate_overrides WHERE tenant_id = $1", &[&tenant])
                    .await
                    .map_err(db)?;
                overrides
                    + client
                        .execute("DELETE FROM tollgate_tenants WHERE tenant_id = $1", &[&tenant])
                        .await
                        .map_err(db)?
            }
        };
        Ok(deleted)
    }

    /// Every tenant with a row in either table (or just `tenant`), ordered by id, rows as stored.
    pub async fn list(&self, tenant: Option<&str>) -> Result<Vec<Listing>, QuotaError> {
        let rows = self
            .client()
            .await?
            .query(
                "SELECT ids.id, t.tier, o.class, o.capacity, o.refill_per_second, o.expires_at \
                 FROM (SELECT tenant_id AS id FROM tollgate_tenants UNION \
                       SELECT tenant_id FROM tollgate_overrides) ids \
                 LEFT JOIN tollgate_tenants t ON t.tenant_id = ids.id \
                 LEFT JOIN tollgate_overrides o ON o.tenant_id = ids.id \
                 WHERE $1::text IS NULL OR ids.id = $1 \
                 ORDER BY ids.id, o.class",
                &[&tenant],
            )
            .await
            .map_err(db)?;
        let mut listings: Vec<Listing> = Vec::new();
        for row in rows {
            let id: String = row.get(0);
            if listings.last().is_none_or(|l| l.tenant != id) {
                listings.push(Listing { tenant: id, tier: row.get(1), overrides: Vec::new() });
            }
            if let Some(class) = row.get::<_, Option<String>>(2) {
                listings.last_mut().expect("pushed above").overrides.push(OverrideRow {
                    class,
                    capacity: row.get(3),
                    refill_per_second: row.get(4),
                    expires_at: row.get(5),
                });
            }
        }
        Ok(listings)
    }
}

fn tls_connector(ca_file: Option<&Path>) -> Result<MakeRustlsConnect, QuotaError> {
    let mut roots = rustls::RootCertStore { roots: webpki_roots::TLS_SERVER_ROOTS.to_vec() };
    if let Some(path) = ca_file {
        let invalid = |e: &dyn std::fmt::Display| QuotaError::Invalid(format!("{}: {e}", path.display()));
        let mut added = 0;
        for cert in CertificateDer::pem_file_iter(path).map_err(|e| invalid(&e))? {
            roots.add(cert.map_err(|e| invalid(&e))?).map_err(|e| invalid(&e))?;
            added += 1;
        }
        if added == 0 {
            return Err(invalid(&"no PEM certificate in the file"));
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| QuotaError::Invalid(e.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(MakeRustlsConnect::new(config))
}

// tokio-postgres puts the useful part (the server's message, the I/O error) in the source.
pub(super) fn db(e: tokio_postgres::Error) -> QuotaError {
    match std::error::Error::source(&e) {
        Some(source) => QuotaError::Db(format!("{e}: {source}")),
        None => QuotaError::Db(e.to_string()),
    }
}

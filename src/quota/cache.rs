//! The in-process cache in front of the quota database: tenant records and budget overrides
//! ([`super::budgets`]), each looked up by its own key under the same rules.
//!
//! The database is read off the hot path, and a decision never waits on it longer than the
//! Redis deadline:
//!
//! * **fresh** entries (younger than the TTL, and not past the first expiry of an override they
//!   hold) are served without a query;
//! * **stale** entries are served as they are while one background query refreshes them, so a
//!   changed quota shows within TTL plus one query;
//! * a **miss** starts one query (concurrent misses of a tenant share it: single flight) and
//!   waits for it at most the deadline; past that the decision goes on without the record
//!   (inline records, then the default tier) and the query still fills the cache;
//! * tenants the database does not know are cached too (negative cache), so repeated unknown ids
//!   cost one query per TTL;
//! * when the database fails, entries already cached keep being served, however old, and a
//!   tenant never seen gets the default tier; either way the next query for that tenant waits
//!   a second;
//! * the cache holds at most `capacity` tenants. Admission is frequency-based (TinyLFU), so a
//!   flood of one-off tenant ids does not push busy tenants out. A tenant the cache declines is
//!   still served the record its query returned (never the default tier in its place); it costs
//!   a query per lookup until the cache admits it.
//!
//! Queries run in tasks of their own so that a caller giving up at its deadline does not cancel
//! them; each ends within `QUERY_LIMIT` (5 s), or when the cache is dropped.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use futures::future::{BoxFuture, FutureExt, Shared};
use tokio::task::AbortHandle;

use super::postgres::PostgresQuotas;
use super::{InlineTenants, QuotaSource, TenantRecord};
use crate::budget::BudgetOverride;

/// How long a failed lookup of a tenant never seen is remembered before the next try.
const FAILURE_BACKOFF: Duration = Duration::from_secs(1);
/// How long a background query may take before it is abandoned.
const QUERY_LIMIT: Duration = Duration::from_secs(5);

/// Tenant records and budget overrides from PostgreSQL through a bounded, TTL'd, single-flight
/// cache.
pub struct CachedQuotas {
    db: Arc<PostgresQuotas>,
    entries: moka::sync::Cache<Key, Arc<Entry>>,
    // Each query's shared answer, and the handle that stops its task when the cache goes.
    inflight: Arc<Mutex<HashMap<Key, (Query, AbortHandle)>>>,
    ttl: Duration,
    deadline: Duration,
}

/// One query for a tenant, shared by every lookup waiting for it; it yields the entry it wrote
/// (`None` if the task died).
type Query = Shared<BoxFuture<'static, Option<Arc<Entry>>>>;

// What is looked up: a tenant's record, or the budget override of a (domain, level path).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Key {
    Tenant(String),
    Budget(String, String),
}

impl std::fmt::Display for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Key::Tenant(tenant) => write!(f, "tenant {tenant}"),
            Key::Budget(domain, path) => write!(f, "budget {path} of domain {domain}"),
        }
    }
}

// What the database has for a key.
#[derive(Debug, Clone)]
enum Found {
    Tenant(Arc<TenantRecord>),
    Budget(BudgetOverride),
}

struct Entry {
    // `None`: the database has no such row (or could not be asked, see FAILURE_BACKOFF).
    record: Option<Found>,
    fresh_until: Instant,
}

impl CachedQuotas {
    /// A cache of at most `capacity` tenants, each fresh for `ttl`, in front of `db`; decisions
    /// wait at most `deadline` for a query.
    pub fn new(db: PostgresQuotas, capacity: u64, ttl: Duration, deadline: Duration) -> Self {
        CachedQuotas {
            db: Arc::new(db),
            entries: moka::sync::Cache::builder().max_capacity(capacity).build(),
            inflight: Arc::default(),
            ttl,
            deadline,
        }
    }

    /// The database's row for `key`: `Some(None)` if it has none, `None` if it could not tell
    /// within the deadline.
    async fn lookup(&self, key: Key) -> Option<Option<Found>> {
        if let Some(entry) = self.entries.get(&key) {
            let result = if Instant::now() < entry.fresh_until {
                "hit"
            } else {
                // Fire and forget: the spawned query refreshes the entry.
                drop(self.refresh(&key));
                "stale"
            };
            metrics::counter!("tollgate_quota_cache_lookups_total", "result" => result).increment(1);
            return Some(entry.record.clone());
        }
        metrics::counter!("tollgate_quota_cache_lookups_total", "result" => "miss").increment(1);
        match tokio::time::timeout(self.deadline, self.refresh(&key)).await {
            // The query's own answer, not a re-read of the cache: the cache may have declined
            // or already evicted the entry.
            Ok(entry) => entry.map(|e| e.record.clone()),
            Err(_) => {
                metrics::counter!("tollgate_quota_deadline_exceeded_total").increment(1);
                None
            }
        }
    }

    // Starts (or joins) the one query for `key`; the query runs to completion on its own.
    fn refresh(&self, key: &Key) -> Query {
        let mut inflight = self.inflight.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((query, _)) = inflight.get(key) {
            return query.clone();
        }
        // A query that finished since the caller looked has left a fresh entry: use it. (A query
        // fills the cache before it leaves `inflight`, so under this lock one of them is seen.)
        if let Some(entry) = self.entries.get(key).filter(|e| Instant::now() < e.fresh_until) {
            return futures::future::ready(Some(entry)).boxed().shared();
        }
        let (db, entries, registry, ttl) =
            (self.db.clone(), self.entries.clone(), self.inflight.clone(), self.ttl);
        let owned = key.clone();
        let task = tokio::spawn(async move {
            let key = owned;
            let now = Instant::now();
            let fetch = async {
                match &key {
                    Key::Tenant(tenant) => db
                        .fetch(tenant)
                        .await
                        .map(|f| (f.record.map(|r| Found::Tenant(Arc::new(r))), f.expires_at)),
                    Key::Budget(domain, path) => {
                        db.fetch_budget(domain, path).await.map(|b| (b.map(Found::Budget), None))
                    }
                }
            };
            let entry = match tokio::time::timeout(QUERY_LIMIT, fetch).await {
                Ok(Ok((record, expires_at))) => {
                    let mut fresh_until = now + ttl;
                    if let Some(at) = expires_at {
                        let left = at.duration_since(SystemTime::now()).unwrap_or_default();
                        fresh_until = fresh_until.min(now + left);
                    }
                    let entry = Arc::new(Entry { record, fresh_until });
                    entries.insert(key.clone(), entry.clone());
                    metrics::gauge!("tollgate_quota_cache_entries").set(entries.entry_count() as f64);
                    entry
                }
                failed => {
                    let kind = match &failed {
                        Ok(Err(_)) => "error",
                        _ => "timeout",
                    };
                    metrics::counter!("tollgate_quota_db_errors_total", "kind" => kind).increment(1);
                    match failed {
                        Ok(Err(error)) => tracing::warn!(lookup = %key, %error, "quota lookup failed"),
                        _ => tracing::warn!(lookup = %key, limit = ?QUERY_LIMIT, "quota lookup timed out"),
                    }
                    // Keep what is known (or nothing), and ask again after the backoff.
                    let record = entries.get(&key).and_then(|e| e.record.clone());
                    let entry = Arc::new(Entry { record, fresh_until: now + FAILURE_BACKOFF });
                    entries.insert(key.clone(), entry.clone());
                    entry
                }
            };
            registry.lock().unwrap_or_else(|p| p.into_inner()).remove(&key);
            entry
        });
        let abort = task.abort_handle();
        let query = task.map(Result::ok).boxed().shared();
        inflight.insert(key.clone(), (query.clone(), abort));
        query
    }
}

impl Drop for CachedQuotas {
    // Queries still running stop with the cache: nothing outlives the service that started it.
    fn drop(&mut self) {
        let inflight = self.inflight.lock().unwrap_or_else(|p| p.into_inner());
        for (_, abort) in inflight.values() {
            abort.abort();
        }
    }
}

impl QuotaSource for CachedQuotas {
    /// The database's record, else the domain file's inline record, else none (default tier).
    fn tenant<'a>(
        &'a self,
        inline: &'a InlineTenants,
        tenant: &'a str,
    ) -> BoxFuture<'a, Option<Arc<TenantRecord>>> {
        Box::pin(async move {
            match self.lookup(Key::Tenant(tenant.to_owned())).await.flatten() {
                Some(Found::Tenant(record)) => Some(record),
                _ => inline.get(tenant).cloned(),
            }
        })
    }

    /// The database's override of the level, else none (the file's budget).
    fn budget<'a>(&'a self, domain: &'a str, path: &'a str) -> BoxFuture<'a, Option<BudgetOverride>> {
        Box::pin(async move {
            match self.lookup(Key::Budget(domain.to_owned(), path.to_owned())).await.flatten() {
                Some(Found::Budget(found)) => Some(found),
                _ => None,
            }
        })
    }
}

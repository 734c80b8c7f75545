//! tollgate: an external rate-limit service for Envoy and Istio.
//!
//! Every Envoy asks tollgate before forwarding a request; tollgate checks and debits per-tenant
//! token buckets in shared state (Redis Cluster), so a tenant gets its quota in total, however
//! many replicas serve it.
//!
//! Where things are:
//!
//! * a request enters at [`edge::rls`] (Envoy's `RateLimitService`, answered on the fast path,
//!   [`edge::rls::fast`], and `POST /json` in [`edge::rls::json`]) or at [`edge::rlqs`] (Envoy's
//!   Rate Limit Quota Service, which leases parts of the same buckets); a region's replicas reach
//!   the global tier through [`edge::region`]; pushed rules arrive over [`edge::xds`]; side
//!   endpoints are at [`http`]; connections are admitted by [`connections`] and [`tls`];
//! * the decision is made in [`limiter`], using [`matcher`] (descriptor → rule), [`quota`]
//!   (tenant → bucket size), [`identity`] (rule and descriptor → bucket and storage key); it
//!   forks by the domain and the rules matched into token buckets (`limiter/mod.rs`), money
//!   budgets (`limiter/budget/`, arithmetic in [`budget`]), concurrency slots
//!   (`limiter/slots.rs`, arithmetic in [`slot`]) and global rules (`limiter/global/`);
//! * state lives behind [`store::Store`]: in Redis ([`store::RedisStore`], the algorithm in
//!   `src/store/redis/bucket.lua` and `group.lua`, run by `token_bucket.lua`, concurrent calls
//!   per hash slot coalesced; standalone, Cluster or behind Sentinel, in `store/redis/`) or in
//!   process ([`store::MemoryStore`], the algorithm in [`bucket`]); [`store::Precheck`] in front
//!   of Redis answers denials that are already certain without a round trip;
//! * rules come from YAML through [`config`] (or xDS) and are kept current by [`reload`]; [`app`]
//!   wires settings into running parts, [`server`] runs and drains them; the `tollgate` command
//!   line is `src/cli/`, with [`render`] for Envoy's side; logs, metrics and traces are in
//!   [`telemetry`].
//!
//! Where a replica keeps state of its own, beside the shared store (each is bounded, and each is
//! lost with the process without loss to anyone: the store's state is the truth):
//!
//! * the rules in force: [`reload::Reloader`]'s swappable rule set;
//! * the pre-check's observations of short buckets: [`store::Precheck`];
//! * tenants' quotas read from PostgreSQL: [`quota::cache::CachedQuotas`];
//! * the RLQS leases it holds for its Envoys' buckets: [`edge::rlqs::pool::Pool`];
//! * in a region, its shares of global buckets ([`limiter::GlobalShares`]) and its money
//!   leases of global budgets ([`limiter::GlobalBudgets`]), renewed with the global tier;
//! * the telemetry's bounded tables (the top denied tenants and spenders, idle series):
//!   [`telemetry`].

pub mod app;
pub mod bucket;
pub mod budget;
pub mod client;
pub mod clock;
pub mod config;
pub mod connections;
pub mod edge;
pub mod http;
pub mod identity;
pub mod limiter;
pub mod matcher;
pub mod quota;
pub mod reload;
pub mod render;
pub mod rule;
pub mod server;
pub mod slot;
pub mod store;
pub mod sweep;
pub mod telemetry;
pub mod tls;
pub mod units;

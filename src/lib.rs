//! tollgate: an external rate-limit service for Envoy and Istio.
//!
//! Every Envoy asks tollgate before forwarding a request; tollgate checks and debits per-tenant
//! token buckets in shared state (Redis Cluster), so a tenant gets its quota in total, however
//! many replicas serve it.
//!
//! Where things are:
//!
//! * a request enters at [`edge::rls`] (Envoy's `RateLimitService`, and `POST /json` in
//!   [`edge::rls::json`]) or at [`edge::rlqs`] (Envoy's Rate Limit Quota Service, which leases
//!   parts of the same buckets); side endpoints at [`http`];
//! * the decision is made in [`limiter`], using [`matcher`] (descriptor → rule), [`quota`]
//!   (tenant → bucket size), [`identity`] (rule and descriptor → bucket and storage key);
//! * state lives behind [`store::Store`]: in Redis ([`store::RedisStore`], the algorithm in
//!   `src/store/redis/bucket.lua` and `group.lua`, run by `token_bucket.lua`, concurrent calls
//!   per slot coalesced) or in process
//!   ([`store::MemoryStore`], the algorithm in [`bucket`]); [`store::Precheck`] in front of
//!   Redis answers denials that are already certain without a round trip;
//! * state lives in Redis standalone, Cluster ([`store`]'s `cluster.rs`) or behind Sentinel;
//! * rules come from YAML through [`config`] and are kept current by [`reload`]; [`app`] wires
//!   settings into running parts, [`server`] runs and drains them; the `tollgate` command line
//!   is `src/cli/`; logs, metrics and traces are in [`telemetry`].

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

//! The protocol edges: where requests enter and answers leave, each in its own protocol's terms.
//!
//! An edge validates what arrives, translates it into the neutral [`crate::limiter::Query`],
//! asks the [`crate::limiter::Limiter`], and encodes the [`crate::limiter::Decision`]. No edge
//! touches a store or a rule tree itself, so every protocol reaches a rule, and a bucket, in
//! exactly one way.
//!
//! * [`rls`]: Envoy's `envoy.service.ratelimit.v3.RateLimitService` (gRPC), the API of the
//!   `envoy.filters.http.ratelimit` filter.
//! * [`rlqs`]: Envoy's `envoy.service.rate_limit_quota.v3.RateLimitQuotaService` (gRPC streams),
//!   the API of the `envoy.filters.http.rate_limit_quota` filter: Envoy enforces, tollgate leases.
//! * [`region`]: tollgate's own `tollgate.region.v1.RegionLeases` (gRPC), served by the global
//!   tier of limits that hold across regions: regions lease its buckets.
//! * [`xds`]: the other way round, tollgate as a client: rate-limit configs pushed by a control
//!   plane over xDS (envoyproxy/ratelimit's `RateLimitConfig`), compiled as files are.
//!
//! [`client_tls`] is the TLS of tollgate's own clients (xDS, a region's link to the global tier).

pub mod client_tls;
pub mod region;
pub mod rlqs;
pub mod rls;
pub mod xds;

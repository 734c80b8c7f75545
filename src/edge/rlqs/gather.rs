//! Reports that arrived together, read as one: Envoy reports each new bucket's first request at
//! once, in a message of its own, and thousands of them taken one at a time would each wait for
//! the ones before. Gathered, they are resolved and leased together.

use envoy_types::pb::envoy::service::rate_limit_quota::v3::RateLimitQuotaUsageReports;
use futures::FutureExt as _;
use tonic::{Status, Streaming};

/// Most usages gathered into one report.
pub const MAX_GATHERED_USAGES: usize = 4096;

/// Appends to `report` the usages of every report already waiting on the stream, up to
/// [`MAX_GATHERED_USAGES`]. Returns a message read that is not a report (the stream's
/// end, an error), to be handled next.
pub fn gather(
    reports: &mut Streaming<RateLimitQuotaUsageReports>,
    report: &mut RateLimitQuotaUsageReports,
) -> Option<Result<Option<RateLimitQuotaUsageReports>, Status>> {
    while report.bucket_quota_usages.len() < MAX_GATHERED_USAGES {
        match reports.message().now_or_never()? {
            Ok(Some(more)) => {
                if report.domain.is_empty() {
                    report.domain = more.domain;
                }
                report.bucket_quota_usages.extend(more.bucket_quota_usages);
            }
            other => return Some(other),
        }
    }
    None
}

//! Repairs in the background: an op whose answer was lost is sent again (or undone) a few times,
//! off the request path, until the store answers; what still fails is left to the state's own
//! expiry, logged and counted. Budgets and concurrency slots use it.

use std::future::Future;
use std::time::Duration;

use crate::store::StoreError;
use crate::telemetry::logs::ErrorChain;

/// How often a repair is tried, how far apart, and how long each try may take (no request waits
/// on them).
const ATTEMPTS: u32 = 3;
const PAUSE: Duration = Duration::from_millis(200);
const DEADLINE: Duration = Duration::from_secs(2);

/// What a repair is, for its metric and its log line.
pub(super) struct Repair {
    /// The counter, labelled with `domain`, `kind` and `outcome` (ok, failed).
    pub(super) metric: &'static str,
    pub(super) domain: String,
    pub(super) kind: &'static str,
    /// Said when every attempt failed: what happens instead.
    pub(super) otherwise: &'static str,
}

/// Runs `attempt` until it succeeds, at most [`ATTEMPTS`] times, on a task of its own.
pub(super) fn spawn<F, Fut, T>(repair: Repair, attempt: F)
where
    F: Fn() -> Fut + Send + 'static,
    Fut: Future<Output = Result<T, StoreError>> + Send,
{
    tokio::spawn(async move {
        let mut last = None;
        for n in 0..ATTEMPTS {
            if n > 0 {
                tokio::time::sleep(PAUSE).await;
            }
            match crate::store::in_background(DEADLINE, attempt()).await {
                Ok(_) => {
                    last = None;
                    break;
                }
                Err(e) => last = Some(e),
            }
        }
        let outcome = if last.is_some() { "failed" } else { "ok" };
        metrics::counter!(repair.metric, "domain" => repair.domain.clone(), "kind" => repair.kind, "outcome" => outcome)
            .increment(1);
        if let Some(error) = last {
            tracing::warn!(domain = %repair.domain, kind = repair.kind, error = %ErrorChain(&error), "{}", repair.otherwise);
        }
    });
}

//! A closed-loop load generator for fault tests: workers send ShouldRateLimit requests in a
//! loop until stopped, and every answer is recorded with its time, tenant and kind.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use tonic::transport::Channel;

/// What one request got back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// OK from a real bucket evaluation.
    Admitted,
    /// OVER_LIMIT from a real bucket evaluation.
    Denied,
    /// An answer made by the failure mode (the status has no duration_until_reset).
    FailureMode,
    /// A gRPC error (including the client's own 5 s deadline).
    Error(tonic::Code),
}

#[derive(Debug, Clone, Copy)]
pub struct Answer {
    /// When the answer arrived, since the load started.
    pub at: Duration,
    pub latency: Duration,
    pub tenant: usize,
    pub kind: Kind,
}

pub struct Load {
    stop: Arc<AtomicBool>,
    workers: Vec<tokio::task::JoinHandle<Vec<Answer>>>,
    pub start: Instant,
}

impl Load {
    /// `workers` loops over `addrs` (round robin), asking about `tenant=<tenants[i]>` in `domain`.
    pub async fn start(addrs: &[String], domain: &str, tenants: &[String], workers: usize) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let start = Instant::now();
        let mut handles = Vec::new();
        for w in 0..workers {
            let channel = Channel::from_shared(format!("http://{}", addrs[w % addrs.len()]))
                .unwrap()
                .connect()
                .await
                .unwrap();
            let (stop, domain, tenants) = (stop.clone(), domain.to_owned(), tenants.to_vec());
            handles.push(tokio::spawn(async move {
                let mut client = RateLimitServiceClient::new(channel);
                let mut answers = Vec::new();
                let mut i = w;
                while !stop.load(Ordering::Relaxed) {
                    let tenant = i % tenants.len();
                    i += workers;
                    let request = super::req(&domain, &[&format!("tenant={}", tenants[tenant])], 1);
                    let sent = Instant::now();
                    let result =
                        tokio::time::timeout(Duration::from_secs(5), client.should_rate_limit(request)).await;
                    let kind = match result {
                        Err(_) => Kind::Error(tonic::Code::DeadlineExceeded),
                        Ok(Err(status)) => Kind::Error(status.code()),
                        Ok(Ok(r)) => {
                            let r = r.into_inner();
                            match (r.statuses[0].duration_until_reset.is_some(), r.overall_code == super::OK)
                            {
                                (false, _) => Kind::FailureMode,
                                (true, true) => Kind::Admitted,
                                (true, false) => Kind::Denied,
                            }
                        }
                    };
                    answers.push(Answer { at: start.elapsed(), latency: sent.elapsed(), tenant, kind });
                }
                answers
            }));
        }
        Load { stop, workers: handles, start }
    }

    /// A handle that stops the load when set.
    pub fn stopper(&self) -> Arc<AtomicBool> {
        self.stop.clone()
    }

    /// Stops the workers and returns every answer, in arrival order.
    pub async fn stop(self) -> Vec<Answer> {
        self.stop.store(true, Ordering::SeqCst);
        let mut all = Vec::new();
        for w in self.workers {
            all.extend(w.await.unwrap());
        }
        all.sort_by_key(|a| a.at);
        all
    }
}

/// Answers per second over the run.
pub fn rate(answers: &[Answer]) -> f64 {
    match (answers.first(), answers.last()) {
        (Some(first), Some(last)) if last.at > first.at => {
            answers.len() as f64 / (last.at - first.at).as_secs_f64()
        }
        _ => 0.0,
    }
}

/// The largest gap between consecutive answers among `answers`.
pub fn max_gap(answers: &[&Answer]) -> Duration {
    answers.windows(2).map(|w| w[1].at.saturating_sub(w[0].at)).max().unwrap_or_default()
}

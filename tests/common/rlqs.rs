//! A neutral RLQS client, as one Envoy: a stream that sends usage reports and reads what the
//! server assigns, in short ([`Said`]).

use std::collections::BTreeMap;
use std::time::Duration;

use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::BucketAction as Action;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_client::RateLimitQuotaServiceClient;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use envoy_types::pb::google::protobuf::Duration as ProtoDuration;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

pub fn bucket(entries: &[(&str, &str)]) -> BucketId {
    BucketId { bucket: entries.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect() }
}

pub fn key(id: &BucketId) -> BTreeMap<String, String> {
    id.bucket.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
}

pub fn report(id: &BucketId, allowed: u64, denied: u64, elapsed_ms: u64) -> BucketQuotaUsage {
    BucketQuotaUsage {
        bucket_id: Some(id.clone()),
        time_elapsed: Some(ProtoDuration {
            seconds: (elapsed_ms / 1000) as i64,
            nanos: ((elapsed_ms % 1000) * 1_000_000) as i32,
        }),
        num_requests_allowed: allowed,
        num_requests_denied: denied,
    }
}

/// What an assignment says, in short.
#[derive(Debug, Clone, PartialEq)]
pub enum Said {
    AllowAll,
    DenyAll,
    Tokens(u32),
}

pub fn said(response: &RateLimitQuotaResponse) -> Vec<(BTreeMap<String, String>, Said)> {
    response
        .bucket_action
        .iter()
        .filter_map(|a| {
            let Some(Action::QuotaAssignmentAction(q)) = &a.bucket_action else { return None };
            let said = match q.rate_limit_strategy.as_ref()?.strategy.as_ref()? {
                Strategy::BlanketRule(r) if *r == BlanketRule::AllowAll as i32 => Said::AllowAll,
                Strategy::BlanketRule(_) => Said::DenyAll,
                Strategy::TokenBucket(b) => Said::Tokens(b.max_tokens),
                Strategy::RequestsPerTimeUnit(_) => return None,
            };
            Some((key(a.bucket_id.as_ref()?), said))
        })
        .collect()
}

/// A stream to a tollgate, as one Envoy.
pub struct Stream {
    pub reports: mpsc::Sender<RateLimitQuotaUsageReports>,
    pub answers: tonic::Streaming<RateLimitQuotaResponse>,
}

impl Stream {
    pub async fn open(addr: &str) -> Stream {
        Self::open_as(addr, None).await
    }

    /// A stream from the loopback address `from` (127.0.0.0/8 is all this host's): another peer.
    pub async fn open_from(addr: &str, from: &str) -> Result<Stream, tonic::Status> {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .local_address(Some(from.parse().unwrap()))
            .connect()
            .await
            .unwrap();
        let (reports, rx) = mpsc::channel(16);
        let answers = RateLimitQuotaServiceClient::new(channel)
            .stream_rate_limit_quotas(tonic::Request::new(ReceiverStream::new(rx)))
            .await?
            .into_inner();
        Ok(Stream { reports, answers })
    }

    /// A stream whose Envoy names itself `name` in the stream's metadata.
    pub async fn open_as(addr: &str, name: Option<&str>) -> Stream {
        let mut client = RateLimitQuotaServiceClient::connect(format!("http://{addr}")).await.unwrap();
        let (reports, rx) = mpsc::channel(16);
        let mut request = tonic::Request::new(ReceiverStream::new(rx));
        if let Some(name) = name {
            request.metadata_mut().insert("x-tollgate-envoy", name.parse().unwrap());
        }
        let answers = client.stream_rate_limit_quotas(request).await.unwrap().into_inner();
        Stream { reports, answers }
    }

    /// Closes the Envoy's side and reads every answer the server still sends until it ends the
    /// stream: the requests of every token bucket among them.
    pub async fn close(self) -> u64 {
        let Stream { reports, mut answers } = self;
        drop(reports);
        let mut granted = 0;
        loop {
            match tokio::time::timeout(Duration::from_secs(5), answers.message()).await {
                Ok(Ok(Some(answer))) => granted += tokens(&said(&answer)),
                Ok(_) => return granted,
                Err(_) => panic!("the stream stayed open 5 s after the Envoy closed its side"),
            }
        }
    }

    pub async fn send(&self, domain: &str, usages: Vec<BucketQuotaUsage>) {
        self.reports
            .send(RateLimitQuotaUsageReports { domain: domain.into(), bucket_quota_usages: usages })
            .await
            .unwrap();
    }

    pub async fn next(&mut self) -> Vec<(BTreeMap<String, String>, Said)> {
        let answer = tokio::time::timeout(Duration::from_secs(5), self.answers.message()).await;
        said(&answer.expect("an answer within 5 s").expect("the stream stands").expect("a message"))
    }
}

/// Requests in the token buckets of `said`.
pub fn tokens(said: &[(BTreeMap<String, String>, Said)]) -> u64 {
    said.iter().map(|(_, s)| if let Said::Tokens(n) = s { u64::from(*n) } else { 0 }).sum()
}

/// The grant (or denial) for `id`, skipping other buckets' messages.
pub async fn grant_for(stream: &mut Stream, id: &BucketId) -> Said {
    loop {
        for (bucket, said) in stream.next().await.into_iter().rev() {
            if bucket == key(id) {
                return said;
            }
        }
    }
}

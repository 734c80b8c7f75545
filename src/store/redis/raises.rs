//! Balance raises, heard by every replica: each script that credits a bucket (a refund, a late
//! reply given back, a client's `is_negative_hits`) publishes the bucket's key on one channel
//! ([`crate::identity::raise_channel`]), and every replica subscribes to it, so that what its
//! pre-check remembers of a bucket never outlives a raise made elsewhere for longer than the
//! message takes to arrive.
//!
//! One subscription per replica, on a connection of its own: on standalone Redis the server, on
//! Sentinel the primary, on a Cluster any node (a classic `PUBLISH` reaches every node). It is
//! pinged every [`PING_EVERY`]; a ping unanswered within [`PING_TIMEOUT`], a closed connection or
//! a failed subscribe counts as lost, is told to the listener (which then answers nothing from
//! what it remembers) and is retried with a doubling delay up to [`RETRY_MAX`].

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt as _;
use tokio_util::task::AbortOnDropHandle;

use super::{RedisStore, Shared};
use crate::store::{RaiseListener, StoreError};
use crate::telemetry::logs::ErrorChain;

/// How often the subscription's connection is pinged.
pub const PING_EVERY: Duration = Duration::from_secs(1);
/// How long a ping (or a subscribe) may take before the subscription counts as lost.
pub const PING_TIMEOUT: Duration = Duration::from_secs(1);
/// The longest wait between attempts to subscribe again.
pub const RETRY_MAX: Duration = Duration::from_secs(2);

impl RedisStore {
    /// Follows the raises published by every replica's scripts, telling `listener`, until the
    /// returned handle is dropped.
    pub fn follow_raises(&self, listener: Arc<dyn RaiseListener>) -> AbortOnDropHandle<()> {
        let shared = self.shared.clone();
        AbortOnDropHandle::new(tokio::spawn(async move {
            let mut delay = Duration::from_millis(100);
            let mut logged_failure = false;
            loop {
                match subscribe(&shared).await {
                    Ok(pubsub) => {
                        listener.subscribed();
                        metrics::gauge!("tollgate_precheck_hearing_raises").set(1.0);
                        tracing::info!(store = %shared.description, "hearing balance raises from every replica");
                        delay = Duration::from_millis(100);
                        logged_failure = false;
                        let cause = hear(pubsub, listener.as_ref()).await;
                        listener.lost();
                        metrics::gauge!("tollgate_precheck_hearing_raises").set(0.0);
                        metrics::counter!("tollgate_precheck_subscription_losses_total").increment(1);
                        tracing::warn!(
                            store = %shared.description,
                            cause = %ErrorChain(&cause),
                            "balance raises from other replicas are not heard: the pre-check answers nothing until the subscription is back"
                        );
                    }
                    Err(cause) if !logged_failure => {
                        logged_failure = true;
                        tracing::warn!(store = %shared.description, cause = %ErrorChain(&cause), "cannot subscribe to balance raises; retrying");
                    }
                    Err(_) => {}
                }
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(RETRY_MAX);
            }
        }))
    }
}

async fn subscribe(shared: &Shared) -> Result<redis::aio::PubSub, StoreError> {
    let attempt = async {
        let mut pubsub = shared.connection.pubsub().await?;
        pubsub.subscribe(crate::identity::raise_channel()).await.map_err(StoreError::Redis)?;
        Ok(pubsub)
    };
    tokio::time::timeout(PING_TIMEOUT, attempt).await.map_err(|_| StoreError::Timeout(PING_TIMEOUT))?
}

// Tells `listener` of every raise until the subscription fails, and why it did.
async fn hear(pubsub: redis::aio::PubSub, listener: &dyn RaiseListener) -> StoreError {
    let (mut sink, mut messages) = pubsub.split();
    let mut ping = tokio::time::interval(PING_EVERY);
    loop {
        tokio::select! {
            message = messages.next() => match message {
                Some(message) => match message.get_payload::<String>() {
                    Ok(key) => listener.raised(&key),
                    Err(e) => return StoreError::Redis(e),
                },
                None => {
                    return StoreError::Redis(redis::RedisError::from((redis::ErrorKind::Io, "subscription closed")))
                }
            },
            _ = ping.tick() => {
                match tokio::time::timeout(PING_TIMEOUT, sink.ping::<redis::Value>()).await {
                    Ok(Ok(_)) => {}
                    Ok(Err(e)) => return StoreError::Redis(e),
                    Err(_) => return StoreError::Timeout(PING_TIMEOUT),
                }
            }
        }
    }
}

//! Whether the store answers, and if it does not, why, in words an operator can act on.
//!
//! A store that fails at startup (a wrong password, a wrong CA, a closed port) must not fail
//! silently: [`watch`] pings it at once and every [`INTERVAL`], and logs one line whenever its
//! state changes (a new cause while down once it holds three pings in a row), naming the cause
//! ([`Cause`]) and the error chain, never credentials; the
//! metrics `tollgate_store_up` and `tollgate_store_down_total{cause}` follow it. `/readyz` names
//! the same cause ([`Cause::of`]) in its body.

use std::sync::Arc;
use std::time::Duration;

use redis::{ErrorKind, ServerErrorKind};
use tokio_util::task::AbortOnDropHandle;

use super::{Store, StoreError};
use crate::telemetry::logs::ErrorChain;

/// How often the store is pinged.
pub const INTERVAL: Duration = Duration::from_secs(1);

/// Why a store does not answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cause {
    /// The server refused the credentials (`WRONGPASS`, `NOAUTH`).
    Authentication,
    /// The credentials lack a permission the scripts need (an ACL).
    Permission,
    /// The TLS handshake failed: certificate verification, or a server that does not speak TLS.
    Tls,
    /// Nothing listens at the address.
    ConnectionRefused,
    /// An open connection was closed under it (the server went away, or a proxy dropped it).
    ConnectionLost,
    /// The host name does not resolve.
    Dns,
    /// No answer within the deadline.
    Timeout,
    /// A Redis Cluster slot has no node, or the Cluster says it is down.
    ClusterCoverage,
    /// Anything else (the error chain says what).
    Other,
}

impl Cause {
    /// The cause of `error`.
    pub fn of(error: &StoreError) -> Cause {
        let redis = match error {
            StoreError::Timeout(_) => return Cause::Timeout,
            StoreError::NoOwner(_) => return Cause::ClusterCoverage,
            StoreError::Protocol(_) => return Cause::Other,
            StoreError::Redis(e) => e,
        };
        let text = ErrorChain(redis).to_string().to_ascii_lowercase();
        match redis.kind() {
            ErrorKind::AuthenticationFailed => return Cause::Authentication,
            ErrorKind::Server(ServerErrorKind::NoPerm) => return Cause::Permission,
            ErrorKind::Server(ServerErrorKind::ClusterDown) => return Cause::ClusterCoverage,
            _ => {}
        }
        if text.contains("wrongpass") || text.contains("noauth") || text.contains("invalid username-password")
        {
            Cause::Authentication
        } else if text.contains("noperm") {
            Cause::Permission
        } else if text.contains("certificate") || text.contains("tls") || text.contains("handshake") {
            Cause::Tls
        } else if redis.is_connection_refusal() || text.contains("connection refused") {
            Cause::ConnectionRefused
        } else if redis.is_connection_dropped() {
            Cause::ConnectionLost
        } else if text.contains("lookup")
            || text.contains("name or service not known")
            || text.contains("resolve")
        {
            Cause::Dns
        } else if redis.is_timeout() {
            Cause::Timeout
        } else {
            Cause::Other
        }
    }

    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Cause::Authentication => "authentication",
            Cause::Permission => "permission",
            Cause::Tls => "tls",
            Cause::ConnectionRefused => "connection_refused",
            Cause::ConnectionLost => "connection_lost",
            Cause::Dns => "dns",
            Cause::Timeout => "timeout",
            Cause::ClusterCoverage => "cluster_coverage",
            Cause::Other => "other",
        }
    }

    /// What an operator reads.
    pub fn describe(self) -> &'static str {
        match self {
            Cause::Authentication => "authentication refused (check the password or ACL user)",
            Cause::Permission => "permission denied by the ACL (see the book: Operations, Security)",
            Cause::Tls => "TLS failed (check the CA, the client certificate, and that the server speaks TLS)",
            Cause::ConnectionRefused => "connection refused (nothing listens at the address)",
            Cause::ConnectionLost => "the connection dropped (the server went away or closed it)",
            Cause::Dns => "the host name does not resolve",
            Cause::Timeout => "no answer within the deadline",
            Cause::ClusterCoverage => "the Redis Cluster does not cover every slot",
            Cause::Other => "the store failed",
        }
    }
}

/// One line for `/readyz` and the logs: the cause, then the error chain.
pub fn explain(error: &StoreError) -> String {
    format!("{}: {}", Cause::of(error).describe(), ErrorChain(error))
}

/// Pings `store` now and every [`INTERVAL`], logging each change of state; stops when the handle
/// is dropped.
pub fn watch(store: Arc<dyn Store>) -> AbortOnDropHandle<()> {
    AbortOnDropHandle::new(tokio::spawn(async move {
        let mut state = States::default();
        loop {
            let (now, error) = match store.ping().await {
                Ok(()) => (None, None),
                Err(error) => (Some(Cause::of(&error)), Some(error)),
            };
            match (state.seen(now), &error) {
                (Some(Change::Down(cause)), Some(error)) => {
                    metrics::counter!("tollgate_store_down_total", "cause" => cause.label()).increment(1);
                    tracing::error!(store = %store.describe(), cause = cause.label(), error = %ErrorChain(error), "the store does not answer: {}", cause.describe());
                }
                (Some(Change::Up), _) => tracing::info!(store = %store.describe(), "the store answers"),
                _ => {}
            }
            metrics::gauge!("tollgate_store_up").set(if now.is_none() { 1.0 } else { 0.0 });
            tokio::time::sleep(INTERVAL).await;
        }
    }))
}

// While the store stays down, another cause is logged once it has held this many pings in a
// row: a server going away fails by turns (a refused reconnect, then a timeout), which logged a
// line a second naming each in turn.
const CAUSE_SETTLES: u32 = 3;

/// What the watch logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Change {
    Up,
    Down(Cause),
}

/// The state the logs last stated, and a cause that differs from it, with how many pings in a row.
#[derive(Debug, Default)]
struct States {
    // None before the first ping; Some(None) up; Some(Some(cause)) down.
    stated: Option<Option<Cause>>,
    other: Option<(Cause, u32)>,
}

impl States {
    // The change to log after a ping that found `now` (a cause when down), if any.
    fn seen(&mut self, now: Option<Cause>) -> Option<Change> {
        let change = match (self.stated, now) {
            (Some(None), None) => None,
            (_, None) => Some(Change::Up),
            (Some(Some(stated)), Some(cause)) if stated != cause => {
                let held = match self.other {
                    Some((other, n)) if other == cause => n + 1,
                    _ => 1,
                };
                self.other = Some((cause, held));
                if held < CAUSE_SETTLES {
                    return None;
                }
                Some(Change::Down(cause))
            }
            (Some(Some(_)), Some(_)) => {
                self.other = None;
                return None;
            }
            (_, Some(cause)) => Some(Change::Down(cause)),
        };
        if change.is_some() {
            self.stated = Some(now);
            self.other = None;
        }
        change
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dropped_connection_is_named() {
        for kind in [std::io::ErrorKind::BrokenPipe, std::io::ErrorKind::ConnectionReset] {
            let error = StoreError::Redis(std::io::Error::new(kind, "gone").into());
            assert_eq!(Cause::of(&error), Cause::ConnectionLost, "{kind:?}");
        }
        let refused = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "no");
        assert_eq!(Cause::of(&StoreError::Redis(refused.into())), Cause::ConnectionRefused);
    }

    #[test]
    fn a_cause_that_alternates_is_logged_once_and_one_that_holds_is_logged() {
        use Cause::{ConnectionRefused as Refused, Timeout};
        let mut states = States::default();
        let mut seen = |now| states.seen(now);
        assert_eq!(seen(None), Some(Change::Up), "the first ping is stated");
        assert_eq!(seen(None), None);
        assert_eq!(seen(Some(Refused)), Some(Change::Down(Refused)));
        for _ in 0..5 {
            assert_eq!((seen(Some(Timeout)), seen(Some(Refused))), (None, None), "flip-flopping: no line");
        }
        assert_eq!((seen(Some(Timeout)), seen(Some(Timeout))), (None, None));
        assert_eq!(seen(Some(Timeout)), Some(Change::Down(Timeout)), "three pings in a row: the new cause");
        assert_eq!(seen(Some(Timeout)), None);
        assert_eq!(seen(None), Some(Change::Up));
        assert_eq!(seen(Some(Timeout)), Some(Change::Down(Timeout)), "down again: at once");
    }
}

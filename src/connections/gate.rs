//! Who gets a port's connections: a cap per port, a share per peer, and a small budget of its
//! own for connections that have not opened yet.
//!
//! A port's cap is shared by every peer, so one peer holding it takes the port from all: 10,000
//! bare TCP connections reopened as closed (no certificate needed to hold one open on an mTLS
//! port while its handshake waits) left 0 of 10 clients with valid certificates answered. So a
//! connection is admitted in two steps:
//!
//! 1. **Opening** ([`Gate::open`]): until it has finished its TLS handshake (under mTLS: presented
//!    a certificate the CA signed) or, in plaintext, sent its first bytes, a connection holds a
//!    permit of the port's *opening* budget (an eighth of the cap), at most a quarter of which one
//!    source address may hold, for at most [`OPENING_DEADLINE`]. A flood of half-open
//!    connections fills only that budget, and one peer only a quarter of it.
//! 2. **Established** ([`Opening::establish`]): then it takes a permit of the rest of the cap,
//!    with every source address holding at most `per_source` connections in all.
//!
//! Each refusal closes the connection at once, is counted in
//! `tollgate_connections_refused_total{port, reason}` (`cap`, `per_source`, `opening`,
//! `slow_opening`) and logged at most once a second. Peers are told apart by IP address: behind a
//! NAT or an L4 load balancer that hides them, raise `--max-connections-per-source`.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::telemetry::logs;

/// Longest a connection may take to open: its TLS handshake, or its first bytes in plaintext.
pub const OPENING_DEADLINE: Duration = Duration::from_secs(5);

/// Why a connection was closed at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The port has its cap of established connections.
    Cap,
    /// Its source address has its share.
    PerSource,
    /// The opening budget (or the source's part of it) is taken.
    Opening,
    /// It did not open within [`OPENING_DEADLINE`].
    SlowOpening,
}

impl Refusal {
    /// The `reason` label.
    pub fn label(self) -> &'static str {
        match self {
            Refusal::Cap => "cap",
            Refusal::PerSource => "per_source",
            Refusal::Opening => "opening",
            Refusal::SlowOpening => "slow_opening",
        }
    }

    /// Every reason, for the series registered at 0.
    pub const ALL: [Refusal; 4] = [Refusal::Cap, Refusal::PerSource, Refusal::Opening, Refusal::SlowOpening];
}

#[derive(Default)]
struct Source {
    open: usize,
    opening: usize,
}

struct Inner {
    port: &'static str,
    max: usize,
    per_source: usize,
    opening_per_source: usize,
    established: Arc<Semaphore>,
    opening: Arc<Semaphore>,
    sources: Mutex<HashMap<IpAddr, Source>>,
}

/// The connections a port may have open, and each source's share of them.
#[derive(Clone)]
pub struct Gate {
    inner: Arc<Inner>,
}

impl Gate {
    /// At most `max` connections on `port` (`grpc`, `http`), an eighth of them (at least one)
    /// kept for connections still opening, and at most `per_source` from one address.
    pub fn new(port: &'static str, max: usize, per_source: usize) -> Gate {
        let opening = (max / 8).max(1);
        Gate {
            inner: Arc::new(Inner {
                port,
                max,
                per_source: per_source.max(1),
                opening_per_source: (opening / 4).max(1),
                established: Arc::new(Semaphore::new(max.saturating_sub(opening).max(1))),
                opening: Arc::new(Semaphore::new(opening)),
                sources: Mutex::new(HashMap::new()),
            }),
        }
    }

    /// A place for a new connection from `peer` while it opens, or `None` (counted and logged).
    pub fn open(&self, peer: IpAddr) -> Option<Opening> {
        let inner = &self.inner;
        let mut sources = inner.sources.lock().unwrap_or_else(|p| p.into_inner());
        let source = sources.entry(peer).or_default();
        let refused = if source.open >= inner.per_source {
            Some(Refusal::PerSource)
        } else if source.opening >= inner.opening_per_source {
            Some(Refusal::Opening)
        } else {
            None
        };
        let permit = match refused {
            Some(_) => None,
            None => inner.opening.clone().try_acquire_owned().ok(),
        };
        let Some(permit) = permit else {
            if source.open == 0 && source.opening == 0 {
                sources.remove(&peer);
            }
            drop(sources);
            self.refused(refused.unwrap_or(Refusal::Opening));
            return None;
        };
        source.open += 1;
        source.opening += 1;
        Some(Opening { slot: Slot { gate: self.clone(), peer, opening: true }, _permit: permit })
    }

    /// Counts and logs (at most once a second) a connection closed for `why`.
    pub fn refused(&self, why: Refusal) {
        let inner = &self.inner;
        metrics::counter!("tollgate_connections_refused_total", "port" => inner.port, "reason" => why.label())
            .increment(1);
        if let Some(held_back) = logs::throttled(inner.port) {
            tracing::warn!(
                port = inner.port,
                reason = why.label(),
                max_connections = inner.max,
                per_source = inner.per_source,
                held_back,
                "a connection refused"
            );
        }
    }
}

/// A connection's place while it opens.
pub struct Opening {
    slot: Slot,
    _permit: OwnedSemaphorePermit,
}

impl Opening {
    /// Waits for `opened` (the TLS handshake, or the first bytes: `None` if the connection is
    /// not to be served) at most [`OPENING_DEADLINE`], then moves the connection to the
    /// established ones. `None` (a refusal counted) when it took too long or the port has its
    /// cap.
    pub async fn complete<T>(
        self,
        opened: impl std::future::Future<Output = Option<T>>,
    ) -> Option<(T, Admission)> {
        match tokio::time::timeout(OPENING_DEADLINE, opened).await {
            Ok(Some(conn)) => self.establish().map(|admission| (conn, admission)),
            Ok(None) => None,
            Err(_) => {
                self.slot.gate.refused(Refusal::SlowOpening);
                None
            }
        }
    }

    /// Moves the connection to the established ones: its place there, or `None` (counted) when
    /// the port has its cap.
    pub fn establish(mut self) -> Option<Admission> {
        let gate = self.slot.gate.clone();
        let Ok(permit) = gate.inner.established.clone().try_acquire_owned() else {
            gate.refused(Refusal::Cap);
            return None;
        };
        self.slot.leave_opening();
        Some(Admission { _slot: self.slot, _permit: permit })
    }
}

/// An established connection's place: given back when it is dropped.
pub struct Admission {
    _slot: Slot,
    _permit: OwnedSemaphorePermit,
}

// A connection counted against its source.
struct Slot {
    gate: Gate,
    peer: IpAddr,
    opening: bool,
}

impl Slot {
    fn leave_opening(&mut self) {
        if std::mem::take(&mut self.opening) {
            let mut sources = self.gate.inner.sources.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(source) = sources.get_mut(&self.peer) {
                source.opening -= 1;
            }
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut sources = self.gate.inner.sources.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(source) = sources.get_mut(&self.peer) {
            source.open -= 1;
            source.opening -= usize::from(self.opening);
            if source.open == 0 {
                sources.remove(&self.peer);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_source_cannot_take_the_port() {
        // Cap 64: 8 opening (2 per source), 56 established, 16 per source.
        let gate = Gate::new("test", 64, 16);
        let (a, b): (IpAddr, IpAddr) = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        let half_open: Vec<Opening> = (0..2).map(|_| gate.open(a).unwrap()).collect();
        assert!(gate.open(a).is_none(), "a source holds at most 2 opening");
        let mut held: Vec<Admission> = (0..6).map(|_| gate.open(b).unwrap().establish().unwrap()).collect();
        drop(half_open);
        for _ in 0..16 {
            held.push(gate.open(a).unwrap().establish().unwrap());
        }
        assert!(gate.open(a).is_none(), "a source holds at most 16");
        assert!(gate.open(b).is_some(), "others still open");
        drop(held);
        assert!(gate.inner.sources.lock().unwrap().is_empty(), "every count given back");
        assert_eq!(gate.inner.established.available_permits(), 56);
        assert_eq!(gate.inner.opening.available_permits(), 8);
    }
}

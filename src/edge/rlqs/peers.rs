//! Each peer's share of the replica's RLQS streams and tracked bucket ids.
//!
//! The replica-wide caps (`--rlqs-max-streams`, `--rlqs-max-buckets`) bound what all streams
//! together make tollgate keep; first come, first served, one client's 5 streams x 20,000 ids left
//! a new Envoy's bucket unassigned, and 1,000 idle streams refused every new one. So one source
//! address holds at most a quarter of each (at least one): a stream past its share is refused
//! with RESOURCE_EXHAUSTED, a bucket id past it gets no assignment (`peer_limit`), and the rest
//! stays for others. Peers are told apart by IP address, as the connection caps tell them.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use super::RlqsLimits;

/// What one source address holds.
#[derive(Default)]
struct Share {
    streams: AtomicUsize,
    buckets: AtomicUsize,
}

/// Every peer's share, and the replica's totals.
#[derive(Default)]
pub struct Peers {
    shares: Mutex<HashMap<IpAddr, Arc<Share>>>,
    streams: AtomicUsize,
    buckets: Arc<AtomicUsize>,
}

/// The most of a replica-wide cap one peer holds.
fn share_of(cap: usize) -> usize {
    (cap / 4).max(1)
}

impl Peers {
    /// A place for a new stream from `peer` (`None`: an address unknown, counted as one), or why
    /// not: the replica has `max_streams` open, or the peer its share of them.
    pub fn open(self: &Arc<Self>, peer: Option<IpAddr>, limits: &RlqsLimits) -> Result<Open, &'static str> {
        let ip = peer.unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED));
        // Counted before they are checked, so that streams opening together cannot all pass; the
        // share counted under the map's lock, so that a stream ending cannot remove it meanwhile.
        let (share, theirs) = {
            let mut shares = self.shares.lock().unwrap_or_else(|p| p.into_inner());
            let share = shares.entry(ip).or_default().clone();
            let theirs = share.streams.fetch_add(1, Ordering::SeqCst) + 1;
            (share, theirs)
        };
        let open = Open { peers: self.clone(), ip, share };
        self.streams.fetch_add(1, Ordering::SeqCst);
        if self.streams.load(Ordering::SeqCst) > limits.max_streams {
            return Err("replica_limit");
        }
        if theirs > share_of(limits.max_streams) {
            return Err("peer_limit");
        }
        Ok(open)
    }
}

/// One open stream, counted while it lives: its streams' place, and its bucket ids.
pub struct Open {
    peers: Arc<Peers>,
    ip: IpAddr,
    share: Arc<Share>,
}

impl Open {
    /// Tracks one more bucket id of this stream, or says which cap it is past
    /// (`peer_limit`, `replica_limit`).
    pub fn track(&self, limits: &RlqsLimits) -> Result<(), &'static str> {
        let under = |cap: usize| move |n: usize| (n < cap).then_some(n + 1);
        if self
            .share
            .buckets
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, under(share_of(limits.max_buckets)))
            .is_err()
        {
            return Err("peer_limit");
        }
        if self
            .peers
            .buckets
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, under(limits.max_buckets))
            .is_err()
        {
            self.share.buckets.fetch_sub(1, Ordering::SeqCst);
            return Err("replica_limit");
        }
        Ok(())
    }

    /// Stops tracking `n` of this stream's bucket ids.
    pub fn untrack(&self, n: usize) {
        self.share.buckets.fetch_sub(n, Ordering::SeqCst);
        self.peers.buckets.fetch_sub(n, Ordering::SeqCst);
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.peers.streams.fetch_sub(1, Ordering::SeqCst);
        let mut shares = self.peers.shares.lock().unwrap_or_else(|p| p.into_inner());
        if self.share.streams.fetch_sub(1, Ordering::SeqCst) == 1
            && self.share.buckets.load(Ordering::SeqCst) == 0
        {
            shares.remove(&self.ip);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_peer_holds_a_quarter_of_the_streams_and_the_ids() {
        let limits = RlqsLimits { max_streams: 8, max_buckets: 100, ..RlqsLimits::default() };
        let peers = Arc::new(Peers::default());
        let (a, b) = (Some("10.0.0.1".parse().unwrap()), Some("10.0.0.2".parse().unwrap()));
        let first = peers.open(a, &limits).unwrap();
        let _second = peers.open(a, &limits).unwrap();
        assert_eq!(peers.open(a, &limits).err(), Some("peer_limit"));
        for _ in 0..25 {
            first.track(&limits).unwrap();
        }
        assert_eq!(first.track(&limits), Err("peer_limit"));
        let other = peers.open(b, &limits).unwrap();
        assert_eq!(other.track(&limits), Ok(()), "another peer keeps its share");
        first.untrack(25);
        other.untrack(1);
        drop((first, _second, other));
        assert!(peers.shares.lock().unwrap().is_empty());
        assert_eq!(peers.streams.load(Ordering::SeqCst), 0);
    }
}

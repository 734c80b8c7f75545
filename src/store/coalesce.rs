//! Hot-tenant coalescing: many concurrent requests for one Cluster slot, one script call.
//!
//! Without it every request is its own EVALSHA, and a hot tenant (all of whose buckets share one
//! slot, hence one shard) is capped by the single-key script rate of that shard. The coalescer
//! keeps one queue per slot. A request for an idle slot goes out at once, so light load pays
//! nothing; requests that arrive while a call for their slot is in flight wait for it and then
//! leave together, as one call whose groups the script evaluates in arrival order with running
//! state, exactly as the same calls one after another would. Decisions stay exact: only the
//! number of round trips changes.
//!
//! The wait is bounded twice: a request that finds the slot's latest call older than the delay
//! starts another call (up to [`MAX_IN_FLIGHT`] per slot) instead of waiting, and a timer does the
//! same for a queue nobody else arrives to (Tokio's timers tick in milliseconds, so that second
//! bound is the delay rounded up to one). A request whose caller gave up (deadline passed) is
//! dropped from the queue before it is sent, so no tokens are spent for an answer nobody reads.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use tokio::sync::oneshot;

use super::StoreError;
use crate::bucket::{Group, GroupOutcome};

/// Most concurrent calls per slot; beyond, requests queue for the next call.
pub const MAX_IN_FLIGHT: usize = 4;
/// Most groups in one call, which bounds the script's run time (Redis runs nothing else meanwhile).
pub const MAX_GROUPS_PER_CALL: usize = 256;

/// One script call for a list of groups of one slot, answering one outcome per group in order.
pub type Call =
    Arc<dyn Fn(Vec<Group>) -> BoxFuture<'static, Result<Vec<GroupOutcome>, StoreError>> + Send + Sync>;

type Reply = Result<Vec<GroupOutcome>, StoreError>;

/// The per-slot queues.
pub struct Coalescer {
    call: Call,
    delay: Duration,
    timeout: Duration,
    slots: Mutex<HashMap<u16, Queue>>,
}

#[derive(Default)]
struct Queue {
    waiting: Vec<Waiter>,
    in_flight: usize,
    last_sent: Option<Instant>,
}

struct Waiter {
    groups: Vec<Group>,
    reply: oneshot::Sender<Reply>,
}

impl Coalescer {
    /// Coalesces calls to `call`; a queued request waits about `delay` at most before a call of
    /// its own goes out, and gets [`StoreError::Timeout`] after `timeout` in all.
    pub fn new(call: Call, delay: Duration, timeout: Duration) -> Arc<Coalescer> {
        Arc::new(Coalescer { call, delay, timeout, slots: Mutex::default() })
    }

    /// Evaluates `groups` (all of slot `slot`) in the next call for that slot.
    pub async fn submit(self: &Arc<Self>, slot: u16, groups: Vec<Group>) -> Reply {
        let (reply, answer) = oneshot::channel();
        {
            let mut slots = self.lock();
            let queue = slots.entry(slot).or_default();
            queue.waiting.push(Waiter { groups, reply });
            let latest_is_slow = queue.last_sent.is_none_or(|t| t.elapsed() >= self.delay);
            if queue.in_flight == 0 || (queue.in_flight < MAX_IN_FLIGHT && latest_is_slow) {
                self.send(slot, queue);
            } else if queue.waiting.len() == 1 {
                let me = self.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(me.delay).await;
                    me.flush(slot);
                });
            }
        }
        match tokio::time::timeout(self.timeout, answer).await {
            Ok(Ok(reply)) => reply,
            Ok(Err(_)) => Err(StoreError::Redis("the coalesced call was abandoned".into())),
            Err(_) => Err(StoreError::Timeout(self.timeout)),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u16, Queue>> {
        self.slots.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    // The delay has passed for a queue that is still waiting on slow calls.
    fn flush(self: &Arc<Self>, slot: u16) {
        let mut slots = self.lock();
        if let Some(queue) = slots.get_mut(&slot) {
            if !queue.waiting.is_empty() && queue.in_flight < MAX_IN_FLIGHT {
                self.send(slot, queue);
            }
        }
    }

    // Sends the waiting requests (whole requests, up to the group limit) as one call.
    fn send(self: &Arc<Self>, slot: u16, queue: &mut Queue) {
        queue.waiting.retain(|w| !w.reply.is_closed());
        if queue.waiting.is_empty() {
            return;
        }
        let mut taken = 0;
        let mut groups = 0;
        for waiter in &queue.waiting {
            if taken > 0 && groups + waiter.groups.len() > MAX_GROUPS_PER_CALL {
                break;
            }
            taken += 1;
            groups += waiter.groups.len();
        }
        let waiters: Vec<Waiter> = queue.waiting.drain(..taken).collect();
        queue.in_flight += 1;
        queue.last_sent = Some(Instant::now());
        let me = self.clone();
        tokio::spawn(async move {
            let sizes: Vec<usize> = waiters.iter().map(|w| w.groups.len()).collect();
            let (all, replies): (Vec<Vec<Group>>, Vec<_>) =
                waiters.into_iter().map(|w| (w.groups, w.reply)).unzip();
            let result = (me.call)(all.into_iter().flatten().collect()).await;
            match result {
                Ok(outcomes) => {
                    let mut outcomes = outcomes.into_iter();
                    for (reply, size) in replies.into_iter().zip(sizes) {
                        let _ = reply.send(Ok(outcomes.by_ref().take(size).collect()));
                    }
                }
                Err(error) => {
                    for reply in replies {
                        let _ = reply.send(Err(error.clone()));
                    }
                }
            }
            let mut slots = me.lock();
            if let Some(queue) = slots.get_mut(&slot) {
                queue.in_flight -= 1;
                me.send(slot, queue);
                if queue.in_flight == 0 && queue.waiting.is_empty() {
                    slots.remove(&slot);
                }
            }
        });
    }
}

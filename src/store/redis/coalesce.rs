//! Every script call goes through here: hot-tenant coalescing, a bound on the calls in flight per
//! slot, and refunds of replies that come after their caller gave up.
//!
//! **Coalescing.** Without it every request is its own EVALSHA, and a hot tenant (all of whose
//! buckets share one slot, hence one shard) is capped by the single-key script rate of that shard.
//! The coalescer keeps one queue per slot. A request for an idle slot goes out at once, so light
//! load pays nothing; requests that arrive while a call for their slot is in flight wait for it
//! and then leave together, as one call whose groups the script evaluates in arrival order with
//! running state, exactly as the same calls one after another would. Decisions stay exact: only
//! the number of round trips changes. The wait is bounded twice: a request that finds the slot's
//! latest call older than the delay starts another call (up to [`MAX_IN_FLIGHT`] per slot)
//! instead of waiting, and a timer does the same for a queue nobody else arrives to (Tokio's
//! timers tick in milliseconds, so that second bound is the delay rounded up to one). With a delay
//! of zero nothing is held back to batch it; calls queue only beyond [`MAX_IN_FLIGHT_UNCOALESCED`]
//! per slot, which bounds what a hung server can accumulate.
//!
//! **Deadlines and late replies.** A caller waits at most its deadline; a request whose caller
//! gave up before it was sent is dropped from the queue unsent, so it takes no tokens. A call that
//! was sent runs on in its own task until its reply comes (or the connection's longer response
//! timeout passes). When the reply shows that a group's script run took tokens for a caller that
//! has already answered, the group's [`LateReply`] decides: `GiveBack` sends the refund at once,
//! `Keep` leaves the tokens taken. Both are counted in `tollgate_store_late_replies_total`. A
//! refund raises balances nobody was told about, so it moves [`Coalescer::refunds`] before it
//! is sent and once it is answered: the store's epoch, which voids what a local pre-check
//! learnt before.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use tokio::sync::oneshot;

use crate::bucket::{refund, Group, GroupOutcome};
use crate::store::{LateReply, StoreError};
use crate::telemetry::logs::{self, ErrorChain};

/// Most concurrent calls per slot when coalescing; beyond, requests queue for the next call.
pub const MAX_IN_FLIGHT: usize = 4;
/// Most concurrent calls per slot with coalescing off.
pub const MAX_IN_FLIGHT_UNCOALESCED: usize = 64;
/// Most bucket operations in one call, which bounds the script's run time (Redis runs nothing
/// else meanwhile) and the size of its arguments; a larger request still goes out, alone.
pub const MAX_OPS_PER_CALL: usize = 256;

/// One script call for a list of groups of one slot, answering one outcome per group in order.
/// It borrows the groups: they stay with the call's task, which needs them again for refunds.
pub type Call = Arc<
    dyn for<'a> Fn(u16, &'a [Group]) -> BoxFuture<'a, Result<Vec<GroupOutcome>, StoreError>> + Send + Sync,
>;

type Reply = Result<Vec<GroupOutcome>, StoreError>;

/// The per-slot queues.
pub struct Coalescer {
    call: Call,
    delay: Duration,
    max_in_flight: usize,
    deadline: Duration,
    slots: Mutex<HashMap<u16, Queue>>,
    // Moves twice per late refund: when it is sent and when it is answered.
    refunds: Arc<AtomicU64>,
}

#[derive(Default)]
struct Queue {
    waiting: Vec<Waiter>,
    in_flight: usize,
    last_sent: Option<Instant>,
}

struct Waiter {
    // Its groups until they are sent; then how many there were.
    groups: Vec<Group>,
    count: usize,
    late: Late,
    reply: oneshot::Sender<Reply>,
}

/// What becomes of the tokens of a reply that comes after its caller gave up, read when it comes.
#[derive(Debug, Clone)]
pub enum Late {
    /// Decided when the call was made.
    Fixed(LateReply),
    /// Kept unless the flag is set by then: for the parts of a request split over Cluster slots,
    /// which another part's denial may decide after this part failed.
    KeepUnlessDenied(Arc<AtomicBool>),
}

impl Late {
    fn now(&self) -> LateReply {
        match self {
            Late::Fixed(late) => *late,
            Late::KeepUnlessDenied(denied) if denied.load(Ordering::SeqCst) => LateReply::GiveBack,
            Late::KeepUnlessDenied(_) => LateReply::Keep,
        }
    }
}

impl Coalescer {
    /// Dispatches calls to `call`; a queued request waits about `delay` at most before a call of
    /// its own goes out (zero: no coalescing), and gets [`StoreError::Timeout`] after `deadline`.
    pub fn new(call: Call, delay: Duration, deadline: Duration) -> Arc<Coalescer> {
        let max_in_flight = if delay.is_zero() { MAX_IN_FLIGHT_UNCOALESCED } else { MAX_IN_FLIGHT };
        Arc::new(Coalescer {
            call,
            delay,
            max_in_flight,
            deadline,
            slots: Mutex::default(),
            refunds: Arc::default(),
        })
    }

    /// A counter that moves whenever a late refund may have raised balances: before it is sent
    /// and once it is answered (or failed).
    pub fn refunds(&self) -> u64 {
        self.refunds.load(Ordering::SeqCst)
    }

    /// Evaluates `groups` (all of slot `slot`) in the next call for that slot.
    pub async fn submit(self: &Arc<Self>, slot: u16, groups: Vec<Group>, late: Late) -> Reply {
        let (reply, answer) = oneshot::channel();
        {
            let mut slots = self.lock();
            let queue = slots.entry(slot).or_default();
            queue.waiting.push(Waiter { count: groups.len(), groups, late, reply });
            let latest_is_slow = queue.last_sent.is_none_or(|t| t.elapsed() >= self.delay);
            if queue.in_flight == 0 || (queue.in_flight < self.max_in_flight && latest_is_slow) {
                self.send(slot, queue);
            } else if queue.waiting.len() == 1 {
                let me = self.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(me.delay).await;
                    me.flush(slot);
                });
            }
        }
        let deadline = crate::store::deadline_or(self.deadline);
        match tokio::time::timeout(deadline, answer).await {
            Ok(Ok(reply)) => reply,
            Ok(Err(_)) => Err(StoreError::Protocol("the call was abandoned".into())),
            Err(_) => Err(StoreError::Timeout(deadline)),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u16, Queue>> {
        self.slots.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    // The delay has passed for a queue that is still waiting on slow calls.
    fn flush(self: &Arc<Self>, slot: u16) {
        let mut slots = self.lock();
        if let Some(queue) = slots.get_mut(&slot) {
            if !queue.waiting.is_empty() && queue.in_flight < self.max_in_flight {
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
        // Without coalescing, one request per call.
        let mut taken = 0;
        let mut ops = 0;
        for waiter in &queue.waiting {
            let size: usize = waiter.groups.iter().map(Vec::len).sum();
            let full = ops + size > MAX_OPS_PER_CALL || self.delay.is_zero();
            if taken > 0 && full {
                break;
            }
            taken += 1;
            ops += size;
        }
        let mut waiters: Vec<Waiter> = queue.waiting.drain(..taken).collect();
        queue.in_flight += 1;
        queue.last_sent = Some(Instant::now());
        let me = self.clone();
        tokio::spawn(async move {
            // The groups move into the call (no copy of their keys); each waiter keeps its count.
            let mut all: Vec<Group> = Vec::with_capacity(waiters.iter().map(|w| w.groups.len()).sum());
            for waiter in &mut waiters {
                all.append(&mut waiter.groups);
            }
            let result = (me.call)(slot, &all).await;
            me.answer(slot, waiters, all, result);
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

    // Hands each waiter its outcomes; refunds what was taken for waiters that gave up and asked
    // for their tokens back, in a task of its own so that the slot's next calls need not wait.
    fn answer(&self, slot: u16, waiters: Vec<Waiter>, groups: Vec<Group>, result: Reply) {
        let mut late_refund = Group::new();
        match result {
            Ok(outcomes) => {
                let mut outcomes = outcomes.into_iter();
                let mut rest: &[Group] = &groups;
                for waiter in waiters {
                    let mine: Vec<GroupOutcome> = outcomes.by_ref().take(waiter.count).collect();
                    let (sent, after) = rest.split_at(waiter.count.min(rest.len()));
                    rest = after;
                    let Err(Ok(mine)) = waiter.reply.send(Ok(mine)) else { continue };
                    let taken: Vec<_> =
                        sent.iter().zip(&mine).flat_map(|(g, o)| refund(g, o)).map(|(_, op)| op).collect();
                    if taken.is_empty() {
                        continue;
                    }
                    let action = match waiter.late.now() {
                        LateReply::GiveBack => {
                            late_refund.extend(taken);
                            "refunded"
                        }
                        LateReply::Keep => "kept",
                    };
                    metrics::counter!("tollgate_store_late_replies_total", "action" => action).increment(1);
                }
            }
            Err(error) => {
                for waiter in waiters {
                    let _ = waiter.reply.send(Err(error.clone()));
                }
            }
        }
        if late_refund.is_empty() {
            return;
        }
        metrics::counter!("tollgate_store_refunds_total", "reason" => "late").increment(1);
        let call = self.call.clone();
        let refunds = self.refunds.clone();
        refunds.fetch_add(1, Ordering::SeqCst);
        tokio::spawn(async move {
            let result = call(slot, std::slice::from_ref(&late_refund)).await;
            refunds.fetch_add(1, Ordering::SeqCst);
            if let Err(error) = result {
                metrics::counter!("tollgate_store_refund_failures_total").increment(1);
                if let Some(held_back) = logs::throttled("late_refund_failed") {
                    tracing::error!(error = %ErrorChain(&error), slot, held_back, "could not refund the tokens of a late reply");
                }
            }
        });
    }
}

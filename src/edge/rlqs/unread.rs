//! A stream's answers on their way to its Envoy, bounded in bytes.
//!
//! The session writes answers ([`Answers::send`], [`send_all`], which also counts a stream ended
//! for answers left unread); tonic reads them ([`Unread`]) as fast as the
//! Envoy takes them off the connection. An Envoy that stops reading leaves them queued here, so
//! the queue holds at most `max_bytes` of them and at most [`MAX_UNREAD_MESSAGES`] (one answer of
//! any size always fits an empty queue); a writer that finds no room waits, and past `deadline`
//! (or finding an answer queued longer than `deadline`, however few bytes wait) the stream is
//! ended: the queue is emptied, its memory given back, and what tonic reads next is
//! RESOURCE_EXHAUSTED. The message bound also keeps a slow reader's answers bundled: while the
//! writer waits, the pool's events gather, and go out together in fewer, larger answers.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use envoy_types::pb::envoy::service::rate_limit_quota::v3::RateLimitQuotaResponse;
use prost::Message as _;
use tokio::sync::Notify;
use tonic::Status;

type Item = Result<RateLimitQuotaResponse, Status>;

/// Most answers queued for one stream, whatever their size.
pub const MAX_UNREAD_MESSAGES: usize = 64;

#[derive(Default)]
struct Queue {
    // Each answer, its size, and when it was queued.
    items: VecDeque<(Item, usize, tokio::time::Instant)>,
    bytes: usize,
    // Set when the stream is ended for not reading: what the reader gets next.
    ended: Option<Status>,
    closed: bool,
    writer_gone: bool,
    reader_gone: bool,
    reader: Option<Waker>,
}

struct Shared {
    queue: Mutex<Queue>,
    room: Notify,
    max_bytes: usize,
    deadline: Duration,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Why an answer was not queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotSent {
    /// The Envoy is gone.
    Gone,
    /// The Envoy left the queue full past the deadline: the stream is ended.
    Unread,
}

/// The session's side: where answers are written.
pub struct Answers(Arc<Shared>);

/// tonic's side: the stream of answers it sends.
pub struct Unread(Arc<Shared>);

/// A queue of at most `max_bytes` of answers, whose writer gives up after `deadline` without
/// room.
pub fn unread(max_bytes: usize, deadline: Duration) -> (Answers, Unread) {
    let shared = Arc::new(Shared { queue: Mutex::default(), room: Notify::new(), max_bytes, deadline });
    (Answers(shared.clone()), Unread(shared))
}

impl Answers {
    /// Queues `item` once there is room for it.
    pub async fn send(&self, item: Item) -> Result<(), NotSent> {
        let size = match &item {
            Ok(response) => response.encoded_len(),
            Err(_) => 0,
        };
        let shared = &self.0;
        let now = tokio::time::Instant::now();
        let deadline = now + shared.deadline;
        loop {
            let room = shared.room.notified();
            tokio::pin!(room);
            room.as_mut().enable();
            {
                let mut queue = shared.lock();
                if queue.reader_gone || queue.closed {
                    return Err(NotSent::Gone);
                }
                // An answer not taken for the deadline, however few bytes wait: the transport has
                // stopped taking them (the Envoy's flow-control window is shut), and a stream with
                // few buckets would take minutes to fill the queue.
                if queue.items.front().is_some_and(|(_, _, at)| now.duration_since(*at) >= shared.deadline) {
                    end(&mut queue, shared);
                    return Err(NotSent::Unread);
                }
                let room = queue.items.len() < MAX_UNREAD_MESSAGES && queue.bytes + size <= shared.max_bytes;
                if queue.items.is_empty() || room {
                    queue.bytes += size;
                    queue.items.push_back((item, size, tokio::time::Instant::now()));
                    if let Some(reader) = queue.reader.take() {
                        reader.wake();
                    }
                    return Ok(());
                }
            }
            if tokio::time::timeout_at(deadline, room).await.is_err() {
                end(&mut shared.lock(), shared);
                return Err(NotSent::Unread);
            }
        }
    }
}

// Ends the stream for answers left unread: the queue emptied, its memory given back, and what
// the reader gets next RESOURCE_EXHAUSTED.
fn end(queue: &mut Queue, shared: &Shared) {
    queue.items.clear();
    queue.items.shrink_to_fit();
    queue.bytes = 0;
    queue.closed = true;
    queue.ended = Some(Status::resource_exhausted(format!(
        "the stream's answers went unread for {:?} (at most {} bytes wait): ended",
        shared.deadline, shared.max_bytes
    )));
    if let Some(reader) = queue.reader.take() {
        reader.wake();
    }
}

impl Drop for Answers {
    fn drop(&mut self) {
        let mut queue = self.0.lock();
        queue.writer_gone = true;
        if let Some(reader) = queue.reader.take() {
            reader.wake();
        }
    }
}

impl futures::Stream for Unread {
    type Item = Item;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Item>> {
        let shared = &self.0;
        let mut queue = shared.lock();
        if let Some(status) = queue.ended.take() {
            // Ended for not reading: this, then nothing.
            queue.writer_gone = true;
            return Poll::Ready(Some(Err(status)));
        }
        if let Some((item, size, _)) = queue.items.pop_front() {
            queue.bytes -= size;
            drop(queue);
            shared.room.notify_one();
            return Poll::Ready(Some(item));
        }
        if queue.writer_gone {
            return Poll::Ready(None);
        }
        queue.reader = Some(cx.waker().clone());
        Poll::Pending
    }
}

impl Drop for Unread {
    fn drop(&mut self) {
        self.0.lock().reader_gone = true;
        self.0.room.notify_one();
    }
}

/// Sends `responses` in order; false once the Envoy is gone, or has left its answers unread past
/// the deadline (the stream is then ended with RESOURCE_EXHAUSTED).
pub async fn send_all(answers: &Answers, responses: Vec<RateLimitQuotaResponse>) -> bool {
    for response in responses {
        match answers.send(Ok(response)).await {
            Ok(()) => {}
            Err(NotSent::Gone) => return false,
            Err(NotSent::Unread) => {
                metrics::counter!("tollgate_rlqs_stream_errors_total", "reason" => "unread").increment(1);
                if let Some(held_back) = crate::telemetry::logs::throttled("rlqs_unread") {
                    tracing::warn!(held_back, "an RLQS stream left its answers unread past the deadline; ended with RESOURCE_EXHAUSTED, its leases given back");
                }
                return false;
            }
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt as _;

    fn response(bytes: usize) -> Item {
        use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::BucketAction;
        use envoy_types::pb::envoy::service::rate_limit_quota::v3::BucketId;
        let id = BucketId { bucket: [("k".to_owned(), "v".repeat(bytes))].into_iter().collect() };
        Ok(RateLimitQuotaResponse {
            bucket_action: vec![BucketAction { bucket_id: Some(id), ..Default::default() }],
        })
    }

    #[tokio::test]
    async fn an_answer_left_unread_past_the_deadline_ends_the_stream_however_small() {
        let (answers, mut unread) = unread(1_000_000, Duration::from_millis(200));
        answers.send(response(10)).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        answers.send(response(10)).await.unwrap();
        // Far under the byte and message bounds, but the first answer has waited 200 ms.
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(answers.send(response(10)).await, Err(NotSent::Unread));
        assert_eq!(unread.next().await.unwrap().unwrap_err().code(), tonic::Code::ResourceExhausted);
    }

    #[tokio::test]
    async fn a_reader_that_stops_ends_the_stream_after_the_deadline() {
        let (answers, mut unread) = unread(1_000, Duration::from_millis(200));
        answers.send(response(600)).await.unwrap();
        // No room for a second one until the first is read.
        let waiting = tokio::spawn(async move {
            let second = answers.send(response(600)).await;
            (answers, second)
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(unread.next().await.unwrap().is_ok(), "the first answer");
        let (answers, second) = waiting.await.unwrap();
        assert_eq!(second, Ok(()), "room once the first was read");
        // The reader stops: the third waits out the deadline and ends the stream.
        assert_eq!(answers.send(response(600)).await, Err(NotSent::Unread));
        let ended = unread.next().await.unwrap().unwrap_err();
        assert_eq!(ended.code(), tonic::Code::ResourceExhausted);
        assert!(unread.next().await.is_none(), "and nothing after");
        assert_eq!(answers.send(response(1)).await, Err(NotSent::Gone));
    }
}

//! Bounds on connections: what a peer's connections can take from tollgate, whichever port they
//! reach.
//!
//! * **A cap per port, a share per peer** ([`Gate`], in `gate.rs`): at most `max_connections`
//!   open on each of the gRPC and HTTP ports, at most `--max-connections-per-source` from one
//!   address, and a small budget of its own for connections still opening (TLS handshake, first
//!   bytes), so that neither one peer nor a flood of half-open connections takes a port; one past
//!   a bound is closed at once, counted (`tollgate_connections_refused_total{port, reason}`) and
//!   logged at most once a second. Each port has its own, so a flood on one never takes the
//!   other's.
//! * **File descriptors**: at start tollgate raises its soft limit to the hard one
//!   ([`raise_fd_limit`]), and the default cap of each port leaves [`FD_RESERVE`] descriptors
//!   for Redis, PostgreSQL, the config files and the watchers, so that a flood of connections
//!   cannot stop Redis reconnects.
//! * **Idle connections** ([`Conn`]): a connection that moves no byte either way for its port's
//!   idle timeout is closed (reads and writes fail with `TimedOut`).
//! * **The HTTP port's request heads** ([`serve_http`]): a client has `header_read_timeout` to
//!   send a request's head, however slowly it trickles it in; HTTP/1 only, as the port serves.
//! * gRPC connections also live at most `max_age`, then get `max_age_grace` to finish (tonic's
//!   `max_connection_age`), as envoyproxy/ratelimit's `GRPC_MAX_CONNECTION_AGE` does.
//! * `accept` failures (out of descriptors, say) are logged at most once a second, with how many
//!   were held back, and the accept loop backs off instead of spinning.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio::time::{Instant, Sleep};

pub use self::gate::{Admission, Gate, Opening, Refusal, OPENING_DEADLINE};
use crate::telemetry::logs;

mod gate;

/// Descriptors left out of the ports' default caps, for Redis, PostgreSQL, files and watchers.
pub const FD_RESERVE: u64 = 128;
/// The most a port's default cap is, however many descriptors there are.
pub const MAX_CONNECTIONS_DEFAULT: usize = 10_000;

/// The connection bounds of one server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnLimits {
    /// Most connections open on each port; `None` for the default from the descriptor limit
    /// ([`max_connections`]).
    pub max_connections: Option<usize>,
    /// Most connections one source address may have open on a port; `None` for a quarter of
    /// the port's cap.
    pub max_per_source: Option<usize>,
    /// How long an HTTP client has to send a request's head.
    pub header_read_timeout: Duration,
    /// How long an HTTP connection may move no byte.
    pub http_idle_timeout: Duration,
    /// How long a gRPC connection may move no byte (Envoy's connections are long-lived; an RLQS
    /// stream reports every 5 s).
    pub grpc_idle_timeout: Duration,
    /// How long a gRPC connection lives before it is asked to go away, and the grace it gets.
    pub max_age: Duration,
    /// The grace after `max_age`.
    pub max_age_grace: Duration,
}

impl Default for ConnLimits {
    fn default() -> Self {
        ConnLimits {
            max_connections: None,
            max_per_source: None,
            header_read_timeout: Duration::from_secs(10),
            http_idle_timeout: Duration::from_secs(60),
            grpc_idle_timeout: Duration::from_secs(600),
            max_age: Duration::from_secs(24 * 3600),
            max_age_grace: Duration::from_secs(3600),
        }
    }
}

/// Raises the soft limit on open files to the hard one; the limit in force afterwards (the soft
/// one as it was, if it could not be raised).
pub fn raise_fd_limit() -> u64 {
    match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(limit) => limit,
        Err(error) => {
            tracing::warn!(%error, "could not raise the open-files limit");
            open_files_limit()
        }
    }
}

// The soft limit on open files in force (1,024, the usual default, if it cannot be read).
fn open_files_limit() -> u64 {
    rlimit::getrlimit(rlimit::Resource::NOFILE).map_or(1024, |(soft, _)| soft)
}

/// Each port's cap: `limits.max_connections`, else half of what the open-files limit in force
/// leaves after [`FD_RESERVE`], at most [`MAX_CONNECTIONS_DEFAULT`].
pub fn max_connections(limits: &ConnLimits) -> usize {
    limits.max_connections.unwrap_or_else(|| {
        let per_port = open_files_limit().saturating_sub(FD_RESERVE) / 2;
        usize::try_from(per_port).unwrap_or(usize::MAX).clamp(1, MAX_CONNECTIONS_DEFAULT)
    })
}

/// A port's gate from `limits`: its cap, an eighth of it for connections still opening, and each
/// source's share.
pub fn gate(port: &'static str, limits: &ConnLimits) -> Gate {
    let max = max_connections(limits);
    Gate::new(port, max, limits.max_per_source.unwrap_or(max / 4))
}

/// How a port admits its connections: its gate, and how long one may be idle.
#[derive(Clone)]
pub struct Admitted {
    /// The port's cap.
    pub gate: Gate,
    /// How long a connection may move no byte.
    pub idle: Duration,
}

/// Logs a failed `accept` at most once a second, and backs off a little: out of descriptors,
/// the next accept would fail at once again.
pub async fn accept_failed(error: &io::Error) {
    if let Some(held_back) = logs::throttled("accept_failed") {
        tracing::warn!(%error, held_back, "accept failed");
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
}

/// An admitted connection: its place is given back when it closes, and it is closed when it
/// moves no byte for `idle`.
///
/// It also gathers writes. HTTP/2 answers of one connection are produced by one task per stream,
/// and each wakes the connection's task, which then flushed at once: one `writev` per answer
/// although one read brings in 7-14 requests (perf: `writev` and the loopback delivery it pays
/// for were 12 % of a decision's CPU). So the first write of each flush yields once instead: the
/// connection's task goes to the back of its runtime's queue (Tokio treats a task that wakes
/// itself while running as yielding), the other streams whose answers are ready run first and
/// add theirs, and one `writev` carries them all. The cost is one more poll of the connection's
/// task per flush, not a timer: nothing waits for a batch that is not already there.
pub struct Conn<T> {
    io: T,
    idle: Duration,
    deadline: Pin<Box<Sleep>>,
    // Whether this flush has yielded once already (reset by `poll_flush`, which ends a flush).
    yielded: bool,
    _admission: Admission,
}

impl<T> Conn<T> {
    /// `io`, holding `admission`, closed after `idle` without a byte.
    pub fn new(io: T, admission: Admission, idle: Duration) -> Conn<T> {
        Conn { io, idle, deadline: Box::pin(tokio::time::sleep(idle)), yielded: false, _admission: admission }
    }

    // Pending once per flush, with the task woken at once: see the type's comment.
    fn gather(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if self.yielded {
            return Poll::Ready(());
        }
        self.yielded = true;
        cx.waker().wake_by_ref();
        Poll::Pending
    }

    fn progress(&mut self) {
        let at = Instant::now() + self.idle;
        // Resetting on every read would cost a timer update each; once a second is enough.
        if at > self.deadline.deadline() + Duration::from_secs(1) {
            self.deadline.as_mut().reset(at);
        }
    }

    // Pending I/O: an error once the connection has been idle too long.
    fn idle_for_too_long(&mut self, cx: &mut Context<'_>) -> Poll<io::Error> {
        self.deadline.as_mut().poll(cx).map(|()| io::Error::new(io::ErrorKind::TimedOut, "connection idle"))
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Conn<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match Pin::new(&mut self.io).poll_read(cx, buf) {
            Poll::Ready(result) => {
                self.progress();
                Poll::Ready(result)
            }
            Poll::Pending => self.idle_for_too_long(cx).map(Err),
        }
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Conn<T> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        ready!(self.gather(cx));
        match Pin::new(&mut self.io).poll_write(cx, data) {
            Poll::Ready(result) => {
                self.progress();
                Poll::Ready(result)
            }
            Poll::Pending => self.idle_for_too_long(cx).map(Err),
        }
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.yielded = false;
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        ready!(self.gather(cx));
        match Pin::new(&mut self.io).poll_write_vectored(cx, bufs) {
            Poll::Ready(result) => {
                self.progress();
                Poll::Ready(result)
            }
            Poll::Pending => self.idle_for_too_long(cx).map(Err),
        }
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

impl<T: tonic::transport::server::Connected> tonic::transport::server::Connected for Conn<T> {
    type ConnectInfo = T::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

/// Serves `router` over HTTP/1 on `listener` within `gate` and `limits` until `stop` resolves,
/// then lets the requests in flight finish (connections close once idle).
pub async fn serve_http(
    listener: TcpListener,
    router: Router,
    gate: Gate,
    limits: ConnLimits,
    stop: impl Future<Output = ()>,
) {
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(limits.header_read_timeout);
    tokio::pin!(stop);
    loop {
        let (tcp, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(conn) => conn,
                Err(error) => {
                    accept_failed(&error).await;
                    continue;
                }
            },
            () = &mut stop => break,
        };
        let Some(opening) = gate.open(peer.ip()) else { continue };
        let _ = tcp.set_nodelay(true);
        let (http, router, graceful_watch) = (http.clone(), router.clone(), graceful.watcher());
        tokio::spawn(async move {
            // Open: the first bytes of a request within the opening deadline (the head then has
            // the header timeout), so that silent connections hold only the opening budget.
            let first_bytes = async {
                let mut first = [0u8; 1];
                matches!(tcp.peek(&mut first).await, Ok(1)).then_some(tcp)
            };
            let Some((tcp, admission)) = opening.complete(first_bytes).await else { return };
            let io = TokioIo::new(Conn::new(tcp, admission, limits.http_idle_timeout));
            let service = TowerToHyperService::new(router);
            // A connection ends with an error when its client goes or times out: nothing to say.
            let _ = graceful_watch.watch(http.serve_connection(io, service)).await;
        });
    }
    drop(listener);
    graceful.shutdown().await;
}

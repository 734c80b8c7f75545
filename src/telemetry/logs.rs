//! Structured logs.
//!
//! Logs go to stderr through `tracing`, filtered by `RUST_LOG` (default `info`), as text or, with
//! `--log-format json`, one JSON object per line for log pipelines. Nothing secret is logged:
//! Redis targets are described by address only.
//!
//! Logs stay readable under faults: what can happen once per request (a store failure answered
//! by the failure mode) is written at most once per [`THROTTLE`] per kind, with the number of
//! occurrences held back since the last line ([`throttled`]); connection trouble is logged once
//! per change of state (`store/redis/node.rs`). Metrics keep the exact counts.

use std::collections::HashMap;
use std::io::IsTerminal;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tracing_subscriber::EnvFilter;

/// Least time between two lines of one throttled kind.
pub const THROTTLE: Duration = Duration::from_secs(1);

static LAST: Mutex<Option<HashMap<&'static str, (Instant, u64)>>> = Mutex::new(None);

/// Whether a line of `kind` may be written now: `Some(n)`, with `n` the occurrences held back
/// since the last line; `None` (and the occurrence counted) within [`THROTTLE`] of it.
pub fn throttled(kind: &'static str) -> Option<u64> {
    let mut last = LAST.lock().unwrap_or_else(|p| p.into_inner());
    let (at, held) =
        last.get_or_insert_with(HashMap::new).entry(kind).or_insert((Instant::now() - THROTTLE, 0));
    if at.elapsed() < THROTTLE {
        *held += 1;
        return None;
    }
    *at = Instant::now();
    Some(std::mem::take(held))
}

/// Installs the global subscriber; `json` selects JSON lines; `traces` adds the OTLP layer.
pub fn init(json: bool, traces: Option<&super::traces::Traces>) {
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    use tracing_subscriber::Layer as _;

    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    let fmt = if json { fmt.json().boxed() } else { fmt.boxed() };
    // Each layer has its own filter: RUST_LOG decides what is logged, not what is traced.
    tracing_subscriber::registry().with(fmt.with_filter(filter)).with(traces.map(|t| t.layer())).init();
}

/// Displays an error with its causes, `outer: inner: innermost`, each said once: a cause whose
/// text the message already holds (many errors repeat their source's text) is left out.
pub struct ErrorChain<'a>(pub &'a (dyn std::error::Error + 'static));

impl std::fmt::Display for ErrorChain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut said = self.0.to_string();
        f.write_str(&said)?;
        let mut source = self.0.source();
        while let Some(cause) = source {
            let text = cause.to_string();
            if !said.contains(&text) {
                write!(f, ": {text}")?;
                said.push_str(&text);
            }
            source = cause.source();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("cannot listen on 127.0.0.1:1: {0}")]
    struct Repeats(#[source] std::io::Error);

    #[derive(Debug, thiserror::Error)]
    #[error("loading the config")]
    struct Outer(#[source] Repeats);

    #[test]
    fn each_cause_is_said_once() {
        let io = std::io::Error::new(std::io::ErrorKind::AddrInUse, "Address already in use (os error 98)");
        let e = Outer(Repeats(io));
        assert_eq!(
            ErrorChain(&e).to_string(),
            "loading the config: cannot listen on 127.0.0.1:1: Address already in use (os error 98)"
        );
    }

    #[test]
    fn throttling_counts_what_it_holds_back() {
        assert_eq!(throttled("test-kind"), Some(0));
        assert_eq!(throttled("test-kind"), None);
        assert_eq!(throttled("test-kind"), None);
        assert_eq!(throttled("other-kind"), Some(0), "kinds are throttled apart");
    }
}

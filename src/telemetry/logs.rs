//! Structured logs.
//!
//! Logs go to stderr through `tracing`, filtered by `RUST_LOG` (default `info`), as text or, with
//! `--log-format json`, one JSON object per line for log pipelines. Nothing secret is logged:
//! Redis targets are described by address only.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

/// Installs the global subscriber; `json` selects JSON lines.
pub fn init(json: bool) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    if json {
        builder.json().init();
    } else {
        builder.init();
    }
}

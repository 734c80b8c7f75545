//! Config hot reload: new rules without a restart, and never a bad config in force.
//!
//! The config path is watched (its directory, for a single file), so both an edited file and a
//! Kubernetes ConfigMap update (the kubelet swaps the `..data` symlink) are seen. Changes are
//! debounced, then the whole path is loaded and validated exactly as at start-up and, if it is
//! valid and different, swapped in atomically: requests already running finish on the rules they
//! started with. A config that fails validation is rejected with its file, position and problem
//! in the log, the previous one keeps serving, and the failure is counted. `SIGHUP` forces a
//! reload. Bucket sizes travel with every store call, so a changed limit applies to the next
//! request.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use notify::{RecursiveMode, Watcher};
use tokio::sync::mpsc;

use crate::config::{ConfigError, RuleSet};

/// How long the files must be quiet before a reload, so one update is loaded once.
const DEBOUNCE: Duration = Duration::from_millis(200);

/// Reloads the rules at `path` into `rules`.
pub struct Reloader {
    path: PathBuf,
    rules: Arc<ArcSwap<RuleSet>>,
}

impl Reloader {
    /// A reloader for the config at `path`, serving into `rules`.
    pub fn new(path: &Path, rules: Arc<ArcSwap<RuleSet>>) -> Self {
        Reloader { path: path.to_owned(), rules }
    }

    /// Loads the config now and swaps it in if it changed (or if `force`); returns whether it
    /// was swapped. On error the rules in force stay.
    pub fn reload(&self, force: bool) -> Result<bool, ConfigError> {
        let rules = RuleSet::load(&self.path)?;
        if !force && rules.fingerprint() == self.rules.load().fingerprint() {
            return Ok(false);
        }
        self.rules.store(Arc::new(rules));
        Ok(true)
    }

    // Reloads, then logs and counts the result.
    fn reload_and_report(&self, force: bool) {
        match self.reload(force) {
            Ok(swapped) => {
                metrics::gauge!("tollgate_config_last_reload_successful").set(1.0);
                if swapped {
                    metrics::counter!("tollgate_config_reloads_total", "result" => "success").increment(1);
                    let rules = self.rules.load();
                    let domains: Vec<&str> = rules.domains().map(|d| d.name.as_str()).collect();
                    tracing::info!(path = %self.path.display(), ?domains, forced = force, "config reloaded");
                } else {
                    tracing::debug!(path = %self.path.display(), "config unchanged");
                }
            }
            Err(error) => {
                metrics::gauge!("tollgate_config_last_reload_successful").set(0.0);
                metrics::counter!("tollgate_config_reloads_total", "result" => "failure").increment(1);
                tracing::error!(%error, "config rejected; the previous config keeps serving");
            }
        }
    }

    /// Watches the path and `SIGHUP` for as long as the returned tasks run.
    pub fn spawn(self) -> Result<Vec<tokio::task::JoinHandle<()>>, notify::Error> {
        let watched = if self.path.is_dir() { self.path.clone() } else { parent(&self.path) };
        let mut hangup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
            .map_err(|e| notify::Error::generic(&format!("cannot watch SIGHUP: {e}")))?;
        metrics::gauge!("tollgate_config_last_reload_successful").set(1.0);
        let reloader = Arc::new(self);
        let on_file = reloader.clone();
        let files = on_change(vec![watched], move || on_file.reload_and_report(false))?;
        let signal = tokio::spawn(async move {
            while hangup.recv().await.is_some() {
                reloader.reload_and_report(true);
            }
        });
        Ok(vec![files, signal])
    }
}

/// The directory a file lives in (`.` for a bare file name).
pub fn parent(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_owned(),
        _ => PathBuf::from("."),
    }
}

/// Calls `action` whenever something in `dirs` changes (debounced), until the task is dropped.
///
/// Directories are watched rather than files, so that files replaced by rename (editors,
/// Kubernetes ConfigMap and Secret volumes, certificate managers) are seen too.
pub fn on_change(
    dirs: Vec<PathBuf>,
    mut action: impl FnMut() + Send + 'static,
) -> Result<tokio::task::JoinHandle<()>, notify::Error> {
    let (changed_tx, mut changed) = mpsc::channel::<()>(1);
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        // A full channel already holds a pending change, which will see this one too.
        if event.is_ok() {
            let _ = changed_tx.try_send(());
        }
    })?;
    for dir in &dirs {
        watcher.watch(dir, RecursiveMode::NonRecursive)?;
    }
    Ok(tokio::spawn(async move {
        // The watcher stops when dropped, so it lives in this task.
        let _watcher = watcher;
        while changed.recv().await.is_some() {
            tokio::time::sleep(DEBOUNCE).await;
            while changed.try_recv().is_ok() {}
            action();
        }
    }))
}

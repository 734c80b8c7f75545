//! Reloading files that change under a running server: the rules and the TLS certificates.
//!
//! A [`Watch`] owns one thread that does all the reloading of one kind of file. File events and
//! explicit requests (`SIGHUP`) arrive on one channel and are handled in order, one at a time,
//! so a slow load of older content can never overwrite a newer one, and the blocking file I/O
//! of a load never runs on the async workers.
//!
//! Directories are watched rather than files, so that files replaced by rename (editors,
//! Kubernetes ConfigMap and Secret volumes swapping their `..data` symlink, certificate managers)
//! are seen too. Events that cannot change what a file holds (opens, reads, closes without
//! writing, attribute changes such as a `touch`) are ignored, so the reload's own reads do not
//! trigger the next one. The others wait until the directory has been quiet for [`DEBOUNCE`];
//! then the reload reads the files, and does nothing if their digest equals that of what is in
//! force.
//!
//! A directory reached through a symlink (a runtime root `current -> v1` swapped to `v2`, as
//! envoyproxy/ratelimit's `RUNTIME_WATCH_ROOT` expects) is watched at its target, which a swap
//! leaves behind: so the parent of every symlink on the way is watched too, and before each
//! reload the directories are watched again where they now resolve.
//!
//! Dropping the [`Watch`] stops the file watcher, the signal task and the thread.

use std::path::{Path, PathBuf};
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use notify::event::{AccessKind, AccessMode, ModifyKind};
use notify::{EventKind, RecursiveMode, Watcher};
use tokio::sync::watch;
use tokio_util::task::AbortOnDropHandle;

use crate::config::{ConfigError, RuleSet, Sources};
use crate::telemetry::logs::ErrorChain;
use crate::telemetry::series::Churn;

/// How long the files must be quiet before a reload, so that one update is loaded once.
pub const DEBOUNCE: Duration = Duration::from_millis(200);

/// Why a reload runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trigger {
    /// Files changed: reload if their content differs from what is in force.
    Files,
    /// An operator asked (`SIGHUP`): reload even if nothing changed.
    Signal,
}

/// A watcher of some directories and the thread that runs reloads for it.
pub struct Watch {
    // Dropped first: no more events once the watch is going away. The thread holds it weakly,
    // to watch the directories again.
    _watcher: Arc<Mutex<notify::RecommendedWatcher>>,
    _signal: Option<AbortOnDropHandle<()>>,
}

impl Watch {
    /// Calls `reload` on a thread of its own whenever something in `dirs` may have changed
    /// (debounced), and, with `hangup`, on `SIGHUP`. Needs a Tokio runtime for the signal.
    pub fn start(
        name: &str,
        dirs: &[PathBuf],
        hangup: bool,
        mut reload: impl FnMut(Trigger) + Send + 'static,
    ) -> Result<Watch, notify::Error> {
        let (tx, rx) = std_mpsc::channel::<Trigger>();
        let files = tx.clone();
        let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
            if event.is_ok_and(|e| may_change_content(&e.kind)) {
                let _ = files.send(Trigger::Files);
            }
        })?;
        let mut watched = dirs.to_vec();
        for dir in dirs {
            for link in dir.ancestors().filter(|a| a.symlink_metadata().is_ok_and(|m| m.is_symlink())) {
                let holder = parent(link);
                if !watched.contains(&holder) {
                    watched.push(holder);
                }
            }
        }
        for dir in &watched {
            watcher.watch(dir, RecursiveMode::NonRecursive)?;
        }
        let watcher = Arc::new(Mutex::new(watcher));
        let rearm = Arc::downgrade(&watcher);
        let dirs = dirs.to_vec();
        let signal = if hangup {
            let mut hangups = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
                .map_err(|e| notify::Error::generic(&format!("cannot watch SIGHUP: {e}")))?;
            Some(AbortOnDropHandle::new(tokio::spawn(async move {
                while hangups.recv().await.is_some() {
                    if tx.send(Trigger::Signal).is_err() {
                        return;
                    }
                }
            })))
        } else {
            drop(tx);
            None
        };
        std::thread::Builder::new()
            .name(format!("tollgate-reload-{name}"))
            .spawn(move || {
                // Ends when the watcher and the signal task are gone (every sender dropped).
                while let Ok(first) = rx.recv() {
                    let mut trigger = first;
                    loop {
                        match rx.recv_timeout(DEBOUNCE) {
                            Ok(Trigger::Signal) => trigger = Trigger::Signal,
                            Ok(Trigger::Files) => {}
                            Err(std_mpsc::RecvTimeoutError::Timeout) => break,
                            Err(std_mpsc::RecvTimeoutError::Disconnected) => return,
                        }
                    }
                    // Where a swapped symlink now leads (a directory it no longer reaches is
                    // watched until it is deleted, which is harmless).
                    if let Some(watcher) = rearm.upgrade() {
                        let mut watcher = watcher.lock().unwrap_or_else(|p| p.into_inner());
                        for dir in &dirs {
                            let _ = watcher.watch(dir, RecursiveMode::NonRecursive);
                        }
                    }
                    reload(trigger);
                }
            })
            .map_err(|e| notify::Error::generic(&format!("cannot start the reload thread: {e}")))?;
        Ok(Watch { _watcher: watcher, _signal: signal })
    }
}

// Whether an event may mean new content: not for reads and attribute changes.
fn may_change_content(kind: &EventKind) -> bool {
    match kind {
        EventKind::Access(AccessKind::Close(AccessMode::Write)) => true,
        EventKind::Access(_) | EventKind::Modify(ModifyKind::Metadata(_)) => false,
        _ => true,
    }
}

/// The directory a file lives in (`.` for a bare file name).
pub fn parent(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_owned(),
        _ => PathBuf::from("."),
    }
}

/// Compiles the rules in force from their inputs, the config files and the resources an xDS
/// server pushed, whichever of the two the service has, and swaps them in.
///
/// A file that vanishes never means no limit. A config file that cannot be read (a dangling
/// symlink, no permission) fails the reload, and the rules in force stay. A domain whose file is
/// gone while the rest of the config loads stays served from the rules in force, and each reload
/// that keeps it names it in a warning, until the operator confirms the removal: `SIGHUP`
/// ([`Trigger::Signal`]) or `--allow-domain-removal`. A domain an xDS update leaves out is
/// dropped: a state-of-the-world response is the control plane's whole intent.
///
/// Files and pushes are compiled one at a time (a lock around compile and swap), so that a file
/// reload never swaps in rules built from a push older than the one in force.
pub struct Reloader {
    path: Option<PathBuf>,
    rules: Arc<ArcSwap<RuleSet>>,
    allow_domain_removal: bool,
    // The last accepted push, if the service takes pushes; `None` inside until the first.
    pushed: Mutex<Option<Sources>>,
    // The series pushes retired, so that churn is paced (telemetry::series).
    churn: Mutex<Churn>,
    loaded: watch::Sender<bool>,
    merge_domains: bool,
}

/// What a reload did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reloaded {
    /// The files hold what is in force: nothing to do.
    Unchanged,
    /// The new rules are in force.
    Swapped,
    /// The new rules are in force, with these domains, whose files are gone, kept from before.
    Kept(Vec<String>),
}

impl Reloader {
    /// A reloader for the config at `path` (none: pushed resources only), serving into `rules`;
    /// with `allow_domain_removal`, a domain whose file is gone is dropped on the reload that
    /// finds it gone. `loaded` says whether the rules in force are a config yet: true from the
    /// start for files, from the first accepted push with `awaits_push`.
    pub fn new(
        path: Option<&Path>,
        rules: Arc<ArcSwap<RuleSet>>,
        allow_domain_removal: bool,
        awaits_push: bool,
    ) -> Self {
        Reloader {
            path: path.map(Path::to_owned),
            rules,
            allow_domain_removal,
            pushed: Mutex::new(None),
            churn: Mutex::new(Churn::new(crate::telemetry::series::DEFAULT_IDLE)),
            loaded: watch::Sender::new(!awaits_push),
            merge_domains: false,
        }
    }

    /// The same reloader reading documents of one domain as one ([`Sources::merging_domains`]).
    pub fn merging_domains(self, merge: bool) -> Self {
        Reloader { merge_domains: merge, ..self }
    }

    /// The same reloader pacing pushes for a recorder that forgets series idle for `idle`.
    pub fn forgetting_series_after(self, idle: Duration) -> Self {
        Reloader { churn: Mutex::new(Churn::new(idle)), ..self }
    }

    /// Whether a config is in force (files loaded, or a first push accepted), and changes to it.
    pub fn loaded(&self) -> watch::Receiver<bool> {
        self.loaded.subscribe()
    }

    /// Loads the config now and swaps it in if its files changed (or for a [`Trigger::Signal`]).
    /// On error the rules in force stay.
    pub fn reload(&self, trigger: Trigger) -> Result<Reloaded, ConfigError> {
        let pushed = self.pushed.lock().unwrap_or_else(|p| p.into_inner());
        let Some(path) = &self.path else { return Ok(Reloaded::Unchanged) };
        let files = Sources::read(path)?;
        let sources = match &*pushed {
            Some(pushed) => files.and(pushed),
            None => files,
        };
        let current = self.rules.load();
        if trigger == Trigger::Files
            && sources.fingerprint() == current.fingerprint()
            && current.price_files_unchanged()
        {
            return Ok(Reloaded::Unchanged);
        }
        let mut rules = RuleSet::compile(sources.merging_domains(self.merge_domains))?;
        let mut kept = Vec::new();
        if trigger == Trigger::Files && !self.allow_domain_removal {
            let gone: Vec<&Arc<crate::config::Domain>> =
                current.domains().filter(|d| rules.domain(&d.name).is_none()).collect();
            for domain in gone {
                kept.push(domain.name.clone());
                rules.keep(domain.clone());
            }
        }
        self.swap(rules);
        Ok(if kept.is_empty() { Reloaded::Swapped } else { Reloaded::Kept(kept) })
    }

    /// Compiles `pushed` (with the files, if the service has any), checks it against `limits`
    /// and swaps it in, answering the domains it dropped; on error the rules in force, and the
    /// last accepted push, stay. [`PushError::Churn`] says when to try the same push again.
    pub fn push(&self, pushed: Sources, limits: &PushLimits) -> Result<Vec<String>, PushError> {
        let mut last = self.pushed.lock().unwrap_or_else(|p| p.into_inner());
        let sources = match &self.path {
            Some(path) => Sources::read(path)?.and(&pushed),
            None => pushed.clone(),
        };
        let rules = RuleSet::compile(sources.merging_domains(self.merge_domains))?;
        let current = self.rules.load();
        let dropped = limits.check(&current, &rules)?;
        let now = std::time::Instant::now();
        let mut churn = self.churn.lock().unwrap_or_else(|p| p.into_inner());
        let retiring = churn.room(&current, &rules, limits.series_budget(), now).map_err(PushError::Churn)?;
        churn.retire(retiring, now);
        self.swap(rules);
        *last = Some(pushed);
        Ok(dropped)
    }

    fn swap(&self, rules: RuleSet) {
        crate::telemetry::register_domains(&rules);
        self.rules.store(Arc::new(rules));
        self.loaded.send_replace(true);
    }

    // Reloads, then logs and counts the result.
    fn reload_and_report(&self, trigger: Trigger) {
        let Some(path) = &self.path else { return };
        let result = self.reload(trigger);
        if !matches!(result, Ok(Reloaded::Unchanged)) {
            crate::telemetry::count_config_load(result.is_ok());
        }
        match result {
            Ok(reloaded) => {
                metrics::gauge!("tollgate_config_last_reload_successful").set(1.0);
                if let Reloaded::Kept(domains) = &reloaded {
                    metrics::counter!("tollgate_config_reloads_total", "result" => "warning").increment(1);
                    tracing::warn!(path = %path.display(), ?domains, "config reloaded, but these domains' files are gone: they stay served from the last good config until the removal is confirmed (SIGHUP, or --allow-domain-removal)");
                }
                if reloaded == Reloaded::Swapped {
                    metrics::counter!("tollgate_config_reloads_total", "result" => "success").increment(1);
                    let rules = self.rules.load();
                    let domains: Vec<&str> = rules.domains().map(|d| d.name.as_str()).collect();
                    tracing::info!(path = %path.display(), ?domains, ?trigger, "config reloaded");
                }
            }
            Err(error) => {
                metrics::gauge!("tollgate_config_last_reload_successful").set(0.0);
                metrics::counter!("tollgate_config_reloads_total", "result" => "failure").increment(1);
                tracing::error!(error = %ErrorChain(&error), "config rejected; the previous config keeps serving");
            }
        }
    }

    /// Watches the path, the directories of the price files the config names now, and
    /// `SIGHUP`, for as long as the returned [`Watch`] lives.
    /// Without config files there is nothing to watch: `None`.
    pub fn watch(self: &Arc<Self>) -> Result<Option<Watch>, notify::Error> {
        let Some(path) = &self.path else { return Ok(None) };
        let mut dirs = vec![if path.is_dir() { path.clone() } else { parent(path) }];
        for file in self.rules.load().price_files() {
            let dir = parent(file);
            if !dirs.contains(&dir) {
                dirs.push(dir);
            }
        }
        metrics::gauge!("tollgate_config_last_reload_successful").set(1.0);
        let this = self.clone();
        Watch::start("config", &dirs, true, move |trigger| this.reload_and_report(trigger)).map(Some)
    }
}

/// What one control plane may make a replica serve, whatever it pushes (`--max-domains`,
/// `--max-rules`, `--xds-allow-empty`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PushLimits {
    /// Most domains in force (the files' included).
    pub max_domains: usize,
    /// Most rules in force, over all domains.
    pub max_rules: usize,
    /// Take a push that leaves no domain at all (otherwise refused while domains are served).
    pub allow_empty: bool,
}

impl PushLimits {
    /// The defaults: room for an Envoy Gateway with thousands of routes.
    pub const DEFAULT: PushLimits = PushLimits { max_domains: 1_000, max_rules: 10_000, allow_empty: false };

    /// Most (domain, rule) pairs with series at once: a config at the caps, plus one such
    /// config's worth retired and not yet forgotten.
    pub fn series_budget(&self) -> usize {
        2 * (self.max_domains + self.max_rules)
    }

    // The domains `next` drops from `current`, or why it is refused.
    fn check(&self, current: &RuleSet, next: &RuleSet) -> Result<Vec<String>, PushError> {
        let domains = next.domains().count();
        let rules: usize = next.domains().map(|d| d.rules.len()).sum();
        if domains > self.max_domains {
            return Err(PushError::TooMany {
                what: "domains",
                count: domains,
                max: self.max_domains,
                flag: "--max-domains",
            });
        }
        if rules > self.max_rules {
            return Err(PushError::TooMany {
                what: "rules",
                count: rules,
                max: self.max_rules,
                flag: "--max-rules",
            });
        }
        let dropped: Vec<String> =
            current.domains().filter(|d| next.domain(&d.name).is_none()).map(|d| d.name.clone()).collect();
        if domains == 0 && !dropped.is_empty() && !self.allow_empty {
            return Err(PushError::Empty { dropped: dropped.len() });
        }
        Ok(dropped)
    }
}

/// Why a push was not swapped in.
#[derive(Debug, thiserror::Error)]
pub enum PushError {
    /// It does not compile (or the files beside it do not).
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// Over a cap.
    #[error("the pushed config has {count} {what}, over the limit of {max} ({flag})")]
    TooMany {
        /// Domains or rules.
        what: &'static str,
        /// How many it has.
        count: usize,
        /// The cap.
        max: usize,
        /// The flag that sets it.
        flag: &'static str,
    },
    /// It would leave every domain unlimited.
    #[error("the pushed config has no domain: it would unlimit the {dropped} served now (refused; --xds-allow-empty takes such pushes)")]
    Empty {
        /// How many domains are served now.
        dropped: usize,
    },
    /// The series of configs pushed lately still fill the metrics budget: the same push may be
    /// taken after this long.
    #[error(
        "pushes are replacing domains and rules faster than their metrics are forgotten; taken in {0:?}"
    )]
    Churn(Duration),
}

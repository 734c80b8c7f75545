//! Config hot reload on a Kubernetes ConfigMap layout: symlink swaps apply, bad configs are
//! rejected while the old one keeps serving, SIGHUP forces a reload, and requests keep being
//! answered throughout. A file that vanishes never means no limit: a dangling symlink (a `..data`
//! swap whose target lacks the file) fails the reload, and a domain whose file is removed stays
//! served, named in a warning, until SIGHUP confirms the removal.

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;

fn rules(capacity: u32) -> String {
    format!("domain: r\ndescriptors:\n  - key: k\n    rate_limit: {{unit: hour, requests_per_unit: {capacity}}}\n")
}

async fn limit(server: &Tollgate) -> String {
    let r = ask(&server.addr(), req("r", &["k=v"], 0)).await.unwrap();
    header(&r, "X-RateLimit-Limit").unwrap_or("-").to_owned()
}

async fn wait_for_limit(server: &Tollgate, expected: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while limit(server).await != expected {
        assert!(Instant::now() < deadline, "limit never became {expected}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn reloads(server: &Tollgate, result: &str) -> f64 {
    sample(&server.metrics(), "tollgate_config_reloads_total", &[("result", result)])
}

#[tokio::test(flavor = "multi_thread")]
async fn configmap_swaps_reload_and_bad_configs_are_rejected() {
    let mut cm = ConfigMap::new(&rules(3));
    let server = Tollgate::start(cm.path(), &Backend::Memory, &[]);
    assert_eq!(limit(&server).await, "3");

    // Requests keep flowing while configs change; every one must be answered.
    let stop = Arc::new(AtomicBool::new(false));
    let answered = Arc::new(AtomicUsize::new(0));
    let traffic = {
        let (stop, answered, addr) = (stop.clone(), answered.clone(), server.addr());
        tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                ask(&addr, req("r", &["k=traffic"], 1)).await.expect("answered during reloads");
                answered.fetch_add(1, Ordering::SeqCst);
            }
        })
    };

    cm.publish(&rules(7));
    wait_for_limit(&server, "7").await;
    assert_eq!(reloads(&server, "success"), 1.0);
    assert_eq!(sample(&server.metrics(), "tollgate_config_last_reload_successful", &[]), 1.0);

    // A config with an error: rejected, counted, logged with file and position; 7 still serves.
    cm.publish(
        "domain: r\ndescriptors:\n  - key: k\n    rate_limit: {unit: fortnight, requests_per_unit: 1}\n",
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while reloads(&server, "failure") < 1.0 {
        assert!(Instant::now() < deadline, "the bad config was never attempted");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(limit(&server).await, "7");
    assert_eq!(sample(&server.metrics(), "tollgate_config_last_reload_successful", &[]), 0.0);
    let log = server.log();
    assert!(
        log.contains("config rejected")
            && log.contains("rules.yaml:4:24: descriptors[0](k): invalid rate limit unit 'fortnight'"),
        "{log}"
    );

    cm.publish(&rules(11));
    wait_for_limit(&server, "11").await;
    assert_eq!(reloads(&server, "success"), 2.0);

    stop.store(true, Ordering::SeqCst);
    traffic.await.unwrap();
    assert!(answered.load(Ordering::SeqCst) > 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_single_file_and_sighup() {
    let (dir, path) = config_file(&rules(5));
    let server = Tollgate::start(&path, &Backend::Memory, &[]);
    assert_eq!(limit(&server).await, "5");

    // An editor saving in place.
    std::fs::write(&path, rules(6)).unwrap();
    wait_for_limit(&server, "6").await;

    // SIGHUP reloads even though nothing changed.
    let before = reloads(&server, "success");
    server.proc.signal("HUP");
    let deadline = Instant::now() + Duration::from_secs(10);
    while reloads(&server, "success") <= before {
        assert!(Instant::now() < deadline, "SIGHUP did not reload");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(limit(&server).await, "6");
    drop(dir);
}

/// Reads and `touch` change nothing; an editor's write-and-rename and a symlink swap each reload
/// once; the reload waits for the debounce and not much longer (issue 14: a read used to start a
/// reload loop).
#[tokio::test(flavor = "multi_thread")]
async fn only_new_content_reloads_and_only_once() {
    let (dir, path) = config_file(&rules(5));
    let server = Tollgate::start_with_env(&path, &Backend::Memory, &[], &[("RUST_LOG", "info")]);
    assert_eq!(limit(&server).await, "5");
    let quiet = || std::thread::sleep(tollgate::reload::DEBOUNCE * 5);

    // Reads (tollgate's own included) and a touch: nothing to reload.
    for _ in 0..3 {
        std::fs::read_to_string(&path).unwrap();
    }
    let touched = std::process::Command::new("touch").arg(&path).status().unwrap();
    assert!(touched.success());
    quiet();
    assert_eq!(reloads(&server, "success"), 0.0, "reads and touch reload nothing");
    assert_eq!(reloads(&server, "failure"), 0.0);

    // An editor: write a temporary file, rename it over the config.
    let staged = dir.path().join(".config.yaml.swp");
    std::fs::write(&staged, rules(6)).unwrap();
    let saved = Instant::now();
    std::fs::rename(&staged, &path).unwrap();
    // Not before the debounce has passed...
    tokio::time::sleep(tollgate::reload::DEBOUNCE / 2).await;
    assert_eq!(limit(&server).await, "5", "applied before the debounce");
    // ...and soon after it.
    wait_for_limit(&server, "6").await;
    let took = saved.elapsed();
    println!(
        "write-and-rename applied after {:.3} s (debounce {:?})",
        took.as_secs_f64(),
        tollgate::reload::DEBOUNCE
    );
    assert!(took < Duration::from_secs(1), "{took:?}");
    quiet();
    assert_eq!(reloads(&server, "success"), 1.0, "one save, one reload");

    // A symlink swap (how Kubernetes volumes update): the config is a link to a versioned file.
    let v2 = dir.path().join("v2.yaml");
    std::fs::write(&v2, rules(7)).unwrap();
    let link = dir.path().join("link.tmp");
    std::os::unix::fs::symlink(&v2, &link).unwrap();
    std::fs::rename(&link, &path).unwrap();
    wait_for_limit(&server, "7").await;
    quiet();
    assert_eq!(reloads(&server, "success"), 2.0, "one swap, one reload");
    assert_eq!(server.log().matches("config reloaded").count(), 2, "{}", server.log());
}

/// A vanished file never means no limit: (1) a `..data` swap whose target lacks `rules.yaml`
/// leaves the link dangling, and the reload fails; (2) the link removed, the domain stays served
/// and each reload that keeps it warns, until SIGHUP confirms; the limit holds throughout
/// (`hits` over the capacity is OVER_LIMIT).
#[tokio::test(flavor = "multi_thread")]
async fn a_vanished_file_never_means_no_limit() {
    let mut cm = ConfigMap::new(&rules(3));
    std::fs::write(cm.path().join("other.yaml"), "domain: other\ndescriptors:\n  - key: a\n").unwrap();
    let server = Tollgate::start(cm.path(), &Backend::Memory, &[]);
    let limited = || async {
        let r = ask(&server.addr(), req("r", &["k=big"], 30)).await.unwrap();
        r.overall_code == OVER_LIMIT
    };
    assert!(limited().await);
    let wait = |what: &str, result: &str, at_least: f64| {
        let deadline = Instant::now() + Duration::from_secs(10);
        while reloads(&server, result) < at_least {
            assert!(Instant::now() < deadline, "{what}");
            std::thread::sleep(Duration::from_millis(20));
        }
    };

    // (1) The kubelet's swap to a directory without the file: the link dangles.
    cm.publish_files(&[]);
    wait("the dangling link's reload", "failure", 1.0);
    assert!(limited().await, "the domain is still limited");
    assert!(server.log().contains("rules.yaml"), "the log names the file");
    cm.publish(&rules(4));
    wait("the file's return", "success", 1.0);

    // (2) The link removed: the domain stays, and the reload is counted as a warning.
    std::fs::remove_file(cm.path().join("rules.yaml")).unwrap();
    wait("the removal's reload", "warning", 1.0);
    assert!(limited().await, "a removed domain stays served");
    assert!(server.log().contains(r#"domains=["r"]"#), "the warning names the domain: {}", server.log());
    // Another change reloads and warns again.
    std::fs::write(cm.path().join("other.yaml"), "domain: other\ndescriptors:\n  - key: b\n").unwrap();
    wait("the next reload's warning", "warning", 2.0);
    assert!(limited().await);
    // SIGHUP confirms: the domain is gone.
    let before = reloads(&server, "success");
    server.proc.signal("HUP");
    wait("SIGHUP", "success", before + 1.0);
    let r = ask(&server.addr(), req("r", &["k=big"], 30)).await.unwrap();
    assert_eq!(r.overall_code, OK, "no domain r any more: the operator confirmed");
}

//! The walkthrough, run as printed: every shell block tagged `<!-- readme-test: NAME -->` in the
//! README and the book's pages (`docs/src`, in the order of its `SUMMARY.md`) is executed, in
//! order, against the servers the pages say to start, and what they say the blocks print is
//! checked. The only changes: the debug build stands in for `cargo run --release` (a release
//! build takes minutes).
//!
//! The pages name fixed ports (8000-8121, 9901-9905, 10000-10004, 6390, 5433); the test moves each to
//! a free one, in the blocks and in copies of the Envoy configs they use, so that the suite never
//! clashes with a service the README told the reader to leave running. One test runs it all, one
//! part after another.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;

/// The README and the book's pages, in reading order.
fn pages() -> Vec<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let read =
        |path: &Path| std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let summary = read(&root.join("docs/src/SUMMARY.md"));
    let mut pages = vec![read(&root.join("README.md"))];
    for line in summary.lines() {
        if let Some((_, rest)) = line.split_once("](") {
            let page = rest.split(')').next().unwrap();
            pages.push(read(&root.join("docs/src").join(page)));
        }
    }
    pages
}

/// The tagged blocks: (tag, the block's text).
fn tagged_blocks() -> Vec<(String, String)> {
    let mut blocks = Vec::new();
    let text = pages().join("\n");
    let mut lines = text.lines();
    while let Some(line) = lines.next() {
        let Some(tag) = line.strip_prefix("<!-- readme-test: ").and_then(|t| t.strip_suffix(" -->")) else {
            continue;
        };
        let fence = lines.next().unwrap_or_default();
        assert!(fence.starts_with("```"), "the block tagged {tag} must follow its tag: {fence}");
        let body: Vec<&str> = lines.by_ref().take_while(|l| !l.starts_with("```")).collect();
        blocks.push((tag.to_owned(), body.join("\n") + "\n"));
    }
    blocks
}

fn block(tag: &str) -> String {
    let found: Vec<String> = tagged_blocks().into_iter().filter(|(t, _)| t == tag).map(|(_, b)| b).collect();
    assert_eq!(found.len(), 1, "one block tagged {tag} in the README and the book");
    found.into_iter().next().unwrap()
}

/// The fixed ports the pages name.
const PORTS: &[u16] = &[
    8000, 8001, 8002, 8080, 8081, 8090, 8091, 8100, 8101, 8110, 8111, 8120, 8121, 9901, 9902, 9903, 9904,
    9905, 10000, 10001, 10002, 10003, 10004, 6390, 5433, 18001,
];

/// Where the walkthrough runs: a directory with copies of `envoy/` whose fixed ports are moved to
/// free ones, and links to `examples/` (no ports), `scripts/` and `target/` (Envoy's venv).
struct Walk {
    dir: tempfile::TempDir,
    ports: Vec<(u16, u16)>,
}

impl Walk {
    fn new() -> Walk {
        let ports = PORTS.iter().map(|p| (*p, free_port())).collect();
        let walk = Walk { dir: tempfile::tempdir().unwrap(), ports };
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        walk.copy(&root.join("envoy"), &walk.dir.path().join("envoy"));
        for linked in ["examples", "scripts", "target"] {
            std::os::unix::fs::symlink(root.join(linked), walk.dir.path().join(linked)).unwrap();
        }
        walk
    }

    fn copy(&self, from: &Path, to: &Path) {
        std::fs::create_dir_all(to).unwrap();
        for entry in std::fs::read_dir(from).unwrap() {
            let entry = entry.unwrap();
            let target = to.join(entry.file_name());
            if entry.file_type().unwrap().is_dir() {
                self.copy(&entry.path(), &target);
            } else {
                let bytes = std::fs::read(entry.path()).unwrap();
                match String::from_utf8(bytes) {
                    Ok(text) => std::fs::write(&target, self.local(&text)).unwrap(),
                    Err(e) => std::fs::write(&target, e.into_bytes()).unwrap(),
                }
                std::fs::set_permissions(&target, entry.metadata().unwrap().permissions()).unwrap();
            }
        }
    }

    /// `text` with each fixed port (a whole number, not part of a longer one) moved, and `/tmp/`
    /// files in the walk's directory.
    fn local(&self, text: &str) -> String {
        let mut out = String::with_capacity(text.len());
        let mut rest = text;
        while let Some(start) = rest.find(|c: char| c.is_ascii_digit()) {
            out.push_str(&rest[..start]);
            let digits = rest[start..].find(|c: char| !c.is_ascii_digit()).map_or(rest.len() - start, |n| n);
            let number = &rest[start..start + digits];
            let after_dot = out.ends_with('.');
            match self.ports.iter().find(|(fixed, _)| number == fixed.to_string() && !after_dot) {
                Some((_, free)) => out.push_str(&free.to_string()),
                None => out.push_str(number),
            }
            rest = &rest[start + digits..];
        }
        out.push_str(rest);
        out.replace("/tmp/", &format!("{}/", self.dir.path().display()))
    }

    fn port(&self, fixed: u16) -> u16 {
        self.ports.iter().find(|(f, _)| *f == fixed).unwrap().1
    }
}

fn with_debug_build(text: &str) -> String {
    let bin = format!("{} ", tollgate_bin());
    // `cargo test` builds the examples beside the test binaries' `deps/`.
    let xds_server = Path::new(tollgate_bin()).parent().unwrap().join("examples/xds-server");
    // The builds a reader runs first are the test's own, made already.
    text.replace("cargo build --release -q --example xds-server && cargo build --release -q", "true")
        .replace("cargo build --release -q ", "true ")
        .replace("cargo run --release -q --example xds-server -- ", &format!("{} ", xds_server.display()))
        .replace("cargo run --release -q -- ", &bin)
        .replace("cargo run --release -- ", &bin)
}

/// PATH with the debug build's directory first: the README's `tollgate` is the binary on PATH.
fn path_with_tollgate() -> String {
    let bin = Path::new(tollgate_bin()).parent().unwrap().display().to_string();
    format!("{bin}:{}", std::env::var("PATH").unwrap_or_default())
}

/// Runs a block with bash in the repository, as a reader would paste it, and returns what it
/// printed. Whatever it starts in the background is stopped (by PID) when it ends; the whole
/// block gets `limit`.
fn run(walk: &Walk, tag: &str, limit: Duration) -> String {
    run_text(walk, tag, &block(tag), limit)
}

fn run_text(walk: &Walk, tag: &str, text: &str, limit: Duration) -> String {
    let script =
        format!("trap 'kill $(jobs -p) 2>/dev/null; wait' EXIT\n{}", walk.local(&with_debug_build(text)));
    let out = tempfile::NamedTempFile::new().unwrap();
    let mut bash = Proc::spawn(
        tag,
        Command::new("bash")
            .arg("-c")
            .arg(&script)
            .current_dir(walk.dir.path())
            .env("PATH", path_with_tollgate())
            .env("RUST_LOG", "warn")
            .stdout(Stdio::from(out.reopen().unwrap()))
            .stderr(Stdio::inherit()),
    );
    let status = bash.wait_exit(limit);
    let printed = std::fs::read_to_string(out.path()).unwrap();
    assert!(status.is_some(), "the block {tag} did not finish within {limit:?}; it printed:\n{printed}");
    println!("--- {tag}\n{printed}");
    printed
}

/// The HTTP status codes a `curl -w '%{http_code} '` loop printed on one line.
fn codes(line: &str) -> Vec<u16> {
    line.split_whitespace().map(|c| c.parse().unwrap_or_else(|_| panic!("not a status: {line}"))).collect()
}

fn leading(codes: &[u16], code: u16) -> usize {
    codes.iter().take_while(|c| **c == code).count()
}

#[test]
fn the_walkthrough_works_as_printed() {
    let walk = Walk::new();
    // Start here: the first command serves (left running for the rest); the second is the test
    // suite itself, which CI runs.
    let start = block("start");
    let mut commands = start.lines().map(str::trim);
    let serve = commands.next().unwrap();
    assert_eq!(commands.next(), Some("scripts/test"));
    assert!(
        serve.contains("--grpc-addr 127.0.0.1:") && serve.contains("--http-addr 127.0.0.1:"),
        "loopback: {serve}"
    );
    let ci = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(".ci/run")).unwrap();
    assert!(ci.contains("exec scripts/test"), "CI runs the README's test command");
    let serve = walk.local(&with_debug_build(serve));
    let mut words = serve.split_whitespace();
    let _service = Proc::spawn(
        "tollgate",
        Command::new(words.next().unwrap())
            .args(words)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .env("RUST_LOG", "warn"),
    );
    let http = format!("127.0.0.1:{}", walk.port(8080)).parse().unwrap();
    wait_until("the README's service", 300, Duration::from_millis(100), || {
        http_get(http, "/readyz").is_some_and(|(status, _)| status == 200)
    });

    // The first answer is exactly the one printed.
    assert_eq!(run(&walk, "ask", Duration::from_secs(30)), block("ask output"));

    let over = run(&walk, "over-limit", Duration::from_secs(30));
    let exits: Vec<&str> = over.lines().filter(|l| l.starts_with("exit ")).collect();
    assert_eq!(exits, ["exit 0", "exit 1"], "{over}");
    // 51 s right after the first ask; less the longer the service took in between.
    let retry: u64 =
        over.lines().find_map(|l| l.trim().strip_prefix("Retry-After: ")).unwrap().parse().unwrap();
    assert!((49..=51).contains(&retry), "{over}");

    let rls = run(&walk, "envoy-rls", Duration::from_secs(180));
    let lines: Vec<&str> = rls.lines().collect();
    let loop_codes = codes(lines[0]);
    assert_eq!(loop_codes.len(), 25);
    let admitted = leading(&loop_codes, 200);
    assert!((20..=22).contains(&admitted), "twenty 200s, a refill or two more: {rls}");
    // Then 429s, with a refill's 200 among them when the loop is slow (a token every 0.5 s).
    let after = &loop_codes[admitted..];
    let refills = after.iter().filter(|c| **c == 200).count();
    assert!(after.iter().all(|c| *c == 200 || *c == 429) && refills <= 2, "then 429s: {rls}");
    assert!(after.first() == Some(&429), "then 429s: {rls}");
    let headers = lines[1..].join("\n").to_lowercase();
    for expected in ["http/1.1 429", "retry-after: 1", "x-ratelimit-limit: 20", "x-ratelimit-remaining: 0"] {
        assert!(headers.contains(expected), "{expected}: {rls}");
    }

    let rlqs = run(&walk, "envoy-rlqs", Duration::from_secs(60));
    let lines: Vec<&str> = rlqs.lines().collect();
    assert_eq!(lines[0], "429", "no assignment before the first report: {rlqs}");
    let loop_codes = codes(lines[1]);
    assert!(loop_codes.iter().all(|c| *c == 200 || *c == 429), "{rlqs}");
    let admitted = leading(&loop_codes, 200);
    // The whole bucket but the first assignment's request, 9, and a refill or two during the
    // loop; then 429s.
    assert!((9..=11).contains(&admitted), "{rlqs}");
    assert!(loop_codes[admitted..].iter().all(|c| *c == 429), "then 429s: {rlqs}");
    for expected in ["tollgate_rlqs_streams 1", "tollgate_rlqs_buckets 1", "tollgate_rlqs_leaseholders 1"] {
        assert!(lines.contains(&expected), "{expected}: {rlqs}");
    }
    let holds: u64 = lines
        .iter()
        .find_map(|l| l.strip_prefix("tollgate_rlqs_leases_total{outcome=\"set\"} "))
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    assert!((3..=4).contains(&holds), "the floor, again to learn the others, all (and a resize?): {rlqs}");

    let llm = run(&walk, "envoy-llm", Duration::from_secs(60));
    let lines: Vec<&str> = llm.lines().collect();
    assert_eq!(codes(lines[0]), [200, 200, 429], "{llm}");
    let headers = lines[1..].join("\n").to_lowercase();
    assert!(headers.contains("http/1.1 429"), "{llm}");
    let retry: u64 =
        headers.lines().find_map(|l| l.strip_prefix("retry-after: ")).unwrap().trim().parse().unwrap();
    assert!((1..=2).contains(&retry), "{llm}");

    let budgets = run(&walk, "envoy-budgets", Duration::from_secs(60));
    let lines: Vec<&str> = budgets.lines().collect();
    assert_eq!(codes(lines[0]), [200, 200, 200, 429], "{budgets}");
    let headers = lines[1..].join("\n").to_lowercase();
    for expected in [
        "http/1.1 429",
        "x-budget-exhausted: api_key",
        "x-budget-remaining: 0.019400000 usd",
        "x-budget-warning: api_key=0.5",
        r#""level":"api_key","value":"k1""#,
        r#""spent":"0.030600000","held":"0.000000000","left":"0.019400000""#,
    ] {
        assert!(headers.contains(expected), "{expected}: {budgets}");
    }
    let reset: u64 =
        headers.lines().find_map(|l| l.strip_prefix("x-budget-reset: ")).unwrap().trim().parse().unwrap();
    let retry: u64 =
        headers.lines().find_map(|l| l.strip_prefix("retry-after: ")).unwrap().trim().parse().unwrap();
    assert!(reset <= 86_400 && retry == reset, "both at the key's midnight: {budgets}");

    // Five slots per tenant, filled by a slow upstream: each round of seven, two refused at once
    // and five admitted; the second round finds every slot given back.
    let conc = run(&walk, "envoy-concurrency", Duration::from_secs(90));
    assert!(!conc.contains("NOT READY"), "{conc}");
    let rounds: Vec<Vec<u16>> = conc.lines().map(codes).collect();
    assert_eq!(rounds.len(), 2, "{conc}");
    for round in &rounds {
        let count = |code| round.iter().filter(|c| **c == code).count();
        assert_eq!((count(200), count(429)), (5, 2), "{conc}");
    }

    // A global tier and two regions: the bucket of 20 is one for both; a region's /budgets shows
    // the money budget worldwide and its own lease.
    let started = std::time::Instant::now();
    let global = run(&walk, "global", Duration::from_secs(180));
    // 10 at once and 2 a second, over no more than the block's whole run.
    let bound = 10 + 2 * started.elapsed().as_secs() as usize + 1;
    assert!(!global.contains("NOT READY"), "{global}");
    let mut lines = global.lines();
    let answers: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
    assert_eq!(answers.len(), 30, "{global}");
    let ok = |region: &str| answers.iter().filter(|a| **a == format!("{region}:ok")).count();
    assert!(ok("eu") > 0 && ok("us") > 0, "both regions admit: {global}");
    assert!((10..=bound).contains(&(ok("eu") + ok("us"))), "one bucket for both, at most {bound}: {global}");
    assert!(answers.iter().any(|a| a.ends_with(":no")), "more than it holds asked: {global}");
    let rest: Vec<&str> = lines.collect();
    assert_eq!(&rest[..3], ["overall: OK"; 3], "{global}");
    let standing: serde_json::Value = serde_json::from_str(rest[3]).expect(&global);
    let org = &standing["levels"][0];
    assert!(org["lease"]["holder"].as_str().unwrap().starts_with("eu/"), "{global}");
    assert_eq!(org["lease"]["held"], "0.030300000", "{global}");
    assert_ne!(org["spent"], "unknown", "{global}");

    // The render commands type as printed, and each prints a config.
    let render = run(&walk, "render", Duration::from_secs(30));
    assert_eq!(render.matches("# Generated by `tollgate render`").count(), 4, "{render}");

    // POST /json answers as printed (the headers are left out there).
    let json = run(&walk, "json", Duration::from_secs(30));
    let printed = block("json output");
    let (head, _) = printed.split_once("[...]").unwrap();
    assert!(json.starts_with(head), "{json}");

    // The quota commands as printed, with the throwaway PostgreSQL they start (stopped again
    // whatever happens: `pg_ctl` leaves it running past the block).
    let quota =
        run_text(&walk, "quota", &format!("set -e\n{}echo done\n", block("quota")), Duration::from_secs(120));
    let stop = run_text(&walk, "quota stop", "scripts/postgres stop 5433\n", Duration::from_secs(60));
    assert!(quota.ends_with("done\n"), "every quota command succeeds: {quota}{stop}");
    assert!(quota.contains("created 3 tollgate table(s)"), "{quota}");
    assert!(quota.contains("tier pro") && quota.contains("export"), "{quota}");
    assert!(quota.contains("llm org=acme:team=search: 500.00 a month"), "{quota}");

    let redis = run(&walk, "redis", Duration::from_secs(60));
    assert!(redis.contains("overall: OK") && redis.contains("remaining=50"), "{redis}");
    let fields: Vec<&str> = redis.lines().rev().take(3).collect();
    assert_eq!(fields, ["50", "200", "50"], "t, c, s: {redis}");

    // Replace envoyproxy/ratelimit in Envoy Gateway: a limit pushed over xDS, changed live.
    let xds = run(&walk, "xds-walkthrough", Duration::from_secs(90));
    let answers: Vec<&str> = xds.lines().filter(|l| l.starts_with("descriptor")).collect();
    let shown: Vec<String> = answers.iter().map(|l| l.split(" full_in").next().unwrap().to_owned()).collect();
    assert_eq!(
        shown,
        [
            "descriptor 0 [user=alice]: OK  limit=3/MINUTE remaining=2",
            "descriptor 0 [user=alice]: OK  limit=3/MINUTE remaining=1",
            "descriptor 0 [user=alice]: OK  limit=3/MINUTE remaining=0",
            "descriptor 0 [user=alice]: OVER_LIMIT  limit=3/MINUTE remaining=0",
            "descriptor 0 [user=alice]: OVER_LIMIT  limit=10/MINUTE remaining=0",
            "descriptor 0 [user=bob]: OK  limit=10/MINUTE remaining=9",
        ],
        "{xds}"
    );
    let (_, after_push) = xds.split_once("pushed v2: api\n").expect(&xds);
    assert!(after_push.contains("demo: ACK v2"), "{xds}");
}

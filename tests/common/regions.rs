//! Regions on one machine for the tests of global limits: each region's tollgate reaches the
//! global tier through a fault proxy of its own, every answer held back by a delay that stands
//! in for the distance (this machine's kernel has no `netem`), and cut off by setting the proxy
//! to `Blackhole`.

use std::path::Path;
use std::time::Duration;

use super::proxy::{Fault, FaultProxy};
use super::service::{Backend, Tollgate};

/// A global tier on `backend` with `config`, for a trial on loopback (no region certificates).
pub fn global_tier(config: &Path, backend: &Backend) -> Tollgate {
    Tollgate::start(config, backend, &["--global-tier", "--global-tier-insecure"])
}

/// What `tollgate explain` prints for `descriptor` of `domain` in `config`, reading the Redis at
/// `redis_url`.
pub fn explain(config: &Path, domain: &str, descriptor: &str, redis_url: &str) -> String {
    let out = std::process::Command::new(super::tollgate_bin())
        .args(["explain", "--config", config.to_str().unwrap(), "--domain", domain])
        .args(["--descriptor", descriptor, "--redis-url", redis_url])
        .env("RUST_LOG", "off")
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A region `name` on `backend` with `config` and the `extra` flags, `delay` from the global
/// tier at `global`: its tollgate, and the proxy between them.
pub fn region(
    config: &Path,
    backend: &Backend,
    global: &Tollgate,
    (name, delay): (&str, Duration),
    extra: &[&str],
) -> (Tollgate, FaultProxy) {
    let proxy = FaultProxy::start(global.grpc.port());
    proxy.set(Fault::DelayReplies(delay));
    let url = format!("http://127.0.0.1:{}", proxy.port);
    let mut flags = vec!["--global-url", &url, "--region", name];
    flags.extend(extra);
    (Tollgate::start(config, backend, &flags), proxy)
}

/// Regions `eu` and `us` on embedded stores, `delay` from the global tier: their tollgates, and
/// their proxies.
pub fn eu_and_us(config: &Path, global: &Tollgate, delay: Duration) -> (Vec<Tollgate>, Vec<FaultProxy>) {
    ["eu", "us"].iter().map(|name| region(config, &Backend::Memory, global, (name, delay), &[])).unzip()
}

/// A priced domain `llm` whose org budget (`amount` a month) is one for every region, holds
/// living `hold_ttl`, and one model, `m`: input at 1.00 and output at 10.00 a million tokens,
/// 100 input tokens held for a call that gives no body size.
pub fn global_budget_config(amount: &str, hold_ttl: &str) -> String {
    format!(
        r#"
domain: llm
tenant_key: org
hold_ttl: {hold_ttl}
on_lost_settle: charge
prices:
  version: "v1"
  currency: USD
  models:
    m: {{input: 1.00, output: 10.00, reserve_input_tokens: 100}}
descriptors:
  - key: org
    budget: {{amount: {amount}, per: month}}
    global: true
    descriptors:
      - key: model
        descriptors:
          - key: request_id
"#
    )
}

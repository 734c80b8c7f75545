//! The bound of a global money budget across regions (issue 36,
//! `docs/src/design/global-limits.md`): the world's spend in a period stays within the amount,
//! with no slack, whatever the delays, losses and partitions between the regions and the
//! global tier. Runs the real pieces in virtual time on one manual clock: three region replicas
//! (a `Limiter` each, its own memory store, money leases in `GlobalBudgets`) and the global tier
//! (a `Limiter` on its memory store, answering renewals with `lease_budget` and spending the
//! same budget on its own requests). Between them, every renewal and answer is delayed 0-500 ms,
//! one in ten lost either way, one in ten arriving a second time later (a stray, after the region
//! moved on), and a region may be cut off for up to 40 s (four lease lives). Requests hold a
//! random call's worth and settle at most what they held after up to 5 s, or never (charged whole
//! at their `hold_ttl`); demand per region moves during the run.
//!
//! Checked per run: what the admitted calls cost (settled cost, or the hold of one never settled)
//! is at most the amount. Across runs, the budget is mostly spent (the leases are used).

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tollgate::clock::ManualClock;
use tollgate::config::RuleSet;
use tollgate::limiter::{
    BudgetGrant, BudgetRenewal, Code, GlobalBudgets, Limiter, Query, QueryDescriptor, ServiceModes,
};
use tollgate::store::MemoryStore;
use tollgate::telemetry::{Telemetry, TelemetryConfig};

const AMOUNT: u128 = 300_000_000;
const REGIONS: usize = 3;
const STEP_MS: u64 = 50;
const RUN_MS: u64 = 60_000;
const RUNS: u64 = 60;
// Mid-month, so that a run stays in one period.
const START_MS: u64 = 1_797_724_800_000;

// A renewal round on its way: sent at `sent`, arriving at the global tier at `arrives` (None:
// lost), its answer back `back` ms after (None: lost); once arrived, its answer.
struct Pending {
    sent: u64,
    renewals: Vec<BudgetRenewal>,
    arrives: Option<u64>,
    back: Option<u64>,
    answer: Option<(u64, Vec<Option<BudgetGrant>>)>,
}

struct Region {
    limiter: Limiter,
    budgets: Arc<GlobalBudgets>,
    pending: Option<Pending>,
    cut: (u64, u64),
    demand: f64,
    next_round: u64,
}

// An admitted call: which limiter holds it, its id and hold, and when it settles with what cost
// (None: never).
struct Call {
    at: usize,
    id: String,
    hold: u128,
    settle: Option<(u64, u64, u64)>,
    settled: bool,
}

fn limiter(rules: &Path, clock: &Arc<ManualClock>) -> Limiter {
    Limiter::new(
        Arc::new(arc_swap::ArcSwap::from_pointee(RuleSet::load(rules).unwrap())),
        Arc::new(MemoryStore::with_clock(clock.clone())),
        Arc::new(tollgate::quota::EmbeddedQuotas),
        Arc::new(Telemetry::without_exporter(TelemetryConfig::default())),
        ServiceModes::default(),
    )
    .with_clock(clock.clone())
}

async fn hold(limiter: &Limiter, id: &str, max_tokens: u64) -> bool {
    let entries = vec![("org", "acme"), ("model", "m"), ("request_id", id)];
    let descriptors = vec![QueryDescriptor { entries, hits: max_tokens, credit: false, limit: None }];
    limiter.decide(&Query { domain: "llm", descriptors }).await.unwrap().overall == Code::Ok
}

async fn settle(limiter: &Limiter, id: &str, input: u64, output: u64) {
    let path = [("org", "acme"), ("model", "m"), ("request_id", id)];
    let kind = |kind: &'static str, hits: u64| {
        let mut entries = path.to_vec();
        entries.push(("usage", kind));
        QueryDescriptor { entries, hits, credit: false, limit: None }
    };
    let descriptors = vec![kind("input", input), kind("output", output)];
    limiter.decide(&Query { domain: "llm", descriptors }).await.unwrap();
}

// One run; the cost of the admitted calls.
async fn run(seed: u64, rules: &Path) -> u128 {
    let mut rng = StdRng::seed_from_u64(seed);
    let clock = Arc::new(ManualClock::new(START_MS));
    let global = limiter(rules, &clock);
    let mut regions: Vec<Region> = (0..REGIONS)
        .map(|i| {
            let budgets = Arc::new(GlobalBudgets::new(format!("r{i}/a"), Duration::ZERO));
            let cut = if rng.random_bool(0.5) {
                let from = START_MS + rng.random_range(0..RUN_MS);
                (from, from + rng.random_range(0..40_000))
            } else {
                (0, 0)
            };
            Region {
                limiter: limiter(rules, &clock).with_global_budgets(budgets.clone()),
                budgets,
                pending: None,
                cut,
                demand: rng.random_range(0.0..0.25),
                next_round: START_MS + rng.random_range(0..1_000),
            }
        })
        .collect();
    // Strays: renewals that arrive at the global tier after their region stopped waiting.
    let mut strays: Vec<(u64, String, Vec<BudgetRenewal>)> = Vec::new();
    let mut calls: Vec<Call> = Vec::new();
    let mut t = START_MS;
    while t < START_MS + RUN_MS + 30_000 {
        t += STEP_MS;
        clock.set(t);
        let ending = t >= START_MS + RUN_MS;
        for (i, region) in regions.iter_mut().enumerate() {
            let holder = region.budgets.leaseholder().to_owned();
            let cut = region.cut;
            let in_cut = |at: u64| (cut.0..cut.1).contains(&at);
            if let Some(p) = &mut region.pending {
                if p.answer.is_none() && p.arrives.is_some_and(|a| a <= t) {
                    let mut grants = Vec::new();
                    for r in &p.renewals {
                        let entries: Vec<(&str, &str)> =
                            r.entries.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
                        let g = global
                            .lease_budget(&r.domain, &entries, &holder, r.period_end_ms, r.report)
                            .await;
                        grants.push(g.map(|g| g.expect("the memory store answers")));
                    }
                    let back = p.back.map(|b| t + b).filter(|at| !in_cut(*at));
                    p.answer = Some((back.unwrap_or(u64::MAX), grants));
                }
                if let Some((_, grants)) = p.answer.as_ref().filter(|(at, _)| *at <= t) {
                    let answers = p.renewals.iter().cloned().zip(grants.iter().copied()).collect();
                    region.budgets.answered(answers, p.sent);
                    region.pending = None;
                } else if t >= p.sent + 1_000 {
                    // No answer within a second: the region moves on; the renewal may still
                    // arrive.
                    let p = region.pending.take().expect("pending");
                    if let Some(a) = p.arrives.filter(|a| *a > t) {
                        strays.push((a, holder.clone(), p.renewals));
                    }
                }
            }
            if t >= region.next_round && region.pending.is_none() {
                region.next_round = t + 1_000;
                let renewals = region.limiter.budget_renewals().await;
                if !renewals.is_empty() {
                    let lost = in_cut(t) || rng.random_bool(0.1);
                    let arrives = (!lost).then(|| t + rng.random_range(0..=500)).filter(|a| !in_cut(*a));
                    let back = (!rng.random_bool(0.1)).then(|| rng.random_range(0..=500));
                    if let Some(a) = arrives.filter(|_| rng.random_bool(0.1)) {
                        strays.push((a + rng.random_range(0..2_000), holder.clone(), renewals.clone()));
                    }
                    region.pending = Some(Pending { sent: t, renewals, arrives, back, answer: None });
                }
            }
            if rng.random_bool(0.002) {
                region.demand = rng.random_range(0.0..0.25);
            }
            if !ending && rng.random_bool(region.demand) {
                let id = format!("{seed}-{i}-{t}");
                let max_tokens = rng.random_range(50..500);
                if hold(&region.limiter, &id, max_tokens).await {
                    let settle = (!rng.random_bool(0.1)).then(|| {
                        (
                            t + rng.random_range(0..5_000),
                            rng.random_range(0..=100),
                            rng.random_range(0..=max_tokens),
                        )
                    });
                    calls.push(Call {
                        at: i,
                        id,
                        hold: u128::from(max_tokens) * 10_000 + 100_000,
                        settle,
                        settled: false,
                    });
                }
            }
        }
        // The global tier's own requests, now and then.
        if !ending && rng.random_bool(0.05) {
            let id = format!("{seed}-g-{t}");
            let max_tokens = rng.random_range(50..500);
            if hold(&global, &id, max_tokens).await {
                let settle = Some((t + rng.random_range(0..5_000), 100, max_tokens));
                calls.push(Call {
                    at: REGIONS,
                    id,
                    hold: u128::from(max_tokens) * 10_000 + 100_000,
                    settle,
                    settled: false,
                });
            }
        }
        let due: Vec<usize> = strays.iter().enumerate().filter(|(_, s)| s.0 <= t).map(|(i, _)| i).collect();
        for i in due.into_iter().rev() {
            let (_, holder, renewals) = strays.remove(i);
            for r in renewals {
                let entries: Vec<(&str, &str)> =
                    r.entries.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
                global.lease_budget(&r.domain, &entries, &holder, r.period_end_ms, r.report).await;
            }
        }
        for call in calls.iter_mut().filter(|c| !c.settled && c.settle.is_some_and(|(at, _, _)| at <= t)) {
            let (_, input, output) = call.settle.expect("due");
            let at = if call.at == REGIONS { &global } else { &regions[call.at].limiter };
            settle(at, &call.id, input, output).await;
            call.settled = true;
        }
    }
    // Settled calls cost what they used; the others are charged their hold at its expiry.
    let cost: u128 = calls
        .iter()
        .map(|c| match c.settle {
            Some((_, input, output)) => u128::from(input) * 1_000 + u128::from(output) * 10_000,
            None => c.hold,
        })
        .sum();
    let cuts: Vec<u64> = regions.iter().map(|r| (r.cut.1 - r.cut.0) / 1000).collect();
    println!("seed {seed}: {} calls, {cost} of {AMOUNT} (cuts {cuts:?} s)", calls.len());
    cost
}

#[tokio::test(flavor = "current_thread")]
async fn the_world_spends_a_global_budget_within_its_amount() {
    let (_dir, path) = common::config_file(&common::regions::global_budget_config("0.30", "20s"));
    let mut spent_most = 0;
    for seed in 0..RUNS {
        let cost = run(seed, &path).await;
        assert!(cost <= AMOUNT, "seed {seed}: the admitted calls cost {cost}, above the amount {AMOUNT}");
        if cost * 10 >= AMOUNT * 8 {
            spent_most += 1;
        }
    }
    println!("{spent_most} of {RUNS} runs spent at least 0.8 of the amount");
    assert!(
        spent_most * 2 >= RUNS,
        "the leases are used: {spent_most} of {RUNS} runs spent 0.8 of the amount"
    );
}

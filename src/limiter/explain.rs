//! Why a query gets the answer it gets, worked out by the decision's own steps but without the
//! store: which rule each descriptor matches, which bucket that is (its key and Cluster slot),
//! its capacity and rate and where they come from, and what changes the outcome (shadow mode,
//! quota mode, `replaces`, `unlimited`, `charge: always`). `tollgate explain` prints it and adds
//! each bucket's current balance read from the store.
//!
//! Nothing here is counted in metrics and nothing is debited.

use std::sync::Arc;

use super::slots::{self, SlotPlan};
use super::{drop_replaced, limit_info, BudgetExplained, LimitInfo, Limiter, Plan, Query};
use crate::bucket::Role;
use crate::config::{Domain, Limit, Rule};
use crate::identity;
use crate::quota::QuotaOrigin;
use crate::slot::{SlotAction, SlotSet};

/// The explanation of a whole query.
#[derive(Debug)]
pub struct Explanation {
    /// The domain, if it is configured.
    pub domain: Option<Arc<Domain>>,
    /// One per query descriptor, in order.
    pub descriptors: Vec<Explained>,
}

/// What one descriptor is held to.
#[derive(Debug)]
pub struct Explained {
    /// The rule the descriptor matches (`None`: no rule, or a request-level override).
    pub rule: Option<Arc<Rule>>,
    /// What that means for the request.
    pub effect: Effect,
    /// The concurrency slots it takes or gives back (a path ending in the request id).
    pub slots: Vec<SlotExplained>,
}

/// A concurrency limit a descriptor takes a slot of (or gives one back to).
#[derive(Debug, Clone)]
pub struct SlotExplained {
    /// The node's path of keys.
    pub node: String,
    /// Its slot set's storage key.
    pub key: String,
    /// Most slots open at once.
    pub max: u64,
    /// How long a slot not given back stays taken, in milliseconds.
    pub ttl_ms: u64,
    /// The Redis Cluster slot of the set.
    pub slot: u16,
    /// Take (request time) or give back (stream end).
    pub action: SlotAction,
}

/// What limits a descriptor.
#[derive(Debug)]
pub enum Effect {
    /// The domain is not configured: every descriptor is OK.
    UnknownDomain,
    /// No rule with a limit matches (or a whitelisted node does).
    NoRule,
    /// An `unlimited` rule: always OK, the store is never asked.
    Unlimited,
    /// Another matched rule lists this one in its `replaces`: no limit for this request.
    Replaced {
        /// The rule that replaced it.
        by: Arc<Rule>,
    },
    /// A priced domain's budgets and token buckets ([`crate::budget`]).
    Budget(Box<BudgetExplained>),
    /// A priced domain's model that the price table lacks: denied.
    UnknownModel,
    /// A bucket.
    Bucket {
        /// Its identity, capacity and rate.
        limit: LimitInfo,
        /// Where the capacity and rate come from.
        origin: SpecOrigin,
        /// Whether a shortage denies (enforced), never denies (shadow), or denies only with the
        /// other quota-mode descriptors.
        role: Role,
        /// Tokens the descriptor takes (hits x cost; negative for a credit).
        need: f64,
        /// The tenant whose slot holds it, for tenant rules.
        tenant: Option<String>,
        /// The Redis Cluster slot of its key.
        slot: u16,
    },
}

/// Where a bucket's capacity and rate come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SpecOrigin {
    /// The rule's `rate_limit` or `token_bucket`.
    Rule,
    /// The request's own `limit` override (envoyproxy/ratelimit's request-level limit).
    RequestOverride,
    /// The tenant's override for the class.
    TenantOverride {
        /// The class.
        class: String,
    },
    /// A tier.
    Tier {
        /// The tier.
        tier: String,
        /// The class whose bucket it is.
        class: String,
    },
}

impl Limiter {
    /// Explains `query` without debiting anything or counting it.
    pub async fn explain(&self, query: &Query<'_>) -> Explanation {
        let rules = self.rules.load_full();
        let Some(domain) = rules.domain(query.domain) else {
            let descriptors = query
                .descriptors
                .iter()
                .map(|_| Explained { rule: None, effect: Effect::UnknownDomain, slots: Vec::new() })
                .collect();
            return Explanation { domain: None, descriptors };
        };
        if let Some(priced) = &domain.priced {
            let mut descriptors = Vec::with_capacity(query.descriptors.len());
            for d in &query.descriptors {
                let effect = self.explain_priced(domain, priced, &d.entries, d.hits).await;
                let slots = match &effect {
                    // A hold takes its slots; a settlement gives them back.
                    Effect::Budget(b) => explain_sets(&b.op.sets, &b.set_nodes, SlotAction::Take),
                    _ => Vec::new(),
                };
                descriptors.push(Explained { rule: None, effect, slots });
            }
            return Explanation { domain: Some(domain.clone()), descriptors };
        }
        // A descriptor that takes or gives back slots is explained as its path (as it is decided).
        let slot_plans: Vec<Option<SlotPlan<'_>>> =
            query.descriptors.iter().map(|d| slots::plan(domain, &d.entries)).collect();
        let effective = slots::effective(query, &slot_plans);
        let mut plans: Vec<Plan<'_>> = slots::plans(self, domain, &effective, &slot_plans);
        let replaced = drop_replaced(&mut plans);
        self.resolve_quotas(domain, &mut plans).await;
        let mut descriptors = Vec::with_capacity(plans.len());
        for (i, ((plan, d), slot_plan)) in plans.iter().zip(&effective).zip(&slot_plans).enumerate() {
            let gives_back = slot_plan.as_ref().is_some_and(|s| !s.take());
            let matched =
                if d.limit.is_some() || gives_back { None } else { domain.lookup(&d.entries).cloned() };
            let effect = match plan {
                Plan::Free => match replaced.iter().find(|(j, _)| *j == i) {
                    Some((_, by)) => Effect::Replaced { by: Arc::clone(by) },
                    None => Effect::NoRule,
                },
                Plan::Unlimited(_) => Effect::Unlimited,
                Plan::Bucket(p) => {
                    let origin = match p.rule {
                        None => SpecOrigin::RequestOverride,
                        Some(rule) if rule.limit == Limit::TenantQuota => {
                            let tenant = p.bucket.tenant.expect("a quota rule has a tenant");
                            let record = self.quotas.tenant(&domain.tenants, tenant).await;
                            let class = identity::quota_class(rule);
                            match domain.quotas.resolve_with_source(record.as_deref(), class) {
                                Some((_, QuotaOrigin::Override)) => {
                                    SpecOrigin::TenantOverride { class: class.to_owned() }
                                }
                                Some((_, QuotaOrigin::Tier { tier, class })) => {
                                    SpecOrigin::Tier { tier: tier.to_owned(), class: class.to_owned() }
                                }
                                None => SpecOrigin::Rule,
                            }
                        }
                        Some(_) => SpecOrigin::Rule,
                    };
                    Effect::Bucket {
                        limit: limit_info(p),
                        origin,
                        role: p.role,
                        need: p.need,
                        tenant: p.bucket.tenant.map(str::to_owned),
                        slot: identity::cluster_slot(&p.bucket.key),
                    }
                }
            };
            let slots =
                slot_plan.as_ref().map_or_else(Vec::new, |s| explain_sets(&s.op.sets, &s.nodes, s.op.action));
            descriptors.push(Explained { rule: matched, effect, slots });
        }
        Explanation { domain: Some(domain.clone()), descriptors }
    }
}

// The slot sets an op takes a slot of or gives one back to, as explained.
fn explain_sets(sets: &[SlotSet], nodes: &[String], action: SlotAction) -> Vec<SlotExplained> {
    sets.iter()
        .zip(nodes)
        .map(|(set, node)| SlotExplained {
            node: node.clone(),
            key: set.key.clone(),
            max: set.max,
            ttl_ms: set.ttl_ms,
            slot: identity::cluster_slot(&set.key),
            action,
        })
        .collect()
}

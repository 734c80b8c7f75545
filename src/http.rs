//! HTTP side endpoints for operators and orchestrators.
//!
//! * `GET /healthz`: the process is alive (liveness).
//! * `GET /readyz`: config loaded, store answering, not draining (readiness); 503 otherwise,
//!   with the reason in the body. `GET /healthcheck` is the same, under envoyproxy/ratelimit's
//!   name, which Envoy Gateway's probes use.
//! * `GET /config`: the loaded rules as JSON, like envoyproxy/ratelimit's `/rlconfig`. It holds
//!   rule trees, tiers and inline tenant quotas, never connection strings or credentials.
//! * `GET /metrics`: Prometheus text exposition.
//! * `POST /json`: a rate-limit decision in JSON, as envoyproxy/ratelimit serves it (see
//!   [`crate::edge::rls::json`]).
//! * `GET /budgets?domain=D&<level>=<value>...`: where a priced domain's budgets stand on a path,
//!   as JSON ([`crate::limiter::Standing`]); 400 with the reason for a domain without prices or
//!   levels that are not a path from the top, 503 when the store cannot be read.
//!
//! `POST /json` spends any tenant's tokens, `GET /budgets` reveals any tenant's spend and
//! `GET /config` shows every rule and tenant, so they
//! are guarded as strongly as the gRPC port ([`Access`]): when gRPC requires client certificates,
//! this plaintext port refuses them (403, saying where they are served) unless the operator opts
//! in, and the gRPC port serves them over its mutual TLS ([`budget_router`]). Probes and
//! `/metrics` stay open to kubelets and Prometheus.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use arc_swap::ArcSwap;
use axum::extract::{DefaultBodyLimit, Query, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};

use crate::config::RuleSet;
use crate::edge::rls::json;
use crate::edge::rls::RateLimitGrpc;
use crate::limiter::StandingError;
use crate::store::{health, Store};
use crate::telemetry::logs::ErrorChain;
use crate::telemetry::Telemetry;

/// What the endpoints look at.
#[derive(Clone)]
pub struct HttpState {
    /// The rules in force.
    pub rules: Arc<ArcSwap<RuleSet>>,
    /// The store, pinged by `/readyz`.
    pub store: Arc<dyn Store>,
    /// Set when shutdown begins, so that load balancers stop sending first.
    pub draining: Arc<AtomicBool>,
    /// Rendered by `/metrics`.
    pub telemetry: Arc<Telemetry>,
    /// The RLS edge `POST /json` asks.
    pub rls: Arc<RateLimitGrpc>,
    /// Who may use `POST /json` and `GET /config` on this port.
    pub access: Access,
    /// Whether a config is in force yet (pushed configs only wait for one).
    pub config_loaded: tokio::sync::watch::Receiver<bool>,
}

/// Who may use the endpoints that spend or reveal tenants' budgets on the plaintext HTTP port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Anyone who reaches the port (gRPC is open too, or the operator opted in).
    Open,
    /// Nobody: gRPC requires client certificates, and these endpoints are served there.
    MutualTlsOnly,
}

/// The side-endpoint router of the HTTP port.
pub fn router(state: HttpState) -> Router {
    let access = state.access;
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/healthcheck", get(readyz))
        .route("/metrics", get(metrics))
        .merge(budget_router(state.clone()).route_layer(middleware::from_fn_with_state(access, guard)))
        .with_state(state)
}

/// The probes alone (`/healthz`, `/readyz`), for the port of `--probe-addr`.
pub fn probe_router(state: HttpState) -> Router {
    Router::new().route("/healthz", get(|| async { "ok\n" })).route("/readyz", get(readyz)).with_state(state)
}

/// `POST /json`, `GET /budgets` and `GET /config`, unguarded: for the HTTP port behind
/// [`guard`], and for the gRPC port when it requires client certificates (its TLS is the guard).
pub fn budget_router<S>(state: HttpState) -> Router<S> {
    Router::new()
        .route("/config", get(config))
        .route("/budgets", get(budgets))
        .route(
            "/json",
            post(json::handle)
                .with_state(state.rls.clone())
                .layer(DefaultBodyLimit::max(json::MAX_BODY_BYTES)),
        )
        .with_state(state)
}

// Refuses what `access` does not allow, saying where it is served.
async fn guard(State(access): State<Access>, request: Request, next: Next) -> Response {
    match access {
        Access::Open => next.run(request).await,
        Access::MutualTlsOnly => (
            StatusCode::FORBIDDEN,
            format!(
                "{} spends or reveals tenants' budgets: with --tls-client-ca it is served on the gRPC port, over mutual TLS (https with a client certificate); --http-unauthenticated serves it here too\n",
                request.uri().path()
            ),
        )
            .into_response(),
    }
}

async fn readyz(State(state): State<HttpState>) -> Response {
    if state.draining.load(Ordering::SeqCst) {
        return (StatusCode::SERVICE_UNAVAILABLE, "draining\n").into_response();
    }
    if !*state.config_loaded.borrow() {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "no config yet: waiting for the first from the xDS server\n",
        )
            .into_response();
    }
    match state.store.ping().await {
        // A region cut off from the global tier still serves: it decides global limits on the
        // shares it holds, then by each rule's fallback; the body says so for whoever looks.
        Ok(()) => match state.rls.limiter().global_cut_off() {
            Some(cut) => format!(
                "ready; cut off from the global tier for {:.1} s: global limits are decided on the shares held until they lapse, then by each rule's fallback (denied, or its split)\n",
                cut.as_secs_f64()
            )
            .into_response(),
            None => "ready\n".into_response(),
        },
        Err(e) => (StatusCode::SERVICE_UNAVAILABLE, format!("store unreachable: {}\n", health::explain(&e)))
            .into_response(),
    }
}

async fn metrics(State(state): State<HttpState>) -> Response {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], state.telemetry.render()).into_response()
}

async fn budgets(State(state): State<HttpState>, Query(query): Query<Vec<(String, String)>>) -> Response {
    let domain = query.iter().find(|(k, _)| k == "domain").map(|(_, v)| v.as_str());
    let Some(domain) = domain else {
        return (StatusCode::BAD_REQUEST, "give the domain: /budgets?domain=D&<level>=<value>...\n")
            .into_response();
    };
    let levels: Vec<(&str, &str)> =
        query.iter().filter(|(k, _)| k != "domain").map(|(k, v)| (k.as_str(), v.as_str())).collect();
    match state.rls.limiter().standing(domain, &levels).await {
        Ok(standing) => Json(standing).into_response(),
        Err(e @ StandingError::Store(_)) => {
            (StatusCode::SERVICE_UNAVAILABLE, format!("{}\n", ErrorChain(&e))).into_response()
        }
        Err(e) => (StatusCode::BAD_REQUEST, format!("{e}\n")).into_response(),
    }
}

async fn config(State(state): State<HttpState>) -> Json<Value> {
    Json(config_json(&state.rules.load()))
}

/// The JSON view of `rules` served at `/config`.
pub fn config_json(rules: &RuleSet) -> Value {
    let domains: Vec<Value> = rules
        .domains()
        .map(|d| {
            json!({
                "domain": d.name,
                "file": d.file,
                "tenant_key": d.tenant_key,
                "failure_mode": d.failure_mode,
                "response_headers": d.headers,
                "rules": d.rules,
                "concurrency": d.concurrency_limits().into_iter().map(|(path, limit)| json!({
                    "path": path, "max": limit.max, "ttl_ms": limit.ttl_ms,
                })).collect::<Vec<_>>(),
                "request_id_key": d.request_id_key,
                "tiers": d.quotas.tiers,
                "default_tier": d.quotas.default_tier,
                "tenants": d.tenants,
            })
        })
        .collect();
    json!({ "domains": domains })
}

//! `tollgate render envoy|istio`: the Envoy or Istio configuration that sends the descriptors a
//! config expects, from the `source:` of its descriptors.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Args, Subcommand};
use tollgate::config::RuleSet;
use tollgate::render::{IstioTarget, JwtPayload, Protocol, RenderOptions};

use super::Outcome;

#[derive(Args)]
pub(super) struct RenderArgs {
    #[command(subcommand)]
    target: RenderTarget,
}

#[derive(Args)]
struct RenderCommon {
    /// A YAML file, or a directory of *.yaml / *.yml files, with `source:` on its descriptors.
    #[arg(long)]
    config: PathBuf,
    /// The domain to render (required when the config has several).
    #[arg(long)]
    domain: Option<String>,
    /// Envoy's deadline for tollgate; keep it above tollgate's --redis-timeout.
    #[arg(long, default_value = "100ms", value_parser = humantime::parse_duration)]
    timeout: Duration,
    /// Answer 500 instead of letting requests through when tollgate cannot be reached, also for a
    /// domain with `failure_mode: allow` (domains with `deny` or `error` always get it).
    #[arg(long)]
    failure_mode_deny: bool,
}

/// The Envoy filter `render envoy` configures.
#[derive(Clone, Copy, clap::ValueEnum)]
enum ProtocolArg {
    /// envoy.filters.http.ratelimit: every request asks tollgate.
    Rls,
    /// envoy.filters.http.rate_limit_quota: Envoy enforces the leases tollgate takes for it.
    Rlqs,
}

#[derive(Subcommand)]
enum RenderTarget {
    /// The ratelimit filter, the tollgate cluster, and the rate_limits for the virtual host and routes.
    Envoy {
        #[command(flatten)]
        common: RenderCommon,
        /// tollgate's gRPC address as Envoy reaches it.
        #[arg(long, default_value = "tollgate:8081")]
        tollgate_address: String,
        /// jwt_authn's payload_in_metadata key.
        #[arg(long, default_value = "jwt_payload")]
        jwt_payload_key: String,
        /// The filter to configure.
        #[arg(long, value_enum, default_value = "rls")]
        protocol: ProtocolArg,
        /// With --protocol rlqs: the name this Envoy gives itself to tollgate (stream metadata
        /// x-tollgate-envoy), unique per Envoy; needed only where Envoys share an IP address.
        #[arg(long)]
        envoy_name: Option<String>,
    },
    /// An EnvoyFilter for the ingress gateway (--gateway) or the sidecars of one app (--sidecar).
    Istio {
        #[command(flatten)]
        common: RenderCommon,
        /// Configure the ingress gateway (istio: ingressgateway in istio-system).
        #[arg(long, conflicts_with = "sidecar", required_unless_present = "sidecar")]
        gateway: bool,
        /// Configure the sidecars of pods labelled app=APP.
        #[arg(long, value_name = "APP")]
        sidecar: Option<String>,
        /// The namespace of those pods.
        #[arg(long, default_value = "default")]
        namespace: String,
        /// The issuer of the RequestAuthentication that verifies the JWT (the metadata key of its
        /// payload): its http(s) URL, as in the tokens' `iss` claim.
        #[arg(long, value_parser = issuer_url)]
        jwt_issuer: String,
        /// tollgate's Service host.
        #[arg(long, default_value = "tollgate.tollgate.svc.cluster.local")]
        tollgate_service: String,
        /// tollgate's gRPC Service port.
        #[arg(long, default_value_t = 8081)]
        tollgate_port: u16,
    },
}

pub(super) fn run(args: RenderArgs) -> Outcome {
    let (common, rendered) = match &args.target {
        RenderTarget::Envoy { common, tollgate_address, jwt_payload_key, protocol, envoy_name } => {
            let rules = RuleSet::load(&common.config)?;
            let mut options = render_options(common, JwtPayload::MetadataKey(jwt_payload_key.clone()));
            options.protocol = match protocol {
                ProtocolArg::Rls if envoy_name.is_some() => {
                    anyhow::bail!(
                        "--envoy-name names an Envoy to the RLQS server: use it with --protocol rlqs"
                    )
                }
                ProtocolArg::Rls => Protocol::Rls,
                ProtocolArg::Rlqs => Protocol::Rlqs,
            };
            options.envoy_name = envoy_name.clone();
            (common, tollgate::render::envoy(&rules, &options, tollgate_address)?)
        }
        RenderTarget::Istio {
            common,
            gateway: _,
            sidecar,
            namespace,
            jwt_issuer,
            tollgate_service,
            tollgate_port,
        } => {
            let rules = RuleSet::load(&common.config)?;
            let options = render_options(common, JwtPayload::Issuer(jwt_issuer.clone()));
            let target = match sidecar {
                Some(app) => IstioTarget::Sidecar { app: app.clone(), namespace: namespace.clone() },
                None => IstioTarget::Gateway,
            };
            (common, tollgate::render::istio(&rules, &options, &target, tollgate_service, *tollgate_port)?)
        }
    };
    outln!(
        "# Generated by `tollgate render` from {}; regenerate it when the config changes.",
        common.config.display()
    );
    out!("{}", serde_saphyr::to_string(&rendered).context("writing YAML")?);
    Ok(ExitCode::SUCCESS)
}

fn render_options(common: &RenderCommon, jwt: JwtPayload) -> RenderOptions {
    RenderOptions {
        domain: common.domain.clone(),
        jwt,
        timeout: common.timeout,
        failure_mode_deny: common.failure_mode_deny,
        protocol: Protocol::Rls,
        envoy_name: None,
    }
}

// An issuer is an http(s) URL (Istio discovers the issuer's keys from it); a placeholder such as
// `...` is refused rather than rendered into a policy no token can match.
fn issuer_url(value: &str) -> Result<String, String> {
    match url::Url::parse(value) {
        Ok(url) if matches!(url.scheme(), "https" | "http") && url.host().is_some() => Ok(value.to_owned()),
        Ok(url) => Err(format!("an issuer is an http(s) URL with a host, not a {} URL", url.scheme())),
        Err(e) => Err(format!("an issuer is an http(s) URL, e.g. https://auth.example.com ({e})")),
    }
}

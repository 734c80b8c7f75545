//! The deployment artefacts, checked offline: Kubernetes manifests against the bundled schemas
//! (kubernetes-validate --strict) and our own invariants, Istio EnvoyFilters against what
//! `tollgate render` prints and, through their Envoy fragments, against a real Envoy; the
//! docker-compose stack and the Dockerfile against the files they reference.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;
use serde_json::{json, Value};

fn repo(relative: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(relative)
}

fn yaml_docs(relative: &str) -> Vec<Value> {
    let text = std::fs::read_to_string(repo(relative)).unwrap();
    serde_saphyr::from_str_multiple(&text).unwrap_or_else(|e| panic!("{relative}: {e}"))
}

fn manifests(dir: &str) -> Vec<(String, Value)> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(repo(dir))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml") && !p.ends_with("kustomization.yaml"))
        .collect();
    files.sort();
    files
        .iter()
        .flat_map(|f| {
            let name = format!("{dir}/{}", f.file_name().unwrap().to_string_lossy());
            yaml_docs(&name).into_iter().map(move |d| (name.clone(), d))
        })
        .collect()
}

fn kubernetes_validate() -> PathBuf {
    std::env::var("KUBERNETES_VALIDATE_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|_| repo("target/venv/bin/kubernetes-validate"))
}

/// The overlays of `k8s/overlays`, each a way to run tollgate (docs/src/operations/kubernetes.md).
const OVERLAYS: [&str; 5] = ["embedded", "redis", "redis-cluster", "istio", "envoy-gateway"];

// What `kubectl kustomize` renders for the kustomization in `dir` (relative to the repository).
fn kustomize(dir: &str) -> String {
    let kubectl =
        std::env::var("KUBECTL_BIN").map(PathBuf::from).unwrap_or_else(|_| repo("target/venv/bin/kubectl"));
    let out = Command::new(kubectl)
        .arg("kustomize")
        .arg(repo(dir))
        .output()
        .expect("kubectl (scripts/test installs it into target/venv)");
    assert!(out.status.success(), "kubectl kustomize {dir}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

// An overlay's rendered objects.
fn overlay(name: &str) -> Vec<Value> {
    let text = kustomize(&format!("k8s/overlays/{name}"));
    serde_saphyr::from_str_multiple(&text).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn find<'a>(docs: &'a [Value], kind: &str, name: &str) -> Option<&'a Value> {
    docs.iter().find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
}

// Every overlay (and one with the ServiceMonitor component) rendered by `kubectl kustomize` and
// each object validated against the Kubernetes 1.37 schemas (kubernetes-validate --strict; the
// kinds of CRDs, Istio's and the Prometheus Operator's, have no schema there and are skipped with
// a warning); the demo Redis Cluster and the Deployment Envoy Gateway makes, as files.
#[test]
fn kubernetes_manifests_pass_the_schema_validator() {
    let rendered = repo("target/kustomize");
    let _ = std::fs::remove_dir_all(&rendered);
    std::fs::create_dir_all(rendered.join("monitored")).unwrap();
    std::fs::write(
        rendered.join("monitored/kustomization.yaml"),
        "resources: [../../../k8s/overlays/redis]\ncomponents: [../../../k8s/components/servicemonitor]\n",
    )
    .unwrap();
    let mut files = vec![
        repo("k8s/redis/demo-redis-cluster.yaml"),
        repo("k8s/overlays/envoy-gateway/ratelimit-deployment.yaml"),
    ];
    for name in OVERLAYS {
        let file = rendered.join(format!("{name}.yaml"));
        std::fs::write(&file, kustomize(&format!("k8s/overlays/{name}"))).unwrap();
        files.push(file);
    }
    let monitored = kustomize("target/kustomize/monitored");
    assert!(monitored.contains("kind: ServiceMonitor"), "the component adds a ServiceMonitor");
    let file = rendered.join("monitored.yaml");
    std::fs::write(&file, monitored).unwrap();
    files.push(file);
    let out = Command::new(kubernetes_validate())
        .arg("--strict")
        .args(&files)
        .output()
        .expect("kubernetes-validate (scripts/test installs it into target/venv)");
    let report = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{report}");
    let passed = |file: &str, kind: &str| report.contains(&format!("{file} passed for resource {kind} "));
    for name in ["embedded", "redis", "redis-cluster", "istio"] {
        for kind in [
            "namespace/tollgate",
            "deployment/tollgate",
            "service/tollgate",
            "configmap/tollgate-rules",
            "networkpolicy/tollgate",
        ] {
            assert!(passed(&format!("{name}.yaml"), kind), "{name}: {kind} not validated:\n{report}");
        }
    }
    for (file, kind) in [
        ("redis.yaml", "horizontalpodautoscaler/tollgate"),
        ("redis.yaml", "poddisruptionbudget/tollgate"),
        ("redis.yaml", "deployment/redis"),
        ("redis.yaml", "networkpolicy/redis-only-from-tollgate"),
        ("redis-cluster.yaml", "networkpolicy/redis-only-from-tollgate"),
        ("demo-redis-cluster.yaml", "statefulset/redis-cluster"),
        ("ratelimit-deployment.yaml", "deployment/envoy-ratelimit"),
        ("envoy-gateway.yaml", "configmap/envoy-gateway-config"),
    ] {
        assert!(passed(file, kind), "{file}: {kind} not validated:\n{report}");
    }
}

// The Deploy on Kubernetes page's own overlay, as printed (beside a checkout named `tollgate`,
// with a rules file of its own): it renders, sets what it says, and validates.
#[test]
fn the_books_own_overlay_renders_as_printed() {
    let page = std::fs::read_to_string(repo("docs/src/operations/kubernetes.md")).unwrap();
    let (_, after) = page.split_once("# my-tollgate/kustomization.yaml\n").expect("the page's overlay");
    let (overlay, _) = after.split_once("```").unwrap();
    let dir = repo("target/kustomize/page");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("my-tollgate/rules")).unwrap();
    std::os::unix::fs::symlink(repo(""), dir.join("tollgate")).unwrap();
    std::fs::write(dir.join("my-tollgate/kustomization.yaml"), overlay).unwrap();
    std::fs::copy(repo("examples/tollgate.yaml"), dir.join("my-tollgate/rules/api-gateway.yaml")).unwrap();
    let text = kustomize("target/kustomize/page/my-tollgate");
    let docs: Vec<Value> = serde_saphyr::from_str_multiple(&text).unwrap();
    let deploy = find(&docs, "Deployment", "tollgate").unwrap();
    let c = &deploy["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(deploy["spec"]["replicas"], 4);
    assert_eq!(c["image"], format!("registry.mycorp.example/tollgate:{}", env!("CARGO_PKG_VERSION")));
    let cluster =
        c["env"].as_array().unwrap().iter().find(|e| e["name"] == "TOLLGATE_REDIS_CLUSTER").unwrap();
    assert!(
        cluster["value"].as_str().unwrap().starts_with("my-redis-0"),
        "the patch hits the store's variable"
    );
    let rules = &find(&docs, "ConfigMap", "tollgate-rules").unwrap()["data"];
    assert!(rules.get("api-gateway.yaml").is_some() && rules.get("grpc-api.yaml").is_none(), "{rules}");
    assert!(find(&docs, "ServiceMonitor", "tollgate").is_some());
    let file = dir.join("tollgate.yaml");
    std::fs::write(&file, &text).unwrap();
    let out = Command::new(kubernetes_validate()).arg("--strict").arg(&file).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stdout));
}

#[test]
fn tollgate_manifests_keep_their_promises() {
    let docs = overlay("redis-cluster");
    let one = |kind: &str, name: &str| find(&docs, kind, name).unwrap_or_else(|| panic!("{kind}/{name}"));
    let deploy = one("Deployment", "tollgate");
    let pod = &deploy["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    assert_eq!(deploy["spec"]["replicas"], 3);
    assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert_eq!(c["livenessProbe"]["httpGet"]["path"], "/healthz");
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    assert_eq!(c["securityContext"]["readOnlyRootFilesystem"], true);
    assert_eq!(c["securityContext"]["allowPrivilegeEscalation"], false);
    assert!(c["resources"]["requests"]["cpu"].is_string() && c["resources"]["limits"]["memory"].is_string());
    let pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"].as_u64().expect("preStop sleep");
    assert!(
        pod["terminationGracePeriodSeconds"].as_u64().unwrap() > pre_stop + 2,
        "grace covers preStop and drain"
    );
    // Hot reload needs the ConfigMap mounted as a directory: subPath mounts never update.
    let mount = &c["volumeMounts"][0];
    assert!(mount.get("subPath").is_none());
    assert_eq!(c["args"], json!(["serve", "--config", mount["mountPath"]]));
    // And under the name the Deployment mounts: a hashed name would roll every pod instead.
    assert_eq!(pod["volumes"][0]["configMap"]["name"], "tollgate-rules");
    let env = |c: &Value, name: &str| {
        c["env"].as_array().unwrap().iter().find(|e| e["name"] == name).map(|e| e["value"].clone())
    };
    assert!(env(c, "TOLLGATE_REDIS_CLUSTER").is_some_and(|v| v.as_str().unwrap().contains(":6379,")));

    let service = one("Service", "tollgate");
    let grpc = service["spec"]["ports"].as_array().unwrap().iter().find(|p| p["port"] == 8081).unwrap();
    assert_eq!((grpc["name"].as_str(), grpc["appProtocol"].as_str()), (Some("grpc"), Some("grpc")));
    assert_eq!(one("HorizontalPodAutoscaler", "tollgate")["spec"]["minReplicas"], 3);
    assert_eq!(one("PodDisruptionBudget", "tollgate")["spec"]["minAvailable"], 2);

    // The ConfigMap carries exactly the example rules, which load.
    let rules = &one("ConfigMap", "tollgate-rules")["data"];
    for file in ["tollgate.yaml", "grpc-api.yaml"] {
        let shipped = std::fs::read_to_string(repo(&format!("examples/{file}"))).unwrap();
        assert_eq!(rules[file].as_str().unwrap(), shipped, "configmap {file} differs from examples/{file}");
        tollgate::config::RuleSet::from_yaml(Path::new(file), &shipped).unwrap();
    }

    // Each overlay sets its store, and every one runs the image kustomization.yaml names.
    let version = env!("CARGO_PKG_VERSION");
    for name in ["embedded", "redis", "redis-cluster", "istio"] {
        let docs = overlay(name);
        let c = &find(&docs, "Deployment", "tollgate").unwrap()["spec"]["template"]["spec"]["containers"][0];
        assert_eq!(c["image"], format!("registry.example.com/tollgate:{version}"), "{name}");
        let stores = ["TOLLGATE_REDIS_URL", "TOLLGATE_REDIS_CLUSTER"].map(|n| env(c, n).is_some());
        let expected = match name {
            "embedded" => [false, false],
            "redis" => [true, false],
            _ => [false, true],
        };
        assert_eq!(stores, expected, "{name}: its store");
    }
    // On the embedded store one replica, nothing that would add more.
    let embedded = overlay("embedded");
    assert_eq!(find(&embedded, "Deployment", "tollgate").unwrap()["spec"]["replicas"], 1);
    assert!(find(&embedded, "HorizontalPodAutoscaler", "tollgate").is_none());
    assert!(find(&embedded, "PodDisruptionBudget", "tollgate").is_none());
    // In the mesh: injected, and the gRPC port open to the mesh's proxies.
    let istio = overlay("istio");
    assert_eq!(
        find(&istio, "Namespace", "tollgate").unwrap()["metadata"]["labels"]["istio-injection"],
        "enabled"
    );
    let from = &find(&istio, "NetworkPolicy", "tollgate").unwrap()["spec"]["ingress"][0]["from"];
    assert_eq!(from[0]["podSelector"]["matchLabels"]["istio"], "ingressgateway");
}

fn render(args: &[&str]) -> Value {
    let out = Command::new(tollgate_bin()).arg("render").args(args).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_saphyr::from_str(&String::from_utf8(out.stdout).unwrap()).unwrap()
}

#[test]
fn istio_envoyfilters_are_what_render_prints() {
    let examples = repo("examples");
    let common = [
        "--config",
        examples.to_str().unwrap(),
        "--domain",
        "api-gateway",
        "--jwt-issuer",
        "https://auth.tollgate.example",
    ];
    let gateway = render(&[&["istio", "--gateway"][..], &common].concat());
    assert_eq!(yaml_docs("k8s/overlays/istio/ingress-gateway.yaml"), vec![gateway]);
    let sidecar = render(&[&["istio", "--sidecar", "demo-api", "--namespace", "demo"][..], &common].concat());
    assert_eq!(yaml_docs("k8s/overlays/istio/sidecar.yaml"), vec![sidecar]);
}

#[test]
fn istio_manifests_are_well_formed() {
    let apply_to = [
        "HTTP_FILTER",
        "VIRTUAL_HOST",
        "HTTP_ROUTE",
        "CLUSTER",
        "LISTENER",
        "NETWORK_FILTER",
        "ROUTE_CONFIGURATION",
    ];
    let contexts = ["GATEWAY", "SIDECAR_INBOUND", "SIDECAR_OUTBOUND", "ANY"];
    let operations = ["MERGE", "ADD", "REMOVE", "INSERT_BEFORE", "INSERT_AFTER", "INSERT_FIRST", "REPLACE"];
    let docs = manifests("k8s/overlays/istio");
    let mut kinds = Vec::new();
    for (file, d) in &docs {
        for field in ["apiVersion", "kind"] {
            assert!(d[field].is_string(), "{file}: {field}");
        }
        assert!(
            d["metadata"]["name"].is_string() && d["metadata"]["namespace"].is_string(),
            "{file}: metadata"
        );
        let kind = d["kind"].as_str().unwrap();
        kinds.push(kind.to_owned());
        match kind {
            "EnvoyFilter" => {
                assert_eq!(d["apiVersion"], "networking.istio.io/v1alpha3", "{file}");
                assert!(d["spec"]["workloadSelector"]["labels"].is_object(), "{file}: workloadSelector");
                for p in d["spec"]["configPatches"].as_array().unwrap() {
                    assert!(apply_to.contains(&p["applyTo"].as_str().unwrap()), "{file}: {p}");
                    assert!(contexts.contains(&p["match"]["context"].as_str().unwrap()), "{file}: {p}");
                    assert!(operations.contains(&p["patch"]["operation"].as_str().unwrap()), "{file}: {p}");
                    assert!(p["patch"]["value"].is_object(), "{file}: {p}");
                }
            }
            "RequestAuthentication" => {
                let rule = &d["spec"]["jwtRules"][0];
                assert!(
                    rule["issuer"].is_string() && (rule["jwks"].is_string() || rule["jwksUri"].is_string()),
                    "{file}"
                );
            }
            "AuthorizationPolicy" => {
                assert!(
                    d["spec"]["rules"][0]["from"][0]["source"]["requestPrincipals"].is_array(),
                    "{file}: requires a JWT"
                );
            }
            "Gateway" | "VirtualService" => assert!(d["spec"].is_object(), "{file}"),
            other => panic!("{file}: unexpected kind {other}"),
        }
    }
    for kind in ["EnvoyFilter", "RequestAuthentication", "AuthorizationPolicy", "VirtualService"] {
        assert!(kinds.iter().any(|k| k == kind), "no {kind}");
    }
    // The VirtualService names the route the HTTP_ROUTE patch matches.
    let vs = docs.iter().map(|(_, d)| d).find(|d| d["kind"] == "VirtualService").unwrap();
    let gateway = docs
        .iter()
        .map(|(_, d)| d)
        .find(|d| d["metadata"]["name"] == "tollgate-api-gateway-gateway")
        .unwrap();
    let route_patch = gateway["spec"]["configPatches"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["applyTo"] == "HTTP_ROUTE")
        .unwrap();
    let name = &route_patch["match"]["routeConfiguration"]["vhost"]["route"]["name"];
    assert!(
        vs["spec"]["http"].as_array().unwrap().iter().any(|r| &r["name"] == name),
        "no VirtualService route named {name}"
    );
}

// An Envoy bootstrap built from an EnvoyFilter's patches, the way Istio would apply them.
fn bootstrap_from(filter: &Value) -> Value {
    let patches = filter["spec"]["configPatches"].as_array().unwrap();
    let of = |kind: &'static str| patches.iter().filter(move |p| p["applyTo"] == kind);
    let http_filter = of("HTTP_FILTER").next().expect("an HTTP_FILTER patch")["patch"]["value"].clone();
    let cluster_name = http_filter["typed_config"]["rate_limit_service"]["grpc_service"]["envoy_grpc"]
        ["cluster_name"]
        .as_str()
        .unwrap()
        .to_owned();
    let mut vhost = json!({"name": "all", "domains": ["*"], "routes": []});
    for p in of("VIRTUAL_HOST") {
        for (k, v) in p["patch"]["value"].as_object().unwrap() {
            vhost[k] = v.clone();
        }
    }
    let mut routes: Vec<Value> = of("HTTP_ROUTE")
        .map(|p| {
            let mut route = json!({
                "name": p["match"]["routeConfiguration"]["vhost"]["route"]["name"],
                "match": {"prefix": "/named"},
                "route": {"cluster": "upstream"},
            });
            for (k, v) in p["patch"]["value"]["route"].as_object().unwrap() {
                route["route"][k] = v.clone();
            }
            route
        })
        .collect();
    routes.push(json!({"match": {"prefix": "/"}, "route": {"cluster": "upstream"}}));
    vhost["routes"] = json!(routes);
    let cluster = |name: &str, http2: bool| {
        let mut c = json!({
            "name": name, "type": "STATIC", "connect_timeout": "1s",
            "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 8081}}}}]}]},
        });
        if http2 {
            c["typed_extension_protocol_options"] = json!({"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}}}});
        }
        c
    };
    json!({"static_resources": {
        "listeners": [{
            "name": "istio", "address": {"socket_address": {"address": "127.0.0.1", "port_value": 10000}},
            "filter_chains": [{"filters": [{
                "name": "envoy.filters.network.http_connection_manager",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                    "stat_prefix": "istio",
                    "route_config": {"virtual_hosts": [vhost]},
                    "http_filters": [http_filter, {"name": "envoy.filters.http.router", "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
                },
            }]}],
        }],
        "clusters": [cluster(&cluster_name, true), cluster("upstream", false)],
    }})
}

#[test]
fn envoy_fragments_of_the_envoyfilters_load_in_envoy() {
    let filters: Vec<Value> = manifests("k8s/overlays/istio")
        .into_iter()
        .map(|(_, d)| d)
        .filter(|d| d["kind"] == "EnvoyFilter")
        .collect();
    assert_eq!(filters.len(), 2);
    for filter in &filters {
        let (ok, output) = envoy_validate(&bootstrap_from(filter));
        assert!(ok, "{}: {output}", filter["metadata"]["name"]);
    }
    // A typo inside a patch is caught.
    let mut broken = filters[0].clone();
    broken["spec"]["configPatches"][0]["patch"]["value"]["typed_config"]
        ["rate_limited_as_resource_exhaustd"] = json!(true);
    let (ok, output) = envoy_validate(&bootstrap_from(&broken));
    assert!(!ok, "{output}");
}

#[test]
fn docker_compose_stack_references_resolve() {
    // A Docker engine is not available where these tests run; if the compose client is, let it
    // check the file too.
    if let Ok(out) =
        Command::new("docker").args(["compose", "config", "--quiet"]).current_dir(repo("")).output()
    {
        if out.status.success() || !String::from_utf8_lossy(&out.stderr).contains("unknown") {
            assert!(out.status.success(), "docker compose config: {}", String::from_utf8_lossy(&out.stderr));
        }
    }
    let compose = &yaml_docs("docker-compose.yml")[0];
    let services = compose["services"].as_object().unwrap();
    for name in ["tollgate", "envoy", "upstream", "grpc-upstream", "redis-cluster-init"] {
        assert!(services.contains_key(name), "no service {name}");
    }
    assert_eq!(services.keys().filter(|k| k.starts_with("redis-") && *k != "redis-cluster-init").count(), 6);
    for (name, s) in services {
        assert!(s["image"].is_string() || s["build"].is_string(), "{name}: image or build");
        if let Some(context) = s["build"].as_str() {
            assert!(repo(context).join("Dockerfile").exists(), "{name}: build context without Dockerfile");
        }
        for volume in s["volumes"].as_array().into_iter().flatten() {
            let host = volume.as_str().unwrap().split(':').next().unwrap();
            assert!(repo(host).exists(), "{name}: mounted path {host} does not exist");
        }
        for port in s["ports"].as_array().into_iter().flatten() {
            let (host, container) = port.as_str().unwrap().split_once(':').unwrap();
            assert!(host.parse::<u16>().is_ok() && container.parse::<u16>().is_ok(), "{name}: port {port}");
        }
        let deps: Vec<String> = match &s["depends_on"] {
            Value::Array(a) => a.iter().map(|d| d.as_str().unwrap().to_owned()).collect(),
            Value::Object(o) => o.keys().cloned().collect(),
            _ => vec![],
        };
        for d in deps {
            assert!(services.contains_key(&d), "{name} depends on unknown {d}");
        }
    }
    // What Envoy dials exists: each front-proxy cluster's host is a service listening there.
    let envoy_config = repo_yaml("envoy/front-proxy.yaml");
    let listens = |service: &str, port: u64| -> bool {
        let command: Vec<String> = services[service]["command"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c.as_str().unwrap().to_owned())
            .collect();
        let text = command.join(" ");
        text.contains(&format!(":{port}"))
            || (service == "tollgate" && port == 8081 && !text.contains("--grpc-addr"))
    };
    for cluster in envoy_config["static_resources"]["clusters"].as_array().unwrap() {
        let addr = &cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
            ["socket_address"];
        let (host, port) = (addr["address"].as_str().unwrap(), addr["port_value"].as_u64().unwrap());
        assert!(services.contains_key(host), "envoy dials {host}, which is not a compose service");
        assert!(listens(host, port), "{host} does not listen on {port}");
    }
    // tollgate's rules load as the container would read them.
    let out =
        Command::new(tollgate_bin()).args(["validate", repo("examples").to_str().unwrap()]).output().unwrap();
    assert!(out.status.success());
}

#[test]
fn dockerfile_copies_what_exists() {
    let dockerfile = std::fs::read_to_string(repo("Dockerfile")).unwrap();
    let mut copies = 0;
    for line in dockerfile.lines().filter(|l| l.starts_with("COPY ") && !l.contains("--from")) {
        let parts: Vec<&str> = line.split_whitespace().skip(1).collect();
        for source in &parts[..parts.len() - 1] {
            assert!(repo(source).exists(), "Dockerfile copies missing {source}");
            copies += 1;
        }
    }
    assert!(copies >= 3);
    assert!(dockerfile.contains("USER nonroot") && dockerfile.contains("cargo build --release --locked"));
    // Everything the build reads is copied: the manifest, the build script and the proto it
    // compiles, the sources, and what the crate includes at compile time.
    let copied: Vec<&str> = dockerfile
        .lines()
        .filter(|l| l.starts_with("COPY ") && !l.contains("--from"))
        .flat_map(|l| {
            let parts: Vec<&str> = l.split_whitespace().skip(1).collect();
            parts[..parts.len() - 1].to_vec()
        })
        .collect();
    for needed in ["Cargo.toml", "Cargo.lock", "build.rs", "src", "proto", "migrations"] {
        assert!(copied.contains(&needed), "the Dockerfile does not copy {needed}");
    }
    for included in [
        "src/store/redis/bucket.lua",
        "src/store/redis/lease.lua",
        "proto/tollgate/region/v1/region.proto",
        "migrations/0001_tollgate_quotas.sql",
    ] {
        assert!(repo(included).exists());
    }
}

#[test]
fn envoy_gateways_ratelimit_deployment_changes_only_its_image() {
    let theirs = &yaml_docs("tests/data/envoy-gateway/deployment-default.yaml")[0];
    let ours = &yaml_docs("k8s/overlays/envoy-gateway/ratelimit-deployment.yaml")[0];
    let (a, b) = (&theirs["spec"]["template"]["spec"], &ours["spec"]["template"]["spec"]);
    let mut theirs_container = a["containers"][0].clone();
    theirs_container["image"] = b["containers"][0]["image"].clone();
    assert_eq!(b["containers"][0], theirs_container, "only the image differs");
    assert_eq!(a["volumes"], b["volumes"]);
    assert_eq!(theirs["spec"]["selector"], ours["spec"]["selector"]);
    let config = &yaml_docs("k8s/overlays/envoy-gateway/envoy-gateway-config.yaml")[0];
    let eg: Value = serde_saphyr::from_str(config["data"]["envoy-gateway.yaml"].as_str().unwrap()).unwrap();
    assert_eq!(
        eg["provider"]["kubernetes"]["rateLimitDeployment"]["container"]["image"],
        b["containers"][0]["image"]
    );
    let dockerfile = std::fs::read_to_string(repo("Dockerfile")).unwrap();
    assert_eq!(b["containers"][0]["command"], json!(["/bin/ratelimit"]));
    assert!(
        dockerfile.contains("ln -s /usr/local/bin/tollgate /out/bin/ratelimit"),
        "the image answers to /bin/ratelimit"
    );
}

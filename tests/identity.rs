//! Bucket identity: two requests share a bucket only where envoyproxy/ratelimit would share a
//! counter (same domain, same rule, same values or the same `share_threshold` pattern), or where
//! the config says so explicitly (one `class` in one class scope).
//!
//! * A table of cases, each defect of the past and its mirror (what must still share), runs on
//!   the embedded store, a standalone Redis and a Redis Cluster; on Redis the keys written are
//!   read back and must be exactly the documented ones.
//! * A randomized property: random configs and descriptor sequences, decided by a memory-store
//!   server and a Redis-backed one. Both must answer alike; on Redis, every admitted request
//!   touches exactly one key, requests an independent model of envoyproxy/ratelimit's identity
//!   keeps apart never touch the same key, and every balance equals the capacity minus what
//!   the admitted requests of its identity took.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use common::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// (domain, descriptors, expected overall code)
type Step = (&'static str, &'static [&'static str], i32);

struct Case {
    name: &'static str,
    files: &'static [&'static str],
    steps: &'static [Step],
    keys: &'static [&'static str],
}

const CASES: &[Case] = &[
    Case {
        name: "a rule's name never merges buckets",
        files: &["domain: n1\ndescriptors:\n  - key: tenant\n    descriptors:\n      - key: path\n        rate_limit: {name: per_path, unit: minute, requests_per_unit: 2}\n"],
        steps: &[
            ("n1", &["tenant=t,path=/a"], OK),
            ("n1", &["tenant=t,path=/a"], OK),
            ("n1", &["tenant=t,path=/b"], OK),
            ("n1", &["tenant=t,path=/a"], OVER_LIMIT),
        ],
        keys: &["rl:{t}:n1:tenant=t:path=/a", "rl:{t}:n1:tenant=t:path=/b"],
    },
    Case {
        name: "rules [path, tenant] and [tenant, path] are two buckets",
        files: &["domain: n2\ndescriptors:\n  - key: path\n    descriptors:\n      - key: tenant\n        rate_limit: {unit: minute, requests_per_unit: 1}\n  - key: tenant\n    descriptors:\n      - key: path\n        rate_limit: {unit: minute, requests_per_unit: 1000}\n"],
        steps: &[
            ("n2", &["path=/x,tenant=t9"], OK),
            ("n2", &["tenant=t9,path=/x"], OK),
            ("n2", &["path=/x,tenant=t9"], OVER_LIMIT),
            ("n2", &["tenant=t9,path=/x"], OK),
        ],
        keys: &["rl:{t9}:n2:path=/x:tenant=t9", "rl:{t9}:n2:tenant=t9:path=/x"],
    },
    Case {
        name: "buckets never cross domains",
        files: &[
            "domain: n3a\ndescriptors:\n  - key: tenant\n    rate_limit: {unit: minute, requests_per_unit: 2}\n",
            "domain: n3b\ndescriptors:\n  - key: tenant\n    rate_limit: {unit: minute, requests_per_unit: 2}\n",
        ],
        steps: &[
            ("n3a", &["tenant=t"], OK),
            ("n3a", &["tenant=t"], OK),
            ("n3a", &["tenant=t"], OVER_LIMIT),
            ("n3b", &["tenant=t"], OK),
        ],
        keys: &["rl:{t}:n3a:tenant=t", "rl:{t}:n3b:tenant=t"],
    },
    Case {
        name: "an override is its own bucket",
        files: &["domain: n4\ndescriptors:\n  - key: ip\n    rate_limit: {unit: minute, requests_per_unit: 10}\n"],
        steps: &[("n4", &["ip=1"], OK)],
        keys: &["rl:n4:=1/minute:ip=1", "rl:n4:ip=1"],
    },
    Case {
        name: "one explicit class in one domain is one bucket (mirror)",
        files: &["domain: s1\ndescriptors:\n  - key: tenant\n    descriptors:\n      - key: route\n        value: a\n        class: export\n        rate_limit: {unit: minute, requests_per_unit: 2}\n      - key: route\n        value: b\n        class: export\n        rate_limit: {unit: minute, requests_per_unit: 2}\n"],
        steps: &[
            ("s1", &["tenant=t,route=a"], OK),
            ("s1", &["tenant=t,route=b"], OK),
            ("s1", &["tenant=t,route=a"], OVER_LIMIT),
            ("s1", &["tenant=t,route=b"], OVER_LIMIT),
            ("s1", &["tenant=t2,route=b"], OK),
        ],
        keys: &["rl:{t2}:s1:export", "rl:{t}:s1:export"],
    },
    Case {
        name: "the same value twice is one bucket (mirror)",
        files: &["domain: s2\ndescriptors:\n  - key: ip\n    rate_limit: {unit: minute, requests_per_unit: 2}\n"],
        steps: &[("s2", &["ip=1"], OK), ("s2", &["ip=1"], OK), ("s2", &["ip=1"], OVER_LIMIT), ("s2", &["ip=2"], OK)],
        keys: &["rl:s2:ip=1", "rl:s2:ip=2"],
    },
    Case {
        name: "share_threshold: every value of the wildcard is one bucket (mirror)",
        files: &["domain: s3\ndescriptors:\n  - key: file\n    value: \"docs/*\"\n    share_threshold: true\n    rate_limit: {unit: minute, requests_per_unit: 2}\n"],
        steps: &[("s3", &["file=docs/a"], OK), ("s3", &["file=docs/b"], OK), ("s3", &["file=docs/c"], OVER_LIMIT)],
        keys: &["rl:s3:file=docs/*"],
    },
    Case {
        name: "class_scope shares a class across domains, explicitly (mirror)",
        files: &[
            "domain: s4a\nclass_scope: s4\ndescriptors:\n  - key: tenant\n    descriptors:\n      - key: kind\n        class: shared\n        rate_limit: {unit: minute, requests_per_unit: 2}\n",
            "domain: s4b\nclass_scope: s4\ndescriptors:\n  - key: tenant\n    descriptors:\n      - key: kind\n        class: shared\n        rate_limit: {unit: minute, requests_per_unit: 2}\n",
        ],
        steps: &[("s4a", &["tenant=t,kind=x"], OK), ("s4b", &["tenant=t,kind=y"], OK), ("s4a", &["tenant=t,kind=x"], OVER_LIMIT)],
        keys: &["rl:{t}:s4:shared"],
    },
];

fn write_cases(dir: &Path) {
    let mut n = 0;
    for case in CASES {
        for file in case.files {
            std::fs::write(dir.join(format!("{n:02}.yaml")), file).unwrap();
            n += 1;
        }
    }
}

async fn run_cases(addr: &str) {
    for case in CASES {
        for (i, (domain, descriptors, expected)) in case.steps.iter().enumerate() {
            let r = ask(addr, req(domain, descriptors, 1)).await.unwrap();
            assert_eq!(r.overall_code, *expected, "{}: step {i}", case.name);
        }
    }
    // The override case: a 1/minute override next to the rule's 10/minute bucket.
    let mut request = req("n4", &["ip=1"], 1);
    request.descriptors[0].limit = Some(
        envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride {
            requests_per_unit: 1,
            unit: 2,
        },
    );
    assert_eq!(ask(addr, request.clone()).await.unwrap().overall_code, OK);
    assert_eq!(ask(addr, request).await.unwrap().overall_code, OVER_LIMIT, "the override holds");
    let r = ask(addr, req("n4", &["ip=1"], 1)).await.unwrap();
    assert_eq!(
        (r.overall_code, r.statuses[0].limit_remaining),
        (OK, 8),
        "the rule's bucket saw only its own"
    );
}

fn expected_keys() -> Vec<String> {
    let mut keys: Vec<String> = CASES.iter().flat_map(|c| c.keys.iter().map(|k| k.to_string())).collect();
    keys.sort();
    keys
}

#[tokio::test(flavor = "multi_thread")]
async fn identity_table_on_every_backend() {
    let dir = tempfile::tempdir().unwrap();
    write_cases(dir.path());
    let memory = Tollgate::start(dir.path(), &Backend::Memory, &[]);
    run_cases(&memory.addr()).await;

    let redis = Redis::start();
    let server = Tollgate::start(dir.path(), &Backend::Redis(redis.url()), &[]);
    run_cases(&server.addr()).await;
    let mut keys: Vec<String> = redis::cmd("KEYS").arg("rl:*").query(&mut redis.connection()).unwrap();
    keys.sort();
    assert_eq!(keys, expected_keys(), "exactly the documented buckets");

    let cluster = RedisCluster::start();
    let server = Tollgate::start(dir.path(), &Backend::Cluster(cluster.seeds()), &[]);
    run_cases(&server.addr()).await;
    let mut keys: Vec<String> = cluster
        .primaries()
        .iter()
        .flat_map(|p| node_query::<Vec<String>>(*p, &["KEYS", "rl:*"]).unwrap())
        .collect();
    keys.sort();
    assert_eq!(keys, expected_keys(), "exactly the documented buckets, each on its slot's primary");
}

// ---- The randomized property ----

/// A node of a generated config, and the oracle's view of it.
#[derive(Debug, Clone)]
struct Node {
    id: usize,
    key: &'static str,
    value: Option<&'static str>,
    share: bool,
    limit: Option<(u32, Option<&'static str>)>,
    class: Option<&'static str>,
    children: Vec<Node>,
}

const KEYS: [&str; 3] = ["tenant", "a", "b"];
const CONFIG_VALUES: [&str; 4] = ["x", "y", "x*", "*y"];
const REQUEST_VALUES: [&str; 6] = ["x", "y", "xy", "xx", "yy", "z"];
// Every rule of a class has the same size (the config would be rejected otherwise).
const CLASSES: [(&str, u32); 2] = [("c1", 3), ("c2", 2)];

fn gen_level(rng: &mut StdRng, depth: usize, under_tenant: bool, next_id: &mut usize) -> Vec<Node> {
    let mut used = Vec::new();
    let mut nodes = Vec::new();
    for _ in 0..rng.random_range(1..=4) {
        let key = KEYS[rng.random_range(0..KEYS.len())];
        let value = if rng.random_bool(0.4) {
            None
        } else {
            Some(CONFIG_VALUES[rng.random_range(0..CONFIG_VALUES.len())])
        };
        if used.contains(&(key, value)) {
            continue;
        }
        used.push((key, value));
        let tenant = under_tenant || key == "tenant";
        let mut node = Node {
            id: *next_id,
            key,
            value,
            share: value.is_some_and(|v| v.contains('*')) && rng.random_bool(0.5),
            limit: None,
            class: None,
            children: Vec::new(),
        };
        *next_id += 1;
        if rng.random_bool(0.7) {
            if tenant && rng.random_bool(0.3) {
                let (class, capacity) = CLASSES[rng.random_range(0..CLASSES.len())];
                node.class = Some(class);
                node.limit = Some((capacity, None));
            } else {
                let name = [None, Some("n"), Some("m")][rng.random_range(0..3)];
                node.limit = Some((rng.random_range(1..=4), name));
            }
        }
        if depth < 2 && rng.random_bool(0.5) {
            node.children = gen_level(rng, depth + 1, tenant, next_id);
        }
        nodes.push(node);
    }
    nodes
}

fn yaml(nodes: &[Node], indent: usize, out: &mut String) {
    let pad = " ".repeat(indent);
    for n in nodes {
        out.push_str(&format!("{pad}- key: {}\n", n.key));
        if let Some(v) = n.value {
            out.push_str(&format!("{pad}  value: \"{v}\"\n"));
        }
        if n.share {
            out.push_str(&format!("{pad}  share_threshold: true\n"));
        }
        if let Some(class) = n.class {
            out.push_str(&format!("{pad}  class: {class}\n"));
        }
        if let Some((capacity, name)) = n.limit {
            let name = name.map(|n| format!(", name: {n}")).unwrap_or_default();
            out.push_str(&format!(
                "{pad}  rate_limit: {{unit: hour, requests_per_unit: {capacity}{name}}}\n"
            ));
        }
        if !n.children.is_empty() {
            out.push_str(&format!("{pad}  descriptors:\n"));
            yaml(&n.children, indent + 4, out);
        }
    }
}

fn glob(pattern: &str, value: &str) -> bool {
    match pattern.split_once('*') {
        None => pattern == value,
        Some((head, tail)) => {
            value.len() >= head.len() + tail.len() && value.starts_with(head) && value.ends_with(tail)
        }
    }
}

/// envoyproxy/ratelimit's identity of the counter a descriptor reaches, with tollgate's class
/// extension: (the rule's node, the entries with share patterns) or (tenant, class).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Identity {
    Values(usize, Vec<(String, String)>),
    Class(String, String),
}

fn oracle(root: &[Node], entries: &[(&str, &str)]) -> Option<(Identity, u32)> {
    let mut level = root;
    let mut shared: Vec<(String, String)> = Vec::new();
    let mut tenant: Option<&str> = None;
    for (i, (k, v)) in entries.iter().enumerate() {
        let node = level
            .iter()
            .find(|n| n.key == *k && n.value == Some(*v))
            .or_else(|| {
                level.iter().find(|n| n.key == *k && n.value.is_some_and(|p| p.contains('*') && glob(p, v)))
            })
            .or_else(|| level.iter().find(|n| n.key == *k && n.value.is_none()))?;
        let value = if node.share { node.value.unwrap() } else { v };
        if *k == "tenant" && tenant.is_none() {
            tenant = Some(value);
        }
        shared.push((k.to_string(), value.to_string()));
        if i == entries.len() - 1 {
            let (capacity, _) = node.limit?;
            return Some(match (node.class, tenant) {
                (Some(class), Some(t)) => (Identity::Class(t.to_string(), class.to_string()), capacity),
                _ => (Identity::Values(node.id, shared), capacity),
            });
        }
        level = &node.children;
    }
    None
}

// Mostly descriptors that walk the tree (values chosen to hit exact, wildcard and any nodes),
// sometimes anything at all.
fn random_entries(rng: &mut StdRng, root: &[Node]) -> Vec<(&'static str, &'static str)> {
    let any_value = |rng: &mut StdRng| REQUEST_VALUES[rng.random_range(0..REQUEST_VALUES.len())];
    if rng.random_bool(0.2) {
        return (0..rng.random_range(1..=3))
            .map(|_| (KEYS[rng.random_range(0..KEYS.len())], any_value(rng)))
            .collect();
    }
    let mut entries = Vec::new();
    let mut level = root;
    while !level.is_empty() {
        let node = &level[rng.random_range(0..level.len())];
        let value = match node.value {
            Some(v) if !v.contains('*') => v,
            Some(p) => {
                *REQUEST_VALUES.iter().filter(|v| glob(p, v)).nth(rng.random_range(0..2)).unwrap_or(&"x")
            }
            None => any_value(rng),
        };
        entries.push((node.key, value));
        if node.children.is_empty() || (node.limit.is_some() && rng.random_bool(0.5)) {
            break;
        }
        level = &node.children;
    }
    entries
}

fn snapshot(con: &mut redis::Connection) -> BTreeMap<String, Vec<String>> {
    let keys: Vec<String> = redis::cmd("KEYS").arg("rl:*").query(con).unwrap();
    keys.into_iter()
        .map(|k| {
            let v: Vec<String> = redis::cmd("HGETALL").arg(&k).query(con).unwrap();
            (k, v)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn random_configs_share_buckets_exactly_as_the_reference_does() {
    let redis = Redis::start();
    let mut con = redis.connection();
    let mut checked = 0;
    for seed in 0..30u64 {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut next_id = 0;
        let root = gen_level(&mut rng, 0, false, &mut next_id);
        let mut text = String::from("domain: p\ndescriptors:\n");
        yaml(&root, 2, &mut text);
        let (_dir, config) = config_file(&text);
        let memory = Tollgate::start(&config, &Backend::Memory, &[]);
        let _: () = redis::cmd("FLUSHALL").query(&mut con).unwrap();
        let server = Tollgate::start(&config, &Backend::Redis(redis.url()), &[]);

        let mut key_of: HashMap<Identity, String> = HashMap::new();
        let mut identity_of: HashMap<String, Identity> = HashMap::new();
        let mut taken: HashMap<Identity, (u32, u32)> = HashMap::new();
        for step in 0..60 {
            let entries = random_entries(&mut rng, &root);
            let descriptor: String =
                entries.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(",");
            let what = format!("seed {seed} step {step} [{descriptor}]\n{text}");
            let before = snapshot(&mut con);
            let from_redis = ask(&server.addr(), req("p", &[&descriptor], 1)).await.unwrap();
            let from_memory = ask(&memory.addr(), req("p", &[&descriptor], 1)).await.unwrap();
            assert_eq!(from_redis.overall_code, from_memory.overall_code, "{what}");
            // The same verdict, remaining and limit; the time to full differs by the
            // milliseconds between the two servers' decisions.
            let view = |r: &envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse| {
                r.statuses
                    .iter()
                    .map(|s| (s.code, s.current_limit.clone(), s.limit_remaining))
                    .collect::<Vec<_>>()
            };
            assert_eq!(view(&from_redis), view(&from_memory), "{what}");
            let after = snapshot(&mut con);
            let touched: Vec<&String> = after.keys().filter(|k| before.get(*k) != after.get(*k)).collect();
            let expected = oracle(&root, &entries);
            match (&expected, from_redis.overall_code) {
                (None, code) => {
                    assert_eq!(code, OK, "{what}");
                    assert!(touched.is_empty(), "{what}: no rule, yet {touched:?} changed");
                }
                (Some((identity, capacity)), OK) => {
                    assert_eq!(touched.len(), 1, "{what}: {touched:?}");
                    let key = touched[0].clone();
                    let known = key_of.entry(identity.clone()).or_insert_with(|| key.clone());
                    assert_eq!(*known, key, "{what}: one identity, two keys");
                    let owner = identity_of.entry(key.clone()).or_insert_with(|| identity.clone());
                    assert_eq!(owner, identity, "{what}: two identities share {key}");
                    taken.entry(identity.clone()).or_insert((*capacity, 0)).1 += 1;
                    checked += 1;
                }
                (Some(_), _) => assert!(touched.is_empty(), "{what}: a denied request changed {touched:?}"),
            }
        }
        // Every balance is its capacity minus what its identity's admitted requests took.
        for (identity, (capacity, admitted)) in &taken {
            let tokens = stored_tokens(&mut con, &key_of[identity]);
            let expected = f64::from(capacity - admitted);
            assert!((tokens - expected).abs() < 0.01, "seed {seed} {identity:?}: {tokens} != {expected}");
        }
    }
    println!("{checked} admitted requests checked against the reference identity");
    assert!(checked > 300, "only {checked} requests reached a bucket");
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2_000))]

    /// RLQS bucket ids built from hostile keys and values (separators, escapes, braces, control
    /// characters): two ids share a name only if they have the same entries.
    #[test]
    fn rlqs_bucket_ids_that_differ_never_share_a_name(
        a in proptest::collection::btree_map("[a=:,%{}\\x01 ]{0,4}", "[a=:,%{}\\x01 ]{0,4}", 0..4),
        b in proptest::collection::btree_map("[a=:,%{}\\x01 ]{0,4}", "[a=:,%{}\\x01 ]{0,4}", 0..4),
    ) {
        let name = |m: &BTreeMap<String, String>| {
            tollgate::identity::bucket_id_name(m.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        };
        proptest::prop_assert_eq!(name(&a) == name(&b), a == b, "{:?} {:?}", name(&a), name(&b));
    }
}

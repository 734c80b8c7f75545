//! What a team adopting tollgate reads first is true: the minimum Rust that `Cargo.toml` and the
//! README state is the one the locked dependencies need (a dependency update that raises it fails
//! here until both say the new one), the repository ships the license it declares, and the
//! version is one: `tollgate --version`, the changelog's newest entry and the image the manifests
//! name all say `Cargo.toml`'s.

use std::path::Path;
use std::process::Command;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

fn read(path: &str) -> String {
    std::fs::read_to_string(Path::new(ROOT).join(path)).unwrap()
}

fn parse_version(text: &str) -> Vec<u64> {
    let mut parts: Vec<u64> = text.split('.').map(|p| p.parse().unwrap()).collect();
    parts.resize(3, 0);
    parts
}

/// The highest `rust_version` among the packages the lock resolves for this machine's target,
/// walking normal and build dependencies from tollgate (dev-dependencies of tollgate itself too,
/// since the test suite builds them; a dependency's own dev-dependencies are never built).
fn locked_minimum() -> (Vec<u64>, String) {
    let host = String::from_utf8(Command::new("rustc").arg("-vV").output().unwrap().stdout).unwrap();
    let host = host.lines().find_map(|l| l.strip_prefix("host: ")).unwrap().to_string();
    let out = Command::new(env!("CARGO"))
        .args(["metadata", "--locked", "--offline", "--format-version", "1"])
        .args(["--filter-platform", &host, "--manifest-path"])
        .arg(Path::new(ROOT).join("Cargo.toml"))
        .output()
        .unwrap();
    assert!(out.status.success(), "cargo metadata: {}", String::from_utf8_lossy(&out.stderr));
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let packages: std::collections::HashMap<&str, &serde_json::Value> =
        meta["packages"].as_array().unwrap().iter().map(|p| (p["id"].as_str().unwrap(), p)).collect();
    let nodes: std::collections::HashMap<&str, &serde_json::Value> =
        meta["resolve"]["nodes"].as_array().unwrap().iter().map(|n| (n["id"].as_str().unwrap(), n)).collect();
    let root = meta["resolve"]["root"].as_str().unwrap();
    let (mut seen, mut stack) = (std::collections::HashSet::new(), vec![root]);
    let mut best = (vec![0, 0, 0], String::new());
    while let Some(id) = stack.pop() {
        if !seen.insert(id) {
            continue;
        }
        let package = packages[id];
        if id != root {
            if let Some(v) = package["rust_version"].as_str() {
                let v = parse_version(v);
                if v > best.0 {
                    best = (v, format!("{} {}", package["name"], package["version"]));
                }
            }
        }
        for dep in nodes[id]["deps"].as_array().unwrap() {
            let dev_only = dep["dep_kinds"].as_array().unwrap().iter().all(|k| k["kind"] == "dev");
            if id == root || !dev_only {
                stack.push(dep["pkg"].as_str().unwrap());
            }
        }
    }
    best
}

#[test]
fn stated_minimum_rust_is_what_the_lock_needs() {
    let (needed, by) = locked_minimum();
    let needed = format!("{}.{}", needed[0], needed[1]);
    let manifest = read("Cargo.toml");
    let stated = manifest.lines().find_map(|l| l.strip_prefix("rust-version = ")).unwrap().trim_matches('"');
    assert_eq!(stated, needed, "Cargo.toml's rust-version; the lock needs {needed} ({by})");
    let readme = read("README.md");
    assert!(
        readme.contains(&format!("with Rust {needed} or later")),
        "the README must say \"with Rust {needed} or later\" ({by} needs it)"
    );
}

#[test]
fn the_declared_license_ships() {
    let manifest = read("Cargo.toml");
    assert!(manifest.contains("license = \"Apache-2.0\""));
    let license = read("LICENSE");
    assert!(license.contains("Apache License") && license.contains("Version 2.0, January 2004"));
    assert!(read("NOTICE").contains("tollgate"));
}

#[test]
fn one_version_everywhere() {
    let manifest = read("Cargo.toml");
    let version = manifest.lines().find_map(|l| l.strip_prefix("version = ")).unwrap().trim_matches('"');
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate")).arg("--version").output().unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), format!("tollgate {version}"));
    let changelog = read("CHANGELOG.md");
    let newest = changelog.lines().find(|l| l.starts_with("## [")).unwrap();
    assert!(newest.starts_with(&format!("## [{version}]")), "CHANGELOG.md's newest entry: {newest}");
    let base = read("k8s/base/kustomization.yaml");
    assert!(base.contains(&format!("newTag: {version}")), "k8s/base/kustomization.yaml's image tag");
    assert!(base.contains(&format!("app.kubernetes.io/version: {version}")), "k8s/base's version label");
    let manifest = "k8s/overlays/envoy-gateway/envoy-gateway-config.yaml";
    let text = read(manifest);
    let image = text.lines().find_map(|l| l.trim().strip_prefix("image: ")).unwrap();
    assert!(image.contains(&format!("tollgate:{version}")), "{manifest} names {image}");
    assert!(!image.contains("ghcr.io/tollgate-dev"), "{manifest}: nothing publishes {image}");
}

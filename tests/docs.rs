//! The README and the book name only what exists: every relative link resolves to a file (and its
//! `#anchor` to a heading of that page), and every repository path a page names in backticks
//! (`src/...`, `tests/...`, `examples/...` and the other top-level folders) exists. Module docs
//! are held to the same for the paths they name. The book itself is built by `scripts/test`
//! (`mdbook build docs`), which fails on a page missing from `SUMMARY.md`.

use std::path::{Path, PathBuf};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");
/// Top-level folders whose paths pages name.
const FOLDERS: &[&str] = &[
    "src/",
    "tests/",
    "examples/",
    "envoy/",
    "bench/",
    "scripts/",
    "docs/",
    "migrations/",
    "k8s/",
    "fuzz/",
    "proto/",
    "dashboards/",
];

// Every file under `dir` whose name ends in `.{extension}`.
fn files(dir: &Path, extension: &str, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files(&path, extension, out);
        } else if path.extension().is_some_and(|e| e == extension) {
            out.push(path);
        }
    }
}

fn pages() -> Vec<PathBuf> {
    let mut pages = vec![Path::new(ROOT).join("README.md")];
    files(&Path::new(ROOT).join("docs/src"), "md", &mut pages);
    pages
}

// GitHub's anchor of a heading: lower case, punctuation dropped, spaces as dashes.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

// The anchors of a page's headings (outside code blocks).
fn anchors(text: &str) -> Vec<String> {
    let mut fence = false;
    let mut found = Vec::new();
    for line in text.lines() {
        if line.starts_with("```") {
            fence = !fence;
        } else if !fence && line.starts_with('#') {
            found.push(anchor(line.trim_start_matches('#')));
        }
    }
    found
}

// The text of a page outside code blocks.
fn prose(text: &str) -> String {
    let mut fence = false;
    let mut out = String::new();
    for line in text.lines() {
        if line.starts_with("```") {
            fence = !fence;
        } else if !fence {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

#[test]
fn every_relative_link_resolves() {
    let mut broken = Vec::new();
    for page in pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        let dir = page.parent().unwrap();
        // Links outside inline code (`descriptors[0](tenant)` is an error message, not a link).
        let links: String = prose(&text).split('`').step_by(2).collect();
        for link in links.split("](").skip(1) {
            let target = link.split(')').next().unwrap();
            if target.starts_with("http://") || target.starts_with("https://") || target.contains(' ') {
                continue;
            }
            let (file, fragment) = target.split_once('#').unwrap_or((target, ""));
            let path = if file.is_empty() { page.clone() } else { dir.join(file) };
            if !path.exists() {
                broken.push(format!("{}: {target}", page.display()));
                continue;
            }
            if !fragment.is_empty() && path.extension().is_some_and(|e| e == "md") {
                let headings = anchors(&std::fs::read_to_string(&path).unwrap());
                if !headings.iter().any(|h| h == fragment) {
                    broken.push(format!("{}: {target} (no such heading)", page.display()));
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

// Repository paths named in backticks in `text`: `src/store/mod.rs`, `examples/`, ...
fn named_paths(text: &str) -> Vec<String> {
    text.split('`')
        .skip(1)
        .step_by(2)
        .filter(|code| FOLDERS.iter().any(|f| code.starts_with(f)))
        .filter(|code| !code.contains(|c: char| c.is_whitespace() || "*<>{}$".contains(c)))
        .map(|code| code.trim_end_matches([',', '.', ':']).to_owned())
        .collect()
}

#[test]
fn every_path_a_page_names_exists() {
    let mut missing = Vec::new();
    for page in pages() {
        for path in named_paths(&prose(&std::fs::read_to_string(&page).unwrap())) {
            if !Path::new(ROOT).join(&path).exists() {
                missing.push(format!("{}: {path}", page.display()));
            }
        }
    }
    assert!(missing.is_empty(), "paths that do not exist:\n{}", missing.join("\n"));
}

#[test]
fn every_path_a_module_doc_names_exists() {
    let mut sources = Vec::new();
    files(&Path::new(ROOT).join("src"), "rs", &mut sources);
    files(&Path::new(ROOT).join("tests"), "rs", &mut sources);
    let mut missing = Vec::new();
    for source in sources {
        let text = std::fs::read_to_string(&source).unwrap();
        let docs: String =
            text.lines().filter_map(|l| l.trim_start().strip_prefix("//!")).collect::<Vec<_>>().join("\n");
        for path in named_paths(&docs) {
            if !Path::new(ROOT).join(&path).exists() {
                missing.push(format!("{}: {path}", source.display()));
            }
        }
    }
    assert!(missing.is_empty(), "paths that do not exist:\n{}", missing.join("\n"));
}

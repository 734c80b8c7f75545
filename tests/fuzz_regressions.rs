//! Every fuzzing seed and every input that ever made a fuzz target fail, re-checked with the
//! targets' own checks (fuzz/checks.rs) on each test run.

#[path = "../fuzz/checks.rs"]
mod checks;

use std::path::Path;

#[test]
fn seeds_and_regressions_pass_the_fuzz_checks() {
    type Check = fn(&[u8]);
    let targets: [(&str, Check); 4] = [
        ("config", checks::config),
        ("matching", checks::matching),
        ("keys", checks::keys),
        ("bucket_ids", checks::bucket_ids),
    ];
    let mut checked = 0;
    for (target, check) in targets {
        for kind in ["seeds", "regressions"] {
            let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz").join(kind).join(target);
            for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
                let path = entry.unwrap().path();
                if path.file_name().is_some_and(|n| n.to_string_lossy().starts_with('.')) {
                    continue;
                }
                check(&std::fs::read(&path).unwrap());
                checked += 1;
            }
        }
    }
    assert!(checked >= 7, "{checked} inputs");
}

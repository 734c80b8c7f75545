//! Properties of the key encoding: no two buckets share a key, and only the tenant decides the
//! Cluster slot of a tenant bucket.

use proptest::prelude::*;
use tollgate::keys::{cluster_slot, descriptor_key, tenant_key, Class};

// Strings rich in the characters that matter: separators, braces, percent signs, controls.
fn tricky() -> impl Strategy<Value = String> {
    proptest::collection::vec(
        prop_oneof![
            Just('{'),
            Just('}'),
            Just(':'),
            Just('%'),
            Just('='),
            Just('\n'),
            Just('\0'),
            Just('a'),
            Just('b'),
            Just('2'),
            Just('5'),
            Just('*'),
            Just('é'),
        ],
        0..8,
    )
    .prop_map(|chars| chars.into_iter().collect())
}

#[derive(Debug, Clone)]
enum ClassSpec {
    Named(String),
    Path(Vec<(String, String)>),
}

fn class_spec() -> impl Strategy<Value = ClassSpec> {
    prop_oneof![
        tricky().prop_map(ClassSpec::Named),
        proptest::collection::vec((tricky(), tricky()), 1..3).prop_map(ClassSpec::Path),
    ]
}

fn key_of(tenant: &str, class: &ClassSpec) -> String {
    match class {
        ClassSpec::Named(n) => tenant_key(tenant, &Class::Named(n)),
        ClassSpec::Path(p) => {
            let entries: Vec<(&str, &str)> = p.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
            tenant_key(tenant, &Class::Path(&entries))
        }
    }
}

fn same(a: &ClassSpec, b: &ClassSpec) -> bool {
    match (a, b) {
        (ClassSpec::Named(x), ClassSpec::Named(y)) => x == y,
        (ClassSpec::Path(x), ClassSpec::Path(y)) => x == y,
        _ => false,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]

    #[test]
    fn distinct_tenant_buckets_never_share_a_key(
        t1 in tricky(), c1 in class_spec(), t2 in tricky(), c2 in class_spec(),
    ) {
        let (k1, k2) = (key_of(&t1, &c1), key_of(&t2, &c2));
        if t1 != t2 || !same(&c1, &c2) {
            prop_assert_ne!(k1, k2);
        } else {
            prop_assert_eq!(k1, k2);
        }
    }

    #[test]
    fn the_slot_depends_only_on_the_tenant(t in tricky(), c1 in class_spec(), c2 in class_spec()) {
        prop_assert_eq!(cluster_slot(&key_of(&t, &c1)), cluster_slot(&key_of(&t, &c2)));
    }

    #[test]
    fn descriptor_keys_never_meet_tenant_keys(
        t in tricky(), c in class_spec(), domain in tricky(),
        entries in proptest::collection::vec((tricky(), tricky()), 1..3),
    ) {
        let e: Vec<(&str, &str)> = entries.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let key = descriptor_key(&domain, &e);
        prop_assert_ne!(&key, &key_of(&t, &c));
        // No brace survives escaping, so the whole key is hashed and keys spread over slots.
        prop_assert!(!key.contains(['{', '}']), "braces in {}", key);
    }

    #[test]
    fn distinct_descriptors_never_share_a_key(
        d1 in tricky(), e1 in proptest::collection::vec((tricky(), tricky()), 1..3),
        d2 in tricky(), e2 in proptest::collection::vec((tricky(), tricky()), 1..3),
    ) {
        let r1: Vec<(&str, &str)> = e1.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let r2: Vec<(&str, &str)> = e2.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        if (d1.as_str(), &r1) != (d2.as_str(), &r2) {
            prop_assert_ne!(descriptor_key(&d1, &r1), descriptor_key(&d2, &r2));
        }
    }
}

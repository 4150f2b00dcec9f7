//! The etcd key layout of Go's `concurrency.Mutex`: `<prefix><name>/<lease id hex>`.

use lock_core::LockKey;

/// The range every contender of `key` writes under: `<prefix><escaped key>/`.
///
/// Ordinary characters map verbatim (so `etcdctl lock <prefix>NAME` contends with the key `NAME`);
/// `/` and `%` are percent-escaped, so no key's range contains another key's range (`"a"` never
/// queues behind `"a/b"`) and the mapping is injective.
pub(crate) fn name_prefix(prefix: &str, key: &LockKey) -> Vec<u8> {
    let mut out = String::with_capacity(prefix.len() + key.as_str().len() + 8);
    out.push_str(prefix);
    for c in key.as_str().chars() {
        match c {
            '/' => out.push_str("%2F"),
            '%' => out.push_str("%25"),
            c => out.push(c),
        }
    }
    out.push('/');
    out.into_bytes()
}

/// One contender's key: the name's range plus the session lease id in lowercase hex, exactly as
/// Go formats it (`fmt.Sprintf("%s%x", pfx, leaseID)`).
pub(crate) fn entry_key(name_prefix: &[u8], lease_id: i64) -> Vec<u8> {
    let mut out = name_prefix.to_vec();
    out.extend_from_slice(format!("{lease_id:x}").as_bytes());
    out
}

/// Whether `key` (attached to `lease`) is a contender entry of the range `name_prefix`: exactly
/// the range followed by the hex id of the lease it is attached to, as Go's mutex writes it.
/// Anything else under the range — an application's key under an empty prefix, an entry of a
/// lock under a longer prefix that nests inside this one (`a/` + `b` vs `a/b/` + `x`) — is not
/// a contender and never blocks the lock.
pub(crate) fn is_entry(name_prefix: &[u8], key: &[u8], lease: i64) -> bool {
    lease != 0
        && key
            .strip_prefix(name_prefix)
            .is_some_and(|suffix| suffix == format!("{lease:x}").as_bytes())
}

/// The marker that abandons one acquisition attempt (a random id of that attempt, never its
/// ownership token): a put whose outcome is unknown requires it absent, so once it is written
/// the put can never apply. `<prefix>\0attempt/<32 hex digits>`: a lock key has no control
/// characters, so this is in no lock's range (neither ours nor Go's `concurrency.Mutex` ever
/// reads it as a contender).
pub(crate) fn attempt_marker(prefix: &str, attempt: u128) -> Vec<u8> {
    let mut out = prefix.as_bytes().to_vec();
    out.extend_from_slice(b"\0attempt/");
    out.extend_from_slice(format!("{attempt:032x}").as_bytes());
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn p(prefix: &str, key: &str) -> String {
        String::from_utf8(name_prefix(prefix, &LockKey::new(key).unwrap())).unwrap()
    }

    #[test]
    fn ordinary_names_map_verbatim_and_slashes_are_escaped() {
        assert_eq!(p("distlock/", "orders"), "distlock/orders/");
        assert_eq!(p("", "orders"), "orders/");
        assert_eq!(p("x/", "a/b"), "x/a%2Fb/");
        assert_eq!(p("x/", "100%"), "x/100%25/");
        assert_eq!(p("x/", "ünï code"), "x/ünï code/");
    }

    #[test]
    fn no_name_range_contains_another() {
        let names = ["a", "a/b", "a/", "a%2Fb", "a%", "ab", "a b", "%", "/"];
        for x in names {
            for y in names {
                if x != y {
                    let (px, py) = (p("pre/", x), p("pre/", y));
                    assert!(!py.starts_with(&px), "{x:?} -> {px} contains {y:?} -> {py}");
                }
            }
        }
    }

    #[test]
    fn only_keys_shaped_like_entries_are_entries() {
        let range = p("a/", "b").into_bytes();
        assert!(is_entry(&range, b"a/b/ff", 255));
        assert!(
            !is_entry(&range, b"a/b/ff", 254),
            "attached to another lease"
        );
        assert!(!is_entry(&range, b"a/b/ff", 0), "no lease");
        assert!(
            !is_entry(&range, b"a/b/x/ff", 255),
            "nested prefix a/b/ + x"
        );
        assert!(!is_entry(&range, b"a/b/0ff", 255), "not Go's hex");
        assert!(!is_entry(&range, b"a/b/", 255));
        let marker = attempt_marker("a/", 255);
        assert!(!marker.starts_with(&range));
        assert!(marker.contains(&0));
    }

    #[test]
    fn entry_keys_use_go_hex() {
        assert_eq!(
            entry_key(b"m/", 0x3268_a228_da9c_750d),
            b"m/3268a228da9c750d".to_vec()
        );
        assert_eq!(entry_key(b"m/", 255), b"m/ff".to_vec());
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod proptests {
    use proptest::prelude::*;

    use super::*;

    fn key() -> impl Strategy<Value = LockKey> {
        prop_oneof!["[ab/%2F5 .]{1,10}", "\\PC{1,30}"]
            .prop_filter_map("valid key", |s| LockKey::new(s).ok())
    }

    proptest! {
        /// A key's contender range never contains (or equals) another key's range, so locks never
        /// collide or queue behind each other.
        #[test]
        fn distinct_keys_get_disjoint_ranges(prefix in "[a-z/]{0,6}", a in key(), b in key()) {
            let ra = name_prefix(&prefix, &a);
            let rb = name_prefix(&prefix, &b);
            if a != b {
                prop_assert!(!rb.starts_with(&ra), "{:?} contains {:?}", rb, ra);
                prop_assert!(!entry_key(&rb, 0x694d_1234).starts_with(&ra));
            }
        }
    }
}

//! The etcd key layout of Go's `concurrency.Mutex`: `<prefix><name>/<lease id hex>`.

use lock_core::raw::{HolderIdentity, LockKey, OwnershipToken};

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

/// An entry's value: the ownership token in hex, then a space and the holder's identity, written
/// by the same put that creates the entry (so it is always the identity of that entry's
/// contender, and it goes with the entry). An older distlock wrote the token alone.
pub(crate) fn entry_value(token: &OwnershipToken, identity: &HolderIdentity) -> String {
    format!("{} {}", token.expose_hex(), identity.as_str())
}

/// Reads an entry's value back: the token and the identity when it is one of ours (the identity
/// is `None` for the token-only value of an older distlock). A foreign value (`etcdctl lock` and
/// Go's `concurrency.Mutex` put an empty one) gives neither.
pub(crate) fn parse_entry_value(value: &[u8]) -> (Option<OwnershipToken>, Option<HolderIdentity>) {
    let (hex, rest) = value.split_at(value.len().min(32));
    let Some(token) = std::str::from_utf8(hex)
        .ok()
        .and_then(|h| OwnershipToken::from_hex(h).ok())
    else {
        return (None, None);
    };
    match rest.split_first() {
        None => (Some(token), None),
        Some((b' ', identity)) => (Some(token), HolderIdentity::from_stored(identity)),
        Some(_) => (None, None),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn entry_values_round_trip_and_old_or_foreign_ones_are_read_safely() {
        let token = OwnershipToken::generate();
        let id = HolderIdentity::process(Some("job-1")).unwrap();
        let value = entry_value(&token, &id);
        let (t, h) = parse_entry_value(value.as_bytes());
        assert_eq!(t.map(|t| t.digest()), Some(token.digest()));
        assert_eq!(h, Some(id));
        // An older distlock's entry: the token alone.
        let (t, h) = parse_entry_value(token.expose_hex().as_bytes());
        assert_eq!(t.map(|t| t.digest()), Some(token.digest()));
        assert_eq!(h, None);
        // etcdctl lock / Go's mutex: empty; anything else foreign: neither.
        for foreign in [&b""[..], b"x", b"\xff\xfe", &[b'a'; 40], &[b'a'; 32]] {
            let (t, h) = parse_entry_value(foreign);
            assert!(h.is_none(), "{foreign:?}");
            if foreign.len() != 32 {
                assert!(t.is_none(), "{foreign:?}");
            }
        }
        let mut tainted = token.expose_hex().into_bytes();
        tainted.extend_from_slice(b" host=a\n\x1b[1mpid=1");
        let (_, h) = parse_entry_value(&tainted);
        assert_eq!(h.unwrap().as_str(), "host=a[1mpid=1");
    }

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

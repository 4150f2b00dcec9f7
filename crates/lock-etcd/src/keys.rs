//! The etcd key layout of Go's `concurrency.Mutex` and `concurrency.Election` (the same one):
//! `<prefix><name>/<lease id hex>`.

use lock_core::raw::{HolderIdentity, LockKey, OwnershipToken};

/// The lock keys of elections: `lock_core::Election` campaigns on the lock `election/<name>`.
const ELECTION_KEYS: &str = "election/";

/// The range every contender of `key` writes under: `<prefix><escaped key>/`.
///
/// Ordinary characters map verbatim (so `etcdctl lock <prefix>NAME` contends with the key `NAME`);
/// `/` and `%` are percent-escaped, so no key's range contains another key's range (`"a"` never
/// queues behind `"a/b"`) and the mapping is injective.
///
/// One exception, for interoperation with Go's `concurrency.Election`: the key of an election,
/// `election/<name>`, keeps its first `/`, so its range is `<prefix>election/<escaped name>/` —
/// the range `etcdctl elect <prefix>election/<escaped name>` campaigns in. Such a range is still
/// no other key's (an escaped name has no `/`), and it lies inside the range of the key
/// `election` only; that lock never counts it, because an election's keys are never shaped like
/// its entries (see [`is_entry`]: they have a `/` after the range).
pub(crate) fn name_prefix(prefix: &str, key: &LockKey) -> Vec<u8> {
    let mut out = String::with_capacity(prefix.len() + key.as_str().len() + 8);
    out.push_str(prefix);
    let name = match key.as_str().strip_prefix(ELECTION_KEYS) {
        Some(election) if !election.is_empty() => {
            out.push_str(ELECTION_KEYS);
            election
        }
        _ => key.as_str(),
    };
    for c in name.chars() {
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

/// The name range of an entry key [`entry_key`] made with `lease_id`: the key without the
/// lease's hex id.
pub(crate) fn entry_name(key: &[u8], lease_id: i64) -> &[u8] {
    let id = lease_id.cast_unsigned();
    let hex_digits =
        usize::try_from(id.checked_ilog2().map_or(1, |bits| bits / 4 + 1)).unwrap_or(usize::MAX);
    key.get(..key.len().saturating_sub(hex_digits))
        .unwrap_or_default()
}

/// Whether `key` (attached to `lease`) is a contender entry of the range `name_prefix`: exactly
/// the range followed by the hex id of the lease it is attached to, as Go's mutex writes it.
/// Anything else under the range — an application's key under an empty prefix, an entry of a
/// lock under a longer prefix that nests inside this one (`a/` + `b` vs `a/b/` + `x`) — is not
/// a contender and never blocks the lock.
pub(crate) fn is_entry(name_prefix: &[u8], key: &[u8], lease: i64) -> bool {
    lease != 0 && key.strip_prefix(name_prefix).is_some_and(is_go_lease_hex)
}

/// Whether `suffix` is a lease id as Go formats it (`%x` of a non-zero id: 1–16 lowercase hex
/// digits, no leading zero). An entry's suffix is the id of the session lease it was created
/// on; job mode's keep may since have moved it onto a lease of its own (see
/// `renew::keep`), so the suffix is not compared with the lease it is attached to now.
fn is_go_lease_hex(suffix: &[u8]) -> bool {
    (1..=16).contains(&suffix.len())
        && suffix[0] != b'0'
        && suffix
            .iter()
            .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(c))
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

/// The sidecar of an election entry: `<prefix>\0holder/<the entry key after the prefix>`,
/// holding [`entry_value`] (token and identity), attached to the entry's lease and written,
/// relabelled and deleted in the same txn as the entry. Like the [`attempt_marker`]s it starts
/// with a control character, so it is in no lock's range and no Go client reads it as a
/// candidate; it is named after the entry key, so each entry has exactly one.
fn holder_key(prefix: &str, entry_key: &[u8]) -> Vec<u8> {
    let mut out = prefix.as_bytes().to_vec();
    out.extend_from_slice(b"\0holder/");
    out.extend_from_slice(
        entry_key
            .strip_prefix(prefix.as_bytes())
            .unwrap_or(entry_key),
    );
    out
}

/// The [`holder_key`] of `entry_key` when it is an election's entry
/// (`<prefix>election/<escaped name>/<lease hex>`, see [`name_prefix`]); `None` for any other
/// lock's (a key `election` has no second `/`), whose entry keeps token and identity in its value.
pub(crate) fn sidecar_of(prefix: &str, entry_key: &[u8]) -> Option<Vec<u8>> {
    let rest = entry_key
        .strip_prefix(prefix.as_bytes())?
        .strip_prefix(ELECTION_KEYS.as_bytes())?;
    let slash = rest.iter().position(|&c| c == b'/')?;
    let (name, lease) = (&rest[..slash], &rest[slash + 1..]);
    (!name.is_empty() && !lease.is_empty() && !lease.contains(&b'/'))
        .then(|| holder_key(prefix, entry_key))
}

/// An election entry's value: exactly what its peers read as the leader's value (Go's
/// `Election.Observe` / `Leader`, `etcdctl elect -l`) — the identity's label (the value given
/// to `distlock elect --value` or proclaimed), or, without a label, the identity itself
/// (`host=… pid=… since=…`). Never the token.
pub(crate) fn candidate_value(identity: &HolderIdentity) -> String {
    identity.label().unwrap_or(identity.as_str()).to_owned()
}

/// An entry's value: the ownership token in hex, then a space and the holder's identity, written
/// by the same put that creates the entry (so it is always the identity of that entry's
/// contender, and it goes with the entry). An older distlock wrote the token alone.
pub(crate) fn entry_value(token: &OwnershipToken, identity: &HolderIdentity) -> String {
    format!("{} {}", token.expose_hex(), identity.as_str())
}

/// Reads an entry's value back: the token and the identity when it is one of ours (the identity
/// is `None` for the token-only value of an older distlock). A foreign value is shown as the
/// holder's identity (sanitised by [`HolderIdentity::from_stored`]): the value a Go
/// `concurrency.Election` campaigner (`etcdctl elect NAME VALUE`) proclaims; `etcdctl lock` and
/// Go's `concurrency.Mutex` put an empty one, which gives none. A value that begins with what
/// reads as a token is never shown (it could be one of ours in a form we do not know).
pub(crate) fn parse_entry_value(value: &[u8]) -> (Option<OwnershipToken>, Option<HolderIdentity>) {
    let (hex, rest) = value.split_at(value.len().min(32));
    let Some(token) = std::str::from_utf8(hex)
        .ok()
        .and_then(|h| OwnershipToken::from_hex(h).ok())
    else {
        return (None, HolderIdentity::from_stored(value));
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

    /// An election's sidecar is outside every lock's range and Go's election range, one per
    /// entry; its candidate value is the label alone, or the identity without one.
    #[test]
    fn an_election_keeps_its_value_in_the_entry_and_token_and_identity_beside_it() {
        let key = LockKey::new("election/orders/eu").unwrap();
        let range = name_prefix("distlock/", &key);
        let entry = entry_key(&range, 0x1f);
        let sidecar = sidecar_of("distlock/", &entry).expect("an election's entry");
        assert_eq!(sidecar, b"distlock/\0holder/election/orders%2Feu/1f");
        assert!(!sidecar.starts_with(&range));
        assert!(!is_entry(&range, &sidecar, 0x1f));
        assert_ne!(
            sidecar_of("distlock/", &entry_key(&range, 0x20)),
            Some(sidecar)
        );
        for not in [
            "election",
            "election/",
            "orders",
            "elections/x",
            "election%2Fx",
        ] {
            let range = name_prefix("distlock/", &LockKey::new(not).unwrap());
            assert_eq!(
                sidecar_of("distlock/", &entry_key(&range, 0x1f)),
                None,
                "{not}"
            );
        }
        assert_eq!(sidecar_of("other/", &entry), None, "another prefix");
        let labelled = HolderIdentity::process(Some("10.0.0.7:8080")).unwrap();
        assert_eq!(candidate_value(&labelled), "10.0.0.7:8080");
        let bare = HolderIdentity::process(None).unwrap();
        assert_eq!(candidate_value(&bare), bare.as_str());
    }

    /// A held lock keeps its entry key only; its name range is read back from it.
    #[test]
    fn an_entry_key_gives_back_its_name_range() {
        for id in [
            0,
            1,
            0xf,
            0x10,
            0x694d_9a1b_2c3e_4f5a,
            i64::MAX,
            -1,
            i64::MIN,
        ] {
            let key = entry_key(b"p/lock%2Fa/", id);
            assert_eq!(entry_name(&key, id), b"p/lock%2Fa/", "lease {id:x}");
        }
    }

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
        // etcdctl lock / Go's mutex: empty; unprintable or token-like: neither.
        for foreign in [&b""[..], b"\xff\xfe", b" \n\t", &[b'a'; 40], &[b'a'; 32]] {
            let (t, h) = parse_entry_value(foreign);
            assert!(h.is_none(), "{foreign:?}");
            if foreign.len() != 32 {
                assert!(t.is_none(), "{foreign:?}");
            }
        }
        // Go's Election (etcdctl elect NAME VALUE): the value is the holder, sanitised.
        for (foreign, shown) in [
            (&b"web-1"[..], "web-1"),
            (b"x", "x"),
            (b"leader \x1b[1m\xffA\n", "leader [1mA"),
            (
                b"0123456789abcdef0123456789abcdeX tail",
                "0123456789abcdef0123456789abcdeX tail",
            ),
        ] {
            let (t, h) = parse_entry_value(foreign);
            assert!(t.is_none(), "{foreign:?}");
            assert_eq!(h.map(|h| h.as_str().to_owned()).as_deref(), Some(shown));
        }
        let long = vec![b'v'; 5000];
        let (_, h) = parse_entry_value(&long);
        assert_eq!(h.unwrap().as_str().len(), HolderIdentity::MAX_LEN);
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
        let names = [
            "a",
            "a/b",
            "a/",
            "a%2Fb",
            "a%",
            "ab",
            "a b",
            "%",
            "/",
            "election",
            "election/",
            "election%2Fa",
            "election/a",
            "election/a/b",
            "election/a%2Fb",
            "election/a/",
            "election/election/a",
            "electiona",
        ];
        for x in names {
            for y in names {
                if x != y {
                    let (px, py) = (p("pre/", x), p("pre/", y));
                    if x == "election" && y.starts_with("election/") && y.len() > 9 {
                        // The one nesting: the lock `election` and the elections' ranges.
                        assert!(py.starts_with(&px));
                        let entry = entry_key(py.as_bytes(), 0xab);
                        assert!(!is_entry(px.as_bytes(), &entry, 0xab), "{y:?}");
                        continue;
                    }
                    assert!(!py.starts_with(&px), "{x:?} -> {px} contains {y:?} -> {py}");
                }
            }
        }
    }

    #[test]
    fn an_election_maps_to_the_range_of_etcdctl_elect() {
        // `etcdctl elect distlock/election/scheduler` campaigns under `distlock/election/scheduler/`.
        assert_eq!(
            p("distlock/", "election/scheduler"),
            "distlock/election/scheduler/"
        );
        assert_eq!(p("", "election/a/b"), "election/a%2Fb/");
        assert_eq!(p("x/", "election/100%"), "x/election/100%25/");
        // Not an election's key: escaped as any other.
        assert_eq!(p("x/", "election/"), "x/election%2F/");
        assert_eq!(p("x/", "elections/a"), "x/elections%2Fa/");
    }

    #[test]
    fn only_keys_shaped_like_entries_are_entries() {
        let range = p("a/", "b").into_bytes();
        assert!(is_entry(&range, b"a/b/ff", 255));
        assert!(
            is_entry(&range, b"a/b/ff", 254),
            "moved onto another lease by job mode's keep"
        );
        assert!(!is_entry(&range, b"a/b/fF", 255), "not Go's lowercase hex");
        assert!(!is_entry(&range, b"a/b/orders", 255), "not hex at all");
        assert!(
            !is_entry(&range, b"a/b/11112222333344445", 255),
            "longer than an i64"
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
        prop_oneof![
            "[ab/%2F5 .]{1,10}",
            "(election/)?[ab/%2F5 .]{0,10}",
            "\\PC{1,30}"
        ]
        .prop_filter_map("valid key", |s| LockKey::new(s).ok())
    }

    proptest! {
        /// Any value under an election's range (a foreign campaigner's, any bytes) reads back
        /// without a panic, as printable text of bounded length or nothing.
        #[test]
        fn any_entry_value_reads_back_safely(value in proptest::collection::vec(any::<u8>(), 0..300)) {
            let (_, holder) = parse_entry_value(&value);
            if let Some(h) = holder {
                prop_assert!(h.as_str().len() <= HolderIdentity::MAX_LEN);
                prop_assert!(h.as_str().bytes().all(|b| b.is_ascii_graphic() || b == b' '));
            }
        }

        /// A key's contender range never contains (or equals) another key's range, so locks never
        /// collide or queue behind each other.
        #[test]
        fn distinct_keys_get_disjoint_ranges(prefix in "[a-z/]{0,6}", a in key(), b in key()) {
            let ra = name_prefix(&prefix, &a);
            let rb = name_prefix(&prefix, &b);
            if a != b {
                if a.as_str() == "election" {
                    // The lock `election` nests the elections' ranges, never counting their keys.
                    prop_assert!(!is_entry(&ra, &entry_key(&rb, 0x694d_1234), 0x694d_1234));
                } else {
                    prop_assert!(!rb.starts_with(&ra), "{:?} contains {:?}", rb, ra);
                    prop_assert!(!entry_key(&rb, 0x694d_1234).starts_with(&ra));
                }
            }
        }
    }
}

//! Lock keys to ZooKeeper paths, and Curator's InterProcessMutex node layout.
//!
//! A key maps to one path segment under the root. Characters ZooKeeper forbids or that would
//! change the path's shape (`/`, the escape character `%`, code points ZooKeeper rejects:
//! U+E000..U+F8FF, U+FFF0..U+FFFF and anything outside the BMP, whose UTF-16 surrogates it
//! rejects) are percent-encoded as their UTF-8 bytes; the whole segments `.` and `..` have their
//! dots encoded. Everything else maps verbatim, so a Curator client locking `<root>/orders` and a
//! distlock client locking the key `orders` contend for the same lock. Because `%` is always
//! encoded, the mapping is injective: distinct keys never share a directory.
//!
//! One exception, for interoperation with Curator's `LeaderSelector` (which is an
//! InterProcessMutex on its leader path, the participant id as each node's data): an election's
//! key `election/<name>` (`lock_core::Election`) maps to the directory
//! `<root>/election/<escaped name>`, the leader path a Curator client passes for it. In that
//! segment `lock-` is also written `lock%2D`, so that no election directory is ever taken for a
//! contender node of the lock `election` (whose directory holds them); `%2D` is never produced by
//! the escaping otherwise, so the mapping stays injective.

use lock_core::raw::{LockKey, OwnershipToken, TokenDigest};

/// Curator's protected-mode prefix.
const PROTECTED_PREFIX: &str = "_c_";
/// Curator's InterProcessMutex lock name.
pub(crate) const LOCK_NAME: &str = "lock-";

/// The lock keys of elections: `lock_core::Election` campaigns on the lock `election/<name>`.
const ELECTION_KEYS: &str = "election/";

/// The child of a lock directory that keeps the lock held for job mode's `at_least` (see
/// [`KeepMarker`]). A bare `%` followed by a non-hex letter is never produced by
/// [`escape_segment`], so no election directory or escaped key can have this name, and it holds
/// no `lock-`, so Curator and [`sorted_contenders`] never take it for a contender.
pub(crate) const KEEP_NODE: &str = "%keep";

/// The keep marker of lock directory `dir`.
pub(crate) fn keep_path(dir: &str) -> String {
    format!("{dir}/{KEEP_NODE}")
}

/// The pin of the keep marker at `keep` written for the grant with fencing token `fence`: a
/// child that keeps ZooKeeper's TTL sweep off the marker while it holds (see
/// `crate::renew::KeptMarker`). Named after the grant, so a pin's path is never reused.
pub(crate) fn keep_pin(keep: &str, fence: i64) -> String {
    format!("{keep}/pin-{fence}")
}

/// The directory, under the root, of the sessions' holder nodes (see [`session_holder`]). A bare
/// `%` followed by a non-hex letter, as [`KEEP_NODE`]: no escaped key or election directory has
/// this name, so it is no lock's directory, and Curator never looks in it.
const HOLDERS_DIR: &str = "%holders";

/// `<root>/%holders`.
pub(crate) fn holders_dir(root: &str) -> String {
    format!("{root}/{HOLDERS_DIR}")
}

/// The holder node of session `session_id`: `<root>/%holders/<session id, 16 hex digits>`, an
/// ephemeral node of that session whose data is this process's identity without its label
/// (`host=… pid=… since=…`). An election node's data is the leader's value alone (Curator's
/// participant id), so the identity of an election's holder is read from here, by the node's
/// ephemeral owner, with the node's data as its label.
pub(crate) fn session_holder(root: &str, session_id: i64) -> String {
    format!("{root}/{HOLDERS_DIR}/{:016x}", session_id.cast_unsigned())
}

/// Whether lock directory `dir` (under `root`) is an election's, `<root>/election/<escaped
/// name>` (see [`lock_dir`]): its nodes' data is the value Curator's `LeaderSelector` peers read.
pub(crate) fn is_election_dir(root: &str, dir: &str) -> bool {
    dir.strip_prefix(root)
        .and_then(|rest| rest.strip_prefix('/'))
        .and_then(|rest| rest.strip_prefix(ELECTION_KEYS))
        .is_some_and(|name| !name.is_empty() && !name.contains('/'))
}

/// The data of our contender node in an election directory: exactly the value its peers read
/// (Curator's participant id) — the identity's label, or without one the identity itself. Never
/// a token (that is in the node's name).
pub(crate) fn candidate_value(identity: &lock_core::raw::HolderIdentity) -> &str {
    identity.label().unwrap_or(identity.as_str())
}

/// The lock directory of the contender node `path`.
pub(crate) fn dir_of(path: &str) -> &str {
    path.rsplit_once('/').map_or("", |(dir, _)| dir)
}

/// What a keep marker says: the lock is held until `hold` after the marker's last write
/// (its `mtime`, the leader's clock), for the grant with fencing token `fence` whose holder was
/// `holder`. Written as `distlock-keep/1 <hold ms> <fence>` and the holder on the next line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct KeepMarker {
    pub(crate) hold: std::time::Duration,
    pub(crate) fence: i64,
    pub(crate) holder: String,
}

const KEEP_FORMAT: &str = "distlock-keep/1";

impl KeepMarker {
    pub(crate) fn encode(&self) -> Vec<u8> {
        format!(
            "{KEEP_FORMAT} {} {}\n{}",
            self.hold.as_millis(),
            self.fence,
            self.holder
        )
        .into_bytes()
    }

    /// `None` when `data` is not a marker of this format.
    pub(crate) fn decode(data: &[u8]) -> Option<Self> {
        let text = std::str::from_utf8(data).ok()?;
        let (head, holder) = text.split_once('\n').unwrap_or((text, ""));
        let mut words = head.split(' ');
        (words.next()? == KEEP_FORMAT).then_some(())?;
        let hold = std::time::Duration::from_millis(words.next()?.parse().ok()?);
        let fence = words.next()?.parse().ok()?;
        words.next().is_none().then_some(())?;
        Some(Self {
            hold,
            fence,
            holder: holder.to_owned(),
        })
    }

    /// The fencing token of the grant that wrote it (its node's czxid).
    pub(crate) fn fence_token(&self) -> Option<lock_core::raw::FencingToken> {
        u64::try_from(self.fence)
            .ok()
            .map(lock_core::raw::FencingToken)
    }

    /// The leader-clock millisecond at which a marker last written at `mtime` stops holding.
    pub(crate) fn expires_at(&self, mtime: i64) -> i64 {
        let hold = i64::try_from(self.hold.as_millis()).unwrap_or(i64::MAX);
        mtime.saturating_add(hold)
    }
}

/// The directory holding the contenders for `key`: `<root>/<escaped key>`, or
/// `<root>/election/<escaped name>` for an election's key (see the module docs).
pub(crate) fn lock_dir(root: &str, key: &LockKey) -> String {
    match key.as_str().strip_prefix(ELECTION_KEYS) {
        Some(name) if !name.is_empty() => format!(
            "{root}/{ELECTION_KEYS}{}",
            escape_segment(name).replace(LOCK_NAME, "lock%2D")
        ),
        _ => format!("{root}/{}", escape_segment(key.as_str())),
    }
}

/// `_c_<uuid>-lock-`: the name prefix of our contender node for one acquisition (ZooKeeper
/// appends the 10-digit sequence). The uuid is the acquisition's ownership token.
pub(crate) fn node_prefix(token: &OwnershipToken) -> String {
    format!("{PROTECTED_PREFIX}{}-{LOCK_NAME}", protected_id(token))
}

/// `_c_<uuid>-`: what identifies our node among the children (Curator's protected id).
pub(crate) fn protected_marker(token: &OwnershipToken) -> String {
    format!("{PROTECTED_PREFIX}{}-", protected_id(token))
}

fn protected_id(token: &OwnershipToken) -> uuid::Uuid {
    uuid::Uuid::from_bytes(*token.as_bytes())
}

/// The digest of the ownership token written into a protected node name, if it has one.
pub(crate) fn token_digest_of(node: &str) -> Option<TokenDigest> {
    let id = node.strip_prefix(PROTECTED_PREFIX)?.get(..36)?;
    let uuid = uuid::Uuid::try_parse(id).ok()?;
    Some(TokenDigest::of(uuid.as_bytes()))
}

/// The contenders among `children`, in lock order: Curator keeps the names containing `lock-`
/// and sorts them by what follows the last `lock-` (the zero-padded sequence).
pub(crate) fn sorted_contenders(mut children: Vec<String>) -> Vec<String> {
    children.retain(|c| c.contains(LOCK_NAME));
    children.sort_by(|a, b| sort_key(a).cmp(sort_key(b)).then_with(|| a.cmp(b)));
    children
}

fn sort_key(name: &str) -> &str {
    match name.rfind(LOCK_NAME) {
        Some(i) => &name[i + LOCK_NAME.len()..],
        None => name,
    }
}

/// Escapes a key into one legal, collision-free ZooKeeper path segment.
pub(crate) fn escape_segment(name: &str) -> String {
    if name == "." || name == ".." {
        return name.replace('.', "%2E");
    }
    let mut out = String::with_capacity(name.len());
    for ch in name.chars() {
        if needs_escape(ch) {
            let mut buf = [0u8; 4];
            for b in ch.encode_utf8(&mut buf).bytes() {
                out.push_str(&format!("%{b:02X}"));
            }
        } else {
            out.push(ch);
        }
    }
    out
}

fn needs_escape(ch: char) -> bool {
    let c = u32::from(ch);
    ch == '/'
        || ch == '%'
        || c <= 0x1F
        || (0x7F..=0x9F).contains(&c)
        || (0xD800..=0xF8FF).contains(&c)
        || (0xFFF0..=0xFFFF).contains(&c)
        || c > 0xFFFF
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn election_directories_are_told_apart_and_holder_nodes_are_in_none() {
        let dir = |key: &str| lock_dir("/distlock", &LockKey::new(key).unwrap());
        assert!(is_election_dir("/distlock", &dir("election/orders/eu")));
        for not in ["election", "election/", "orders", "elections/x"] {
            assert!(!is_election_dir("/distlock", &dir(not)), "{not}");
        }
        assert!(!is_election_dir("/other", &dir("election/x")));
        assert_eq!(
            session_holder("/distlock", -1),
            "/distlock/%holders/ffffffffffffffff"
        );
        assert_eq!(
            dir_of(&session_holder("/distlock", 7)),
            holders_dir("/distlock")
        );
        assert_ne!(holders_dir("/distlock"), dir("%holders"));
        let labelled = lock_core::raw::HolderIdentity::process(Some("10.0.0.7:80")).unwrap();
        assert_eq!(candidate_value(&labelled), "10.0.0.7:80");
        let bare = lock_core::raw::HolderIdentity::process(None).unwrap();
        assert_eq!(candidate_value(&bare), bare.as_str());
    }

    #[test]
    fn keep_markers_round_trip_and_foreign_data_is_refused() {
        let marker = KeepMarker {
            hold: std::time::Duration::from_millis(2200),
            fence: 4_294_967_301,
            holder: "host-1/pid 42 label=a b".into(),
        };
        assert_eq!(KeepMarker::decode(&marker.encode()), Some(marker.clone()));
        assert_eq!(marker.expires_at(1_000), 3_200);
        assert_eq!(marker.expires_at(i64::MAX), i64::MAX);
        for bad in [
            &b""[..],
            b"10.0.0.1",
            b"distlock-keep/1 x 3",
            b"distlock-keep/1 1 2 3",
            b"distlock-keep/2 1 2",
        ] {
            assert_eq!(KeepMarker::decode(bad), None, "{bad:?}");
        }
        assert!(sorted_contenders(vec![KEEP_NODE.into()]).is_empty());
        for name in ["keep", "%keep", "election/%keep", "x%keep"] {
            assert_ne!(escape_segment(name), KEEP_NODE, "{name}");
        }
        assert_eq!(
            dir_of("/distlock/orders/_c_x-lock-0000000001"),
            "/distlock/orders"
        );
    }

    #[test]
    fn ordinary_names_map_verbatim_and_odd_ones_are_escaped() {
        assert_eq!(escape_segment("orders"), "orders");
        assert_eq!(escape_segment("a b:c{d}-é"), "a b:c{d}-é");
        assert_eq!(escape_segment("zookeeper"), "zookeeper");
        assert_eq!(escape_segment("a/b"), "a%2Fb");
        assert_eq!(escape_segment("a%2Fb"), "a%252Fb");
        assert_eq!(escape_segment("."), "%2E");
        assert_eq!(escape_segment(".."), "%2E%2E");
        assert_eq!(escape_segment("..."), "...");
        assert_eq!(escape_segment("\u{1F512}"), "%F0%9F%94%92");
        assert_eq!(escape_segment("\u{E000}"), "%EE%80%80");
    }

    #[test]
    fn distinct_keys_get_distinct_segments() {
        let names = [
            "a",
            "a/b",
            "a/b/c",
            "A",
            "a.b",
            "a_b",
            "a-b",
            "a b",
            "a:b",
            "{a}",
            "a/",
            "/a",
            ".",
            "..",
            "%2E",
            "%2E%2E",
            "a%2Fb",
            "a%252Fb",
            "zookeeper",
            "ünï/çødé",
            "\u{1F512}",
            "%F0%9F%94%92",
        ];
        let escaped: HashSet<_> = names.iter().map(|n| escape_segment(n)).collect();
        assert_eq!(escaped.len(), names.len());
        for e in &escaped {
            assert!(!e.contains('/') && e != "." && e != "..", "{e}");
        }
    }

    fn dir(key: &str) -> String {
        lock_dir("/distlock", &LockKey::new(key).unwrap())
    }

    #[test]
    fn an_election_maps_to_the_leader_path_of_curator() {
        // `new LeaderSelector(client, "/distlock/election/scheduler", listener)`.
        assert_eq!(dir("election/scheduler"), "/distlock/election/scheduler");
        assert_eq!(dir("election/a/b"), "/distlock/election/a%2Fb");
        assert_eq!(dir("election/.."), "/distlock/election/%2E%2E");
        assert_eq!(dir("election/my-lock-1"), "/distlock/election/my-lock%2D1");
        assert_eq!(dir("election/lock%2D"), "/distlock/election/lock%252D");
        // Not an election's key: one segment as any other.
        assert_eq!(dir("election"), "/distlock/election");
        assert_eq!(dir("election/"), "/distlock/election%2F");
        assert_eq!(dir("elections/a"), "/distlock/elections%2Fa");
    }

    #[test]
    fn no_election_directory_is_a_contender_of_the_lock_election() {
        for name in [
            "lock-",
            "a-lock-1",
            "lock-lock-",
            "x",
            "_c_00000000-0000-0000-0000-000000000000-lock-0000000001",
        ] {
            let path = dir(&format!("election/{name}"));
            let child = path.strip_prefix("/distlock/election/").unwrap();
            assert!(
                sorted_contenders(vec![child.to_owned()]).is_empty(),
                "{path}"
            );
        }
    }

    #[test]
    fn node_names_follow_curator() {
        let t = OwnershipToken::generate();
        let p = node_prefix(&t);
        assert!(p.starts_with("_c_") && p.ends_with("-lock-") && p.len() == 3 + 36 + 6);
        let node = format!("{p}0000000007");
        assert!(node.starts_with(&protected_marker(&t)));
        assert_eq!(token_digest_of(&node), Some(t.digest()));
        assert_eq!(token_digest_of("lock-0000000001"), None);
        let sorted = sorted_contenders(vec![
            "_c_x-lock-0000000003".into(),
            "junk".into(),
            "_c_y-lock-0000000001".into(),
            "lock-0000000002".into(),
        ]);
        assert_eq!(
            sorted,
            [
                "_c_y-lock-0000000001",
                "lock-0000000002",
                "_c_x-lock-0000000003"
            ]
        );
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod proptests {
    use proptest::prelude::*;

    use super::*;

    fn key() -> impl Strategy<Value = LockKey> {
        prop_oneof![
            "[a/%.2EF ]{1,8}",
            "(election/)?[lock/%.2DEF -]{0,12}",
            "\\PC{1,30}"
        ]
        .prop_filter_map("valid key", |s| LockKey::new(s).ok())
    }

    proptest! {
        /// Every key maps to one legal path segment, and distinct keys to distinct segments.
        #[test]
        fn keys_map_to_distinct_legal_segments(a in key(), b in key()) {
            let sa = escape_segment(a.as_str());
            prop_assert!(!sa.is_empty() && !sa.contains('/') && sa != "." && sa != "..");
            let illegal = |c: char| c == '\0' || ('\u{e000}'..='\u{f8ff}').contains(&c) || c >= '\u{fff0}';
            prop_assert!(!sa.chars().any(illegal), "illegal character in {:?}", sa);
            let dir = lock_dir("/distlock", &a);
            let segments: Vec<&str> = dir.split('/').skip(2).collect();
            prop_assert!(segments.len() <= 2, "{:?}", dir);
            for s in &segments {
                prop_assert!(!s.is_empty() && *s != "." && *s != ".." && !s.chars().any(illegal), "{:?}", dir);
            }
            if segments.len() == 2 {
                // An election's directory is never a contender of the lock `election`.
                prop_assert!(segments[0] == "election" && !segments[1].contains(LOCK_NAME), "{:?}", dir);
            }
            if a != b {
                prop_assert_ne!(dir, lock_dir("/distlock", &b));
            }
        }
    }
}

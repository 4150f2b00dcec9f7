//! Where a lock lives in Redis.
//!
//! * The lock itself is the string key `<namespace><name>`, exactly, so any other client that
//!   takes that key with `SET key value NX` (redis-py's `Lock`, StackExchange.Redis `LockTake`,
//!   a shell script) contends with us.
//! * The fence counter is a separate key in the same Cluster hash slot. Its name contains the
//!   ASCII unit separator `\x1f`, a control character no [`LockKey`] may contain, so it can never
//!   be another lock's key, and it is unique per lock key:
//!   - the lock key has no hash tag and no `}`: `{<lock key>}\x1ffence` (the common case,
//!     e.g. `{distlock:orders}\x1ffence`);
//!   - the lock key has a hash tag (`a{tag}b`): `<lock key>\x1ftagged-fence` (the tag is kept);
//!   - otherwise (a `}` but no usable tag): `{<hex>}\x1f<lock key>\x1ffence`, where `<hex>` is
//!     the smallest hex number whose hash slot equals the lock key's (two separators tell this
//!     form apart).
//! * The waiter queue is derived the same way with `waiters` in place of `fence`
//!   (`{distlock:orders}\x1fwaiters`, `<lock key>\x1ftagged-waiters`, …), and so are the
//!   short-lived undo markers of clean-ups, `undone:<token hex>:` in place of `fence`, and so is
//!   the holder key, `holder` in place of `fence` (who holds the current grant).

use std::sync::OnceLock;

use lock_core::raw::LockKey;

const SEP: u8 = 0x1f;

/// The Redis names of one lock: the lock key, and the fence counter and waiter queue derived
/// from it on demand (each request needs only some of them).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct KeyNames {
    pub(crate) lock: Vec<u8>,
}

impl KeyNames {
    pub(crate) fn new(namespace: &str, key: &LockKey) -> Self {
        let mut lock = Vec::with_capacity(namespace.len() + key.as_str().len());
        Self::write_lock(namespace, key, &mut lock);
        Self { lock }
    }

    /// Appends the lock key's name to `out` (what [`KeyNames::new`] holds as `lock`).
    pub(crate) fn write_lock(namespace: &str, key: &LockKey, out: &mut Vec<u8>) {
        out.extend_from_slice(namespace.as_bytes());
        out.extend_from_slice(key.as_str().as_bytes());
    }

    /// Appends the holder key's name of the lock key named `lock` to `out` (what
    /// [`KeyNames::holder`] returns).
    pub(crate) fn write_holder(lock: &[u8], out: &mut Vec<u8>) {
        write_derived_key(lock, b"holder", out);
    }

    /// The fence counter key.
    pub(crate) fn fence(&self) -> Vec<u8> {
        derived_key(&self.lock, b"fence")
    }

    /// The waiter queue: a sorted set of waiting `acquire`s, each scored by the expiry of its
    /// registration (server time in milliseconds).
    pub(crate) fn queue(&self) -> Vec<u8> {
        derived_key(&self.lock, b"waiters")
    }

    /// The holder key: `<token hex>:<fence> <holder identity>` of the current grant, written
    /// with it and living as long (see [`crate::scripts`]).
    pub(crate) fn holder(&self) -> Vec<u8> {
        derived_key(&self.lock, b"holder")
    }

    /// The undo marker of an owner prefix (`<token hex>:`): left by the clean-up of a request
    /// whose outcome is unknown, so that the request, should it still arrive, does nothing.
    pub(crate) fn undone(&self, prefix: &str) -> Vec<u8> {
        let mut name = b"undone:".to_vec();
        name.extend_from_slice(prefix.as_bytes());
        derived_key(&self.lock, &name)
    }

    /// On a Cluster, the prefix of this lock's shard wake channels (`<prefix><client id>`, see
    /// [`crate::wake`]): in the lock key's hash slot, so a release script may `SPUBLISH` to it
    /// and a waiter `SSUBSCRIBE`s on the slot's own node. (Channels are not keys: the name
    /// cannot collide with a lock.)
    pub(crate) fn wake_prefix(&self) -> Vec<u8> {
        derived_key(&self.lock, b"wake:")
    }
}

/// A key belonging to the lock (`fence`, `waiters`), in the lock key's hash slot.
fn derived_key(lock: &[u8], name: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(lock.len() + 24);
    write_derived_key(lock, name, &mut out);
    out
}

/// Appends [`derived_key`]'s name to `out`.
fn write_derived_key(lock: &[u8], name: &[u8], out: &mut Vec<u8>) {
    if hash_tag(lock).is_some() {
        out.extend_from_slice(lock);
        out.push(SEP);
        out.extend_from_slice(b"tagged-");
        out.extend_from_slice(name);
    } else if !lock.contains(&b'}') {
        out.push(b'{');
        out.extend_from_slice(lock);
        out.push(b'}');
        out.push(SEP);
        out.extend_from_slice(name);
    } else {
        let tag = slot_tags()
            .get(usize::from(key_slot(lock)))
            .copied()
            .unwrap_or_default();
        out.push(b'{');
        out.extend_from_slice(hex_digits(tag, &mut [0u8; 8]));
        out.push(b'}');
        out.push(SEP);
        out.extend_from_slice(lock);
        out.push(SEP);
        out.extend_from_slice(name);
    }
}

/// For each hash slot, the smallest number whose lowercase hex form hashes to it (computed once,
/// about 180k CRCs).
fn slot_tags() -> &'static [u32] {
    static TAGS: OnceLock<Vec<u32>> = OnceLock::new();
    TAGS.get_or_init(|| {
        let mut tags = vec![u32::MAX; 16384];
        let mut missing = tags.len();
        let mut buf = [0u8; 8];
        for n in 0u32.. {
            if missing == 0 {
                break;
            }
            let hex = hex_digits(n, &mut buf);
            let slot = usize::from(crc16(hex) % 16384);
            if tags[slot] == u32::MAX {
                tags[slot] = n;
                missing -= 1;
            }
        }
        tags
    })
}

fn hex_digits(mut n: u32, buf: &mut [u8; 8]) -> &[u8] {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut at = buf.len();
    loop {
        at -= 1;
        buf[at] = HEX[(n & 0xf) as usize];
        n >>= 4;
        if n == 0 {
            return &buf[at..];
        }
    }
}

/// The Redis Cluster hash tag of `key`: the bytes between the first `{` and the first `}` after
/// it, when that is non-empty.
fn hash_tag(key: &[u8]) -> Option<&[u8]> {
    let open = key.iter().position(|&b| b == b'{')?;
    let rest = &key[open + 1..];
    let close = rest.iter().position(|&b| b == b'}')?;
    (close > 0).then(|| &rest[..close])
}

/// The Redis Cluster hash slot of `key` (CRC16/XMODEM of the hash tag or whole key, mod 16384).
pub(crate) fn key_slot(key: &[u8]) -> u16 {
    crc16(hash_tag(key).unwrap_or(key)) % 16384
}

fn crc16(bytes: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &b in bytes {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn crc16_matches_the_redis_cluster_spec() {
        assert_eq!(crc16(b"123456789"), 0x31c3);
        assert_eq!(key_slot(b"{user1000}.following"), key_slot(b"user1000"));
        assert_eq!(key_slot(b"foo{}{bar}"), crc16(b"foo{}{bar}") % 16384);
        assert_eq!(key_slot(b"foo{{bar}}zap"), key_slot(b"{bar"));
        // Values checked against `CLUSTER KEYSLOT` of a Redis 7 cluster.
        assert_eq!(key_slot(b"foo"), 12182);
        assert_eq!(key_slot(b"somekey"), 11058);
    }

    fn names(ns: &str, key: &str) -> KeyNames {
        KeyNames::new(ns, &LockKey::new(key).unwrap())
    }

    const TRICKY: &[&str] = &[
        "a",
        "orders",
        "a/b",
        "a b",
        "{x}",
        "x",
        "{x",
        "x}",
        "}x{",
        "a}b",
        "a}b{c",
        "x{}y}",
        "{}",
        "{{x}}",
        "fence",
        "ünï/çødé",
        "{a3}orders",
        "distlock:orders",
        "orders}fence",
    ];

    #[test]
    fn the_lock_key_is_exactly_namespace_plus_name() {
        assert_eq!(names("distlock:", "orders").lock, b"distlock:orders");
        assert_eq!(names("", "a b").lock, b"a b");
        assert_eq!(
            names("distlock:", "orders").fence(),
            b"{distlock:orders}\x1ffence"
        );
    }

    #[test]
    fn fence_counters_share_the_lock_slot_and_never_collide() {
        for ns in ["", "distlock:", "{ns}", "ns}"] {
            let mut seen = HashSet::new();
            for key in TRICKY {
                let n = names(ns, key);
                assert_eq!(key_slot(&n.fence()), key_slot(&n.lock), "{ns:?} {key:?}");
                assert!(n.fence().contains(&SEP), "{ns:?} {key:?}");
                assert!(!n.lock.contains(&SEP));
                assert!(seen.insert(n.lock.clone()), "lock {ns:?} {key:?}");
                assert!(seen.insert(n.fence()), "fence {ns:?} {key:?}");
                assert_eq!(key_slot(&n.queue()), key_slot(&n.lock), "{ns:?} {key:?}");
                assert!(seen.insert(n.queue()), "queue {ns:?} {key:?}");
                assert_eq!(key_slot(&n.holder()), key_slot(&n.lock), "{ns:?} {key:?}");
                assert!(seen.insert(n.holder()), "holder {ns:?} {key:?}");
                let undone = n.undone("0123456789abcdef0123456789abcdef:");
                assert_eq!(key_slot(&undone), key_slot(&n.lock), "{ns:?} {key:?}");
                assert!(seen.insert(undone), "undo marker {ns:?} {key:?}");
                let mut wake = n.wake_prefix();
                wake.extend_from_slice(b"0123456789abcdef");
                assert_eq!(key_slot(&wake), key_slot(&n.lock), "{ns:?} {key:?}");
                assert!(seen.insert(wake), "wake channel {ns:?} {key:?}");
            }
        }
    }

    #[test]
    fn every_slot_has_a_tag() {
        let tags = slot_tags();
        for (slot, n) in tags.iter().enumerate() {
            assert_eq!(usize::from(key_slot(format!("{n:x}").as_bytes())), slot);
        }
        let mut buf = [0u8; 8];
        assert_eq!(hex_digits(0, &mut buf), b"0");
        assert_eq!(hex_digits(0xab12, &mut buf), b"ab12");
    }

    #[test]
    fn random_names_keep_slots() {
        let alphabet = ['a', 'b', '{', '}', ' ', '/', 'é'];
        for _ in 0..2000 {
            let len = rand::random_range(1..10);
            let key: String = (0..len)
                .map(|_| alphabet[rand::random_range(0..alphabet.len())])
                .collect();
            let n = names("", &key);
            assert_eq!(key_slot(&n.fence()), key_slot(&n.lock), "{key:?}");
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod proptests {
    use proptest::prelude::*;

    use super::*;

    /// An alphabet dense in the characters that matter to the mapping.
    fn key() -> impl Strategy<Value = LockKey> {
        prop_oneof!["[a{}/:% .\u{1f}x-]{1,10}", "\\PC{1,30}",]
            .prop_filter_map("valid key", |s| LockKey::new(s).ok())
    }

    proptest! {
        #[test]
        fn distinct_keys_get_distinct_names_and_fences_share_the_slot(
            ns in "[a-z:{}]{0,4}", a in key(), b in key(),
        ) {
            let na = KeyNames::new(&ns, &a);
            let nb = KeyNames::new(&ns, &b);
            prop_assert_eq!(key_slot(&na.lock), key_slot(&na.fence()));
            prop_assert_eq!(key_slot(&na.lock), key_slot(&[na.wake_prefix(), b"0123abcd".to_vec()].concat()));
            prop_assert_ne!(&na.lock, &nb.fence());
            prop_assert_ne!(&na.fence(), &na.lock);
            prop_assert_ne!(&na.queue(), &nb.fence());
            prop_assert_eq!(key_slot(&na.lock), key_slot(&na.queue()));
            if a != b {
                prop_assert_ne!(&na.lock, &nb.lock);
                prop_assert_ne!(&na.fence(), &nb.fence());
                prop_assert_ne!(&na.queue(), &nb.queue());
            }
        }
    }
}

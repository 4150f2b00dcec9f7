//! Boundary values: TTLs at the backend's own minimum and maximum (and one step past them), keys of
//! the longest length and of every character class [`LockKey`] allows, deadlines already past and
//! zero-length waits.
//!
//! Declared as a child of `properties` (which re-exports the properties), so that it shares the
//! helpers there.

use std::time::Duration;

use lock_core::{Capabilities, DynLock, Error, Lease, LockKey};
use tokio::time::{Instant, timeout};

use super::{LONG_TTL, SLACK, fencing_claimed, is_held_elsewhere, release, take};
use crate::{Harness, Outcome};

/// The longest TTL `caps` accepts: its own maximum, capped by the one every backend shares.
fn effective_max_ttl(caps: &Capabilities) -> Duration {
    if caps.max_ttl.is_zero() {
        Capabilities::MAX_TTL
    } else {
        caps.max_ttl.min(Capabilities::MAX_TTL)
    }
}

/// The shortest TTL `caps` accepts (1 ms is the floor every backend shares).
fn effective_min_ttl(caps: &Capabilities) -> Duration {
    caps.min_ttl.max(Duration::from_millis(1))
}

/// `try_acquire` and `acquire` with `ttl` are refused with `InvalidTtl`, promptly, and leave the
/// key free. On an unreachable client a refusal that needed I/O would be `Unavailable` instead.
async fn assert_ttl_refused(c: &DynLock, key: &LockKey, ttl: Duration, what: &str) {
    let start = Instant::now();
    let Err(err) = c.try_acquire(key, ttl).await else {
        panic!("try_acquire with {what} ({ttl:?}) was accepted");
    };
    assert!(
        matches!(err, Error::InvalidTtl { .. }),
        "try_acquire with {what} ({ttl:?}): {err}"
    );
    let Err(err) = c.acquire(key, ttl, Instant::now() + SLACK).await else {
        panic!("acquire with {what} ({ttl:?}) was accepted");
    };
    assert!(
        matches!(err, Error::InvalidTtl { .. }),
        "acquire with {what} ({ttl:?}): {err}"
    );
    assert!(
        start.elapsed() < SLACK,
        "a refused ttl ({what}) took {:?}",
        start.elapsed()
    );
}

/// TTLs at the backend's limits: the maximum is granted, renewed and released, or refused before
/// I/O with a typed error; one nanosecond past either limit, and zero, are refused with
/// `InvalidTtl` before I/O (the unreachable client answers the same).
pub async fn ttl_limits_are_honoured_or_refused_before_io(h: Harness) -> Outcome {
    let [a, b] = <[DynLock; 2]>::try_from(h.clients(2).await).ok().unwrap();
    let caps = a.capabilities();
    let min = effective_min_ttl(&caps);
    let max = effective_max_ttl(&caps);

    // One step past each limit, and zero: refused, on a reachable and an unreachable client.
    let mut clients = vec![a.clone()];
    clients.extend(h.unreachable_client().await);
    for c in &clients {
        let key = h.key("boundary-ttl-bad");
        assert_ttl_refused(c, &key, Duration::ZERO, "zero").await;
        assert_ttl_refused(c, &key, min - Duration::from_nanos(1), "min - 1ns").await;
        assert_ttl_refused(c, &key, max + Duration::from_nanos(1), "max + 1ns").await;
        assert_ttl_refused(c, &key, Duration::MAX, "Duration::MAX").await;
    }
    let key = h.key("boundary-ttl-bad");
    assert!(
        !is_held_elsewhere(&b, &key).await,
        "a refused ttl left the key held"
    );

    // The maximum: granted and usable, or refused before I/O with a typed error.
    let key = h.key("boundary-ttl-max");
    match a.try_acquire(&key, max).await {
        Ok(Some(mut lease)) => {
            assert!(lease.local_deadline() <= Instant::now() + max);
            let info = a.inspect(&key).await.unwrap().expect("the key is held");
            assert_eq!(info.fencing_token, lease.fencing_token());
            if let Some(left) = info.ttl_remaining {
                assert!(left <= max, "{left:?} left on a {max:?} lease");
                assert!(
                    left > max / 2,
                    "only {left:?} left on a fresh {max:?} lease: the coordinator shortened it"
                );
            }
            assert!(is_held_elsewhere(&b, &key).await);
            if caps.renew {
                a.renew(&mut lease, max)
                    .await
                    .unwrap_or_else(|e| panic!("renew to the maximum ttl {max:?}: {e}"));
                let err = a
                    .renew(&mut lease, max + Duration::from_nanos(1))
                    .await
                    .unwrap_err();
                assert!(
                    matches!(err, Error::InvalidTtl { .. }),
                    "renew past max: {err}"
                );
            }
            assert!(release(&a, &lease).await);
            assert!(!is_held_elsewhere(&b, &key).await);
        }
        Ok(None) => panic!("a fresh key was held"),
        Err(err) => {
            assert!(
                matches!(
                    err,
                    Error::InvalidTtl { .. } | Error::Unsupported { .. } | Error::Config(_)
                ),
                "the maximum ttl {max:?} was refused with an untyped error: {err}"
            );
            if let Some(offline) = h.unreachable_client().await {
                let again = offline
                    .try_acquire(&key, max)
                    .await
                    .map(|_| ())
                    .unwrap_err();
                assert_eq!(
                    again.kind(),
                    err.kind(),
                    "the maximum ttl is refused only after I/O: {again}"
                );
            }
        }
    }
    Outcome::Passed
}

/// A TTL at the backend's minimum works end to end: granted for a free key, honoured as a lease
/// the coordinator expires by itself (another client gets the key within the TTL plus slack,
/// and the old lease's release does not touch the new holder) or, without `lease_ttl`, shown by
/// `inspect` and released.
///
/// Found: PostgreSQL (and Redis, whenever a reply took more than 0.5 ms) claimed `min_ttl` =
/// 1 ms but answered every grant at that TTL with `Unavailable` (the reply came after the
/// lease's local deadline, `ttl - drift_margin(ttl)` = 0.5 ms); both now claim 100 ms. The grant
/// is taken with `acquire` under a short deadline, so one scheduling stall longer than the
/// minimum is retried rather than failing the property.
pub async fn ttl_at_the_minimum_works_end_to_end(h: Harness) -> Outcome {
    let [a, b] = <[DynLock; 2]>::try_from(h.clients(2).await).ok().unwrap();
    let caps = a.capabilities();
    let min = effective_min_ttl(&caps);
    // The minimum, end to end.
    let key = h.key("boundary-ttl-min");
    let sent = Instant::now();
    let lease = a
        .acquire(&key, min, sent + SLACK)
        .await
        .unwrap_or_else(|e| panic!("a free key at the minimum ttl {min:?}: {e}"));
    assert!(
        lease.local_deadline() <= sent + min,
        "the local deadline of a {min:?} lease is later than its ttl from the request"
    );
    if caps.lease_ttl {
        // The coordinator expires it by itself: another client gets the key within the TTL
        // (plus slack), and the old lease neither releases nor renews it away from them.
        let other = b
            .acquire(&key, LONG_TTL, Instant::now() + min + SLACK)
            .await
            .unwrap_or_else(|e| panic!("a {min:?} lease did not expire in time: {e}"));
        assert!(
            !release(&a, &lease).await,
            "releasing an expired {min:?} lease released the new holder's"
        );
        assert!(
            is_held_elsewhere(&a, &key).await,
            "the new holder lost the key"
        );
        assert!(release(&b, &other).await);
    } else {
        let info = a.inspect(&key).await.unwrap().expect("the key is held");
        assert_eq!(info.fencing_token, lease.fencing_token());
        assert!(release(&a, &lease).await);
        assert!(!is_held_elsewhere(&b, &key).await);
    }

    Outcome::Passed
}

/// The characters of each class a key may contain, each standing alone in a key.
const CHARACTER_CLASSES: &[&str] = &[
    " ",
    "!",
    "\"",
    "#",
    "$",
    "%",
    "&",
    "'",
    "(",
    ")",
    "*",
    "+",
    ",",
    "-",
    ".",
    "/",
    ":",
    ";",
    "<",
    "=",
    ">",
    "?",
    "@",
    "[",
    "\\",
    "]",
    "^",
    "_",
    "`",
    "{",
    "|",
    "}",
    "~",
    "0",
    "9",
    "A",
    "Z",
    "a",
    "z",
    "\u{a0}",
    "\u{e9}",
    "e\u{301}",
    "\u{3b1}",
    "\u{5d0}",
    "\u{200b}",
    "\u{200d}",
    "\u{2028}",
    "\u{2029}",
    "\u{feff}",
    "\u{fffd}",
    "\u{ffff}",
    "\u{e000}",
    "\u{4e2d}",
    "\u{1f512}",
    "\u{10ffff}",
];

/// Acquires every key with one client, checks each is held with its own grant, then releases.
async fn acquire_all_apart(h: &Harness, keys: &[LockKey]) {
    let [a, b] = <[DynLock; 2]>::try_from(h.clients(2).await).ok().unwrap();
    let mut leases: Vec<Lease> = Vec::with_capacity(keys.len());
    for key in keys {
        match a.try_acquire(key, LONG_TTL).await {
            Ok(Some(lease)) => leases.push(lease),
            Ok(None) => panic!(
                "{key:?} ({} bytes) contends with one of the keys before it",
                key.as_str().len()
            ),
            Err(e) => panic!("try_acquire({key:?}, {} bytes): {e}", key.as_str().len()),
        }
    }
    for lease in &leases {
        let info = b
            .inspect(lease.key())
            .await
            .unwrap_or_else(|e| panic!("inspect({:?}): {e}", lease.key()))
            .unwrap_or_else(|| panic!("{:?} is held but inspect says free", lease.key()));
        assert_eq!(
            info.fencing_token,
            lease.fencing_token(),
            "inspect({:?}) shows another grant",
            lease.key()
        );
        if let Some(digest) = info.token_digest {
            assert_eq!(digest, lease.token().digest(), "{:?}", lease.key());
        }
        assert!(is_held_elsewhere(&b, lease.key()).await);
    }
    for lease in &leases {
        assert!(release(&a, lease).await, "release({:?})", lease.key());
        assert!(
            b.inspect(lease.key()).await.unwrap().is_none(),
            "{:?} still held after its release",
            lease.key()
        );
    }
}

/// Keys of the longest length [`LockKey`] allows (in one-byte and in four-byte characters, and
/// differing only in their first or last character) and keys containing every character class it
/// allows (ASCII punctuation, digits, letters of both cases, NBSP, precomposed and combining
/// accents, right-to-left letters, zero-width and format characters, line/paragraph separators,
/// BOM, noncharacters, private use, CJK, emoji, U+10FFFF) each acquire, inspect and release
/// correctly, and keys differing only in one such character never contend.
pub async fn keys_at_the_length_limit_and_of_every_character_class_are_distinct(
    h: Harness,
) -> Outcome {
    let base = h.key("boundary-key");
    let base = base.as_str();
    let max = LockKey::MAX_LEN;
    let key = |s: String| LockKey::new(&s).unwrap_or_else(|e| panic!("{s:?}: {e}"));

    // Longest keys: the base, then padding, differing in the last or the first byte.
    let pad = |prefix: &str, fill: char, last: char| {
        let mut s = String::from(prefix);
        while s.len() + fill.len_utf8() + last.len_utf8() <= max {
            s.push(fill);
        }
        s.push(last);
        s
    };
    let mut long = vec![
        pad(base, 'k', 'a'),
        pad(base, 'k', 'b'),
        pad(base, 'k', 'A'),
        pad(base, '\u{1f512}', '\u{1f513}'),
        pad(base, '\u{1f512}', '\u{1f510}'),
    ];
    // The same tails under bases differing only in their first character.
    let tail = pad("", 'q', 'q');
    let tail = &tail[..max - base.len()];
    long.push(format!("{base}{tail}"));
    long.push(format!("X{}{tail}", &base[1..]));
    let mut keys: Vec<LockKey> = long.into_iter().map(key).collect();
    for k in &keys {
        assert!(k.as_str().len() >= max - 3, "{} bytes", k.as_str().len());
    }
    assert!(
        keys.iter().filter(|k| k.as_str().len() == max).count() >= 4,
        "fewer than four keys of exactly {max} bytes"
    );

    // Every character class, in the middle of a key: each differs from the others in that one
    // character only, and from `xy` without it (a driver that drops or normalises a character
    // away collides there).
    keys.push(key(format!("{base}/xy")));
    for c in CHARACTER_CLASSES {
        keys.push(key(format!("{base}/x{c}y")));
    }
    // And standing alone at the end, and a key of only that character's class at full length.
    for c in ["\u{2028}", "\u{feff}", "\u{10ffff}", "\\", "%", "*"] {
        keys.push(key(format!("{base}/{c}")));
    }
    let mut distinct = keys.clone();
    distinct.sort();
    distinct.dedup();
    assert_eq!(
        distinct.len(),
        keys.len(),
        "the test's keys must be distinct"
    );

    acquire_all_apart(&h, &keys).await;
    Outcome::Passed
}

/// A deadline already past still allows one complete attempt (`flock -w 0`): a free key is
/// granted, a held key gives `Timeout` at once (the holder keeps it, nobody stays queued), and an
/// unreachable client answers with an error promptly — for a deadline one nanosecond and one hour
/// ago.
pub async fn past_deadlines_still_make_one_attempt(h: Harness) -> Outcome {
    let [a, b] = <[DynLock; 2]>::try_from(h.clients(2).await).ok().unwrap();
    let held = h.key("boundary-past-held");
    let holder = take(&b, &held, LONG_TTL).await;
    for ago in [Duration::from_nanos(1), Duration::from_secs(3600)] {
        let start = Instant::now();
        let deadline = start.checked_sub(ago).unwrap_or(start);
        let free = h.key("boundary-past-free");
        let lease = timeout(SLACK, a.acquire(&free, LONG_TTL, deadline))
            .await
            .expect("an acquire whose deadline has passed hung")
            .unwrap_or_else(|e| panic!("a free key was not taken (deadline {ago:?} ago): {e}"));
        assert!(
            is_held_elsewhere(&b, &free).await,
            "the past-deadline grant does not hold the key"
        );
        assert!(
            release(&a, &lease).await,
            "the past-deadline grant lost its lease"
        );

        let err = timeout(SLACK, a.acquire(&held, LONG_TTL, deadline))
            .await
            .expect("an acquire of a held key whose deadline has passed hung")
            .map(|_| ())
            .expect_err("a held key was granted");
        assert!(
            matches!(err, Error::Timeout { .. }),
            "deadline {ago:?} ago on a held key: {err}"
        );
        assert!(
            start.elapsed() < SLACK,
            "a past deadline took {:?}",
            start.elapsed()
        );
    }
    if let Some(unreachable) = h.unreachable_client().await {
        let start = Instant::now();
        let res = timeout(
            SLACK * 4,
            unreachable.acquire(&h.key("boundary-past-down"), LONG_TTL, start),
        )
        .await
        .expect("a past-deadline acquire on an unreachable client hung");
        assert!(res.is_err(), "an unreachable client granted a lease");
    }
    assert!(release(&b, &holder).await, "the holder lost its lease");
    assert!(
        !is_held_elsewhere(&a, &held).await,
        "a waiter stayed queued"
    );
    Outcome::Passed
}

/// Zero-length waits never hang: `acquire` with deadline = now grants a free key at once; for a held key it and `try_acquire` return promptly
/// (`Timeout` / `None`), the holder keeps its grant, and nobody stays queued after it releases.
pub async fn zero_length_waits_return_promptly(h: Harness) -> Outcome {
    let [a, b] = <[DynLock; 2]>::try_from(h.clients(2).await).ok().unwrap();

    // A free key.
    for _ in 0..3 {
        let free = h.key("boundary-zero-free");
        let start = Instant::now();
        let res = timeout(SLACK, a.acquire(&free, LONG_TTL, Instant::now()))
            .await
            .expect("a zero-length wait for a free key hung");
        let lease =
            res.unwrap_or_else(|e| panic!("a zero-length wait did not take a free key: {e}"));
        assert!(is_held_elsewhere(&b, &free).await);
        assert!(release(&a, &lease).await);
        assert!(start.elapsed() < SLACK * 2);
    }

    // A held key.
    let held = h.key("boundary-zero-held");
    let holder = take(&b, &held, LONG_TTL).await;
    for _ in 0..3 {
        let start = Instant::now();
        let res = timeout(SLACK, a.acquire(&held, LONG_TTL, Instant::now()))
            .await
            .expect("a zero-length wait for a held key hung");
        let err = res.map(|_| ()).expect_err("a held key was granted");
        assert!(matches!(err, Error::Timeout { .. }), "{err}");
        let res = timeout(SLACK, a.try_acquire(&held, LONG_TTL))
            .await
            .expect("try_acquire of a held key hung");
        assert!(res.unwrap().is_none(), "a held key was granted");
        assert!(start.elapsed() < SLACK);
    }
    let info = a.inspect(&held).await.unwrap().expect("the holder kept it");
    assert_eq!(info.fencing_token, holder.fencing_token());
    if let Some(waiters) = info.waiters {
        assert_eq!(waiters, 0, "a zero-length wait stayed queued");
    }
    assert!(release(&b, &holder).await, "the holder lost its lease");
    let lease = take(&a, &held, LONG_TTL).await;
    assert!(release(&a, &lease).await);
    Outcome::Passed
}

/// Fences across 2^53 (where an `f64`, a JSON number, stops being exact) and up to `i64::MAX`
/// (the largest signed 64-bit counter), with the counter set on the server: every grant's fence
/// is the counter's next value, strictly above the last, reported exactly by `inspect`; a grant
/// that would take the fence past `i64::MAX` fails with an error instead of wrapping or
/// repeating one, and leaves the key free.
pub async fn fences_stay_exact_across_2_pow_53_and_up_to_i64_max(h: Harness) -> Outcome {
    let c = h.client().await;
    if !fencing_claimed(&c) {
        return Outcome::Skipped("fencing not claimed");
    }
    let i64_max = u64::try_from(i64::MAX).unwrap();
    for (start, grants) in [((1u64 << 53) - 3, 5), (i64_max - 2, 2)] {
        let key = h.key("boundary-fence");
        let lease = take(&c, &key, LONG_TTL).await;
        assert!(release(&c, &lease).await);
        if !h.set_fence_counter(&key, start).await {
            return Outcome::Skipped("the backend's fence counter cannot be set");
        }
        for i in 1..=grants {
            let lease = take(&c, &key, LONG_TTL).await;
            let fence = lease
                .fencing_token()
                .expect("a fencing backend's grant has a fence");
            assert_eq!(fence.0, start + i, "the fence after {start} + {}", i - 1);
            let info = c.inspect(&key).await.unwrap().expect("the key is held");
            assert_eq!(info.fencing_token, Some(fence), "inspect's fence");
            assert!(release(&c, &lease).await);
        }
        if start + grants == i64_max {
            match c.try_acquire(&key, LONG_TTL).await {
                Ok(Some(lease)) => panic!(
                    "a grant past i64::MAX got the fence {:?}",
                    lease.fencing_token()
                ),
                Ok(None) => panic!("the free key was held after the fence reached i64::MAX"),
                Err(e) => assert!(!e.is_temporary(), "a fence overflow is not temporary: {e}"),
            }
            assert!(
                c.inspect(&key).await.unwrap().is_none(),
                "the failed grant left the key held"
            );
        }
    }
    Outcome::Passed
}

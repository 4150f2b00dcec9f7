//! Direct hand-off for drivers with a waiter queue: a release grants the lock to the oldest
//! queued waiter in the same atomic step and tells that waiter, which then holds the lock from
//! the message alone.
//!
//! A driver that does this (Redis, PostgreSQL) registers each attempt of a waiting `acquire`
//! under a number (`seq`, one more per attempt) together with a grant token of that `acquire`
//! and its TTL. A release that grants from the registration of attempt `seq` sends
//! `<waiter>:<seq>:<fence>` ([`Message::Granted`]); a release that only wakes (an older
//! client's registration) sends `<waiter>` ([`Message::Wake`]).
//!
//! Why the waiter may count its lease from the send time of attempt `seq`: the release read the
//! registration that attempt wrote, so the server granted after the attempt was sent, and the
//! local deadline is never later than the server's expiry. A message is taken only for the
//! attempt whose reply confirmed the current registration ([`Registered::lease`]): a message
//! for an older attempt may belong to a grant that was lost since (expired, force-released),
//! which a later attempt would have seen. A grant seen after more than a quarter of its TTL is
//! not taken from the message either, since most of its lease would be gone: the driver's next
//! attempt finds the grant by its grant token and restarts its TTL, as it does when a message
//! is lost.

use std::time::Duration;

use tokio::time::Instant;

use crate::{FencingToken, Lease, LockKey, OwnershipToken};

/// A release's grant to one waiter: the attempt whose registration it read, and the fence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grant {
    /// The number of the attempt that wrote the registration.
    pub seq: u64,
    /// The fence of the grant.
    pub fence: FencingToken,
}

/// What a release tells one waiter of a client (the waiter's number on that client first).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Message {
    /// `<waiter>`: try now.
    Wake(u64),
    /// `<waiter>:<seq>:<fence>`: the lock is the waiter's.
    Granted(u64, Grant),
}

impl Message {
    /// Parses a payload; `None` for anything else (a foreign publisher's message).
    pub fn parse(payload: &[u8]) -> Option<Self> {
        let payload = std::str::from_utf8(payload).ok()?;
        let mut parts = payload.split(':');
        let waiter = parts.next()?.parse().ok()?;
        match (parts.next(), parts.next(), parts.next()) {
            (None, _, _) => Some(Self::Wake(waiter)),
            (Some(seq), Some(fence), None) => Some(Self::Granted(
                waiter,
                Grant {
                    seq: seq.parse().ok()?,
                    fence: FencingToken(fence.parse().ok()?),
                },
            )),
            _ => None,
        }
    }

    /// The waiter the message is for.
    pub fn waiter(&self) -> u64 {
        match *self {
            Self::Wake(waiter) | Self::Granted(waiter, _) => waiter,
        }
    }
}

/// The attempt whose reply confirmed a waiter's current registration, and when it was sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Registered {
    /// Its number.
    pub seq: u64,
    /// Taken before it was sent.
    pub sent_at: Instant,
}

impl Registered {
    /// The lease a grant message gives, if it names this registration and came within a
    /// quarter of `ttl` of its sending (see the module documentation); `None` means: confirm
    /// by an attempt.
    pub fn lease(
        &self,
        grant: Grant,
        key: &LockKey,
        grant_token: OwnershipToken,
        ttl: Duration,
    ) -> Option<Lease> {
        if grant.seq != self.seq || self.sent_at.elapsed() > ttl / 4 {
            return None;
        }
        Some(Lease::new(
            key.clone(),
            grant_token,
            Some(grant.fence),
            ttl,
            self.sent_at,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_are_wake_ups_or_grants() {
        assert_eq!(Message::parse(b"7"), Some(Message::Wake(7)));
        let grant = Grant {
            seq: 3,
            fence: FencingToken(42),
        };
        assert_eq!(Message::parse(b"7:3:42"), Some(Message::Granted(7, grant)));
        assert_eq!(Message::Granted(7, grant).waiter(), 7);
        for foreign in [
            &b""[..],
            b"x",
            b"7:3",
            b"7:3:42:1",
            b"7:x:42",
            b"7:3:x",
            b"-1",
            b"7:3:-1",
            b"\xff",
        ] {
            assert_eq!(Message::parse(foreign), None, "{foreign:?}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn only_a_fresh_grant_of_the_current_registration_is_a_lease() {
        let key = LockKey::new("handoff").unwrap();
        let token = OwnershipToken::generate();
        let ttl = Duration::from_secs(8);
        let registered = Registered {
            seq: 5,
            sent_at: Instant::now(),
        };
        let grant = |seq| Grant {
            seq,
            fence: FencingToken(9),
        };
        assert!(registered.lease(grant(4), &key, token, ttl).is_none());
        tokio::time::advance(Duration::from_secs(2)).await;
        let lease = registered.lease(grant(5), &key, token, ttl).unwrap();
        assert_eq!(lease.acquired_at(), registered.sent_at);
        assert_eq!(lease.fencing_token(), Some(FencingToken(9)));
        assert_eq!(*lease.token(), token);
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(registered.lease(grant(5), &key, token, ttl).is_none());
    }
}

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
//!
//! [`acquire_queued`] is the waiting `acquire` of such a driver, written once: the driver
//! supplies its queue's steps as a [`QueuedWaiter`] (one attempt, joining the queue, the
//! wake-up, a grant from a message, leaving), the loop supplies the order they run in, the
//! deadline, the backoff and the rule that a waiter that gives up leaves the queue.

use std::{future::Future, time::Duration};

use tokio::time::{Instant, sleep};

use crate::{
    Error, FencingToken, Lease, LockKey, OwnershipToken, Result,
    backoff::{AcquireWait, Backoff},
};

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

/// What a waiting `acquire` asked for: the driver's [`QueuedWaiter`] keeps it.
#[derive(Clone, Copy, Debug)]
pub struct Asked<'a> {
    /// The lock.
    pub key: &'a LockKey,
    /// The TTL of the lease it wants (a grant to it lasts that long).
    pub ttl: Duration,
    /// When it gives up.
    pub deadline: Instant,
}

/// What one attempt of a queued `acquire` found.
#[derive(Debug)]
pub enum Found {
    /// The lock is the waiter's (taken by the attempt, or a grant to the waiter the attempt
    /// found and extended).
    Granted(Lease),
    /// Someone else holds it.
    Held {
        /// Try again after this long, when the holder's lease runs out (its expiry is not
        /// announced); `None`: unknown.
        expires_in: Option<Duration>,
        /// The attempt's registration is confirmed: a release grants to this waiter or wakes
        /// it, so the fallback poll may be slow (the `queued` backoff of [`acquire_queued`]).
        queued: bool,
    },
}

/// A driver's waiter queue for one waiting `acquire`, as [`acquire_queued`] drives it.
///
/// The methods run one at a time, in the loop's order; none needs to undo anything when the
/// loop's future is dropped between them: the driver's `Drop` does (leaving the queue in the
/// background), as it does for an attempt in flight.
pub trait QueuedWaiter: Send {
    /// Before each attempt (e.g. take again a wake-up subscription the server dropped, and
    /// poll quickly meanwhile through `wait`'s backoff).
    ///
    /// # Errors
    /// The timeout, when the deadline passed.
    fn before_attempt(
        &mut self,
        wait: &mut AcquireWait,
    ) -> impl Future<Output = Result<()>> + Send {
        let _ = wait;
        std::future::ready(Ok(()))
    }

    /// One attempt: take the lock, or (once joined) register in its queue.
    ///
    /// # Errors
    /// The attempt's error; the loop retries a temporary one (see [`acquire_queued`]).
    fn attempt(&mut self) -> impl Future<Output = Result<Found>> + Send;

    /// Subscribes to wake-ups, the first time the lock is found held; `Ok(true)`: subscribed
    /// (the next attempt, made at once, registers), `Ok(false)`: the waiter polls instead.
    ///
    /// # Errors
    /// The timeout, when the deadline passed.
    fn join(&mut self, wait: &AcquireWait) -> impl Future<Output = Result<bool>> + Send;

    /// Completes when a wake-up or grant message may have come; never, before [`join`](Self::join).
    fn woken(&mut self) -> impl Future<Output = ()> + Send;

    /// The lease of a grant a release announced to this waiter since the last call, when the
    /// message may be taken as the lock (see [`Registered::lease`]); the notifications so far
    /// count as seen. Called before each attempt and when the wait ends with the deadline.
    fn granted(&mut self) -> Option<Lease>;

    /// Leaves the queue (and hands on a grant that crossed the leaving) before `acquire`
    /// returns without the lock, waiting a short grace past the deadline for the answer; the
    /// rest goes on in the background.
    fn leave(&mut self) -> impl Future<Output = ()> + Send;
}

/// The waiting `acquire` of a driver whose releases grant directly: attempts until one takes
/// the lock; when held, joins the queue once and then waits for a wake-up or grant message,
/// the holder's expiry or the fallback poll (`wait`'s backoff; `queued` once the registration
/// is confirmed), attempting again after each. A grant announced by a message is taken
/// without another attempt, also one that came with the deadline. A temporary error is
/// retried after a backoff delay. On any error (the deadline included) the waiter leaves the
/// queue before returning.
///
/// The deadline: an attempt that failed at or after it (cut short by it, or left without an
/// answer; its clean-up goes on in the background) ends the wait as [`Error::Timeout`], and so
/// does one of unknown outcome that was still being retried when it passed; any other error
/// stays what it was (an unreachable server is `Unavailable`).
///
/// # Errors
/// [`Error::Timeout`] at the deadline, a permanent error of an attempt at once, as above.
///
/// # Cancellation safety
/// What dropping it leaves behind is the [`QueuedWaiter`]'s to undo (on its drop).
pub async fn acquire_queued<W: QueuedWaiter>(
    waiter: &mut W,
    wait: &mut AcquireWait,
    queued: Backoff,
) -> Result<Lease> {
    let result = wait_in_queue(waiter, wait, queued).await;
    if result.is_err() {
        waiter.leave().await;
    }
    result
}

async fn wait_in_queue<W: QueuedWaiter>(
    waiter: &mut W,
    wait: &mut AcquireWait,
    queued_backoff: Backoff,
) -> Result<Lease> {
    let mut joined = false;
    loop {
        if let Some(lease) = waiter.granted() {
            return Ok(lease);
        }
        waiter.before_attempt(wait).await?;
        let (expires_in, queued) = match waiter.attempt().await {
            Ok(Found::Granted(lease)) => return Ok(lease),
            Ok(Found::Held { expires_in, queued }) => (expires_in, queued),
            Err(e) => {
                retry_after(wait, e).await?;
                continue;
            }
        };
        if !joined {
            joined = true;
            if waiter.join(wait).await? {
                continue;
            }
        }
        if queued {
            wait.set_backoff(queued_backoff.clone());
        }
        let expiry = async {
            match expires_in {
                Some(left) => sleep(left).await,
                None => std::future::pending().await,
            }
        };
        let woken = async {
            tokio::select! {
                () = waiter.woken() => {}
                () = expiry => {}
            }
        };
        if let Err(e) = wait.wait(woken).await {
            // A grant that came with the deadline is taken rather than handed on.
            return waiter.granted().ok_or(e);
        }
    }
}

/// The deadline rule of [`acquire_queued`] for a failed attempt.
async fn retry_after(wait: &mut AcquireWait, e: Error) -> Result<()> {
    let unknown = matches!(e, Error::Indeterminate { .. });
    if e.is_temporary() && Instant::now() >= wait.deadline() {
        return Err(wait.timeout());
    }
    match wait.retry_after(e).await {
        Err(_) if unknown => Err(wait.timeout()),
        other => other,
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

    /// A scripted queue: each attempt's answer comes from `answer`, calls are counted, and a
    /// grant message is "announced" at `grant_at`. It is the loop under test, not a backend.
    struct Scripted {
        key: LockKey,
        answer: fn(u32) -> Result<Found>,
        attempts: u32,
        joins: u32,
        leaves: u32,
        joined: bool,
        grant_at: Option<Instant>,
        log: Vec<&'static str>,
        attempted_at: Vec<Instant>,
    }

    impl Scripted {
        fn new(answer: fn(u32) -> Result<Found>) -> Self {
            Self {
                key: LockKey::new("queued").unwrap(),
                answer,
                attempts: 0,
                joins: 0,
                leaves: 0,
                joined: false,
                grant_at: None,
                log: Vec::new(),
                attempted_at: Vec::new(),
            }
        }

        fn lease(&self) -> Lease {
            Lease::new(
                self.key.clone(),
                OwnershipToken::generate(),
                None,
                Duration::from_secs(10),
                Instant::now(),
            )
        }
    }

    impl QueuedWaiter for Scripted {
        async fn attempt(&mut self) -> Result<Found> {
            self.attempts += 1;
            self.log.push("attempt");
            self.attempted_at.push(Instant::now());
            (self.answer)(self.attempts)
        }

        async fn join(&mut self, _: &AcquireWait) -> Result<bool> {
            self.joins += 1;
            self.joined = true;
            self.log.push("join");
            Ok(true)
        }

        async fn woken(&mut self) {
            std::future::pending().await
        }

        fn granted(&mut self) -> Option<Lease> {
            let at = self.grant_at?;
            (Instant::now() >= at).then(|| self.lease())
        }

        async fn leave(&mut self) {
            self.leaves += 1;
            self.log.push("leave");
        }
    }

    fn held(_: u32) -> Result<Found> {
        Ok(Found::Held {
            expires_in: None,
            queued: true,
        })
    }

    fn run(waiter: &mut Scripted, wait_for: Duration) -> impl Future<Output = Result<Lease>> {
        let deadline = Instant::now() + wait_for;
        let mut wait = AcquireWait::new(&waiter.key, deadline, Backoff::default()).unwrap();
        let queued = Backoff::new(Duration::from_millis(500), Duration::from_millis(500));
        async move { acquire_queued(waiter, &mut wait, queued).await }
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiter_joins_once_attempts_at_once_after_joining_and_leaves_when_it_gives_up() {
        let mut waiter = Scripted::new(held);
        let err = run(&mut waiter, Duration::from_secs(2)).await.unwrap_err();
        assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
        assert_eq!((waiter.joins, waiter.leaves), (1, 1));
        assert_eq!(waiter.log[..3], ["attempt", "join", "attempt"]);
        // The attempt after joining (which registers) is made at once, not after a poll.
        assert_eq!(waiter.attempted_at[0], waiter.attempted_at[1]);
        assert_eq!(waiter.log.last(), Some(&"leave"));
        // Queued: the fallback poll is the slow one (250-500 ms jittered): two attempts at 0 s,
        // then one after each wait that ends before the deadline — 3 (all 500 ms) to 7 (all
        // 250 ms) — not the dozens of the quick backoff.
        assert!((5..=9).contains(&waiter.attempts), "{}", waiter.attempts);
    }

    #[tokio::test(start_paused = true)]
    async fn a_grant_that_comes_with_the_deadline_is_taken_not_left() {
        let mut waiter = Scripted::new(held);
        waiter.grant_at = Some(Instant::now() + Duration::from_secs(2));
        let lease = run(&mut waiter, Duration::from_secs(2)).await.unwrap();
        assert_eq!(lease.key().as_str(), "queued");
        assert_eq!(waiter.leaves, 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_granted_attempt_returns_its_lease_without_leaving() {
        let mut waiter = Scripted::new(|n| {
            if n < 3 {
                return held(n);
            }
            Ok(Found::Granted(Lease::new(
                LockKey::new("queued").unwrap(),
                OwnershipToken::generate(),
                None,
                Duration::from_secs(10),
                Instant::now(),
            )))
        });
        run(&mut waiter, Duration::from_secs(5)).await.unwrap();
        assert_eq!((waiter.attempts, waiter.leaves), (3, 0));
    }

    #[tokio::test(start_paused = true)]
    async fn an_unknown_outcome_at_the_deadline_is_a_timeout_an_unreachable_server_is_not() {
        let mut waiter = Scripted::new(|_| {
            Err(Error::Indeterminate {
                backend: "scripted",
                op: "acquire",
                key: "queued".into(),
                message: "no answer".into(),
            })
        });
        let err = run(&mut waiter, Duration::from_secs(1)).await.unwrap_err();
        assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
        assert_eq!((waiter.joins, waiter.leaves), (0, 1));
        assert!(waiter.attempts > 1, "a temporary error is retried");

        let mut waiter = Scripted::new(|_| Err(Error::unavailable("scripted", "acquire", "down")));
        let err = run(&mut waiter, Duration::from_secs(1)).await.unwrap_err();
        assert!(matches!(err, Error::Unavailable { .. }), "{err:?}");
        assert_eq!(waiter.leaves, 1);

        let mut waiter = Scripted::new(|_| Err(Error::not_held(&LockKey::new("queued").unwrap())));
        let err = run(&mut waiter, Duration::from_secs(1)).await.unwrap_err();
        assert!(matches!(err, Error::NotHeld { .. }), "{err:?}");
        assert_eq!(
            (waiter.attempts, waiter.leaves),
            (1, 1),
            "a permanent error ends at once"
        );
    }
}

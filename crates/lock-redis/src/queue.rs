//! The waiter queue: how a waiting `acquire` queues (a registration per attempt, renewed by
//! each), waits for its turn (a grant message for its confirmed registration, see
//! [`lock_core::raw::handoff`], whose loop drives [`QueueWaiter`]), and leaves (removing its
//! members and passing on a grant that crossed its leaving, before it returns or, dropped, in
//! the background).

use std::{sync::Arc, time::Duration};

use lock_core::raw::{
    AcquireWait, Backoff, Error, Lease, LockKey, OwnershipToken, Result,
    handoff::{Asked, Found, QueuedWaiter, Registered},
};
use tokio::time::{Instant, timeout_at};

use crate::{
    RedisLock, RedisLockConfig,
    client::{after, request_until},
    keys::KeyNames,
    lock::{Attempt, Inner, Undo, spawn_undo},
    scripts::{owner_prefix, ttl_millis},
    wake::Watch,
};

/// How long past its deadline an `acquire` that gives up waits for the answer to its leaving
/// the queue: a round trip on a loaded machine, far less than a stalled request's budget.
pub(crate) const LEAVE_GRACE: Duration = Duration::from_millis(200);

/// The longest first lease a release hands a waiter (its grant's TTL on the server until the
/// waiter confirms it): a waiter that died after its last attempt — while its registration was
/// still live, up to its lifetime (2 s by default) — holds the lock this long at most, not for
/// the TTL it asked for. A live waiter confirms at once (one renewal to its TTL, see
/// [`RedisLock::acquire`](lock_core::raw::Driver::acquire)), so this only needs to outlast the
/// grant message's delivery and one round trip.
pub(crate) const HANDOFF_LEASE: Duration = Duration::from_millis(1500);

/// The TTL a release's grant to a waiter asking for `ttl` gets: [`HANDOFF_LEASE`] at most.
pub(crate) fn first_lease(ttl: Duration) -> Duration {
    ttl.min(HANDOFF_LEASE)
}

/// How long a waiter's registration lives unless its next attempt renews it (saturating).
pub(crate) fn registration_lifetime(config: &RedisLockConfig) -> Duration {
    config
        .max_poll_interval
        .saturating_mul(2)
        .saturating_add(Duration::from_secs(1))
}

/// What a waiting `acquire`'s attempt sends besides the plain attempt.
pub(crate) struct Waiting<'a> {
    /// The member this attempt registers.
    pub(crate) member: &'a str,
    /// The token a release's grant gives this waiter.
    pub(crate) grant: OwnershipToken,
    /// This waiter's earlier members that may still be queued (removed by the attempt).
    pub(crate) earlier: &'a [String],
}

/// At most this many earlier members ride along with an attempt. Members of attempts without
/// a reply are also removed by those attempts' own clean-ups (which keep trying in the
/// background), so the list is only a fast path: bounded, an attempt's arguments (and Lua's
/// `unpack` of them, which fails at about 8,000) stay small however long attempts keep failing.
const MAX_EARLIER: usize = 16;

/// Adds the member of a finished attempt to `earlier`, dropping the oldest beyond
/// [`MAX_EARLIER`] (it expires with its short registration lifetime, or its clean-up removes it).
fn remember(earlier: &mut Vec<String>, previous: String) {
    if previous.is_empty() {
        return;
    }
    if earlier.len() >= MAX_EARLIER {
        earlier.remove(0);
    }
    earlier.push(previous);
}

/// A waiting `acquire`'s subscription and its entries in a lock's waiter queue. A waiter that
/// gives up leaves the queue ([`Registration::leave`]; dropped while still armed, in the
/// background) and passes on a grant a release made to it meanwhile (which would otherwise
/// block the lock until its TTL).
pub(crate) struct Registration {
    inner: Arc<Inner>,
    names: KeyNames,
    /// The TTL this `acquire` asks for (a grant to it lasts that long).
    ttl: Duration,
    /// The waiter's wake-up subscription and grant messages.
    pub(crate) watch: Watch,
    /// The token a release's grant gives this waiter: one per `acquire`, random. (Each attempt
    /// still grants itself under a fresh token, which its unknown-outcome cleanup goes by.)
    grant: OwnershipToken,
    /// The number of the latest attempt.
    seq: u64,
    /// The member of the latest attempt (empty before the first), which may be queued even
    /// while its attempt is in flight: a dropped `acquire` leaves with it too.
    member: String,
    /// Earlier members that may still be queued: the last confirmed one and those of the
    /// latest attempts without a reply (at most [`MAX_EARLIER`]). An attempt removes them in
    /// the same step as it registers its own.
    earlier: Vec<String>,
    /// The attempt whose reply confirmed the current registration: a grant message naming it
    /// is this waiter's lock (see [`lock_core::raw::handoff`]).
    pub(crate) registered: Option<Registered>,
    /// Cleared when a grant removed the entries already, or the leaving was handed to the
    /// background.
    pub(crate) armed: bool,
    /// An attempt is in flight (sent, no answer yet).
    in_flight: bool,
    /// An attempt got no answer: it may still reach the server after the leaving.
    unsure: bool,
}

impl Registration {
    /// A waiter of `names` asking for `ttl`, subscribed through `watch`, with no attempt yet.
    pub(crate) fn new(inner: Arc<Inner>, names: KeyNames, ttl: Duration, watch: Watch) -> Self {
        Self {
            inner,
            names,
            ttl,
            watch,
            grant: OwnershipToken::generate(),
            seq: 0,
            member: String::new(),
            earlier: Vec::new(),
            registered: None,
            armed: true,
            in_flight: false,
            unsure: false,
        }
    }

    /// What the next attempt sends: a new member, the last of `members`.
    pub(crate) fn next_attempt(&mut self, ttl: Duration) -> Waiting<'_> {
        self.seq += 1;
        // A release grants the member only its short first lease (the waiter confirms it).
        let member = self.watch.member(
            self.seq,
            ttl_millis(first_lease(ttl)),
            &self.grant.expose_hex(),
            &self.inner.identity,
        );
        let previous = std::mem::replace(&mut self.member, member);
        remember(&mut self.earlier, previous);
        self.in_flight = true;
        Waiting {
            member: &self.member,
            grant: self.grant,
            earlier: &self.earlier,
        }
    }

    /// The latest attempt ended; `unanswered`: without an answer (it may still arrive).
    pub(crate) fn ended(&mut self, unanswered: bool) {
        self.in_flight = false;
        self.unsure |= unanswered;
    }

    /// The latest attempt's registration was confirmed: the earlier members are gone.
    pub(crate) fn confirmed(&mut self, sent_at: Instant) {
        self.earlier.clear();
        self.registered = Some(Registered {
            seq: self.seq,
            sent_at,
        });
    }

    /// A lease from a grant message, if one came for the current registration within a quarter
    /// of `ttl` of its sending and its first lease is still locally valid; otherwise the next
    /// attempt finds the grant and restarts its TTL (or `leave` passes it on).
    ///
    /// The lease is the grant's first lease ([`first_lease`] of `ttl`, what the release set on
    /// the server), counted from the registering attempt's send time (the release read what
    /// that attempt wrote), so its local deadline is never later than the server's expiry;
    /// `acquire` extends it to `ttl` before returning it.
    pub(crate) fn granted(&mut self, key: &LockKey, ttl: Duration) -> Option<Lease> {
        let grant = self.watch.take_grant()?;
        // With replica acknowledgement the releaser's grant was not WAITed for: the waiter's
        // own attempt confirms it (restarting its TTL) with its WAIT.
        if self.inner.config.replicas > 0 {
            return None;
        }
        let registered = self.registered?;
        // A grant message for an older registration may belong to a grant lost since; one that
        // comes more than a quarter of the TTL after its registration is confirmed by an
        // attempt (see `lock_core::raw::handoff`).
        if grant.seq != registered.seq || registered.sent_at.elapsed() > ttl / 4 {
            return None;
        }
        let first = first_lease(ttl);
        let lease = Lease::new(
            key.clone(),
            self.grant,
            Some(grant.fence),
            first,
            registered.sent_at,
        );
        if !lease.is_locally_valid() {
            return None;
        }
        self.armed = false;
        Some(lease)
    }

    /// Hands the leaving to the background: removes every member this waiter may have
    /// queued, releases (passing on) a grant that crossed the leaving and, when an attempt of
    /// this `acquire` may still arrive (one got no answer, or is in flight), leaves the marker
    /// that makes it a no-op (so a plain timeout leaves no key behind). Retried until answered,
    /// for as long as a registration of this waiter could still be granted and its grant last.
    fn spawn_leaving(&mut self) -> Option<tokio::sync::oneshot::Receiver<()>> {
        if !std::mem::replace(&mut self.armed, false) {
            return None;
        }
        let mut members = std::mem::take(&mut self.earlier);
        if !self.member.is_empty() {
            members.push(self.member.clone());
        }
        let lifetime = registration_lifetime(&self.inner.config);
        let undo = Undo {
            names: self.names.clone(),
            prefix: owner_prefix(&self.grant),
            members,
            marker: (self.unsure || self.in_flight).then(|| self.ttl.max(lifetime)),
        };
        let until = after(lifetime.saturating_add(self.ttl));
        Some(spawn_undo(self.inner.clone(), undo, until))
    }

    /// Leaves the queue before `acquire` returns without the lock, waiting for the answer
    /// until `until` (then it goes on in the background). Awaited, so that a process that
    /// exits right after a timeout (the CLI's `run --wait`) leaves no registration that a
    /// release would grant the lock to.
    pub(crate) async fn leave(&mut self, until: Instant) {
        if let Some(answered) = self.spawn_leaving() {
            let _ = timeout_at(until, answered).await;
        }
    }
}

/// One waiting `acquire` of a [`RedisLock`], as [`lock_core::raw::handoff::acquire_queued`]
/// drives it: attempts (registering once subscribed), the wake-up subscription (on a Cluster,
/// the lock's shard channel on the slot's node, taken again when the server drops it) and the
/// [`Registration`] that leaves the queue.
pub(crate) struct QueueWaiter<'a> {
    lock: &'a RedisLock,
    asked: Asked<'a>,
    /// The backoff of a waiter whose wake-ups may be missed.
    quick: Backoff,
    /// After the server dropped the waiter's shard subscription (a Cluster failover), the
    /// fallback poll stays quick until then (see `Watch::take_dropped`).
    quick_until: Option<Instant>,
    /// Subscribed to wake-ups (after the first `Held`): the queue entries to leave.
    registration: Option<Registration>,
}

impl<'a> QueueWaiter<'a> {
    pub(crate) fn new(lock: &'a RedisLock, asked: Asked<'a>, quick: Backoff) -> Self {
        Self {
            lock,
            asked,
            quick,
            quick_until: None,
            registration: None,
        }
    }

    fn config(&self) -> &RedisLockConfig {
        &self.lock.inner.config
    }
}

impl QueuedWaiter for QueueWaiter<'_> {
    async fn before_attempt(&mut self, wait: &mut AcquireWait) -> Result<()> {
        let Some(r) = &self.registration else {
            return Ok(());
        };
        if r.watch.take_dropped() {
            self.quick_until = Some(after(self.config().max_poll_interval));
            wait.set_backoff(self.quick.clone());
        }
        // On a Cluster, a shard subscription the server dropped (its slot moved) is taken
        // again before the attempt, so a release after it is heard.
        let until = request_until(self.config(), Some(self.asked.deadline));
        let again = self.quick_until.is_some_and(|t| Instant::now() < t);
        match timeout_at(until, r.watch.subscribe_shard(again)).await {
            Ok(Ok(())) => {}
            Err(_) if Instant::now() >= self.asked.deadline => return Err(wait.timeout()),
            Ok(Err(_)) | Err(_) => {
                tracing::debug!(key = %self.asked.key, "cannot subscribe to wake-ups again; polling");
            }
        }
        Ok(())
    }

    async fn attempt(&mut self) -> Result<Found> {
        let sent_at = Instant::now();
        let waiting = self
            .registration
            .as_mut()
            .map(|r| r.next_attempt(self.asked.ttl));
        let outcome = self
            .lock
            .attempt(
                self.asked.key,
                self.asked.ttl,
                waiting.as_ref(),
                Some(self.asked.deadline),
            )
            .await;
        let registered = match (&outcome, self.registration.as_mut()) {
            (_, None) => false,
            (outcome, Some(r)) => {
                r.ended(matches!(outcome, Err(Error::Indeterminate { .. })));
                match outcome {
                    Ok(Attempt::Granted(_)) => r.armed = false,
                    Ok(Attempt::Held(_)) => r.confirmed(sent_at),
                    Err(_) => r.registered = None,
                }
                true
            }
        };
        Ok(match outcome? {
            Attempt::Granted(lease) => Found::Granted(lease),
            Attempt::Held(left) => {
                // Registered: a release grants to or wakes this waiter, so the fallback poll
                // (which also moves it back in the queue) need not be quick, unless a dropped
                // subscription made it quick for a while.
                let quick = self.quick_until.is_some_and(|t| Instant::now() < t);
                if registered && !quick {
                    self.quick_until = None;
                }
                Found::Held {
                    expires_in: left.map(|left| left + EXPIRY_MARGIN),
                    queued: registered && !quick,
                }
            }
        })
    }

    async fn join(&mut self, wait: &AcquireWait) -> Result<bool> {
        let names = self.lock.names(self.asked.key);
        let inner = &self.lock.inner;
        match timeout_at(
            self.asked.deadline,
            inner.wakeups.watch(&inner.conn, &names),
        )
        .await
        {
            Ok(Ok(watch)) => {
                self.registration = Some(Registration::new(
                    inner.clone(),
                    names,
                    self.asked.ttl,
                    watch,
                ));
                Ok(true)
            }
            Ok(Err(e)) => {
                tracing::debug!(key = %self.asked.key, error = %e, "cannot subscribe to wake-ups; polling");
                Ok(false)
            }
            Err(_) => Err(wait.timeout()),
        }
    }

    async fn woken(&mut self) {
        match &self.registration {
            Some(r) => r.watch.woken().await,
            None => std::future::pending().await,
        }
    }

    fn granted(&mut self) -> Option<Lease> {
        self.registration
            .as_mut()?
            .granted(self.asked.key, self.asked.ttl)
    }

    async fn leave(&mut self) {
        // The deadline bounds the wait for the answer; a small grace lets a healthy server's
        // answer arrive even when the deadline has just passed (else it goes on in the
        // background).
        let until = request_until(self.config(), Some(self.asked.deadline)).max(Instant::now());
        if let Some(r) = self.registration.as_mut() {
            r.leave(until + LEAVE_GRACE).await;
        }
    }
}

/// How long past a holder's reported TTL a waiter looks again (its key is gone by then).
const EXPIRY_MARGIN: Duration = Duration::from_millis(2);

impl Drop for Registration {
    fn drop(&mut self) {
        self.spawn_leaving();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// L6: a waiter whose attempts keep failing sent every earlier member with each attempt
    /// (O(n²) traffic) until Lua's `unpack` failed at about 8,000 of them, and every attempt
    /// and the leaving failed with it.
    #[test]
    fn the_earlier_members_an_attempt_carries_stay_bounded() {
        let mut earlier = Vec::new();
        for seq in 0..10_000 {
            remember(&mut earlier, format!("client:1:{seq}:30000:grant"));
            assert!(earlier.len() <= MAX_EARLIER);
        }
        assert_eq!(earlier.len(), MAX_EARLIER);
        assert_eq!(earlier.last().unwrap(), "client:1:9999:30000:grant");
        remember(&mut earlier, String::new());
        assert_eq!(earlier.len(), MAX_EARLIER);
    }
}

//! The waiter queue: how a waiting `acquire` queues in the lock row, learns that a release
//! granted it the lock, and leaves the queue when it gives up (freeing a grant that crossed its
//! leaving); [`lock_core::raw::handoff`]'s loop drives it through [`QueueWaiter`]. The SQL is
//! in [`crate::sql`], the notifications in [`crate::wake`].

use std::{
    sync::{Arc, atomic::AtomicU64},
    time::Duration,
};

use lock_core::raw::{
    AcquireWait, Lease, LockKey, OwnershipToken, Result,
    cleanup::Retries,
    handoff::{Asked, Found, QueuedWaiter, Registered},
};
use sqlx::postgres::PgRow;
use tokio::time::{Instant, timeout_at};

use crate::{
    PgLock,
    client::{ExecError, Failure},
    lock::{Attempt, Inner, Mode, later},
    wake::Subscription,
};

/// What a queued attempt writes into the waiter's entry. No `Debug`: it holds a secret token.
#[derive(Clone, Copy)]
pub(crate) struct Queueing<'a> {
    /// `<channel>:<number>`.
    pub(crate) entry: &'a str,
    /// The owner a release's direct grant gives the lock to (one per `acquire`).
    pub(crate) grant_owner: OwnershipToken,
    /// The last seq used: each statement takes the next one.
    pub(crate) seq: &'a AtomicU64,
}

/// A waiting `acquire`'s subscription to notifications and its entry in the lock's queue.
/// A waiter that gives up leaves the queue ([`Queued::leave`]; dropped while still queued, in
/// the background) and frees a grant a release made to its grant owner meanwhile (handing
/// the lock to the next waiter), so a gone waiter neither gets the next hand-off nor keeps a
/// grant it never heard of. No `Debug`: it holds a secret token.
pub(crate) struct Queued {
    inner: Arc<Inner>,
    key: LockKey,
    subscription: Subscription,
    /// `<channel>:<number>`.
    entry: String,
    /// The owner of a direct grant to this waiter.
    grant_owner: OwnershipToken,
    /// The TTL a direct grant to this waiter gets.
    ttl: Duration,
    /// The entry may be in the queue, or a grant to `grant_owner` may exist: set before the
    /// first queued attempt is sent; cleared only once the lock is returned with a grant that
    /// consumed the entry, or under `grant_owner`.
    queued: bool,
}

impl Queued {
    /// Leaves the queue before `acquire` returns without the lock, freeing (and handing on) a
    /// grant made to this waiter meanwhile. Awaited, so that a process that exits right after
    /// a timeout (the CLI's `run --wait`) leaves no entry that a release would grant the lock
    /// to; when it fails, the drop keeps trying in the background. Bounded by `limit` (the
    /// acquire's deadline plus [`LEAVE_GRACE`]).
    pub(crate) async fn leave(&mut self, limit: Instant) {
        if !self.queued {
            return;
        }
        let grant_owner = self.grant_owner.expose_hex();
        match self
            .inner
            .dequeue(&self.key, &self.entry, &grant_owner, limit)
            .await
        {
            Ok(_) => self.queued = false,
            Err(e) => {
                tracing::debug!(key = %self.key, error = ?Failure::from(e), "could not leave the wait queue; retrying in the background");
            }
        }
    }

    /// Marks every notification so far as seen (before each attempt) and returns the lease of
    /// a grant announced for `by`, the attempt whose reply confirmed the entry (see
    /// [`lock_core::raw::handoff`]).
    pub(crate) fn granted(
        &mut self,
        by: Option<Registered>,
        key: &LockKey,
        ttl: Duration,
    ) -> Option<Lease> {
        let grant = self.subscription.mark_seen()?;
        // The release granted the entry's short first lease (see [`HANDOFF_LEASE`]), from
        // after `by` was sent: the lease counts that long from then, and `acquire` extends it
        // to `ttl` before returning it. One already past its local deadline is not taken: the
        // next attempt confirms and extends the grant instead (if it still holds).
        let by = by?;
        // As `Registered::lease`: a grant of an older attempt, or one seen more than a quarter
        // of the TTL after the attempt, is confirmed by the next attempt instead.
        if by.seq != grant.seq || by.sent_at.elapsed() > ttl / 4 {
            return None;
        }
        let first = first_lease(ttl);
        let lease = Lease::new(
            key.clone(),
            self.grant_owner,
            Some(grant.fence),
            first,
            by.sent_at,
        );
        if !lease.is_locally_valid() {
            return None;
        }
        // The release read the entry this attempt wrote, so it granted after `sent_at`: the
        // local deadline cannot be later than the server's expiry.
        self.queued = false;
        tracing::debug!(%key, token = %self.grant_owner.digest(), fence = %grant.fence, "granted by a release");
        Some(lease)
    }
}

/// One waiting `acquire` of a [`PgLock`], as [`lock_core::raw::handoff::acquire_queued`]
/// drives it: looks (a read when held), then, once subscribed on the client's `LISTEN`
/// connection, queues in the lock row with each attempt; a release's direct grant is taken
/// from its notification. No `Debug`: it holds a secret token.
pub(crate) struct QueueWaiter<'a> {
    lock: &'a PgLock,
    asked: Asked<'a>,
    /// A release's direct grant makes this the owner. Each attempt still grants itself under
    /// a fresh token of its own, so undoing an attempt of unknown outcome (by its token) can
    /// never remove a direct grant.
    grant_owner: OwnershipToken,
    seq: AtomicU64,
    /// The latest attempt whose reply said the entry is queued: only a grant read from the
    /// entry it wrote is taken from a notification (an older one may have been lost since).
    queued_by: Option<Registered>,
    /// Subscribed (the first look reads before it writes: uncontended, that is the only
    /// statement): the entry to leave.
    queue: Option<Queued>,
}

impl<'a> QueueWaiter<'a> {
    pub(crate) fn new(lock: &'a PgLock, asked: Asked<'a>) -> Self {
        Self {
            lock,
            asked,
            grant_owner: OwnershipToken::generate(),
            seq: AtomicU64::new(0),
            queued_by: None,
            queue: None,
        }
    }
}

impl QueuedWaiter for QueueWaiter<'_> {
    async fn attempt(&mut self) -> Result<Found> {
        let listening = self
            .queue
            .as_ref()
            .is_some_and(|q| q.subscription.listening());
        if let Some(q) = self.queue.as_mut()
            && listening
        {
            q.queued = true;
        }
        let mode = match self.queue.as_ref() {
            Some(q) if listening => Mode::Queue(Queueing {
                entry: &q.entry,
                grant_owner: self.grant_owner,
                seq: &self.seq,
            }),
            Some(_) => Mode::Poll {
                grant_owner: Some(self.grant_owner),
            },
            None => Mode::Poll { grant_owner: None },
        };
        let queue_mode = matches!(mode, Mode::Queue(_));
        let attempt = self
            .lock
            .inner
            .attempt(self.asked.key, self.asked.ttl, mode, self.asked.deadline)
            .await?;
        Ok(match attempt {
            Attempt::Granted(lease) => {
                // A queued grant dropped the entry from the queue, and a grant to the grant
                // owner consumed it; after a polled grant the entry (and any later grant to
                // the grant owner) is removed on the way out.
                if let Some(q) = self.queue.as_mut()
                    && (queue_mode || *lease.token() == self.grant_owner)
                {
                    q.queued = false;
                }
                Found::Granted(lease)
            }
            // Also wake when the holder's lease runs out (expiry is not notified).
            Attempt::Held { remaining, queued } => {
                if queue_mode {
                    self.queued_by = queued;
                }
                Found::Held {
                    expires_in: Some(remaining + Duration::from_millis(1)),
                    queued: queued.is_some(),
                }
            }
            // Taken by a grant that committed during the statement: look again now.
            Attempt::Lost => Found::Held {
                expires_in: Some(Duration::ZERO),
                queued: false,
            },
        })
    }

    async fn join(&mut self, wait: &AcquireWait) -> Result<bool> {
        if !self.lock.inner.config.listen {
            return Ok(false);
        }
        // LISTEN, then queue at once (the statement also tries again).
        let Ok(subscription) =
            timeout_at(self.asked.deadline, self.lock.notifier().subscribe()).await
        else {
            return Err(wait.timeout());
        };
        let entry = subscription.entry();
        self.queue = Some(Queued {
            inner: self.lock.inner.clone(),
            key: self.asked.key.clone(),
            subscription,
            entry,
            grant_owner: self.grant_owner,
            ttl: self.asked.ttl,
            queued: false,
        });
        Ok(true)
    }

    async fn woken(&mut self) {
        match self.queue.as_mut() {
            Some(q) => q.subscription.changed().await,
            None => std::future::pending().await,
        }
    }

    /// A grant of an older attempt, or one that went unused for too long of its TTL, is not
    /// taken here: the next attempt finds it (if still held) and extends it.
    fn granted(&mut self) -> Option<Lease> {
        let queued_by = self.queued_by;
        self.queue
            .as_mut()?
            .granted(queued_by, self.asked.key, self.asked.ttl)
    }

    async fn leave(&mut self) {
        if let Some(q) = self.queue.as_mut() {
            q.leave(later(self.asked.deadline, LEAVE_GRACE)).await;
        }
    }
}

impl Inner {
    /// Removes queue entry `entry` of `key` and frees a grant to `grant_owner`, handing the
    /// lock on (see [`crate::sql`]).
    async fn dequeue(
        &self,
        key: &LockKey,
        entry: &str,
        grant_owner: &str,
        limit: Instant,
    ) -> std::result::Result<Option<PgRow>, ExecError> {
        self.fetch_idempotent(
            || {
                sqlx::query(self.sql().dequeue.clone())
                    .bind(key.as_str())
                    .bind(entry.to_owned())
                    .bind(grant_owner.to_owned())
            },
            limit,
        )
        .await
    }
}

impl Drop for Queued {
    fn drop(&mut self) {
        if !self.queued {
            return;
        }
        let (inner, key, entry, grant_owner) = (
            self.inner.clone(),
            self.key.clone(),
            std::mem::take(&mut self.entry),
            self.grant_owner.expose_hex(),
        );
        // Past this, the entry has lapsed (an attempt in flight writes it within timeout)
        // and any grant made from it has expired: there is nothing left to undo.
        let lifetime = Duration::from_millis(
            u64::try_from(inner.queue_entry_lifetime_ms()).unwrap_or(u64::MAX),
        );
        let until = later(later(inner.op_deadline(), lifetime), self.ttl);
        lock_core::raw::cleanup::spawn(async move {
            let mut retries = Retries::until(until);
            while retries.next().await {
                let limit = inner.request_deadline().min(until);
                let Err(e) = inner.dequeue(&key, &entry, &grant_owner, limit).await else {
                    return;
                };
                let failure = Failure::from(e);
                if failure.is_refused() {
                    tracing::debug!(%key, error = ?failure, "could not leave the wait queue");
                    return;
                }
                // The server is unreachable: a grant to this waiter would block the lock after
                // it comes back, so keep trying (dequeueing twice is harmless).
            }
            // The entry lapses by itself within two poll intervals; a grant made to it
            // meanwhile holds the lock until its TTL runs out.
            tracing::debug!(%key, "could not leave the wait queue in time");
        });
    }
}

pub(crate) use crate::sql::HANDOFF_LEASE;

/// The first lease of a direct grant to a waiter asking for `ttl`: [`HANDOFF_LEASE`] at most.
pub(crate) fn first_lease(ttl: Duration) -> Duration {
    ttl.min(HANDOFF_LEASE)
}

/// How long past its deadline an `acquire` that gives up may spend leaving the queue before it
/// returns (a dequeue takes a millisecond on a healthy server; past this, the background takes
/// over), so a process that exits on the timeout leaves no entry behind.
pub(crate) const LEAVE_GRACE: Duration = Duration::from_millis(250);

impl Inner {
    /// How long a queue entry lives without a refresh: two poll intervals (a queued waiter
    /// refreshes it at least once per poll interval), at least 100 ms.
    pub(crate) fn queue_entry_lifetime_ms(&self) -> i64 {
        let ms = self
            .config
            .poll_interval
            .saturating_mul(2)
            .max(Duration::from_millis(100))
            .as_millis();
        i64::try_from(ms).unwrap_or(i64::MAX)
    }
}

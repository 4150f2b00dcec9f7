//! The coordinator's algorithm: `impl Driver for PgLock` — try_acquire, acquire (look, queue,
//! take the grant a release made), release, inspect and force_release — and the undo of an
//! acquire whose outcome is unknown.

use std::{
    fmt,
    sync::{
        Arc, OnceLock,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use lock_core::raw::{
    AcquireWait, Backoff, Batcher, Capabilities, Driver, Error, FencingGuarantee, FencingToken,
    HolderIdentity, HolderInfo, Lease, LockKey, LossReason, OwnershipToken, Result, async_trait,
    cleanup::Retries,
    handoff::{self, Asked, Registered},
    server_expired_lease,
};
use sqlx::{PgPool, Row, postgres::PgRow};
use tokio::{
    sync::OnceCell,
    time::{Instant, timeout_at},
};

use crate::{
    PgLockConfig,
    client::{ConnPool, ExecError, exec_error},
    queue::{QueueWaiter, Queueing},
    renew::{RenewAnswer, Renewal},
    sql::Statements,
    wake::Notifier,
};

pub(crate) const BACKEND: &str = "postgres";

/// A distributed lock on a PostgreSQL lease table.
///
/// One row per lock name: `owner` (the holder's token, `NULL` when free), `fence` (bumped by
/// every grant, never reset: rows are never deleted) and `expires_at`, always compared with the
/// database's own `clock_timestamp()`. Acquire is one `INSERT … ON CONFLICT DO UPDATE … WHERE`
/// statement; renew and release are guarded on name, owner token and fence. Waiters queue in
/// the row (`waiters`) and `LISTEN` on one shared connection per client; a release hands the
/// lock to the first live waiter in the same statement and `pg_notify`s only that waiter,
/// with a bounded jittered poll as fallback.
///
/// No session state is used for locking (no advisory locks, no temporary tables), so it works
/// through transaction-pooling proxies; set `listen=false` there, since `LISTEN` needs a
/// session.
#[derive(Clone)]
pub struct PgLock {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) config: PgLockConfig,
    pub(crate) conns: ConnPool,
    pub(crate) user_pool: OnceLock<PgPool>,
    /// The statements of a table with the holder columns, and of one without them (an older
    /// version's table this role could not `ALTER`).
    pub(crate) sql: Statements,
    pub(crate) sql_plain: Statements,
    /// Set once the table is checked: whether it has the holder columns.
    pub(crate) table_ready: OnceCell<bool>,
    /// This client's holder identity, recorded with each of its grants.
    pub(crate) identity: HolderIdentity,
    pub(crate) notifier: OnceLock<Notifier>,
    /// Renewals waiting for, or riding in, the next batch statement.
    pub(crate) renewals: Batcher<Renewal, RenewAnswer>,
    /// Statements sent on the lock's own connections (each is one transaction).
    pub(crate) statements: AtomicU64,
}

/// What one acquire statement did (`F`: the fence, then the lease, once granted).
#[derive(Debug)]
pub(crate) enum Attempt<F = Lease> {
    /// Granted, with this fence.
    Granted(F),
    /// A live holder was seen, with this much of its lease left; `queued` when the waiter's
    /// entry is in the lock's queue (so a release will grant it the lock or wake it): the
    /// attempt that wrote it.
    Held {
        remaining: Duration,
        queued: Option<Registered>,
    },
    /// Not granted, and no holder seen: taken by a grant that committed during the polling
    /// statement (free in its snapshot), or the bare upsert found the row held.
    Lost,
}

/// A grant decided by an acquire statement: its fence, and whether it is the waiter's grant
/// owner's (a direct grant made by a release, found and extended) rather than the attempt's.
#[derive(Debug)]
struct Granted {
    fence: FencingToken,
    to_grant_owner: bool,
}

fn fence_token(fence: i64) -> Result<FencingToken> {
    u64::try_from(fence).map(FencingToken).map_err(|_| {
        Error::backend(
            BACKEND,
            "try_acquire",
            format!("negative fence {fence} in the table"),
        )
    })
}

/// Which acquire statement an attempt runs.
#[derive(Clone, Copy)]
pub(crate) enum Mode<'a> {
    /// The bare upsert (`try_acquire`): the cheapest grant; on a held row it takes the row
    /// lock and commits it, and it tells nothing about the holder.
    Try,
    /// A waiter's look that reads first and returns the holder's remaining time; with the
    /// waiter's grant owner once it may have queued (a grant made to it is then taken).
    Poll { grant_owner: Option<OwnershipToken> },
    /// A waiter's attempt that queues (or refreshes) its entry when the lock is held.
    Queue(Queueing<'a>),
}

impl Mode<'_> {
    /// The owner a release's direct grant gives the lock to, when this attempt may find one.
    fn grant_owner(self) -> Option<OwnershipToken> {
        match self {
            Mode::Try => None,
            Mode::Poll { grant_owner } => grant_owner,
            Mode::Queue(q) => Some(q.grant_owner),
        }
    }
}

/// Reads an acquire statement's row; `by`: the statement, as the writer of a queue entry.
fn attempt_of(row: &PgRow, mode: Mode<'_>, by: Registered) -> Result<Attempt<Granted>> {
    const OP: &str = "try_acquire";
    let column = |e| Error::backend(BACKEND, OP, e);
    let fence: Option<i64> = row.try_get(0).map_err(column)?;
    // The column telling whether the grant is the grant owner's.
    let granted_column = match mode {
        Mode::Try => None,
        Mode::Poll { .. } => Some(2),
        Mode::Queue(_) => Some(3),
    };
    if let Some(fence) = fence {
        let to_grant_owner = match granted_column {
            Some(i) => row.try_get::<bool, _>(i).map_err(column)?,
            None => false,
        };
        return Ok(Attempt::Granted(Granted {
            fence: fence_token(fence)?,
            to_grant_owner,
        }));
    }
    if matches!(mode, Mode::Try) {
        return Ok(Attempt::Lost);
    }
    let remaining: Option<i64> = row.try_get(1).map_err(column)?;
    let queued = match mode {
        Mode::Queue(_) => row.try_get::<bool, _>(2).map_err(column)?,
        _ => false,
    };
    Ok(match remaining {
        Some(remaining) => Attempt::Held {
            remaining: Duration::from_micros(u64::try_from(remaining).unwrap_or(0)),
            queued: queued.then_some(by),
        },
        None => Attempt::Lost,
    })
}

/// `at + d`, saturating far in the future instead of overflowing the clock.
pub(crate) fn later(at: Instant, d: Duration) -> Instant {
    at.checked_add(d)
        .or_else(|| at.checked_add(Duration::from_secs(100 * 365 * 24 * 3600)))
        .unwrap_or(at)
}

pub(crate) fn micros(ttl: Duration) -> i64 {
    i64::try_from(ttl.as_micros()).unwrap_or(i64::MAX)
}

impl Inner {
    /// Until when an attempt sent at `sent_at` whose outcome is unknown may still hold a
    /// grant: the statement may run on the server for up to `timeout` after it was sent
    /// (the server does not notice that its connection was closed), then its grant lasts `ttl`.
    fn undo_until(&self, sent_at: Instant, ttl: Duration) -> Instant {
        later(later(sent_at, self.config.timeout), ttl)
    }

    /// One acquire statement (retried only when its connection died and the attempt was
    /// provably undone). `mode`: the bare upsert, or a waiter's statement. Every request it
    /// sends ends by `limit` (the caller's deadline); a clean-up that needs longer goes on in
    /// the background.
    ///
    /// A grant whose reply came after the lease's local deadline is released again (compare
    /// by token and fence) and answered with [`Error::Unavailable`]: it can no longer be
    /// trusted, and the holder must never see a lease that is already expired.
    pub(crate) async fn attempt(
        self: &Arc<Self>,
        key: &LockKey,
        ttl: Duration,
        mode: Mode<'_>,
        limit: Instant,
    ) -> Result<Attempt> {
        const OP: &str = "try_acquire";
        match timeout_at(limit, self.ensure_table()).await {
            Ok(ready) => ready?,
            Err(_) => return Err(Error::unavailable(BACKEND, OP, "no answer by the deadline")),
        }
        let holders = self.holders();
        let give_up = self.op_deadline().min(limit);
        let mut attempts = self.config.pool_size.saturating_add(1);
        loop {
            let token = OwnershipToken::generate();
            let sent_at = Instant::now();
            // Armed until the outcome is known (or its undo is done): dropped earlier, with the
            // future or on an error, it undoes the grant in the background.
            let mut undo = UndoOnDrop {
                inner: Some(self.clone()),
                key: key.clone(),
                token,
                until: self.undo_until(sent_at, ttl),
            };
            // Each statement of a queued attempt writes a seq of its own.
            let mut seq = 0;
            let query = match mode {
                Mode::Try => sqlx::query(self.sql().acquire.clone())
                    .bind(key.as_str())
                    .bind(token.expose_hex())
                    .bind(micros(ttl)),
                Mode::Poll { grant_owner } => sqlx::query(self.sql().acquire_polling.clone())
                    .bind(key.as_str())
                    .bind(token.expose_hex())
                    .bind(micros(ttl))
                    .bind(grant_owner.map(|g| g.expose_hex())),
                Mode::Queue(q) => {
                    seq = q.seq.fetch_add(1, Ordering::Relaxed) + 1;
                    sqlx::query(self.sql().acquire_queued.clone())
                        .bind(key.as_str())
                        .bind(token.expose_hex())
                        .bind(micros(ttl))
                        .bind(q.entry)
                        .bind(self.queue_entry_lifetime_ms())
                        .bind(q.grant_owner.expose_hex())
                        .bind(i64::try_from(seq).unwrap_or(i64::MAX))
                }
            };
            // The identity is the last parameter of each acquire statement that has it.
            let query = if holders {
                query.bind(self.identity.as_str())
            } else {
                query
            };
            let outcome = self
                .fetch_all(query, limit)
                .await
                .map(|rows| rows.into_iter().next());
            match outcome {
                // Only the bare upsert returns no row: held (or taken meanwhile).
                Ok(None) if matches!(mode, Mode::Try) => {
                    undo.disarm();
                    return Ok(Attempt::Lost);
                }
                // Unexpected: whatever the statement did is undone (by the armed guard).
                Ok(None) => return Err(Error::backend(BACKEND, OP, "the acquire returned no row")),
                Ok(Some(row)) => {
                    let granted = match attempt_of(&row, mode, Registered { seq, sent_at }) {
                        Ok(Attempt::Granted(granted)) => granted,
                        Ok(Attempt::Held { remaining, queued }) => {
                            undo.disarm();
                            return Ok(Attempt::Held { remaining, queued });
                        }
                        Ok(Attempt::Lost) => {
                            undo.disarm();
                            return Ok(Attempt::Lost);
                        }
                        Err(e) => {
                            // The statement completed but its row cannot be read: it may have
                            // granted. Undo by token (the guard, if this is dropped meanwhile).
                            self.undo_now(undo, limit).await;
                            return Err(e);
                        }
                    };
                    let fence = granted.fence;
                    // A grant to the waiter's grant owner was made by a release and extended by
                    // this statement (from `sent_at` on, like a fresh grant).
                    let lease_token = match mode.grant_owner() {
                        Some(grant_owner) if granted.to_grant_owner => grant_owner,
                        _ => token,
                    };
                    let lease = Lease::new(key.clone(), lease_token, Some(fence), ttl, sent_at);
                    if !lease.is_locally_valid() {
                        self.release_late_grant(&lease, limit).await;
                        undo.disarm();
                        return Err(Error::Unavailable {
                            backend: BACKEND,
                            op: OP,
                            message: format!(
                                "the grant's reply came {:?} after it was sent, past the lease's \
                                 local deadline (ttl {ttl:?}); the grant is being released",
                                sent_at.elapsed()
                            ),
                            source: None,
                        });
                    }
                    undo.disarm();
                    tracing::debug!(%key, token = %lease_token.digest(), %fence, direct = granted.to_grant_owner, "acquired");
                    return Ok(Attempt::Granted(lease));
                }
                Err(ExecError::Unknown { message, retry }) => {
                    // The grant may have been applied: undo it by token before anything else.
                    // The guard stays armed while this is awaited.
                    let cleaned = self.release_token(key, token, limit).await;
                    tracing::debug!(%key, token = %token.digest(), %message, cleaned = ?cleaned.as_ref().map_err(|e| e.kind()), "acquire outcome unknown");
                    if matches!(cleaned, Ok(true)) {
                        // Found and removed: the statement has run, nothing of it is left.
                        undo.disarm();
                    }
                    // Otherwise the statement may still commit later (on the server, after its
                    // connection was closed): the guard's background undo keeps trying until
                    // any grant it makes would have expired.
                    drop(undo);
                    attempts -= 1;
                    if retry && cleaned.is_ok() && attempts > 0 && Instant::now() < give_up {
                        // A fresh attempt (a fresh token) is safe; one that the old statement
                        // blocks is cleared by the undo.
                        continue;
                    }
                    return Err(exec_error(OP, key, ExecError::Unknown { message, retry }));
                }
                // Not sent, or refused (rolled back): nothing was applied.
                Err(e) => {
                    undo.disarm();
                    return Err(exec_error(OP, key, e));
                }
            }
        }
    }

    /// Undoes the attempt of `undo` by its token once within `limit`; when that does not
    /// settle it, the guard goes on in the background.
    async fn undo_now(&self, mut undo: UndoOnDrop, limit: Instant) {
        if let Ok(true) = self.release_token(&undo.key, undo.token, limit).await {
            undo.disarm();
        }
    }

    /// Releases a grant that can no longer be trusted (its reply came too late), by token and
    /// fence (so a later grant to the same owner is never touched); in the background when
    /// that fails within `limit`.
    async fn release_late_grant(self: &Arc<Self>, lease: &Lease, limit: Instant) {
        let released = self.release_by(lease, &self.sql().release, limit).await;
        tracing::debug!(key = %lease.key(), fence = ?lease.fencing_token(), released = ?released.as_ref().map_err(|e| e.kind()), "a grant came after its local deadline");
        if released.is_err() {
            let (inner, lease) = (self.clone(), lease.clone());
            let until = later(Instant::now(), lease.ttl());
            lock_core::raw::cleanup::spawn(async move {
                let mut retries = Retries::until(until);
                while retries.next().await {
                    let limit = inner.request_deadline().min(until);
                    if inner
                        .release_by(&lease, &inner.sql().release, limit)
                        .await
                        .is_ok()
                    {
                        return;
                    }
                }
            });
        }
    }

    /// Retries [`Inner::release_token`] in a background task until it removes the grant or
    /// the grant it undoes would have expired anyway (`until`). An answer "nothing to undo" is
    /// not the end: the statement of unknown outcome may still commit later (it may be queued
    /// on the server behind a row lock, or still in flight on a dead connection).
    fn undo_in_background(self: Arc<Self>, key: LockKey, token: OwnershipToken, until: Instant) {
        lock_core::raw::cleanup::spawn(async move {
            let mut retries = Retries::until(until);
            while retries.next().await {
                let limit = self.request_deadline().min(until);
                if let Ok(true) = self.release_token(&key, token, limit).await {
                    tracing::debug!(%key, token = %token.digest(), "undid an acquire of unknown outcome");
                    return;
                }
            }
            tracing::debug!(%key, token = %token.digest(), "stopped undoing an acquire of unknown outcome: any grant it made has expired");
        });
    }

    /// Compare-and-release by token alone (the fence of a lost reply is unknown).
    async fn release_token(
        &self,
        key: &LockKey,
        token: OwnershipToken,
        limit: Instant,
    ) -> Result<bool> {
        let hex = token.expose_hex();
        self.fetch_idempotent(
            || {
                sqlx::query(self.sql().release_token.clone())
                    .bind(key.as_str())
                    .bind(hex.clone())
            },
            limit,
        )
        .await
        .map(|row| row.is_some())
        .map_err(|e| exec_error("release", key, e))
    }

    async fn release(&self, lease: &Lease) -> Result<bool> {
        let sql = if self.config.async_release {
            &self.sql().release_async
        } else {
            &self.sql().release
        };
        self.release_by(lease, sql, self.request_deadline()).await
    }

    /// Compare-and-release by name, token and fence (idempotent: a fence is never granted
    /// twice), with statement `sql`.
    async fn release_by(&self, lease: &Lease, sql: &sqlx::SqlStr, limit: Instant) -> Result<bool> {
        const OP: &str = "release";
        let key = lease.key();
        let fence = lease_fence(lease, OP)?;
        let hex = lease.token().expose_hex();
        let (rows, resent) = self
            .fetch_all_idempotent(
                || {
                    sqlx::query(sql.clone())
                        .bind(key.as_str())
                        .bind(hex.clone())
                        .bind(fence)
                },
                limit,
            )
            .await
            .map_err(|e| exec_error(OP, key, e))?;
        if rows.is_empty() && resent {
            // The first send may have released it (its reply was lost): "not held" would claim
            // the lease had been lost before this release, which nobody knows.
            return Err(Error::Indeterminate {
                backend: BACKEND,
                op: OP,
                key: key.to_string(),
                message: "the reply to the release was lost and its re-send found the grant gone: \
                          released by the first send, or expired or taken before it"
                    .into(),
            });
        }
        Ok(!rows.is_empty())
    }

    /// The operator override. Without `holder`, the current grant's fence is read first and
    /// only that grant is removed: the statement is then idempotent, so re-sending it after a
    /// lost reply can never remove the grant its first run just handed to the next waiter.
    async fn force_release(&self, key: &LockKey, holder: Option<FencingToken>) -> Result<bool> {
        const OP: &str = "force_release";
        let fence = match holder {
            Some(f) => match i64::try_from(f.get()) {
                Ok(f) => f,
                // No grant has a fence beyond bigint: nothing to remove.
                Err(_) => return Ok(false),
            },
            None => match self.inspect(key).await? {
                Some(HolderInfo {
                    fencing_token: Some(f),
                    ..
                }) => match i64::try_from(f.get()) {
                    Ok(f) => f,
                    Err(_) => return Ok(false),
                },
                _ => return Ok(false),
            },
        };
        self.ensure_table().await?;
        let (rows, resent) = self
            .fetch_all_idempotent(
                || {
                    sqlx::query(self.sql().force_release.clone())
                        .bind(key.as_str())
                        .bind(fence)
                },
                self.request_deadline(),
            )
            .await
            .map_err(|e| exec_error(OP, key, e))?;
        // A re-sent statement that finds the grant gone: the lost first run (or the holder)
        // ended it. Either way the grant the operator meant is no longer held.
        let removed = !rows.is_empty() || resent;
        tracing::info!(%key, removed, resent, "forced release");
        Ok(removed)
    }

    async fn inspect(&self, key: &LockKey) -> Result<Option<HolderInfo>> {
        const OP: &str = "inspect";
        self.ensure_table().await?;
        let row = self
            .fetch_idempotent(
                || sqlx::query(self.sql().inspect.clone()).bind(key.as_str()),
                self.request_deadline(),
            )
            .await
            .map_err(|e| match e {
                // A read changes nothing: an unknown outcome is just an unreachable server.
                ExecError::Unknown { message, .. } => Error::Unavailable {
                    backend: BACKEND,
                    op: OP,
                    message,
                    source: None,
                },
                e => exec_error(OP, key, e),
            })?;
        let Some(row) = row else {
            return Ok(None);
        };
        let owner: String = row.try_get(0).map_err(|e| Error::backend(BACKEND, OP, e))?;
        let fence = {
            let fence: i64 = row.try_get(1).map_err(|e| Error::backend(BACKEND, OP, e))?;
            u64::try_from(fence).ok().map(FencingToken)
        };
        let remaining: i64 = row.try_get(2).map_err(|e| Error::backend(BACKEND, OP, e))?;
        let waiters: i64 = row.try_get(3).map_err(|e| Error::backend(BACKEND, OP, e))?;
        let holder: Option<String> = row.try_get(4).map_err(|e| Error::backend(BACKEND, OP, e))?;
        Ok(Some(HolderInfo {
            token_digest: OwnershipToken::from_hex(&owner).ok().map(|t| t.digest()),
            fencing_token: fence,
            ttl_remaining: Some(Duration::from_micros(u64::try_from(remaining).unwrap_or(0))),
            // Queued (listening) waiters only; polling ones are not counted.
            waiters: usize::try_from(waiters).ok(),
            holder: holder.and_then(|h| HolderIdentity::from_stored(h.as_bytes())),
        }))
    }
}

pub(crate) fn lease_fence(lease: &Lease, op: &'static str) -> Result<i64> {
    lease
        .fencing_token()
        .and_then(|f| i64::try_from(f.get()).ok())
        .ok_or_else(|| {
            Error::backend(
                BACKEND,
                op,
                "the lease has no PostgreSQL fencing token (was it granted by another backend?)",
            )
        })
}

/// Undoes a grant whose `try_acquire` future was dropped while the statement was in flight,
/// so a cancelled `acquire` leaves no lock behind (it would otherwise block others for a TTL).
struct UndoOnDrop {
    inner: Option<Arc<Inner>>,
    key: LockKey,
    token: OwnershipToken,
    until: Instant,
}

impl UndoOnDrop {
    /// The outcome is known (or undone): nothing to do on drop.
    fn disarm(&mut self) {
        self.inner = None;
    }
}

impl Drop for UndoOnDrop {
    fn drop(&mut self) {
        if let Some(inner) = self.inner.take() {
            inner.undo_in_background(self.key.clone(), self.token, self.until);
        }
    }
}

#[async_trait]
impl Driver for PgLock {
    fn backend_name(&self) -> &'static str {
        BACKEND
    }

    fn capabilities(&self) -> Capabilities {
        // A renewal sets `expires_at` to the server's clock + any TTL, and a row that nobody
        // renews expires on its own (PostgreSQL intervals go much further than the year of
        // `max_ttl`).
        Capabilities {
            wait_notify: self.inner.config.listen,
            // Needs the table's holder columns: on an older table this role may not alter,
            // `relabel` answers `Unsupported` (before any I/O).
            relabel: true,
            ..server_expired_lease(FencingGuarantee::SingleNode)
        }
    }

    /// One bare upsert, the cheapest grant: when another acquire of the key is in progress, it
    /// waits on the row for its outcome rather than answer `None` while the lock may turn out
    /// free.
    async fn try_acquire(&self, key: &LockKey, ttl: Duration) -> Result<Option<Lease>> {
        let limit = self.inner.request_deadline();
        match self.inner.attempt(key, ttl, Mode::Try, limit).await? {
            Attempt::Granted(lease) => Ok(Some(lease)),
            Attempt::Held { .. } | Attempt::Lost => Ok(None),
        }
    }

    /// Looks once (a read when the lock is held); when held, subscribes to notifications on the
    /// client's shared `LISTEN` connection and queues in the lock row, then waits for a
    /// notification, for the holder's lease to run out (each attempt returns its remaining
    /// time), or for a fallback delay of about `poll_interval`, trying again after each (an
    /// attempt of a queued waiter also refreshes its entry, keeping its place).
    ///
    /// A release hands the lock **directly** to the first live waiter of the queue, in the same
    /// statement, and notifies only that waiter, which takes the grant without another attempt
    /// and renews it to its TTL (one statement) before returning it; when its latest attempt
    /// was sent more than a quarter of the TTL ago, an attempt confirms and extends it. So
    /// waiters take the lock in the order they queued, barring a `try_acquire` or a newly
    /// arriving `acquire` that gets there first while the lock is free. A waiter that misses
    /// the notification (connection trouble) finds the grant on its next attempt. A waiter that
    /// gives up leaves the queue, and frees a grant that crossed its leaving.
    ///
    /// A direct grant gives the entry's short first lease (1.5 s at most,
    /// `queue::HANDOFF_LEASE`), which the waiter renews to its TTL before `acquire` returns. A
    /// waiter that **crashed** (or hangs) after queueing may still be granted the lock by a
    /// release until its entry lapses (two poll intervals after its last attempt); it then
    /// holds the lock for that first lease only, not for the TTL it asked for.
    ///
    /// With `listen=false`, beyond 256 queued waiters, or while the `LISTEN` connection is
    /// down, waiters poll instead: from 10 ms backing off to `poll_interval`, or about once
    /// per `poll_interval` for a waiter that was queued before.
    ///
    /// # Cancellation safety
    /// Dropping the future leaves the queue in the background (freeing a grant made to this
    /// waiter, if any); a grant in flight at that moment is undone in the background.
    async fn acquire(&self, key: &LockKey, ttl: Duration, deadline: Instant) -> Result<Lease> {
        let poll = self.inner.config.poll_interval;
        loop {
            let mut wait =
                AcquireWait::new(key, deadline, Backoff::new(Duration::from_millis(10), poll))?;
            let mut waiter = QueueWaiter::new(self, Asked { key, ttl, deadline });
            let mut lease =
                handoff::acquire_queued(&mut waiter, &mut wait, Backoff::new(poll, poll)).await?;
            drop(waiter);
            if lease.ttl() >= ttl {
                return Ok(lease);
            }
            // A release's direct grant, taken from its notification: the release gave it only
            // the entry's short first lease (`queue::HANDOFF_LEASE`), so that a waiter that died
            // before it could take it blocks the lock that long at most. Confirmed here — one
            // renewal to `ttl`, counted from its sending — before the caller sees it.
            // Dropped meanwhile, or unconfirmed, the grant is released (handed on) in the
            // background, until it would have expired even if the renewal applied.
            let mut undo = UndoOnDrop {
                inner: Some(self.inner.clone()),
                key: key.clone(),
                token: *lease.token(),
                until: self.inner.undo_until(Instant::now(), ttl),
            };
            match self.inner.renew(&mut lease, ttl).await {
                Ok(()) => {
                    undo.disarm();
                    return Ok(lease);
                }
                Err(e) => {
                    // Gone (expired or force-released first), or unconfirmed: released by the
                    // undo and, while the deadline allows, the wait starts again.
                    tracing::debug!(%key, error = %e, "a direct grant could not be confirmed; waiting again");
                    drop(undo);
                    if Instant::now() >= deadline {
                        return Err(wait.timeout());
                    }
                }
            }
        }
    }

    async fn renew(&self, lease: &mut Lease, ttl: Duration) -> Result<()> {
        self.inner.renew(lease, ttl).await
    }

    async fn release(&self, lease: &Lease) -> Result<bool> {
        self.inner.release(lease).await
    }

    async fn inspect(&self, key: &LockKey) -> Result<Option<HolderInfo>> {
        self.inner.inspect(key).await
    }

    /// Frees `key` whoever holds it (the runbook's manual delete) and wakes its waiters. The
    /// fence is kept, so the next grant still gets a higher token; the removed holder's next
    /// renewal fails with `NotHeld`.
    ///
    /// Two statements: the current grant's fence is read, then only that grant is removed (as
    /// [`Driver::force_release_grant`]), so re-sending the second after a lost reply
    /// can never remove the grant the first run handed to the next waiter. A grant made
    /// between the two is left alone (`Ok(false)`).
    /// An `UPDATE` of the row's holder identity guarded by name, owner token and fence (and a
    /// live lease), as a release is; re-sent after a lost reply (it is idempotent).
    async fn relabel(&self, lease: &Lease, holder: &HolderIdentity) -> Result<()> {
        const OP: &str = "relabel";
        let key = lease.key();
        let Some(sql) = self.inner.sql().relabel.clone() else {
            return Err(Error::unsupported(
                BACKEND,
                "relabel (the lease table has no holder columns and this role may not add them)",
            ));
        };
        let fence = lease_fence(lease, OP)?;
        let hex = lease.token().expose_hex();
        let limit = self.inner.request_deadline();
        let row = self
            .inner
            .fetch_idempotent(
                || {
                    sqlx::query(sql.clone())
                        .bind(key.as_str())
                        .bind(hex.clone())
                        .bind(fence)
                        .bind(holder.as_str())
                },
                limit,
            )
            .await
            .map_err(|e| exec_error(OP, key, e))?;
        match row {
            Some(_) => Ok(()),
            None => Err(Error::not_held(key)),
        }
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool> {
        self.inner.force_release(key, None).await
    }

    /// Pushed: an operator's force-release notifies the grant it removed on
    /// `wake::LOST_CHANNEL`, which the client's `LISTEN` connection hears; the holder then reads
    /// the row, and only when it is no longer this grant (another owner or fence, or free) is
    /// the lease lost — a forged or stale notification (the row still ours) is ignored, and so
    /// is a read that fails (the renewals decide then). With `listen=false`, and for anything
    /// else (an expiry, a failover or restore that lost the grant), the renewals and the local
    /// deadline find the loss.
    fn watch_lost(
        &self,
        lease: &Lease,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = LossReason> + Send + 'static>> {
        if !self.inner.config.listen {
            return Box::pin(std::future::pending());
        }
        let (lock, lease) = (self.clone(), lease.clone());
        Box::pin(async move {
            let Some(fence) = lease
                .fencing_token()
                .and_then(|f| i64::try_from(f.get()).ok())
            else {
                return std::future::pending().await;
            };
            let watch = lock
                .notifier()
                .watch_lost(lease.key().as_str(), fence)
                .await;
            let mine = lease.token().digest();
            loop {
                watch.announced().await;
                match lock.inner.inspect(lease.key()).await {
                    Ok(Some(info))
                        if info.token_digest == Some(mine)
                            && info.fencing_token == lease.fencing_token() =>
                    {
                        tracing::debug!(key = %lease.key(), "a force-release notification named this grant, which still holds; ignored");
                    }
                    Ok(_) => {
                        tracing::warn!(key = %lease.key(), %fence, "the lock was force-released: lease lost");
                        return LossReason::Revoked;
                    }
                    Err(e) => {
                        tracing::debug!(key = %lease.key(), error = %e, "cannot read the lock after a force-release notification; renewals will tell");
                    }
                }
            }
        })
    }

    /// As `force_release`, only while the holder is the grant with fencing token `holder` (one
    /// statement: the row's fence is part of its `WHERE`).
    async fn force_release_grant(&self, key: &LockKey, holder: FencingToken) -> Result<bool> {
        self.inner.force_release(key, Some(holder)).await
    }
}

impl fmt::Debug for PgLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgLock")
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn duration() -> impl proptest::strategy::Strategy<Value = Duration> {
        use proptest::prelude::*;
        prop_oneof![
            Just(Duration::ZERO),
            Just(Duration::MAX),
            (0u64..5_000).prop_map(Duration::from_millis),
            (any::<u64>(), 0u32..1_000_000_000).prop_map(|(s, n)| Duration::new(s, n)),
        ]
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

        /// Whatever the fields hold (set directly, not through the URL): a typed error or a
        /// lock whose deadlines, queue lifetimes and acquire never panic.
        #[test]
        fn any_config_fields_give_a_typed_error_or_a_working_lock(
            pool_size in proptest::prelude::any::<u32>(),
            connect_timeout in duration(),
            timeout in duration(),
            poll_interval in duration(),
            ttl in duration(),
            label in proptest::option::of("[a-z]{0,3}[ \n.@]?[a-z0-9]{0,66}"),
        ) {
            let mut config =
                PgLockConfig::from_url("postgres://postgres@127.0.0.1:1/db?table=t").unwrap();
            config.label = label;
            config.pool_size = pool_size;
            config.connect_timeout = connect_timeout;
            config.timeout = timeout;
            config.poll_interval = poll_interval;
            let valid = config.validate();
            let lock = match PgLock::connect_lazy(config) {
                Ok(lock) => lock,
                Err(e) => {
                    proptest::prop_assert!(matches!(e, Error::Config(_)), "{e}");
                    proptest::prop_assert!(valid.is_err());
                    return Ok(());
                }
            };
            proptest::prop_assert!(valid.is_ok());
            let inner = &lock.inner;
            proptest::prop_assert!(inner.queue_entry_lifetime_ms() >= 100);
            let now = Instant::now();
            proptest::prop_assert!(inner.request_deadline() >= now);
            proptest::prop_assert!(inner.undo_until(now, ttl) >= now);
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            let key = LockKey::new("props").unwrap();
            let res = rt.block_on(async {
                let deadline = Instant::now() + Duration::from_millis(20);
                lock.acquire(&key, ttl, deadline).await
            });
            // Nothing listens on port 1: a typed error, whatever the TTL.
            proptest::prop_assert!(res.is_err());
        }
    }
}

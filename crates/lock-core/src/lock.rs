//! The object-safe trait every backend implements.

use std::{fmt, sync::Arc, time::Duration};

use async_trait::async_trait;
use futures::{future::BoxFuture, stream::BoxStream};
use tokio::time::Instant;

use crate::{
    Capabilities, FencingToken, HolderIdentity, HolderInfo, Lease, LockKey, Result,
    raw::{AcquireWait, Backoff},
};

/// A distributed lock service: one coordinator client that can lock any number of keys.
///
/// The trait keeps the primitive operations; conveniences (builders, guards with a watchdog,
/// `run_exclusive`) live in [`crate::DistributedLockExt`]. Nobody implements it by hand: a
/// driver implements [`crate::raw::Driver`], and every driver gets this trait from the check
/// layer, which refuses bad input and missing capabilities before the driver runs (sealed, so
/// that no implementation can skip it). Drivers never panic on server errors or disconnects,
/// and never delete or extend a lease that belongs to another token.
///
/// ```
/// use std::time::Duration;
/// use lock_core::{DistributedLock, InMemoryLock, LockKey};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> lock_core::Result<()> {
/// let coordinator = InMemoryLock::new();
/// let key = LockKey::new("refund/order-42")?;
/// let lease = coordinator
///     .try_acquire(&key, Duration::from_secs(10))
///     .await?
///     .expect("nobody else holds it");
/// // A second attempt while held is refused, not queued.
/// assert!(coordinator.try_acquire(&key, Duration::from_secs(10)).await?.is_none());
/// // Bad input is refused before any I/O.
/// assert!(coordinator.try_acquire(&key, Duration::ZERO).await.is_err());
/// assert!(coordinator.release(&lease).await?);
/// # Ok(()) }
/// ```
#[async_trait]
pub trait DistributedLock: sealed::Sealed + Send + Sync + fmt::Debug + 'static {
    /// A short backend name for errors and metric labels (`"redis"`, `"memory"`, …).
    fn backend_name(&self) -> &'static str;

    /// What this backend promises. Constant for the lifetime of the client.
    fn capabilities(&self) -> Capabilities;

    /// One attempt to take `key` for `ttl`.
    ///
    /// # Behavior
    /// `Ok(Some(lease))` with a fresh ownership token (and a fencing token where the backend
    /// mints them) when the key was free; `Ok(None)` when somebody else holds it.
    /// [`crate::Error::Indeterminate`] when the request was sent but its reply was lost; the
    /// driver has then already tried a compare-and-release of the attempt's token.
    ///
    /// # Errors
    /// [`crate::Error::InvalidTtl`] before any I/O; `Unavailable`, `Indeterminate`, `Backend`.
    async fn try_acquire(&self, key: &LockKey, ttl: Duration) -> Result<Option<Lease>>;

    /// Waits until `key` is acquired or `deadline` passes.
    ///
    /// # Behavior
    /// Without a queue on the coordinator, [`poll_acquire`] retries
    /// [`DistributedLock::try_acquire`] with bounded, jittered backoff and retries temporary
    /// errors while the deadline allows. Backends that can be woken by the
    /// coordinator (`wait_notify`) override it; FIFO backends (`fair_queue`) grant in arrival
    /// order.
    ///
    /// A deadline always allows one complete attempt (`flock -w 0`): when it is nearer than
    /// [`crate::raw::ONE_ATTEMPT_WINDOW`] — zero or already past included — the check layer
    /// makes one [`DistributedLock::try_acquire`] first, so a free key is taken whatever the
    /// deadline; the deadline decides only whether to wait after that. Against a coordinator
    /// that does not answer, that attempt is given up that window after the call (`Timeout`).
    ///
    /// # Errors
    /// [`crate::Error::Timeout`] at the deadline (for a deadline already past: right after the
    /// one attempt found the key held); the attempt's own errors;
    /// [`crate::Error::InvalidTtl`] before any I/O.
    ///
    /// # Cancellation safety
    /// Dropping the future while it waits leaves nothing behind that blocks other clients.
    async fn acquire(&self, key: &LockKey, ttl: Duration, deadline: Instant) -> Result<Lease>;

    /// Extends a lease we still hold to `ttl` from now.
    ///
    /// # Behavior
    /// Compare-and-renew: succeeds only while the coordinator still records this lease's
    /// ownership token. Updates the lease's local deadline. Requires `renew`.
    ///
    /// # Errors
    /// [`crate::Error::NotHeld`] when the lease expired or belongs to another token (the
    /// other holder's lease is never extended); [`crate::Error::Unsupported`] without `renew`.
    async fn renew(&self, lease: &mut Lease, ttl: Duration) -> Result<()>;

    /// Releases the lease iff it is still held by its token (compare-and-release).
    ///
    /// # Behavior
    /// `Ok(true)` when it was released, `Ok(false)` when it had already been lost; never
    /// deletes another holder's lock. Wakes waiters where `wait_notify` is claimed.
    async fn release(&self, lease: &Lease) -> Result<bool>;

    /// Who holds `key` now, as far as the coordinator knows. `Ok(None)` when it is free.
    async fn inspect(&self, key: &LockKey) -> Result<Option<HolderInfo>>;

    /// Operator override (the runbook's manual delete): removes whoever holds `key`, regardless
    /// of their token. `Ok(true)` when a holder was removed.
    ///
    /// # Behavior
    /// The removed holder learns of it through its next renewal or the backend's loss report;
    /// its fencing token is stale from then on, but a paused holder may still write with it —
    /// only resource-side fencing stops that. Requires `force_release`: `Unsupported` without.
    async fn force_release(&self, key: &LockKey) -> Result<bool>;

    /// [`DistributedLock::force_release`] of one grant: removes the holder of `key` only while
    /// it is the grant with fencing token `holder` (as [`DistributedLock::inspect`] showed it),
    /// in one atomic step on the coordinator — so an operator who confirmed what `inspect`
    /// showed never removes a holder that took over in between. `Ok(false)` when the lock is
    /// free or held by another grant.
    ///
    /// # Behavior
    /// As `force_release`. Requires `force_release`: `Unsupported` without.
    async fn force_release_grant(&self, key: &LockKey, holder: FencingToken) -> Result<bool>;

    /// A future that completes when the coordinator itself reports that `lease` is gone
    /// (lease revoked, node deleted, session expired) without waiting for a renewal.
    ///
    /// # Behavior
    /// Backends that learn of a loss only through renewals return a future that never
    /// completes; the guard's watchdog and local deadline still detect the loss.
    fn watch_lost(&self, lease: &Lease) -> BoxFuture<'static, crate::LossReason>;

    /// The [`RenewalGroup`](crate::raw::RenewalGroup) `lease` belongs to, when the backend
    /// renews many leases with one request (etcd: the session lease its entry is attached to;
    /// ZooKeeper: its session). A guard whose lease has one is renewed by the group's renewal
    /// alone: a tick of any number of such guards costs one request.
    ///
    /// # Behavior
    /// `None` for backends whose renewals are per lease, and without `renew`.
    fn renewal_group(&self, lease: &Lease) -> Option<crate::raw::SharedGroup>;

    /// Job mode ([`crate::LockOptions::at_least`]), right after a grant and before its job
    /// starts: makes the coordinator hold `lease`'s grant until at least `at_least` from now by
    /// its own clock, even if this process dies at once. Where the grant's TTL is the lease
    /// (every backend but ZooKeeper), the grant — asked for with a TTL of at least `at_least` —
    /// already does, and this sends nothing.
    ///
    /// # Errors
    /// [`crate::Error::Unsupported`] without [`Capabilities::keep_until`], before any I/O; the
    /// backend's errors (the grant then may or may not be held that long: release it).
    async fn hold_at_least(&self, lease: &Lease, at_least: Duration) -> Result<()>;

    /// Job mode's release before `at_least` has passed: instead of releasing, the coordinator
    /// keeps `lease`'s grant for `left` more (at least the backend's `min_ttl`) with nobody
    /// renewing it, and frees it by itself — even if this process dies. `Ok(true)`: kept;
    /// `Ok(false)`: it was already lost.
    ///
    /// # Errors
    /// [`crate::Error::Unsupported`] without [`Capabilities::keep_until`], before any I/O; the
    /// backend's errors.
    async fn keep(&self, lease: &mut Lease, left: Duration) -> Result<bool>;

    /// Replaces the holder identity recorded beside `lease`'s grant with `holder` while that
    /// grant still holds the lock (compare on the grant, never a blind write): what
    /// [`crate::Leadership::proclaim`] does.
    ///
    /// # Errors
    /// [`crate::Error::Unsupported`] without [`Capabilities::relabel`], before any I/O;
    /// [`crate::Error::NotHeld`] when the grant no longer holds it (nothing changed);
    /// [`crate::Error::Indeterminate`] when the reply was lost.
    async fn relabel(&self, lease: &Lease, holder: &HolderIdentity) -> Result<()>;

    /// Pushes that the holder of `key` may have changed; `None` when the backend cannot watch
    /// (see [`crate::raw::Driver::watch_holder`]).
    fn watch_holder(&self, key: &LockKey) -> Option<BoxStream<'static, ()>>;
}

/// Seals [`DistributedLock`]: only the check layer implements it.
mod sealed {
    pub trait Sealed {}
    impl<T: crate::raw::Driver + ?Sized> Sealed for T {}
}

/// A shared, type-erased lock client.
pub type DynLock = Arc<dyn DistributedLock>;

/// The default `acquire`: bounded jittered polling of `try_acquire` until `deadline`.
///
/// # Errors
/// See [`DistributedLock::acquire`].
pub async fn poll_acquire<L: DistributedLock + ?Sized>(
    lock: &L,
    key: &LockKey,
    ttl: Duration,
    deadline: Instant,
) -> Result<Lease> {
    lock.capabilities().check_ttl(ttl)?;
    let mut wait = AcquireWait::new(key, deadline, Backoff::default())?;
    loop {
        match lock.try_acquire(key, ttl).await {
            Ok(Some(lease)) if lease.is_locally_valid() => return Ok(lease),
            Ok(Some(late)) => {
                // The reply came after the lease's local deadline: it is worth nothing to us,
                // and the coordinator may already grant it to someone else. Give it back.
                tracing::warn!(%key, "a grant arrived after its local deadline; releasing it and trying again");
                let _ = tokio::time::timeout_at(deadline, lock.release(&late)).await;
                wait.retry_after(crate::Error::Unavailable {
                    backend: lock.backend_name(),
                    op: "acquire",
                    message: "the grant arrived after its local deadline".into(),
                    source: None,
                })
                .await?;
            }
            Ok(None) => wait.wait(std::future::pending()).await?,
            Err(e) => wait.retry_after(e).await?,
        }
    }
}

/// Why a guard stopped trusting its lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LossReason {
    /// A renewal was refused: the coordinator no longer records our token.
    NotHeld,
    /// The local deadline passed without a successful renewal (coordinator unreachable or slow).
    DeadlinePassed,
    /// The coordinator reported the lease revoked or our entry deleted.
    Revoked,
    /// The client's session with the coordinator expired.
    SessionExpired,
    /// A renewal failed with a permanent error.
    RenewFailed,
    /// Job mode's [`crate::LockOptions::at_most`] passed: the guard stopped renewing.
    HeldTooLong,
}

impl fmt::Display for LossReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LossReason::NotHeld => "renewal refused: not held",
            LossReason::DeadlinePassed => "local deadline passed without renewal",
            LossReason::Revoked => "revoked by the coordinator",
            LossReason::SessionExpired => "session expired",
            LossReason::RenewFailed => "renewal failed",
            LossReason::HeldTooLong => "held for its at_most limit",
        })
    }
}

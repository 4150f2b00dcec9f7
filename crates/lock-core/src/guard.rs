//! A held lock with its watchdog and lost-ownership signal.

use std::{fmt, sync::Arc, time::Duration};

use tokio::{sync::oneshot, time::Instant};
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

use crate::{
    DynLock, FencingToken, Lease, LockKey, LossReason, Result, TokenDigest,
    renewer::{self, NewSlot, Scheduler, SlotRef, Status, Taken, mark_lost},
};

/// A held lock. Created by [`crate::LockBuilder`]; keeps the lease alive with a watchdog and
/// signals [`LockGuard::lost`] as soon as ownership can no longer be trusted.
///
/// `lost()` fires when a renewal is refused or fails permanently, when the conservative local
/// deadline passes without a successful renewal (temporary errors are retried until then), or
/// when the backend reports the lease gone. Call [`LockGuard::release`] to release explicitly;
/// dropping the guard stops the watchdog and releases best-effort in the background (the TTL is
/// the last resort).
///
/// ```
/// use std::{sync::Arc, time::Duration};
/// use lock_core::{DistributedLockExt, InMemoryLock};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> lock_core::Result<()> {
/// let coordinator = Arc::new(InMemoryLock::new());
/// let guard = coordinator
///     .lock("nightly-export")
///     .ttl(Duration::from_secs(10))
///     .acquire()
///     .await?;
/// let fence = guard.fencing_token(); // hand this to the resource with every write
/// assert!(fence.is_some());
/// tokio::select! {
///     // Stop the work the moment ownership can no longer be trusted.
///     () = guard.lost() => eprintln!("lost the lock: {:?}", guard.loss_reason()),
///     () = async { /* the protected work */ } => {}
/// }
/// if !guard.is_lost() {
///     assert!(guard.release().await?);
/// }
/// # Ok(()) }
/// ```
pub struct LockGuard {
    granted: Lease,
    status: Arc<Status>,
    /// The guard's slot in its client's renewal scheduler; `None` once released.
    slot: Option<(Arc<Scheduler>, SlotRef)>,
    /// Job mode's `at_least`: a release before this renews the lease to end then instead.
    keep_until: Option<Instant>,
}

/// Job mode ([`crate::LockOptions::at_least`], [`crate::LockOptions::at_most`]). Each counts
/// from the end of the grant that makes it safe: `at_most` from the lease's `acquired_at` (no
/// later than the coordinator's grant, so the lock is never renewed past grant + `at_most`),
/// `at_least` from the guard's start (no earlier than the grant, so the lock is never given up
/// before grant + `at_least` — on ZooKeeper a lease's `acquired_at` is the session's vouched
/// send time, which can be seconds before the grant).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct JobLimits {
    pub(crate) at_least: Option<Duration>,
    pub(crate) at_most: Option<Duration>,
}

/// What a job needs to know about its guard's loss: the signal and the current local deadline.
/// `is_lost()` is true from the moment the deadline passes, even before the scheduler has run
/// to cancel the token (a starved runtime, a lease that arrived already expired).
#[derive(Clone, Debug)]
pub(crate) struct LossView {
    lost: CancellationToken,
    status: Arc<Status>,
}

impl LossView {
    pub(crate) fn is_lost(&self) -> bool {
        self.lost.is_cancelled()
            || self.status.is_marked_lost()
            || Instant::now() >= self.status.deadline()
    }

    pub(crate) fn token(&self) -> &CancellationToken {
        &self.lost
    }
}

impl LockGuard {
    /// Starts supervising `lease`: renews every `watchdog` interval (none: only the local
    /// deadline and the backend's loss reports are watched), as a slot of `lock`'s renewal
    /// scheduler (see `renewer.rs`).
    ///
    /// A lease whose local deadline has already passed (its reply arrived late) gives a guard
    /// that is lost from the start: `is_lost()` is true and `lost()` complete before the caller
    /// sees it, so no job starts on it.
    pub(crate) fn start(
        lock: DynLock,
        lease: Lease,
        watchdog: Option<Duration>,
        limits: JobLimits,
    ) -> Self {
        let status = Arc::new(Status::new(lease.local_deadline()));
        if !lease.is_locally_valid() {
            mark_lost(
                &status,
                lock.backend_name(),
                &lease,
                LossReason::DeadlinePassed,
            );
        }
        let renew_until = limits
            .at_most
            .and_then(|d| lease.acquired_at().checked_add(d));
        let keep_until = limits.at_least.and_then(|d| Instant::now().checked_add(d));
        let scheduler = renewer::for_lock(&lock);
        let slot = scheduler.register(NewSlot {
            lease: lease.clone(),
            status: status.clone(),
            interval: watchdog,
            renew_until,
        });
        Self {
            granted: lease,
            status,
            slot: Some((scheduler, slot)),
            keep_until,
        }
    }

    /// The lease as granted (its local deadline is not updated by renewals: see
    /// [`LockGuard::local_deadline`]). For runbooks and fault-injection tests.
    pub fn granted_lease(&self) -> &Lease {
        &self.granted
    }

    /// The lock key.
    pub fn key(&self) -> &LockKey {
        self.granted.key()
    }

    /// The fencing token of this grant, if the backend mints them. Pass it to the protected
    /// resource with every write.
    pub fn fencing_token(&self) -> Option<FencingToken> {
        self.granted.fencing_token()
    }

    /// A loggable digest of the ownership token.
    pub fn token_digest(&self) -> TokenDigest {
        self.granted.token().digest()
    }

    /// The TTL the lease was granted with.
    pub fn ttl(&self) -> Duration {
        self.granted.ttl()
    }

    /// The current conservative local deadline (moves forward with each renewal).
    pub fn local_deadline(&self) -> Instant {
        self.status.deadline()
    }

    /// How many renewals have succeeded.
    pub fn renewals(&self) -> u64 {
        self.status.renewals()
    }

    /// `true` once ownership can no longer be trusted: `lost()` fired, or the local deadline
    /// has passed (even if the watchdog has not yet run to say so).
    pub fn is_lost(&self) -> bool {
        self.status.is_marked_lost() || Instant::now() >= self.status.deadline()
    }

    /// Why ownership was lost, once it was.
    pub fn loss_reason(&self) -> Option<LossReason> {
        self.status.reason().or_else(|| {
            (Instant::now() >= self.local_deadline()).then_some(LossReason::DeadlinePassed)
        })
    }

    pub(crate) fn loss_view(&self) -> LossView {
        LossView {
            lost: self.status.lost_token().child_token(),
            status: self.status.clone(),
        }
    }

    /// Completes when ownership is lost. Never completes after a clean release.
    pub fn lost(&self) -> WaitForCancellationFutureOwned {
        self.status.lost_token().cancelled_owned()
    }

    /// A token cancelled when ownership is lost, for handing to spawned work. Cancelling it
    /// yourself does not affect the guard.
    pub fn lost_token(&self) -> CancellationToken {
        self.status.lost_token().child_token()
    }

    /// Stops the watchdog and releases the lease iff it is still ours.
    ///
    /// # Errors
    /// The backend's error; the lease then expires by its TTL.
    pub async fn release(mut self) -> Result<bool> {
        let Some(mut pending) = self.stop() else {
            return Ok(false);
        };
        // Cancellation safe: if this future is dropped before the release is done, the
        // pending release finishes in the background, as a dropped guard's does.
        pending.finish().await
    }

    /// Takes the guard's slot out of its scheduler (no renewal starts after this; one in
    /// flight is dropped) and hands its lease to a release.
    fn stop(&mut self) -> Option<PendingRelease> {
        let (scheduler, slot) = self.slot.take()?;
        let stage = match scheduler.take(slot)? {
            Taken::Lease(lease) => Stage::Releasing(lease),
            Taken::Died(rx, lease) => Stage::Died(rx, lease),
        };
        Some(PendingRelease {
            lock: scheduler.client().clone(),
            stage: Some(stage),
            background: false,
            keep_until: self.keep_until,
        })
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        // Dropping it hands the release to the background.
        drop(self.stop());
    }
}

/// A guard's release in progress: the compare-and-release of the lease its slot handed back
/// (or the wait for the release its dying slot started). Dropped unfinished (the guard dropped,
/// or `release()`'s future dropped at any await), it finishes in the background
/// ([`crate::raw::cleanup::spawn`]), so a lock is never left held until its TTL — or, on
/// ZooKeeper, for as long as the session lives — by a release that was cancelled.
struct PendingRelease {
    lock: DynLock,
    stage: Option<Stage>,
    /// Already the background task: dropped unfinished (its runtime shutting down), it gives up
    /// instead of spawning itself again.
    background: bool,
    /// Job mode's `at_least`: before this, the lease is kept until then instead of released.
    keep_until: Option<Instant>,
}

enum Stage {
    /// The slot died (a panic in a driver's future) and started releasing this lease: its
    /// answer; failing that, the lease itself (its token still names our grant, so a
    /// compare-and-release of it is still right).
    Died(Option<oneshot::Receiver<Result<bool>>>, Lease),
    Releasing(Lease),
}

impl PendingRelease {
    fn key(&self) -> Option<&LockKey> {
        match self.stage.as_ref()? {
            Stage::Died(_, lease) | Stage::Releasing(lease) => Some(lease.key()),
        }
    }

    async fn finish(&mut self) -> Result<bool> {
        if let Some(Stage::Died(rx, lease)) = &mut self.stage {
            tracing::error!(key = %lease.key(), "lock watchdog failed");
            if let Some(rx) = rx
                && let Ok(result) = rx.await
            {
                self.stage = None;
                return result;
            }
            let lease = lease.clone();
            self.stage = Some(Stage::Releasing(lease));
        }
        let result = match &self.stage {
            Some(Stage::Releasing(lease)) => match self.keep_until {
                Some(until) if Instant::now() < until => {
                    keep_until(&self.lock, lease.clone(), until).await
                }
                _ => self.lock.release(lease).await,
            },
            _ => Ok(false),
        };
        self.stage = None;
        result
    }
}

/// Job mode's release before `at_least` has passed: the coordinator keeps the grant until
/// `until` ([`DistributedLock::keep`]: on most backends a renew to what is left, at least the
/// minimum TTL) and frees it by itself — nobody renews it any more, and it holds even if this
/// process dies. `Ok(true)`: kept; `Ok(false)`: it was already lost.
async fn keep_until(lock: &DynLock, mut lease: Lease, until: Instant) -> Result<bool> {
    let left = until.saturating_duration_since(Instant::now());
    let kept = lock.keep(&mut lease, left).await?;
    if kept {
        tracing::debug!(key = %lease.key(), ?left, "kept until at_least instead of released");
    }
    Ok(kept)
}

impl Drop for PendingRelease {
    fn drop(&mut self) {
        if self.background {
            return;
        }
        let Some(key) = self.key().cloned() else {
            return;
        };
        let mut rest = PendingRelease {
            lock: self.lock.clone(),
            stage: self.stage.take(),
            background: true,
            keep_until: self.keep_until,
        };
        let key2 = key.clone();
        let spawned = crate::raw::cleanup::spawn(async move {
            if let Err(e) = rest.finish().await {
                tracing::warn!(key = %key2, error = %e, "best-effort release in the background failed; the lease will expire by its ttl");
            }
        });
        if !spawned {
            tracing::warn!(%key, "lock guard released outside a runtime; the lease will expire by its ttl");
        }
    }
}

impl fmt::Debug for LockGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockGuard")
            .field("key", self.key())
            .field("token", &self.token_digest())
            .field("fencing", &self.fencing_token())
            .field("ttl", &self.ttl())
            .field("lost", &self.is_lost())
            .finish_non_exhaustive()
    }
}

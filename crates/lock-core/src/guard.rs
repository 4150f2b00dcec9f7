//! A held lock with its watchdog and lost-ownership signal.

use std::{
    fmt,
    sync::{Arc, Mutex, OnceLock, PoisonError},
    time::Duration,
};

use tokio::{
    sync::oneshot,
    task::JoinHandle,
    time::{Instant, sleep_until, timeout_at},
};
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

use crate::{
    DynLock, Error, FencingToken, Lease, LockKey, LossReason, Result, TokenDigest, raw::Backoff,
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
    lock: DynLock,
    granted: Lease,
    key: LockKey,
    digest: TokenDigest,
    fencing: Option<FencingToken>,
    ttl: Duration,
    shared: Arc<Shared>,
    lost: CancellationToken,
    stop: CancellationToken,
    task: Option<JoinHandle<Lease>>,
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

#[derive(Debug)]
pub(crate) struct Shared {
    deadline: Mutex<Instant>,
    reason: Mutex<Option<LossReason>>,
    renewals: Mutex<u64>,
    /// The lease as last renewed, so that `release()` can still release it when the watchdog
    /// task died (a panic in a driver's `renew`) and did not hand the lease back.
    latest: Mutex<Lease>,
    /// The result of the release a dying watchdog started (see [`DeathWatch`]).
    death_release: Mutex<Option<oneshot::Receiver<Result<bool>>>>,
}

/// What a job needs to know about its guard's loss: the signal and the current local deadline.
/// `is_lost()` is true from the moment the deadline passes, even before the watchdog task has
/// run to cancel the token (a starved runtime, a lease that arrived already expired).
#[derive(Clone, Debug)]
pub(crate) struct LossView {
    lost: CancellationToken,
    shared: Arc<Shared>,
}

impl LossView {
    pub(crate) fn is_lost(&self) -> bool {
        self.lost.is_cancelled() || Instant::now() >= locked(&self.shared.deadline)
    }

    pub(crate) fn token(&self) -> &CancellationToken {
        &self.lost
    }
}

/// Marks a guard lost once: records the reason and the metric, logs, cancels the token.
fn mark_lost(
    shared: &Shared,
    lost: &CancellationToken,
    backend: &'static str,
    lease: &Lease,
    reason: LossReason,
) {
    {
        let mut slot = shared.reason.lock().unwrap_or_else(PoisonError::into_inner);
        if slot.is_some() || lost.is_cancelled() {
            return;
        }
        *slot = Some(reason);
    }
    crate::observe::record_loss(backend, reason);
    tracing::warn!(key = %lease.key(), token = %lease.token(), fencing = ?lease.fencing_token(), %reason, "lock ownership lost");
    lost.cancel();
}

fn locked<T: Copy>(m: &Mutex<T>) -> T {
    *m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl LockGuard {
    /// Starts supervising `lease`: renews every `watchdog` interval (none: only the local
    /// deadline and the backend's loss reports are watched).
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
        let after_grant = |d: Duration| lease.acquired_at().checked_add(d);
        let shared = Arc::new(Shared {
            deadline: Mutex::new(lease.local_deadline()),
            reason: Mutex::new(None),
            renewals: Mutex::new(0),
            latest: Mutex::new(lease.clone()),
            death_release: Mutex::new(None),
        });
        let lost = CancellationToken::new();
        let stop = CancellationToken::new();
        if !lease.is_locally_valid() {
            mark_lost(
                &shared,
                &lost,
                lock.backend_name(),
                &lease,
                LossReason::DeadlinePassed,
            );
        }
        let supervisor = Supervisor {
            lock: lock.clone(),
            shared: shared.clone(),
            lost: lost.clone(),
            stop: stop.clone(),
            interval: watchdog,
            renew_until: limits.at_most.and_then(after_grant),
        };
        let keep_until = limits.at_least.and_then(|d| Instant::now().checked_add(d));
        let key = lease.key().clone();
        let digest = lease.token().digest();
        let fencing = lease.fencing_token();
        let ttl = lease.ttl();
        Self {
            granted: lease.clone(),
            task: Some(tokio::spawn(supervisor.run(lease))),
            lock,
            key,
            digest,
            fencing,
            ttl,
            shared,
            lost,
            stop,
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
        &self.key
    }

    /// The fencing token of this grant, if the backend mints them. Pass it to the protected
    /// resource with every write.
    pub fn fencing_token(&self) -> Option<FencingToken> {
        self.fencing
    }

    /// A loggable digest of the ownership token.
    pub fn token_digest(&self) -> TokenDigest {
        self.digest
    }

    /// The TTL the lease was granted with.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// The current conservative local deadline (moves forward with each renewal).
    pub fn local_deadline(&self) -> Instant {
        locked(&self.shared.deadline)
    }

    /// How many renewals have succeeded.
    pub fn renewals(&self) -> u64 {
        locked(&self.shared.renewals)
    }

    /// `true` once ownership can no longer be trusted: `lost()` fired, or the local deadline
    /// has passed (even if the watchdog task has not yet run to say so).
    pub fn is_lost(&self) -> bool {
        self.loss_view().is_lost()
    }

    /// Why ownership was lost, once it was.
    pub fn loss_reason(&self) -> Option<LossReason> {
        locked(&self.shared.reason).or_else(|| {
            (Instant::now() >= self.local_deadline()).then_some(LossReason::DeadlinePassed)
        })
    }

    pub(crate) fn loss_view(&self) -> LossView {
        LossView {
            lost: self.lost.child_token(),
            shared: self.shared.clone(),
        }
    }

    /// Completes when ownership is lost. Never completes after a clean release.
    pub fn lost(&self) -> WaitForCancellationFutureOwned {
        self.lost.clone().cancelled_owned()
    }

    /// A token cancelled when ownership is lost, for handing to spawned work. Cancelling it
    /// yourself does not affect the guard.
    pub fn lost_token(&self) -> CancellationToken {
        self.lost.child_token()
    }

    /// Stops the watchdog and releases the lease iff it is still ours.
    ///
    /// # Errors
    /// The backend's error; the lease then expires by its TTL.
    pub async fn release(mut self) -> Result<bool> {
        let Some(task) = self.task.take() else {
            return Ok(false);
        };
        self.stop.cancel();
        // Cancellation safe: if this future is dropped before the release is done, the
        // pending release finishes in the background, as a dropped guard's does.
        let mut pending = PendingRelease {
            lock: self.lock.clone(),
            key: self.key.clone(),
            shared: self.shared.clone(),
            stage: Some(Stage::Watchdog(task)),
            background: false,
            keep_until: self.keep_until,
        };
        pending.finish().await
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        let Some(task) = self.task.take() else {
            return;
        };
        self.stop.cancel();
        // Dropping it hands the release to the background.
        drop(PendingRelease {
            lock: self.lock.clone(),
            key: self.key.clone(),
            shared: self.shared.clone(),
            stage: Some(Stage::Watchdog(task)),
            background: false,
            keep_until: self.keep_until,
        });
    }
}

/// A guard's release in progress: stopping the watchdog, then the compare-and-release of the
/// lease it hands back. Dropped unfinished (the guard dropped, or `release()`'s future dropped
/// at any await), it finishes in the background ([`crate::raw::cleanup::spawn`]), so a lock is never
/// left held until its TTL — or, on ZooKeeper, for as long as the session lives — by a release
/// that was cancelled.
struct PendingRelease {
    lock: DynLock,
    key: LockKey,
    shared: Arc<Shared>,
    stage: Option<Stage>,
    /// Already the background task: dropped unfinished (its runtime shutting down), it gives up
    /// instead of spawning itself again.
    background: bool,
    /// Job mode's `at_least`: before this, the lease is kept until then instead of released.
    keep_until: Option<Instant>,
}

enum Stage {
    Watchdog(JoinHandle<Lease>),
    Releasing(Lease),
}

impl PendingRelease {
    async fn finish(&mut self) -> Result<bool> {
        if let Some(Stage::Watchdog(task)) = &mut self.stage {
            match finish_watchdog(task, &self.shared, &self.key).await {
                Handback::Lease(lease) => self.stage = Some(Stage::Releasing(lease)),
                Handback::Released(result) => {
                    self.stage = None;
                    return result;
                }
            }
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
        let Some(stage) = self.stage.take() else {
            return;
        };
        let mut rest = PendingRelease {
            lock: self.lock.clone(),
            key: self.key.clone(),
            shared: self.shared.clone(),
            stage: Some(stage),
            background: true,
            keep_until: self.keep_until,
        };
        let key = self.key.clone();
        let spawned = crate::raw::cleanup::spawn(async move {
            if let Err(e) = rest.finish().await {
                tracing::warn!(key = %rest.key, error = %e, "best-effort release in the background failed; the lease will expire by its ttl");
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
            .field("key", &self.key)
            .field("token", &self.digest)
            .field("fencing", &self.fencing)
            .field("ttl", &self.ttl)
            .field("lost", &self.is_lost())
            .finish_non_exhaustive()
    }
}

/// What the watchdog task hands back when it is stopped.
enum Handback {
    /// The lease as last renewed, still to be released.
    Lease(Lease),
    /// The watchdog died and its [`DeathWatch`] already released the lease: the result.
    Released(Result<bool>),
}

/// Waits for the watchdog task. When the task died (a panic in a driver), its [`DeathWatch`]
/// has started releasing the last renewed lease: that release's result; failing that, the
/// last renewed lease itself (its token still names our grant, so a compare-and-release of it
/// is still right).
async fn finish_watchdog(task: &mut JoinHandle<Lease>, shared: &Shared, key: &LockKey) -> Handback {
    match task.await {
        Ok(lease) => Handback::Lease(lease),
        Err(e) => {
            tracing::error!(%key, error = %e, "lock watchdog task failed");
            let started = shared
                .death_release
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take();
            if let Some(rx) = started
                && let Ok(result) = rx.await
            {
                return Handback::Released(result);
            }
            Handback::Lease(
                shared
                    .latest
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .clone(),
            )
        }
    }
}

/// When to renew next: `renewal_time(now, interval)`, but never so late that the renewal has
/// less than a quarter TTL (or, for a lease with less than that left, half of what is left)
/// to get through before the local deadline: a lease that started old (a direct grant counts
/// from its waiter's request) or an interval close to the TTL would otherwise renew only after
/// the deadline and be lost for nothing.
fn next_renewal(now: Instant, interval: Duration, deadline: Instant, ttl: Duration) -> Instant {
    let remaining = deadline.saturating_duration_since(now);
    let latest = (now + remaining / 2).max(deadline.checked_sub(ttl / 4).unwrap_or(now));
    renewal_time(now, interval).min(latest)
}

/// When to renew next: `interval` after `now`, moved *earlier* onto a process-wide grid of
/// `interval / 4`, so that every guard of the process with the same interval renews at the
/// same instants and a driver can batch them ([`crate::Batcher`]): a tick of any number of held
/// locks then costs a few round trips instead of one per lock. Renewing early is always safe;
/// the gap between renewals stays between ¾ and 1 interval.
fn renewal_time(now: Instant, interval: Duration) -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    let nominal = now + interval;
    let grid = interval / 4;
    let epoch = *EPOCH.get_or_init(Instant::now);
    let Some(since) = nominal.checked_duration_since(epoch) else {
        return nominal;
    };
    if grid.is_zero() {
        return nominal;
    }
    let aligned = since.as_nanos() - since.as_nanos() % grid.as_nanos();
    match u64::try_from(aligned) {
        Ok(nanos) => epoch + Duration::from_nanos(nanos),
        Err(_) => nominal,
    }
}

struct Supervisor {
    lock: DynLock,
    shared: Arc<Shared>,
    lost: CancellationToken,
    stop: CancellationToken,
    interval: Option<Duration>,
    /// Job mode's `at_most`: no renewal after this, and the guard is lost then.
    renew_until: Option<Instant>,
}

enum Step {
    Stop,
    Lost(LossReason),
    Renew,
}

/// Marks the guard lost if the supervisor ends any other way than by returning: its task
/// panicked (a driver bug in `renew`) or was dropped with its runtime. Nothing renews the lease
/// any more, so nobody may go on trusting it — and nobody gains by keeping it until its TTL
/// runs out, so it is released in the background at once (after `lost()` has fired: the
/// release task waits for the token, so no other client can be granted the key while this
/// guard still looks held).
struct DeathWatch<'a> {
    supervisor: &'a Supervisor,
    lease: Lease,
    armed: bool,
}

impl Drop for DeathWatch<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let s = self.supervisor;
        tracing::error!(key = %self.lease.key(), "the lock watchdog stopped unexpectedly; releasing the lease");
        let latest = s
            .shared
            .latest
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let (tx, rx) = oneshot::channel();
        let (lock, lost) = (s.lock.clone(), s.lost.clone());
        // Queued before the loss wakes anyone, so that on a single-threaded runtime the key is
        // free by the time a waiter on `lost()` looks.
        let spawned = crate::raw::cleanup::spawn(async move {
            lost.cancelled().await;
            let _ = tx.send(lock.release(&latest).await);
        });
        if spawned {
            *s.shared
                .death_release
                .lock()
                .unwrap_or_else(PoisonError::into_inner) = Some(rx);
        }
        mark_lost(
            &s.shared,
            &s.lost,
            s.lock.backend_name(),
            &self.lease,
            LossReason::RenewFailed,
        );
    }
}

impl Supervisor {
    async fn run(self, lease: Lease) -> Lease {
        let mut watch = DeathWatch {
            supervisor: &self,
            lease: lease.clone(),
            armed: true,
        };
        let lease = self.supervise(lease).await;
        watch.armed = false;
        lease
    }

    async fn supervise(&self, mut lease: Lease) -> Lease {
        let mut pushed = self.lock.watch_lost(&lease);
        let ttl0 = lease.ttl();
        let mut next_renew = self
            .interval
            .map(|i| next_renewal(Instant::now(), i, lease.local_deadline(), ttl0));
        let mut retry = self
            .interval
            .map(|i| Backoff::new(i / 8, i / 2))
            .unwrap_or_default();
        loop {
            let deadline = lease.local_deadline();
            let wake = next_renew.map_or(deadline, |t| t.min(deadline));
            let wake = self.renew_until.map_or(wake, |t| t.min(wake));
            let step = tokio::select! {
                biased;
                () = self.stop.cancelled() => Step::Stop,
                reason = &mut pushed => Step::Lost(reason),
                () = sleep_until(wake) => {
                    if Instant::now() >= deadline {
                        Step::Lost(LossReason::DeadlinePassed)
                    } else if self.renew_until.is_some_and(|t| Instant::now() >= t) {
                        Step::Lost(LossReason::HeldTooLong)
                    } else {
                        Step::Renew
                    }
                }
            };
            match step {
                Step::Stop => return lease,
                Step::Lost(reason) => {
                    self.mark_lost(&lease, reason);
                    return lease;
                }
                Step::Renew => {}
            }
            let ttl = lease.ttl();
            let outcome = tokio::select! {
                biased;
                () = self.stop.cancelled() => None,
                r = timeout_at(deadline, self.lock.renew(&mut lease, ttl)) => Some(r),
            };
            let interval = self.interval.unwrap_or(ttl / 3);
            match outcome {
                None => return lease,
                Some(Err(_elapsed)) => {
                    self.mark_lost(&lease, LossReason::DeadlinePassed);
                    return lease;
                }
                Some(Ok(Ok(()))) => {
                    *self
                        .shared
                        .latest
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner) = lease.clone();
                    *self
                        .shared
                        .deadline
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner) = lease.local_deadline();
                    *self
                        .shared
                        .renewals
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner) += 1;
                    retry.reset();
                    next_renew = Some(next_renewal(
                        Instant::now(),
                        interval,
                        lease.local_deadline(),
                        lease.ttl(),
                    ));
                }
                Some(Ok(Err(e))) if e.is_temporary() => {
                    tracing::warn!(key = %lease.key(), error = %e, "lease renewal failed; retrying until the local deadline");
                    next_renew = Some(Instant::now() + retry.next_delay());
                }
                Some(Ok(Err(e))) => {
                    let reason = if matches!(e, Error::NotHeld { .. }) {
                        LossReason::NotHeld
                    } else {
                        LossReason::RenewFailed
                    };
                    tracing::warn!(key = %lease.key(), error = %e, "lease renewal refused");
                    self.mark_lost(&lease, reason);
                    return lease;
                }
            }
        }
    }

    fn mark_lost(&self, lease: &Lease, reason: LossReason) {
        mark_lost(
            &self.shared,
            &self.lost,
            self.lock.backend_name(),
            lease,
            reason,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renewal_times_share_a_grid_and_are_never_late() {
        let interval = Duration::from_millis(2000);
        let base = Instant::now();
        let mut seen = std::collections::BTreeSet::new();
        for offset_ms in (0..2000).step_by(7) {
            let now = base + Duration::from_millis(offset_ms);
            let at = renewal_time(now, interval);
            assert!(at <= now + interval, "never later than one interval");
            assert!(at > now + interval * 3 / 4, "at most a quarter early");
            seen.insert(at);
        }
        // 2 s of acquisition times land on at most 5 distinct renewal instants.
        assert!(seen.len() <= 5, "{} distinct renewal times", seen.len());
    }
}

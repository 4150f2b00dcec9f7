//! Conveniences over any [`DistributedLock`]: the lock builder and `run_exclusive`.

use std::{future::Future, pin::Pin, sync::Arc, time::Duration};

use tokio::time::Instant;
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

use crate::{
    Capabilities, DistributedLock, DynLock, Error, FencingGuarantee, FencingToken, Lease,
    LockGuard, LockKey, Result, TokenDigest,
};

/// How often the guard renews.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Watchdog {
    /// Every ttl/3 when the backend supports `renew`; otherwise no renewals (the guard still
    /// watches the local deadline and the backend's loss reports).
    #[default]
    Auto,
    /// Every given interval (must be shorter than the TTL; needs `renew`).
    Every(Duration),
    /// Never renew: the lease lives for one TTL.
    Off,
}

/// Options for one acquisition.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LockOptions {
    /// Lease TTL (default 30 s).
    pub ttl: Duration,
    /// How long to wait for a held lock. `None` (default): do not wait — `run_exclusive` skips,
    /// [`LockBuilder::acquire`] waits [`LockOptions::DEFAULT_WAIT`].
    pub wait: Option<Duration>,
    /// Renewal policy.
    pub watchdog: Watchdog,
    /// The weakest fencing guarantee acceptable; a weaker backend fails with
    /// [`Error::Unsupported`] before any I/O.
    pub fencing: FencingGuarantee,
    /// Job mode, ShedLock's `lockAtLeastFor`: keep the lock until at least this long after the
    /// grant, even when the job (or the guard) ends sooner and even if the process dies right
    /// after — see [`LockOptions::at_least`].
    pub at_least: Option<Duration>,
    /// Job mode, ShedLock's `lockAtMostFor`: never hold longer than this after the grant — see
    /// [`LockOptions::at_most`].
    pub at_most: Option<Duration>,
}

impl LockOptions {
    /// The wait of [`LockBuilder::acquire`] when none was set.
    pub const DEFAULT_WAIT: Duration = Duration::from_secs(30);

    /// Defaults with the given TTL.
    pub fn with_ttl(ttl: Duration) -> Self {
        Self {
            ttl,
            ..Self::default()
        }
    }

    /// Sets the TTL.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// Waits up to `wait` for a held lock.
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = Some(wait);
        self
    }

    /// Renews every `interval` (at instants aligned on a process-wide grid of `interval / 4`,
    /// so renewals can be batched: the gap between renewals is between ¾ and 1 interval).
    pub fn watchdog(mut self, interval: Duration) -> Self {
        self.watchdog = Watchdog::Every(interval);
        self
    }

    /// Never renews.
    pub fn no_watchdog(mut self) -> Self {
        self.watchdog = Watchdog::Off;
        self
    }

    /// Requires at least `guarantee` fencing.
    pub fn require_fencing(mut self, guarantee: FencingGuarantee) -> Self {
        self.fencing = guarantee;
        self
    }

    /// Keeps the lock until at least `d` after the grant (the once-per-period pattern: a job
    /// that takes 200 ms on one instance must not run again on another whose timer fires a
    /// second later). When the job ends — or the guard is released or dropped — before then,
    /// the lease is not deleted but renewed to end at grant + `d` (shortened or extended),
    /// with the coordinator's own expiry, so it holds even if the process dies right after;
    /// and the lease is granted for at least `d` (the TTL is raised to `d` when shorter), so a
    /// holder that dies mid-job holds it too. Needs [`Capabilities::keep_until`]: [`Error::Unsupported`] without, before any I/O.
    pub fn at_least(mut self, d: Duration) -> Self {
        self.at_least = Some(d);
        self
    }

    /// Never holds longer than `d` after the grant: at grant + `d` the watchdog stops renewing,
    /// the guard is lost ([`crate::LossReason::HeldTooLong`]) — `run_exclusive` cancels the
    /// job and answers [`Error::NotHeld`] — and the lease is released (or kept until
    /// [`LockOptions::at_least`], if that is later).
    pub fn at_most(mut self, d: Duration) -> Self {
        self.at_most = Some(d);
        self
    }
}

impl Default for LockOptions {
    fn default() -> Self {
        Self {
            ttl: Duration::from_secs(30),
            wait: None,
            watchdog: Watchdog::Auto,
            fencing: FencingGuarantee::None,
            at_least: None,
            at_most: None,
        }
    }
}

/// Builds one acquisition: `lock.lock("orders").ttl(..).wait(..).acquire().await`.
///
/// ```
/// use std::{sync::Arc, time::Duration};
/// use lock_core::{DistributedLockExt, InMemoryLock};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> lock_core::Result<()> {
/// let coordinator = Arc::new(InMemoryLock::new());
/// // Wait up to 5 s for the lock; hold it with a 10 s lease that a watchdog keeps renewing.
/// let guard = coordinator
///     .lock("refund/order-42")
///     .ttl(Duration::from_secs(10))
///     .wait(Duration::from_secs(5))
///     .acquire()
///     .await?;
/// // Skip instead of waiting: `try_acquire` answers `None` while someone holds it.
/// assert!(coordinator.lock("refund/order-42").try_acquire().await?.is_none());
/// // A bad key is refused before any I/O.
/// assert!(coordinator.lock("").try_acquire().await.is_err());
/// assert!(guard.release().await?);
/// # Ok(()) }
/// ```
#[derive(Debug)]
#[must_use = "a lock builder does nothing until try_acquire or acquire is awaited"]
pub struct LockBuilder {
    lock: DynLock,
    key: Result<LockKey>,
    opts: LockOptions,
}

impl LockBuilder {
    /// Replaces all options.
    pub fn options(mut self, opts: LockOptions) -> Self {
        self.opts = opts;
        self
    }

    /// Sets the TTL.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.opts = self.opts.ttl(ttl);
        self
    }

    /// Sets how long [`LockBuilder::acquire`] waits.
    pub fn wait(mut self, wait: Duration) -> Self {
        self.opts = self.opts.wait(wait);
        self
    }

    /// Renews every `interval` (at instants aligned on a process-wide grid of `interval / 4`,
    /// so renewals can be batched: the gap between renewals is between ¾ and 1 interval).
    pub fn watchdog(mut self, interval: Duration) -> Self {
        self.opts = self.opts.watchdog(interval);
        self
    }

    /// Never renews.
    pub fn no_watchdog(mut self) -> Self {
        self.opts = self.opts.no_watchdog();
        self
    }

    /// Requires at least `guarantee` fencing.
    pub fn require_fencing(mut self, guarantee: FencingGuarantee) -> Self {
        self.opts = self.opts.require_fencing(guarantee);
        self
    }

    /// See [`LockOptions::at_least`].
    pub fn at_least(mut self, d: Duration) -> Self {
        self.opts = self.opts.at_least(d);
        self
    }

    /// See [`LockOptions::at_most`].
    pub fn at_most(mut self, d: Duration) -> Self {
        self.opts = self.opts.at_most(d);
        self
    }

    /// The TTL the lease is granted with: the option's, or `at_least` when that is longer — so
    /// that a holder that dies at any moment after the grant (mid-job included, before its
    /// release could keep the lease) still holds the lock until grant + `at_least`.
    fn grant_ttl(&self) -> Duration {
        self.opts.ttl.max(self.opts.at_least.unwrap_or_default())
    }

    fn limits(&self) -> crate::guard::JobLimits {
        crate::guard::JobLimits {
            at_least: self.opts.at_least,
            at_most: self.opts.at_most,
        }
    }

    /// Checks everything that can be checked before I/O; returns the key and renew interval.
    fn prepare(&self) -> Result<(LockKey, Option<Duration>)> {
        let key = match &self.key {
            Ok(key) => key.clone(),
            Err(Error::InvalidKey { reason }) => {
                return Err(Error::InvalidKey {
                    reason: reason.clone(),
                });
            }
            Err(e) => return Err(Error::Config(e.to_string())),
        };
        let caps = self.lock.capabilities();
        let backend = self.lock.backend_name();
        caps.check_ttl(self.grant_ttl())?;
        caps.require_fencing(backend, self.opts.fencing)?;
        check_job_mode(&caps, backend, &self.opts)?;
        let interval = match self.opts.watchdog {
            Watchdog::Off => None,
            Watchdog::Auto => caps.renew.then(|| self.grant_ttl() / 3),
            Watchdog::Every(_) if !caps.renew => {
                return Err(Error::unsupported(
                    backend,
                    "renew (needed by the watchdog)",
                ));
            }
            Watchdog::Every(i) if i.is_zero() || i >= max_watchdog_interval(self.grant_ttl()) => {
                return Err(Error::Config(format!(
                    "the watchdog interval {i:?} must be positive and shorter than {:?}, what a \
                     lease of ttl {:?} can have left when it is granted (¾ ttl minus the drift margin)",
                    max_watchdog_interval(self.grant_ttl()),
                    self.grant_ttl()
                )));
            }
            Watchdog::Every(i) => Some(i),
        };
        Ok((key, interval))
    }

    /// One attempt: `Ok(None)` when somebody else holds the lock.
    ///
    /// # Errors
    /// Input and capability errors before any I/O; the backend's errors.
    pub async fn try_acquire(self) -> Result<Option<LockGuard>> {
        let (key, interval) = self.prepare()?;
        let limits = self.limits();
        let lease = self.lock.try_acquire(&key, self.grant_ttl()).await?;
        match lease {
            Some(lease) => Ok(Some(start_guard(self.lock, lease, interval, limits).await?)),
            None => Ok(None),
        }
    }

    /// Waits up to the configured wait ([`LockOptions::DEFAULT_WAIT`] when unset).
    ///
    /// # Errors
    /// [`Error::Timeout`] when the wait passes; input and capability errors before any I/O.
    ///
    /// # Cancellation safety
    /// Dropping the future while it waits leaves nothing that blocks others.
    pub async fn acquire(self) -> Result<LockGuard> {
        let (key, interval) = self.prepare()?;
        let limits = self.limits();
        let wait = self.opts.wait.unwrap_or(LockOptions::DEFAULT_WAIT);
        let lease = self
            .lock
            .acquire(&key, self.grant_ttl(), deadline_after(wait))
            .await?;
        start_guard(self.lock, lease, interval, limits).await
    }

    /// Runs `job` while holding the lock; see [`DistributedLockExt::run_exclusive`].
    ///
    /// # Errors
    /// As [`DistributedLockExt::run_exclusive`].
    pub async fn run<F, Fut, T>(self, job: F) -> Result<Option<T>>
    where
        F: FnOnce(JobContext) -> Fut,
        Fut: Future<Output = T>,
    {
        let guard = if self.opts.wait.is_some() {
            self.acquire().await?
        } else {
            match self.try_acquire().await? {
                Some(guard) => guard,
                None => return Ok(None),
            }
        };
        let key = guard.key().clone();
        if guard.is_lost() {
            // The lease was past its local deadline when it arrived: never start the job on it.
            tracing::warn!(%key, reason = ?guard.loss_reason(), "the lease was lost before the job could start");
            let _ = guard.release().await;
            return Err(Error::NotHeld {
                key: key.as_str().to_owned(),
            });
        }
        let ctx = JobContext {
            key: key.clone(),
            fencing: guard.fencing_token(),
            digest: guard.token_digest(),
            loss: guard.loss_view(),
        };
        let lost = guard.lost();
        // The job first: a job that finished in the same poll as the loss did its work, and
        // reporting it cancelled would make a retrying caller run it twice.
        let output = tokio::select! {
            biased;
            output = job(ctx) => Some(output),
            () = lost => None,
        };
        match output {
            None => {
                tracing::warn!(%key, reason = ?guard.loss_reason(), "ownership lost; the job was cancelled");
                let _ = guard.release().await;
                Err(Error::NotHeld {
                    key: key.as_str().to_owned(),
                })
            }
            Some(output) => {
                match guard.release().await {
                    Ok(true) => {}
                    Ok(false) => {
                        tracing::warn!(%key, "the lease had expired when the job finished")
                    }
                    Err(e) => {
                        tracing::warn!(%key, error = %e, "release after the job failed; the lease will expire by its ttl")
                    }
                }
                Ok(Some(output))
            }
        }
    }
}

/// The guard of a fresh grant. In job mode with `at_least`, the coordinator is first made to
/// hold the grant that long whatever happens to this process
/// ([`DistributedLock::hold_at_least`]; nothing is sent where the grant's TTL already does). The
/// guard exists before that request, so an error — or the caller dropping this future — hands
/// the grant back through the guard's drop.
async fn start_guard(
    lock: DynLock,
    lease: Lease,
    interval: Option<Duration>,
    limits: crate::guard::JobLimits,
) -> Result<LockGuard> {
    let at_least = limits.at_least;
    let guard = LockGuard::start(lock.clone(), lease, interval, limits);
    if let Some(at_least) = at_least {
        lock.hold_at_least(guard.granted_lease(), at_least).await?;
    }
    Ok(guard)
}

/// Job mode's limits, before any I/O: `at_least` needs `keep_until` and a TTL the backend
/// honours; `at_most` is positive and not shorter than `at_least`.
fn check_job_mode(caps: &Capabilities, backend: &'static str, opts: &LockOptions) -> Result<()> {
    if let Some(d) = opts.at_least {
        if !(caps.keep_until && caps.renew) {
            return Err(Error::unsupported(
                backend,
                "at_least (keeping a lease until a time after its job with nobody renewing it)",
            ));
        }
        if d.is_zero() {
            return Err(Error::Config("at_least must be positive".into()));
        }
        caps.check_ttl(d.max(caps.min_ttl))?;
    }
    match (opts.at_least, opts.at_most) {
        (_, Some(most)) if most.is_zero() => Err(Error::Config("at_most must be positive".into())),
        (Some(least), Some(most)) if least > most => Err(Error::Config(format!(
            "at_least ({least:?}) must not be longer than at_most ({most:?})"
        ))),
        _ => Ok(()),
    }
}

/// The longest watchdog interval for `ttl`: what a lease can have left when it is handed over
/// (a direct grant counts from its waiter's request, up to a quarter TTL earlier), minus the
/// drift margin. A longer interval would renew only after the local deadline.
fn max_watchdog_interval(ttl: Duration) -> Duration {
    (ttl * 3 / 4).saturating_sub(crate::drift_margin(ttl))
}

/// `now + wait`, saturating far in the future instead of overflowing.
fn deadline_after(wait: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(wait)
        .unwrap_or_else(|| now + Capabilities::MAX_TTL)
}

/// What a job run by `run_exclusive` gets: its fencing token and the lost-ownership signal.
#[derive(Clone, Debug)]
pub struct JobContext {
    key: LockKey,
    fencing: Option<FencingToken>,
    digest: TokenDigest,
    loss: crate::guard::LossView,
}

impl JobContext {
    /// The lock key.
    pub fn key(&self) -> &LockKey {
        &self.key
    }

    /// The fencing token to present to the protected resource (always `Some` when fencing was
    /// required).
    pub fn fencing_token(&self) -> Option<FencingToken> {
        self.fencing
    }

    /// A loggable digest of the ownership token.
    pub fn token_digest(&self) -> TokenDigest {
        self.digest
    }

    /// Completes when ownership is lost.
    pub fn lost(&self) -> WaitForCancellationFutureOwned {
        self.loss.token().clone().cancelled_owned()
    }

    /// `true` once ownership is lost or the local deadline has passed. Check it before each
    /// irreversible step that the fencing token does not protect.
    pub fn is_lost(&self) -> bool {
        self.loss.is_lost()
    }

    /// A token cancelled on loss, for spawned sub-tasks.
    pub fn cancellation_token(&self) -> CancellationToken {
        self.loss.token().child_token()
    }
}

/// A boxed, `Send` future (what [`DistributedLockExt::run_exclusive`] returns).
pub type BoxedFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Conveniences for every lock client held in an `Arc` (including [`DynLock`]).
/// Blanket-implemented; nobody implements it by hand.
pub trait DistributedLockExt {
    /// This client as a [`DynLock`].
    fn as_dyn_lock(&self) -> DynLock;

    /// Starts building an acquisition of `key` (validated before any I/O).
    fn lock<K>(&self, key: K) -> LockBuilder
    where
        K: TryInto<LockKey, Error = Error>,
    {
        LockBuilder {
            lock: self.as_dyn_lock(),
            key: key.try_into(),
            opts: LockOptions::default(),
        }
    }

    /// The article's job pattern in one call: try to take `key` (or wait, when `opts.wait` is
    /// set), run `job` with its fencing token and lost signal while a watchdog renews, release
    /// at the end.
    ///
    /// Returns `Ok(None)` when the lock was held elsewhere (skipped) and `Ok(Some(output))`
    /// when the job completed. When ownership is lost mid-job the job's future is dropped (its
    /// work cancelled) and [`Error::NotHeld`] is returned.
    ///
    /// ```
    /// use std::{sync::Arc, time::Duration};
    /// use lock_core::{DistributedLockExt, FencedRegister, InMemoryLock, LockOptions};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> lock_core::Result<()> {
    /// let coordinator = Arc::new(InMemoryLock::new());
    /// let ledger = FencedRegister::new();
    /// let opts = LockOptions::with_ttl(Duration::from_secs(10));
    /// let done = coordinator
    ///     .run_exclusive("close-timed-out-orders", opts.clone(), |ctx| async move {
    ///         // The resource checks the fencing token: a stale holder's write is refused.
    ///         let token = ctx.fencing_token().expect("memory mints fencing tokens");
    ///         ledger.write(token, "closed 17 orders").is_ok()
    ///     })
    ///     .await?;
    /// assert_eq!(done, Some(true));
    ///
    /// // While another instance holds the lock, the job is skipped.
    /// let held = coordinator.lock("close-timed-out-orders").acquire().await?;
    /// let skipped = coordinator
    ///     .run_exclusive("close-timed-out-orders", opts, |_| async { unreachable!() })
    ///     .await?;
    /// assert_eq!(skipped, None::<()>);
    /// held.release().await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// Input and capability errors before any I/O; backend errors; `NotHeld` on loss.
    fn run_exclusive<'a, K, F, Fut, T>(
        &self,
        key: K,
        opts: LockOptions,
        job: F,
    ) -> BoxedFuture<'a, Result<Option<T>>>
    where
        K: TryInto<LockKey, Error = Error>,
        F: FnOnce(JobContext) -> Fut + Send + 'a,
        Fut: Future<Output = T> + Send + 'a,
        T: Send + 'a,
    {
        let builder = self.lock(key).options(opts);
        Box::pin(builder.run(job))
    }
}

impl DistributedLockExt for Arc<dyn DistributedLock> {
    fn as_dyn_lock(&self) -> DynLock {
        self.clone()
    }
}

impl<T: DistributedLock> DistributedLockExt for Arc<T> {
    fn as_dyn_lock(&self) -> DynLock {
        self.clone()
    }
}

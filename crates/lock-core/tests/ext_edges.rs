//! The edges of `LockBuilder` and `JobContext` (ext.rs) that a mutation run found untested:
//! job-mode options refused before any I/O for each missing capability, `at_least == at_most`
//! accepted, an unbounded wait that waits, and a job's loss seen through `is_lost()` and its
//! cancellation token. On the in-memory coordinator, which counts the requests it receives.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed expectation is a failed test

use std::{sync::Arc, time::Duration};

use lock_core::{
    Capabilities, DistributedLockExt, DynLock, Error, FencingToken, HolderInfo, InMemoryLock,
    Lease, LockKey, LockOptions, Result,
    raw::{Driver, async_trait},
};

const TTL: Duration = Duration::from_secs(3);

/// The in-memory coordinator claiming less than it has: `keep_until` or `renew` taken away.
#[derive(Debug)]
struct Without {
    inner: InMemoryLock,
    keep_until: bool,
    renew: bool,
}

#[async_trait]
impl Driver for Without {
    fn backend_name(&self) -> &'static str {
        "without"
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            keep_until: self.keep_until,
            renew: self.renew,
            ..DistributedLockExt::as_dyn_lock(&Arc::new(self.inner.clone())).capabilities()
        }
    }
    async fn try_acquire(&self, key: &LockKey, ttl: Duration) -> Result<Option<Lease>> {
        lock_core::DistributedLock::try_acquire(&self.inner, key, ttl).await
    }
    async fn renew(&self, lease: &mut Lease, ttl: Duration) -> Result<()> {
        lock_core::DistributedLock::renew(&self.inner, lease, ttl).await
    }
    async fn release(&self, lease: &Lease) -> Result<bool> {
        lock_core::DistributedLock::release(&self.inner, lease).await
    }
    async fn inspect(&self, key: &LockKey) -> Result<Option<HolderInfo>> {
        lock_core::DistributedLock::inspect(&self.inner, key).await
    }
    async fn force_release_grant(&self, key: &LockKey, holder: FencingToken) -> Result<bool> {
        lock_core::DistributedLock::force_release_grant(&self.inner, key, holder).await
    }
}

/// `at_least` needs `keep_until` *and* `renew`: a backend missing either is refused with
/// `Unsupported` before any request (not after a grant, when the grant would have to be given
/// back).
#[tokio::test]
async fn at_least_without_keep_until_or_renew_is_refused_before_any_request() {
    for (keep_until, renew) in [(false, true), (true, false), (false, false)] {
        let inner = InMemoryLock::new();
        let lock: DynLock = Arc::new(Without {
            inner: inner.clone(),
            keep_until,
            renew,
        });
        let before = inner.requests();
        let got = lock
            .lock("ext-at-least")
            .ttl(TTL)
            .at_least(Duration::from_secs(10))
            .no_watchdog()
            .try_acquire()
            .await;
        assert!(
            matches!(got, Err(Error::Unsupported { .. })),
            "keep_until {keep_until}, renew {renew}: {got:?}"
        );
        assert_eq!(
            inner.requests(),
            before,
            "keep_until {keep_until}, renew {renew}: refused only after a request"
        );
    }
}

/// `at_least` longer than `at_most` is refused before any request; equal is a valid job (held
/// exactly that long).
#[tokio::test]
async fn at_least_equal_to_at_most_runs_and_longer_is_refused_before_any_request() {
    let memory = InMemoryLock::new();
    let lock: DynLock = Arc::new(memory.clone());
    let before = memory.requests();
    let longer = LockOptions::with_ttl(TTL)
        .at_least(Duration::from_secs(5))
        .at_most(Duration::from_secs(4));
    let got = lock.run_exclusive("ext-limits", longer, |_| async {}).await;
    assert!(matches!(got, Err(Error::Config(_))), "{got:?}");
    assert_eq!(memory.requests(), before, "refused only after a request");
    let equal = LockOptions::with_ttl(TTL)
        .at_least(Duration::from_secs(4))
        .at_most(Duration::from_secs(4));
    let got = lock
        .run_exclusive("ext-limits", equal, |_| async { 7 })
        .await;
    assert_eq!(got.unwrap(), Some(7));
}

/// `wait(Duration::MAX)` waits (its deadline saturates far ahead) and takes the lock when it
/// is released, instead of timing out at once.
#[tokio::test]
async fn an_unbounded_wait_waits_for_the_release() {
    let memory = InMemoryLock::new();
    let holder: DynLock = Arc::new(memory.clone());
    let waiter: DynLock = Arc::new(memory.client());
    let held = holder.lock("ext-wait").ttl(TTL).try_acquire().await;
    let held = held.unwrap().expect("a free key");
    let waiting = tokio::spawn(async move {
        waiter
            .lock("ext-wait")
            .ttl(TTL)
            .wait(Duration::MAX)
            .acquire()
            .await
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!waiting.is_finished(), "the unbounded wait ended at once");
    assert!(held.release().await.unwrap());
    let guard = tokio::time::timeout(Duration::from_secs(5), waiting)
        .await
        .expect("the waiter was not handed the lock")
        .unwrap()
        .unwrap();
    assert!(guard.release().await.unwrap());
}

/// A job whose lock is taken away sees it: `is_lost()` turns true and the cancellation token
/// it hands to sub-tasks is cancelled (besides `lost()`, which `run_exclusive` itself waits on
/// to cancel the job).
#[tokio::test]
async fn a_jobs_loss_shows_in_is_lost_and_its_cancellation_token() {
    let memory = InMemoryLock::new();
    let lock: DynLock = Arc::new(memory.clone());
    let operator: DynLock = Arc::new(memory.client());
    let (ctx_tx, ctx_rx) = tokio::sync::oneshot::channel();
    let job = lock.run_exclusive(
        "ext-job-loss",
        LockOptions::with_ttl(TTL),
        move |ctx| async move {
            let _ = ctx_tx.send((ctx.clone(), ctx.cancellation_token()));
            // Taken away from outside while the job runs.
            assert!(operator.force_release(ctx.key()).await.unwrap());
            std::future::pending::<()>().await;
        },
    );
    let got = tokio::time::timeout(Duration::from_secs(10), job)
        .await
        .expect("the job was not cancelled on the loss");
    assert!(matches!(got, Err(Error::NotHeld { .. })), "{got:?}");
    let (ctx, token) = ctx_rx.await.unwrap();
    assert!(
        ctx.is_lost(),
        "is_lost() was false after the lock was taken away"
    );
    assert!(
        token.is_cancelled(),
        "the job's cancellation token was not cancelled on the loss"
    );
}

/// A coordinator that never answers a `try_acquire` (frozen).
#[derive(Debug)]
struct Frozen(InMemoryLock);

#[async_trait]
impl Driver for Frozen {
    fn backend_name(&self) -> &'static str {
        "frozen"
    }
    fn capabilities(&self) -> Capabilities {
        DistributedLockExt::as_dyn_lock(&Arc::new(self.0.clone())).capabilities()
    }
    async fn try_acquire(&self, _: &LockKey, _: Duration) -> Result<Option<Lease>> {
        std::future::pending().await
    }
    async fn renew(&self, _: &mut Lease, _: Duration) -> Result<()> {
        std::future::pending().await
    }
    async fn release(&self, _: &Lease) -> Result<bool> {
        std::future::pending().await
    }
    async fn inspect(&self, _: &LockKey) -> Result<Option<HolderInfo>> {
        std::future::pending().await
    }
}

/// The one attempt a short deadline still makes is given up `ONE_ATTEMPT_WINDOW` after the
/// call against a coordinator that never answers (`Timeout`), for a deadline already past, a
/// zero one and one inside the window; a deadline past the window is kept to.
#[tokio::test(start_paused = true)]
async fn the_one_attempt_of_a_short_wait_is_bounded_by_the_window() {
    use lock_core::raw::ONE_ATTEMPT_WINDOW;
    use tokio::time::Instant;
    let lock: DynLock = Arc::new(Frozen(InMemoryLock::new()));
    let key = LockKey::new("ext-frozen").unwrap();
    for wait in [None, Some(Duration::ZERO), Some(ONE_ATTEMPT_WINDOW / 2)] {
        let started = Instant::now();
        let deadline = match wait {
            Some(w) => started + w,
            None => started - Duration::from_millis(1),
        };
        let err = lock.acquire(&key, TTL, deadline).await.unwrap_err();
        assert!(matches!(err, Error::Timeout { .. }), "{wait:?}: {err}");
        assert_eq!(started.elapsed(), ONE_ATTEMPT_WINDOW, "{wait:?}");
    }
}

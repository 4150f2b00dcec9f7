//! Job mode (issue 21): `at_least` keeps a lock held after its job ends early — released,
//! dropped or finished — until grant + d, with the coordinator's expiry; `at_most` stops
//! renewing at grant + d, cancels the job as lost and frees the lock. On the in-memory
//! coordinator with a paused clock, so every instant is exact and nothing sleeps for real.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed expectation is a failed test

use std::{sync::Arc, time::Duration};

use lock_core::{
    Capabilities, DistributedLockExt, DynLock, Error, FencingToken, HolderInfo, InMemoryLock,
    Lease, LockKey, LockOptions, LossReason, Result,
    raw::{Driver, async_trait},
};
use tokio::time::{Instant, sleep, sleep_until};

const TTL: Duration = Duration::from_secs(3);
const AT_LEAST: Duration = Duration::from_secs(10);

const NAME: &str = "close-timed-out-orders";

fn key() -> LockKey {
    LockKey::new(NAME).unwrap()
}

/// Whether another instance could take the lock now.
async fn free(other: &DynLock) -> bool {
    match other.try_acquire(&key(), TTL).await.unwrap() {
        Some(lease) => {
            assert!(other.release(&lease).await.unwrap());
            true
        }
        None => false,
    }
}

#[tokio::test(start_paused = true)]
async fn at_least_keeps_the_lock_after_a_job_that_ended_early_then_frees_it() {
    let coordinator = InMemoryLock::new();
    let (a, b): (DynLock, DynLock) = (
        Arc::new(coordinator.client()),
        Arc::new(coordinator.client()),
    );
    let start = Instant::now();
    let ran = a
        .run_exclusive(
            NAME,
            LockOptions::with_ttl(TTL).at_least(AT_LEAST),
            |_| async {
                sleep(Duration::from_millis(200)).await;
            },
        )
        .await
        .unwrap();
    assert_eq!(ran, Some(()));
    // Another instance's timer fires a second later, and later still, within the window: skipped.
    for at in [1, 5, 9] {
        sleep_until(start + Duration::from_secs(at)).await;
        assert!(!free(&b).await, "the lock was free {at} s after the grant");
    }
    // Past grant + at_least it is free again, with nobody having renewed it since the job ended.
    sleep_until(start + AT_LEAST + Duration::from_millis(50)).await;
    assert!(free(&b).await, "at_least kept the lock past its window");
}

#[tokio::test(start_paused = true)]
async fn at_least_holds_when_the_guard_is_dropped_and_when_at_least_is_shorter_than_the_ttl() {
    let coordinator = InMemoryLock::new();
    let (a, b): (DynLock, DynLock) = (
        Arc::new(coordinator.client()),
        Arc::new(coordinator.client()),
    );
    let start = Instant::now();
    // The holder "exits" right after the job: its guard is dropped, not released.
    let guard = a
        .lock(NAME)
        .ttl(Duration::from_secs(30))
        .at_least(Duration::from_secs(2))
        .try_acquire()
        .await
        .unwrap()
        .expect("free");
    drop(guard);
    lock_core::raw::cleanup::finish(Duration::from_secs(5)).await;
    sleep_until(start + Duration::from_secs(1)).await;
    assert!(
        !free(&b).await,
        "a dropped guard gave the lock up inside at_least"
    );
    // Shortened: the 30 s lease ends at grant + 2 s, not after its TTL.
    sleep_until(start + Duration::from_secs(2) + Duration::from_millis(50)).await;
    assert!(free(&b).await, "the lease was not shortened to at_least");
}

#[tokio::test(start_paused = true)]
async fn at_most_cancels_a_hung_job_as_lost_and_frees_the_lock() {
    let coordinator = InMemoryLock::new();
    let (a, b): (DynLock, DynLock) = (
        Arc::new(coordinator.client()),
        Arc::new(coordinator.client()),
    );
    let start = Instant::now();
    let at_most = Duration::from_secs(7);
    let hung = a.run_exclusive(
        NAME,
        LockOptions::with_ttl(TTL).at_most(at_most),
        |ctx| async move {
            // Hangs; the watchdog renews it well past one TTL until at_most.
            std::future::pending::<()>().await;
            drop(ctx);
        },
    );
    let got = tokio::time::timeout(Duration::from_secs(60), hung)
        .await
        .expect("at_most never cancelled the hung job");
    assert!(matches!(got, Err(Error::NotHeld { .. })), "{got:?}");
    let ended = Instant::now();
    assert!(
        ended >= start + at_most,
        "cancelled before at_most: {:?}",
        ended - start
    );
    assert!(
        ended < start + at_most + TTL,
        "cancelled late: {:?}",
        ended - start
    );
    assert!(free(&b).await, "the lock was not released after at_most");

    // A guard: lost() fires at at_most with its own reason.
    let guard = a
        .lock(NAME)
        .ttl(TTL)
        .at_most(Duration::from_secs(4))
        .try_acquire()
        .await
        .unwrap()
        .expect("free");
    let from = Instant::now();
    tokio::time::timeout(Duration::from_secs(60), guard.lost())
        .await
        .expect("at_most never fired lost()");
    assert!(Instant::now() >= from + Duration::from_secs(4));
    assert_eq!(guard.loss_reason(), Some(LossReason::HeldTooLong));
    assert!(
        guard.renewals() >= 1,
        "the watchdog never renewed before at_most"
    );
    assert!(guard.release().await.unwrap());
}

/// The in-memory coordinator without `keep_until`.
#[derive(Debug)]
struct NoKeep(DynLock);

#[async_trait]
impl Driver for NoKeep {
    fn backend_name(&self) -> &'static str {
        "no-keep"
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            keep_until: false,
            ..self.0.capabilities()
        }
    }
    async fn try_acquire(&self, key: &LockKey, ttl: Duration) -> Result<Option<Lease>> {
        self.0.try_acquire(key, ttl).await
    }
    async fn renew(&self, lease: &mut Lease, ttl: Duration) -> Result<()> {
        self.0.renew(lease, ttl).await
    }
    async fn release(&self, lease: &Lease) -> Result<bool> {
        self.0.release(lease).await
    }
    async fn inspect(&self, key: &LockKey) -> Result<Option<HolderInfo>> {
        self.0.inspect(key).await
    }
    async fn force_release_grant(&self, key: &LockKey, holder: FencingToken) -> Result<bool> {
        self.0.force_release_grant(key, holder).await
    }
}

#[tokio::test]
async fn job_mode_limits_are_checked_before_any_io() {
    let lock: DynLock = Arc::new(NoKeep(Arc::new(InMemoryLock::new())));
    let got = lock
        .lock(NAME)
        .ttl(TTL)
        .at_least(AT_LEAST)
        .try_acquire()
        .await;
    assert!(matches!(got, Err(Error::Unsupported { .. })), "{got:?}");
    let memory: DynLock = Arc::new(InMemoryLock::new());
    for opts in [
        LockOptions::with_ttl(TTL)
            .at_least(Duration::from_secs(5))
            .at_most(Duration::from_secs(4)),
        LockOptions::with_ttl(TTL).at_most(Duration::ZERO),
        LockOptions::with_ttl(TTL).at_least(Duration::ZERO),
    ] {
        let got = memory.run_exclusive(NAME, opts, |_| async {}).await;
        assert!(matches!(got, Err(Error::Config(_))), "{opts:?}: {got:?}");
    }
    let got = memory
        .run_exclusive(
            NAME,
            LockOptions::with_ttl(TTL).at_least(Capabilities::MAX_TTL * 2),
            |_| async {},
        )
        .await;
    assert!(matches!(got, Err(Error::InvalidTtl { .. })), "{got:?}");
    // Nothing was taken by the refused calls.
    assert!(free(&memory).await);
}

#[tokio::test(start_paused = true)]
async fn a_holder_that_dies_mid_job_still_holds_until_at_least() {
    let coordinator = InMemoryLock::new();
    let b: DynLock = Arc::new(coordinator.client());
    let start = Instant::now();
    // The holder's process "dies" mid-job: from now on nothing it sends arrives (its watchdog
    // can no longer renew, nothing releases).
    let dying = coordinator.client();
    let a: DynLock = Arc::new(dying.clone());
    let guard = a
        .lock(NAME)
        .ttl(TTL)
        .at_least(AT_LEAST)
        .try_acquire()
        .await
        .unwrap()
        .expect("free");
    assert!(guard.ttl() >= AT_LEAST, "granted for {:?}", guard.ttl());
    dying.set_offline(true);
    std::mem::forget(guard);
    sleep_until(start + AT_LEAST - Duration::from_millis(100)).await;
    assert!(
        !free(&b).await,
        "a holder that died mid-job gave the lock up inside at_least"
    );
    sleep_until(start + AT_LEAST + Duration::from_millis(100)).await;
    assert!(free(&b).await);
}

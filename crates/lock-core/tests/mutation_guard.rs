//! The guard's accessors and its watchdog's cadence, exactly, on the in-memory coordinator with
//! paused time — written for mutants of `guard.rs` that `scripts/mutants.sh core` found
//! surviving lock-core's other tests and the memory suite.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed expectation is a failed test

use std::{
    collections::VecDeque,
    sync::{Arc, Mutex},
    time::Duration,
};

use lock_core::raw::async_trait;
use lock_core::{
    Capabilities, DistributedLockExt, DynLock, Error, HolderInfo, InMemoryLock, Lease, LockGuard,
    LockKey, LossReason, Result,
};
use tokio::time::{Instant, sleep};

fn client() -> (InMemoryLock, DynLock) {
    let coordinator = InMemoryLock::new();
    let lock: DynLock = Arc::new(coordinator.client());
    (coordinator, lock)
}

#[tokio::test(start_paused = true)]
async fn the_guard_reports_what_it_was_granted() {
    let (_coordinator, lock) = client();
    let ttl = Duration::from_secs(30);
    let sent = Instant::now();
    let guard = lock
        .lock("mutation/guard-accessors")
        .ttl(ttl)
        .try_acquire()
        .await
        .unwrap()
        .expect("free");
    assert_eq!(guard.ttl(), ttl);
    assert_eq!(guard.key().as_str(), "mutation/guard-accessors");
    let lease = guard.granted_lease();
    assert_eq!(lease.ttl(), ttl);
    assert_eq!(guard.fencing_token(), lease.fencing_token());
    assert!(guard.fencing_token().is_some());
    assert_eq!(guard.token_digest(), lease.token().digest());
    assert_eq!(guard.local_deadline(), lease.local_deadline());
    assert_eq!(
        guard.local_deadline(),
        sent + ttl - lock_core::drift_margin(ttl)
    );
    assert_eq!(guard.renewals(), 0);
    assert!(!guard.is_lost());
    assert_eq!(guard.loss_reason(), None);
    assert!(guard.release().await.unwrap());
}

/// Renewals come between ¾ and 1 interval apart (the process-wide grid of interval / 4), each
/// moving the local deadline to its own send time + ttl − margin.
#[tokio::test(start_paused = true)]
async fn the_watchdog_renews_every_three_quarters_to_one_interval() {
    let (_coordinator, lock) = client();
    let ttl = Duration::from_secs(30);
    let interval = Duration::from_secs(8);
    let guard = lock
        .lock("mutation/guard-cadence")
        .ttl(ttl)
        .watchdog(interval)
        .try_acquire()
        .await
        .unwrap()
        .expect("free");
    let first_deadline = guard.local_deadline();
    // Less than ¾ interval: no renewal yet.
    sleep(interval * 3 / 4 - Duration::from_millis(10)).await;
    assert_eq!(guard.renewals(), 0);
    assert_eq!(guard.local_deadline(), first_deadline);
    // By one interval: exactly one.
    sleep(interval / 4 + Duration::from_millis(10)).await;
    assert_eq!(guard.renewals(), 1);
    let renewed = guard.local_deadline();
    assert!(renewed > first_deadline);
    assert!(renewed <= Instant::now() + ttl - lock_core::drift_margin(ttl));
    assert!(renewed >= Instant::now() - interval / 4 + ttl - lock_core::drift_margin(ttl));
    // Over 10 more intervals: 10 or 11 more renewals (a gap is ¾ to 1 interval), never more.
    for _ in 0..40 {
        sleep(interval / 4).await;
    }
    let n = guard.renewals();
    assert!((11..=15).contains(&n), "{n} renewals in 11 intervals");
    assert!(!guard.is_lost());
    assert!(guard.release().await.unwrap());
}

/// The longest interval the TTL allows (just under ¾ TTL − margin) keeps the lease.
#[tokio::test(start_paused = true)]
async fn the_longest_allowed_interval_keeps_the_lease() {
    let (_coordinator, lock) = client();
    let ttl = Duration::from_secs(4);
    // Just under the longest interval the builder accepts.
    let interval = ttl * 3 / 4 - lock_core::drift_margin(ttl) - Duration::from_millis(1);
    let guard = lock
        .lock("mutation/guard-long-interval")
        .ttl(ttl)
        .watchdog(interval)
        .try_acquire()
        .await
        .unwrap()
        .expect("free");
    for _ in 0..60 {
        sleep(Duration::from_millis(250)).await;
    }
    assert!(!guard.is_lost(), "{:?}", guard.loss_reason());
    let n = guard.renewals();
    assert!((5..=7).contains(&n), "{n} renewals in 15 s at {interval:?}");
    assert!(guard.local_deadline() > Instant::now());
    assert!(guard.release().await.unwrap());
}

/// The in-memory coordinator behind a wrapper that hands out leases `age` old (as a direct grant
/// counted from its waiter's request is), answers the first renewals with scripted errors and
/// records when each renewal was asked for.
#[derive(Debug)]
struct Scripted {
    inner: InMemoryLock,
    age: Duration,
    errors: Mutex<VecDeque<Error>>,
    renewals: Mutex<Vec<Instant>>,
}

impl Scripted {
    fn new(age: Duration, errors: Vec<Error>) -> Arc<Self> {
        Arc::new(Self {
            inner: InMemoryLock::new(),
            age,
            errors: Mutex::new(errors.into()),
            renewals: Mutex::new(Vec::new()),
        })
    }

    fn renewals(&self) -> Vec<Instant> {
        self.renewals.lock().unwrap().clone()
    }
}

fn unavailable() -> Error {
    Error::Unavailable {
        backend: "scripted",
        op: "renew",
        message: "scripted temporary failure".into(),
        source: None,
    }
}

#[async_trait]
impl lock_core::raw::Driver for Scripted {
    fn backend_name(&self) -> &'static str {
        "scripted"
    }
    fn capabilities(&self) -> Capabilities {
        lock_core::DistributedLock::capabilities(&self.inner)
    }
    async fn try_acquire(&self, key: &LockKey, ttl: Duration) -> Result<Option<Lease>> {
        let Some(lease) = lock_core::DistributedLock::try_acquire(&self.inner, key, ttl).await?
        else {
            return Ok(None);
        };
        Ok(Some(Lease::new(
            key.clone(),
            *lease.token(),
            lease.fencing_token(),
            ttl,
            lease.acquired_at() - self.age,
        )))
    }
    async fn renew(&self, lease: &mut Lease, ttl: Duration) -> Result<()> {
        self.renewals.lock().unwrap().push(Instant::now());
        let scripted = self.errors.lock().unwrap().pop_front();
        match scripted {
            Some(e) => Err(e),
            None => lock_core::DistributedLock::renew(&self.inner, lease, ttl).await,
        }
    }
    async fn release(&self, lease: &Lease) -> Result<bool> {
        lock_core::DistributedLock::release(&self.inner, lease).await
    }
    async fn inspect(&self, key: &LockKey) -> Result<Option<HolderInfo>> {
        lock_core::DistributedLock::inspect(&self.inner, key).await
    }
}

async fn scripted_guard(
    lock: &Arc<Scripted>,
    name: &str,
    ttl: Duration,
    every: Duration,
) -> LockGuard {
    let dynlock: DynLock = lock.clone();
    dynlock
        .lock(name)
        .ttl(ttl)
        .watchdog(every)
        .try_acquire()
        .await
        .unwrap()
        .expect("free")
}

fn ms(d: Duration) -> u128 {
    d.as_millis()
}

/// A lease that starts old renews early enough to keep a quarter TTL for the renewal (or half of
/// what is left, when less than that is left), however long the interval.
#[tokio::test(start_paused = true)]
async fn an_old_lease_renews_with_a_quarter_ttl_or_half_its_rest_to_spare() {
    let ttl = Duration::from_secs(4);
    let every = Duration::from_millis(2_900);
    // 1 s old: 2.955 s left, so the renewal is due a quarter TTL before the deadline.
    let lock = Scripted::new(Duration::from_secs(1), Vec::new());
    let start = Instant::now();
    let guard = scripted_guard(&lock, "mutation/old-lease", ttl, every).await;
    assert_eq!(guard.local_deadline(), start + Duration::from_millis(2_955));
    sleep(Duration::from_millis(2_500)).await;
    let first = lock.renewals().first().map(|t| ms(*t - start));
    assert_eq!(
        first,
        Some(1_955),
        "renewed a quarter TTL before the deadline"
    );
    assert!(guard.release().await.unwrap());

    // 2.5 s old: 1.455 s left, less than a quarter TTL more: renewed after half of it.
    let lock = Scripted::new(Duration::from_millis(2_500), Vec::new());
    let start = Instant::now();
    let guard = scripted_guard(&lock, "mutation/older-lease", ttl, every).await;
    sleep(Duration::from_millis(1_400)).await;
    let first = lock.renewals().first().map(|t| ms(*t - start));
    assert!(
        matches!(first, Some(727 | 728)),
        "renewed after half of what was left: {first:?}"
    );
    assert!(!guard.is_lost());
    assert!(guard.release().await.unwrap());
}

/// Temporary renewal failures are retried after a backoff between interval / 16 and interval / 2
/// until one gets through; the lease is kept.
#[tokio::test(start_paused = true)]
async fn temporary_renewal_failures_are_retried_after_a_backoff() {
    let ttl = Duration::from_secs(30);
    let every = Duration::from_secs(8);
    let lock = Scripted::new(Duration::ZERO, vec![unavailable(), unavailable()]);
    let guard = scripted_guard(&lock, "mutation/temporary", ttl, every).await;
    sleep(Duration::from_secs(20)).await;
    assert!(!guard.is_lost(), "{:?}", guard.loss_reason());
    assert!(guard.renewals() >= 1);
    let calls = lock.renewals();
    assert!(calls.len() >= 3, "{calls:?}");
    for gap in calls.windows(2).take(2).map(|w| w[1] - w[0]) {
        assert!(
            gap >= every / 16 && gap <= every / 2,
            "a retry {gap:?} after the failure"
        );
    }
    assert!(guard.release().await.unwrap());
}

/// A renewal refused for good ends the lease at once: `RenewFailed`, not a wait for the deadline.
#[tokio::test(start_paused = true)]
async fn a_permanent_renewal_failure_is_a_loss_at_once() {
    let ttl = Duration::from_secs(30);
    let every = Duration::from_secs(8);
    let lock = Scripted::new(
        Duration::ZERO,
        vec![Error::Config("scripted permanent failure".into())],
    );
    let start = Instant::now();
    let guard = scripted_guard(&lock, "mutation/permanent", ttl, every).await;
    guard.lost().await;
    assert_eq!(guard.loss_reason(), Some(LossReason::RenewFailed));
    assert!(
        Instant::now() - start <= every,
        "lost {:?} after the grant",
        Instant::now() - start
    );
    assert_eq!(lock.renewals().len(), 1);
}

#[tokio::test(start_paused = true)]
async fn the_guards_debug_shows_its_key_and_state() {
    let (_coordinator, lock) = client();
    let guard = lock
        .lock("mutation/guard-debug")
        .try_acquire()
        .await
        .unwrap()
        .expect("free");
    let debug = format!("{guard:?}");
    assert!(debug.starts_with("LockGuard"), "{debug}");
    assert!(debug.contains("mutation/guard-debug"), "{debug}");
    assert!(debug.contains("lost: false"), "{debug}");
    assert!(guard.release().await.unwrap());
}

/// However many temporary failures in a row, a retry comes at most interval / 2 later.
#[tokio::test(start_paused = true)]
async fn retries_after_many_temporary_failures_stay_within_half_an_interval() {
    let ttl = Duration::from_secs(30);
    let every = Duration::from_secs(8);
    let lock = Scripted::new(Duration::ZERO, (0..5).map(|_| unavailable()).collect());
    let guard = scripted_guard(&lock, "mutation/many-temporary", ttl, every).await;
    sleep(Duration::from_secs(28)).await;
    assert!(!guard.is_lost(), "{:?}", guard.loss_reason());
    let calls = lock.renewals();
    assert!(calls.len() >= 6, "{calls:?}");
    for gap in calls.windows(2).take(5).map(|w| w[1] - w[0]) {
        assert!(gap <= every / 2, "a retry {gap:?} after the failure");
    }
    assert!(guard.release().await.unwrap());
}

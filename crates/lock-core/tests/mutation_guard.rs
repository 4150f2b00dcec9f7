//! The guard's accessors and its watchdog's cadence, exactly, on the in-memory coordinator with
//! paused time — written for mutants of `guard.rs` that `scripts/mutants.sh core` found
//! surviving lock-core's other tests and the memory suite.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed expectation is a failed test

use std::{sync::Arc, time::Duration};

use lock_core::{DistributedLockExt, DynLock, InMemoryLock};
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

//! Issue 44, items 14 and 15, against the real server: an operator's force-release is pushed
//! to the old holder (`NOTIFY`), whose guard loses the lease at once (not at its next renewal),
//! and only when its grant really is gone; a waiter killed just before a hand-off holds the lock
//! for the hand-off's short first lease, not for its TTL.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed expectation is a failed test

use std::{process::Stdio, sync::Arc, time::Duration};

use conformance::{backend_url, fresh_key};
use lock_core::{DistributedLock, DistributedLockExt, LockKey, LossReason};
use lock_pg::{PgLock, sqlx};
use tokio::time::{Instant, sleep, timeout};

const LONG: Duration = Duration::from_secs(30);

/// Item 14: with a 30 s TTL the watchdog renews every 10 s; the force-release's notification
/// makes the old holder's `lost()` complete within a statement of it (red before: `watch_lost`
/// never completed, and `lost()` came at the next renewal, ~10 s later).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_force_release_is_pushed_to_the_old_holder_at_once() {
    let Some(url) = backend_url("DISTLOCK_TEST_PG_URL") else {
        return;
    };
    let holder = Arc::new(PgLock::connect_url(&url).await.unwrap());
    let operator = PgLock::connect_url(&url).await.unwrap();
    let key = fresh_key("pushed-loss");
    let guard = holder
        .lock(&key)
        .ttl(LONG)
        .try_acquire()
        .await
        .unwrap()
        .expect("a fresh key is free");
    // The guard's watch opens the client's LISTEN connection when the guard is registered; a
    // force-release before that is found by renewals only.
    sleep(Duration::from_millis(300)).await;
    let fence = guard.fencing_token().unwrap();
    let started = Instant::now();
    assert!(operator.force_release_grant(&key, fence).await.unwrap());
    let released = started.elapsed();
    timeout(Duration::from_secs(2), guard.lost())
        .await
        .expect("the old holder did not learn of the force-release within 2 s (TTL 30 s)");
    let lost = started.elapsed();
    eprintln!("force-release answered after {released:?}, lost() after {lost:?}");
    assert_eq!(guard.loss_reason(), Some(LossReason::Revoked));
    assert!(!guard.release().await.unwrap());
}

/// A notification that names a live grant (sent by any role that may `NOTIFY`, or stale) never
/// makes its holder stop: the holder reads the row, finds its own grant and keeps the lease. A
/// real force-release of another lock of the same client, notified after the forged one on the
/// same channel, shows that the forged one was handled by then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_loss_notification_does_not_stop_a_live_holder() {
    let Some(url) = backend_url("DISTLOCK_TEST_PG_URL") else {
        return;
    };
    let holder = Arc::new(PgLock::connect_url(&url).await.unwrap());
    let admin = sqlx::PgPool::connect(&url).await.unwrap();
    let (kept, removed) = (fresh_key("forged-kept"), fresh_key("forged-removed"));
    let guard = holder.lock(&kept).ttl(LONG).try_acquire().await.unwrap();
    let guard = guard.expect("free");
    let other = holder.lock(&removed).ttl(LONG).try_acquire().await.unwrap();
    let other = other.expect("free");
    sleep(Duration::from_millis(300)).await;
    let sent = holder.statements_sent();
    let payload = format!("{}:{}", guard.fencing_token().unwrap(), kept.as_str());
    sqlx::query("SELECT pg_notify('distlock_lost', $1)")
        .bind(payload)
        .execute(&admin)
        .await
        .unwrap();
    // The holder checks the notification with one read of the row.
    let until = Instant::now() + Duration::from_secs(5);
    while holder.statements_sent() == sent {
        assert!(Instant::now() < until, "the holder never read the row");
        sleep(Duration::from_millis(5)).await;
    }
    let operator = PgLock::connect_url(&url).await.unwrap();
    assert!(operator.force_release(&removed).await.unwrap());
    timeout(Duration::from_secs(2), other.lost())
        .await
        .expect("the real force-release was pushed");
    assert!(
        !guard.is_lost(),
        "a forged notification stopped a live holder"
    );
    let info = operator.inspect(&kept).await.unwrap().expect("still held");
    assert_eq!(info.fencing_token, guard.fencing_token());
    assert!(guard.release().await.unwrap());
}

/// The waiter of [`a_waiter_killed_before_a_hand_off_holds_the_lock_for_its_first_lease_only`],
/// in a process of its own (this test binary, run again with the key in its environment): it
/// queues and waits until the parent kills it. Without that environment it does nothing.
#[tokio::test]
async fn child_waiter() {
    let (Ok(url), Ok(key)) = (
        std::env::var("DISTLOCK_CHILD_URL"),
        std::env::var("DISTLOCK_CHILD_KEY"),
    ) else {
        return;
    };
    let lock = PgLock::connect_url(&url).await.unwrap();
    let key = LockKey::new(key).unwrap();
    let got = lock.acquire(&key, LONG, Instant::now() + LONG).await;
    panic!("the child waiter was meant to be killed while waiting: {got:?}");
}

/// Item 15: a waiter SIGKILLed while queued is the one a release hands the lock to (its entry is
/// still live); it holds the lock only for the hand-off's short first lease, so the next waiter
/// gets it within 2 s of the release, not after the dead waiter's 30 s TTL (red before: the next
/// waiter's 10 s wait timed out).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_killed_before_a_hand_off_holds_the_lock_for_its_first_lease_only() {
    let Some(url) = backend_url("DISTLOCK_TEST_PG_URL") else {
        return;
    };
    let holder = PgLock::connect_url(&url).await.unwrap();
    let next = PgLock::connect_url(&url).await.unwrap();
    let key = fresh_key("dead-waiter");
    let lease = holder.try_acquire(&key, LONG).await.unwrap().expect("free");
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["child_waiter", "--exact", "--nocapture", "--test-threads=1"])
        .env("DISTLOCK_CHILD_URL", &url)
        .env("DISTLOCK_CHILD_KEY", key.as_str())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let until = Instant::now() + Duration::from_secs(20);
    loop {
        let info = holder.inspect(&key).await.unwrap().expect("held");
        if info.waiters == Some(1) {
            break;
        }
        assert!(Instant::now() < until, "the child never queued");
        sleep(Duration::from_millis(10)).await;
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let released = Instant::now();
    assert!(holder.release(&lease).await.unwrap());
    let info = holder.inspect(&key).await.unwrap().expect("handed off");
    let shown = info
        .holder
        .map(|h| h.as_str().to_owned())
        .unwrap_or_default();
    assert!(
        shown.contains(&format!("pid={} ", child.id())),
        "the release granted the dead waiter: {shown}"
    );
    let left = info.ttl_remaining.unwrap();
    assert!(left <= Duration::from_millis(1500), "first lease {left:?}");
    let got = next
        .acquire(&key, LONG, released + Duration::from_secs(10))
        .await
        .expect("the next waiter waited out the dead waiter's whole TTL");
    let delay = released.elapsed();
    eprintln!(
        "the next waiter got the lock {delay:?} after the release (dead waiter's grant: {left:?})"
    );
    assert!(delay <= Duration::from_millis(2500), "{delay:?}");
    assert!(got.fencing_token() > info.fencing_token);
    assert!(next.release(&got).await.unwrap());
}

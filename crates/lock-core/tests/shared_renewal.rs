//! The renewal scheduler every guard of a client shares (`renewer.rs`): many held locks cost
//! one task, not one per guard, and each lock still keeps its own deadline, renewals and
//! loss — a neighbour's loss, release or renewal never touches another slot.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed expectation is a failed test

mod support;

use support::hold;

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use lock_core::raw::async_trait;
use lock_core::{
    Capabilities, DistributedLock, DistributedLockExt, DynLock, HolderInfo, InMemoryLock, Lease,
    LockGuard, LockKey, LossReason, Result,
};
use tokio::time::{Instant, sleep, timeout};

fn alive_tasks() -> usize {
    tokio::runtime::Handle::current()
        .metrics()
        .num_alive_tasks()
}

/// 2,000 guards of one client: one task renews them all, every one of them on schedule; an
/// operator's force-release (pushed through `watch_lost`) and a coordinator-side expiry
/// (answered `NotHeld` by the next renewal) lose exactly the locks they hit, with their own
/// reason, and nothing else; after the last release the task is gone.
#[tokio::test(start_paused = true)]
async fn many_guards_of_one_client_share_one_task_and_lose_only_what_was_hit() {
    let coordinator = InMemoryLock::new();
    let lock: DynLock = Arc::new(coordinator.client());
    let operator = coordinator.client();
    let before = alive_tasks();
    let ttl = Duration::from_secs(3);
    let n = 2000;
    let guards = hold(&lock, "shared/many", n, ttl).await;
    assert!(
        alive_tasks() <= before + 1,
        "{} tasks for {n} guards (one scheduler expected)",
        alive_tasks() - before
    );

    // Three intervals: each guard renews about three times, none is lost.
    sleep(ttl).await;
    for g in &guards {
        assert!(!g.is_lost(), "{:?} lost: {:?}", g.key(), g.loss_reason());
        assert!((2..=4).contains(&g.renewals()), "{}", g.renewals());
        assert!(g.local_deadline() > Instant::now() + ttl / 2);
    }

    // Every 7th lock is force-released (pushed), every 7th + 3 expires behind the client's back.
    for (i, g) in guards.iter().enumerate() {
        match i % 7 {
            0 => assert!(operator.force_release(g.key()).await.unwrap()),
            3 => coordinator.force_expire(g.key()),
            _ => {}
        }
    }
    sleep(ttl).await;
    let renewals_then: Vec<u64> = guards.iter().map(LockGuard::renewals).collect();
    for (i, g) in guards.iter().enumerate() {
        let expected = match i % 7 {
            0 => Some(LossReason::Revoked),
            3 => Some(LossReason::NotHeld),
            _ => None,
        };
        assert_eq!(g.loss_reason(), expected, "lock {i}");
        assert_eq!(g.is_lost(), expected.is_some(), "lock {i}");
        if expected.is_some() {
            timeout(Duration::ZERO, g.lost())
                .await
                .expect("lost() has fired");
        }
    }
    // The survivors go on renewing; the lost ones stay as they were.
    sleep(ttl).await;
    for (i, g) in guards.iter().enumerate() {
        let lost = matches!(i % 7, 0 | 3);
        assert_eq!(
            g.renewals() > renewals_then[i],
            !lost,
            "lock {i}: renewals {} then {}",
            renewals_then[i],
            g.renewals()
        );
        assert_eq!(g.is_lost(), lost, "lock {i}");
    }

    // Released one by one: a survivor's release says true, a lost one's false.
    for (i, g) in guards.into_iter().enumerate() {
        let lost = matches!(i % 7, 0 | 3);
        assert_eq!(g.release().await.unwrap(), !lost, "lock {i}");
    }
    for i in 0..n {
        let key = format!("shared/many/{i}").try_into().unwrap();
        assert!(operator.inspect(&key).await.unwrap().is_none(), "lock {i}");
    }
    // With nothing left to serve, the scheduler's task ends.
    timeout(Duration::from_secs(1), async {
        while alive_tasks() > before {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the scheduler's task ends with its last slot");
}

/// Guards without a watchdog, each with its own TTL, held by one client at once: each one's
/// `lost()` fires at its own local deadline (tokio's timer resolution: within 1 ms), not at a
/// neighbour's, and a released guard's never fires.
#[tokio::test(start_paused = true)]
async fn each_slot_is_lost_at_its_own_deadline() {
    let lock: DynLock = Arc::new(InMemoryLock::new());
    let mut guards = Vec::new();
    for i in 0..50u64 {
        let guard = lock
            .lock(format!("shared/deadlines/{i}"))
            .ttl(Duration::from_millis(200 + 37 * i))
            .no_watchdog()
            .try_acquire()
            .await
            .unwrap()
            .expect("free");
        guards.push(guard);
    }
    // Every 5th is released before its deadline.
    let mut kept = Vec::new();
    for (i, g) in guards.into_iter().enumerate() {
        if i % 5 == 4 {
            assert!(g.release().await.unwrap());
        } else {
            kept.push(g);
        }
    }
    let fired: Vec<_> = kept
        .iter()
        .map(|g| {
            let lost = g.lost();
            async move {
                lost.await;
                Instant::now()
            }
        })
        .collect();
    let fired = futures::future::join_all(fired).await;
    for (g, at) in kept.iter().zip(fired) {
        let deadline = g.local_deadline();
        assert!(
            at >= deadline && at <= deadline + Duration::from_millis(1),
            "{:?}: lost {:?} after its deadline",
            g.key(),
            at.checked_duration_since(deadline)
        );
        assert_eq!(g.loss_reason(), Some(LossReason::DeadlinePassed));
    }
}

/// The in-memory coordinator behind renewals that take 50 ms, counting how many are in flight
/// at once.
#[derive(Debug)]
struct SlowRenewals {
    inner: InMemoryLock,
    in_flight: AtomicUsize,
    most: AtomicUsize,
}

#[async_trait]
impl lock_core::raw::Driver for SlowRenewals {
    fn backend_name(&self) -> &'static str {
        "slow-renewals"
    }
    fn capabilities(&self) -> Capabilities {
        DistributedLock::capabilities(&self.inner)
    }
    async fn try_acquire(&self, key: &LockKey, ttl: Duration) -> Result<Option<Lease>> {
        DistributedLock::try_acquire(&self.inner, key, ttl).await
    }
    async fn renew(&self, lease: &mut Lease, ttl: Duration) -> Result<()> {
        let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.most.fetch_max(now, Ordering::SeqCst);
        sleep(Duration::from_millis(50)).await;
        let result = DistributedLock::renew(&self.inner, lease, ttl).await;
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
        result
    }
    async fn release(&self, lease: &Lease) -> Result<bool> {
        DistributedLock::release(&self.inner, lease).await
    }
    async fn inspect(&self, key: &LockKey) -> Result<Option<HolderInfo>> {
        DistributedLock::inspect(&self.inner, key).await
    }
}

/// 10,000 locks taken at once come due at once: at most 4,096 of their renewals are in flight
/// together (each holds its lease and the driver's request), the rest wait their turn, and every
/// lock is still renewed in time, tick after tick.
#[tokio::test(start_paused = true)]
async fn renewals_in_flight_are_capped_and_all_still_renew() {
    let slow = Arc::new(SlowRenewals {
        inner: InMemoryLock::new(),
        in_flight: AtomicUsize::new(0),
        most: AtomicUsize::new(0),
    });
    let lock: DynLock = slow.clone();
    let ttl = Duration::from_secs(3);
    let guards = hold(&lock, "shared/capped", 10_000, ttl).await;
    sleep(ttl * 2).await;
    let most = slow.most.load(Ordering::SeqCst);
    assert!(
        (1000..=4096).contains(&most),
        "{most} renewals in flight at once"
    );
    for g in &guards {
        assert!(!g.is_lost(), "{:?} lost: {:?}", g.key(), g.loss_reason());
        assert!(g.renewals() >= 4, "{}", g.renewals());
    }
    for g in guards {
        assert!(g.release().await.unwrap());
    }
}

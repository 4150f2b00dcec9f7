//! The guard and `run_exclusive` under faults no real server is needed for: a grant whose reply
//! arrives after its local deadline, a driver whose `renew` panics, a job that finishes in the
//! same poll as the loss, and watchdog intervals a lease cannot afford.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::Duration,
};

use lock_core::raw::async_trait;
use lock_core::{
    Capabilities, DistributedLock, DistributedLockExt, Error, HolderInfo, InMemoryLock, Lease,
    LockKey, LockOptions, LossReason, Result,
};
use tokio::time::{Instant, sleep, timeout};

/// The in-memory coordinator with faults injected, one kind per test: grant replies that arrive
/// late (a stalled link, a GC pause between send and receive), a `renew` that panics (a driver
/// bug), a slow `release`.
#[derive(Debug)]
struct Faulty {
    inner: InMemoryLock,
    /// How long the reply to the `n`-th grant (from 0) with this TTL takes.
    reply_delay: fn(usize, Duration) -> Duration,
    renew_panics: bool,
    release_delay: Duration,
    attempts: AtomicUsize,
    releases: AtomicUsize,
}

impl Faulty {
    fn new(inner: InMemoryLock) -> Self {
        Self {
            inner,
            reply_delay: |_, _| Duration::ZERO,
            renew_panics: false,
            release_delay: Duration::ZERO,
            attempts: AtomicUsize::new(0),
            releases: AtomicUsize::new(0),
        }
    }

    /// Every grant's reply takes 300 ms.
    fn late_replies(inner: InMemoryLock) -> Arc<Self> {
        Arc::new(Self {
            reply_delay: |_, _| Duration::from_millis(300),
            ..Self::new(inner)
        })
    }
}

#[async_trait]
impl lock_core::raw::Driver for Faulty {
    fn backend_name(&self) -> &'static str {
        "faulty"
    }
    fn capabilities(&self) -> Capabilities {
        lock_core::DistributedLock::capabilities(&self.inner)
    }
    async fn try_acquire(&self, key: &LockKey, ttl: Duration) -> Result<Option<Lease>> {
        let n = self.attempts.fetch_add(1, Ordering::SeqCst);
        let lease = lock_core::DistributedLock::try_acquire(&self.inner, key, ttl).await?;
        let delay = (self.reply_delay)(n, ttl);
        if !delay.is_zero() {
            sleep(delay).await;
        }
        Ok(lease)
    }
    async fn renew(&self, lease: &mut Lease, ttl: Duration) -> Result<()> {
        assert!(
            !self.renew_panics,
            "a driver bug in renew (expected by this test)"
        );
        lock_core::DistributedLock::renew(&self.inner, lease, ttl).await
    }
    async fn release(&self, lease: &Lease) -> Result<bool> {
        self.releases.fetch_add(1, Ordering::SeqCst);
        if !self.release_delay.is_zero() {
            sleep(self.release_delay).await;
        }
        lock_core::DistributedLock::release(&self.inner, lease).await
    }
    async fn inspect(&self, key: &LockKey) -> Result<Option<HolderInfo>> {
        lock_core::DistributedLock::inspect(&self.inner, key).await
    }
}

#[tokio::test(start_paused = true)]
async fn a_job_never_starts_on_a_lease_that_arrived_expired() {
    let coordinator = InMemoryLock::new();
    let lock = Faulty::late_replies(coordinator.client());
    let ran = Arc::new(AtomicBool::new(false));
    let flag = ran.clone();
    let out = lock
        .run_exclusive(
            "faults/expired-on-arrival",
            LockOptions::with_ttl(Duration::from_millis(100)),
            |_ctx| async move { flag.store(true, Ordering::SeqCst) },
        )
        .await;
    assert!(matches!(out, Err(Error::NotHeld { .. })), "{out:?}");
    assert!(
        !ran.load(Ordering::SeqCst),
        "the job ran on an expired lease"
    );
    assert_eq!(
        lock.releases.load(Ordering::SeqCst),
        1,
        "the late grant is given back"
    );
}

#[tokio::test(start_paused = true)]
async fn a_guard_on_a_lease_that_arrived_expired_is_born_lost() {
    let lock = Faulty::late_replies(InMemoryLock::new());
    let guard = lock
        .lock("faults/expired-guard")
        .ttl(Duration::from_millis(100))
        .try_acquire()
        .await
        .unwrap()
        .expect("free");
    // Before the watchdog task has had a chance to run:
    assert!(guard.is_lost());
    assert_eq!(guard.loss_reason(), Some(LossReason::DeadlinePassed));
    assert!(
        futures::FutureExt::now_or_never(guard.lost()).is_some(),
        "lost() is complete when the guard is handed over"
    );
}

#[tokio::test(start_paused = true)]
async fn the_default_acquire_gives_back_a_late_grant_and_tries_again() {
    // A reply slower than the TTL on the first attempt only.
    let lock = Faulty {
        reply_delay: |n, ttl| if n == 0 { ttl * 2 } else { Duration::ZERO },
        ..Faulty::new(InMemoryLock::new())
    };
    let key = LockKey::new("faults/poll-late").unwrap();
    let ttl = Duration::from_millis(200);
    let lease =
        lock_core::raw::poll_acquire(&lock, &key, ttl, Instant::now() + Duration::from_secs(5))
            .await
            .unwrap();
    assert!(
        lease.is_locally_valid(),
        "the lease handed over is still valid"
    );
}

/// A driver whose `renew` panics (a bug, an unexpected reply shape).
fn panicking_renew(inner: InMemoryLock) -> Arc<Faulty> {
    Arc::new(Faulty {
        renew_panics: true,
        ..Faulty::new(inner)
    })
}

#[tokio::test(start_paused = true)]
async fn a_dead_watchdog_fires_lost_and_release_still_releases() {
    let coordinator = InMemoryLock::new();
    let lock = panicking_renew(coordinator.client());
    let ttl = Duration::from_secs(30);
    let guard = lock
        .lock("faults/watchdog-panic")
        .ttl(ttl)
        .try_acquire()
        .await
        .unwrap()
        .expect("free");
    let key = guard.key().clone();
    let started = Instant::now();
    // The first renewal (about ttl/3 in) panics: lost() fires then, not at the deadline.
    timeout(ttl / 2, guard.lost())
        .await
        .expect("lost() fires when the watchdog dies");
    assert!(started.elapsed() < ttl / 2);
    assert_eq!(guard.loss_reason(), Some(LossReason::RenewFailed));
    assert!(guard.is_lost());
    // Nobody renews it any more: it is given back at once instead of stranding the key for
    // the rest of its 30 s TTL, and release() reports that release.
    // (The effect, not `cleanup::finish`: see a_dropped_guard_with_a_dead_watchdog_still_releases.)
    let client = coordinator.client();
    timeout(Duration::from_secs(1), async {
        while client.inspect(&key).await.unwrap().is_some() {
            sleep(Duration::from_millis(1)).await;
        }
    })
    .await
    .expect("given back at once");
    assert!(
        guard.release().await.unwrap(),
        "release() reports the grant released"
    );
}

#[tokio::test(start_paused = true)]
async fn a_dropped_guard_with_a_dead_watchdog_still_releases() {
    let coordinator = InMemoryLock::new();
    let lock = panicking_renew(coordinator.client());
    let guard = lock
        .lock("faults/watchdog-panic-drop")
        .ttl(Duration::from_secs(30))
        .try_acquire()
        .await
        .unwrap()
        .expect("free");
    let key = guard.key().clone();
    timeout(Duration::from_secs(20), guard.lost())
        .await
        .expect("lost() fires when the watchdog dies");
    drop(guard);
    // Waits for the effect, not for `cleanup::finish`: that counts the clean-ups of the whole
    // process, and another test's (real-time) clean-up would make this paused clock jump past
    // any limit at once.
    let client = coordinator.client();
    timeout(Duration::from_secs(5), async {
        while client.inspect(&key).await.unwrap().is_some() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the dropped guard's background release removes the lease");
}

#[tokio::test(start_paused = true)]
async fn a_job_that_finishes_in_the_same_poll_as_the_loss_is_reported_done() {
    let lock = Arc::new(InMemoryLock::new());
    // No renewals: the loss comes at the local deadline, and the job finishes on that very
    // signal, so both are ready in the same poll.
    let out = lock
        .run_exclusive(
            "faults/same-poll",
            LockOptions::with_ttl(Duration::from_millis(300)).no_watchdog(),
            |ctx| async move {
                ctx.lost().await;
                "committed"
            },
        )
        .await;
    assert!(
        matches!(out, Ok(Some("committed"))),
        "a finished job reported as {out:?}; a retrying caller would run it twice"
    );
}

#[tokio::test(start_paused = true)]
async fn a_job_still_running_at_the_loss_is_cancelled() {
    let lock = Arc::new(InMemoryLock::new());
    let out = lock
        .run_exclusive(
            "faults/cancelled",
            LockOptions::with_ttl(Duration::from_millis(300)).no_watchdog(),
            |_ctx| async move {
                sleep(Duration::from_secs(60)).await;
                "too late"
            },
        )
        .await;
    assert!(matches!(out, Err(Error::NotHeld { .. })), "{out:?}");
}

/// A runtime blocked past the deadline (a CPU-bound step in the job) cannot run the watchdog
/// task; `is_lost()` must still say the truth.
#[tokio::test(flavor = "current_thread")]
async fn is_lost_is_true_at_the_deadline_even_before_the_watchdog_runs() {
    let lock = Arc::new(InMemoryLock::new());
    let guard = lock
        .lock("faults/is-lost-at-deadline")
        .ttl(Duration::from_millis(100))
        .no_watchdog()
        .try_acquire()
        .await
        .unwrap()
        .expect("free");
    assert!(!guard.is_lost());
    // Deliberately blocks the only runtime thread: no other task runs meanwhile.
    std::thread::sleep(Duration::from_millis(250));
    assert!(guard.is_lost(), "past the local deadline");
    assert_eq!(guard.loss_reason(), Some(LossReason::DeadlinePassed));
}

#[tokio::test]
async fn a_watchdog_interval_the_lease_cannot_afford_is_refused_before_io() {
    let lock = Arc::new(InMemoryLock::new());
    let ttl = Duration::from_secs(4);
    for interval in [ttl, ttl - Duration::from_millis(1), ttl * 3 / 4] {
        let err = lock
            .lock("faults/interval")
            .ttl(ttl)
            .watchdog(interval)
            .try_acquire()
            .await
            .unwrap_err();
        assert!(matches!(err, Error::Config(_)), "{interval:?}: {err}");
    }
    let guard = lock
        .lock("faults/interval")
        .ttl(ttl)
        .watchdog(ttl / 2)
        .try_acquire()
        .await
        .unwrap();
    assert!(guard.is_some());
}

/// A lease that starts old (a direct grant counts from its waiter's earlier request) with a
/// long interval: the first renewal comes early enough to keep it, instead of after the deadline.
#[tokio::test(start_paused = true)]
async fn an_aged_lease_with_a_long_interval_is_renewed_before_its_deadline() {
    // Handed over a third of the TTL after it started.
    let lock = Arc::new(Faulty {
        reply_delay: |_, ttl| ttl / 3,
        ..Faulty::new(InMemoryLock::new())
    });
    let ttl = Duration::from_secs(3);
    let guard = lock
        .lock("faults/aged")
        .ttl(ttl)
        .watchdog(ttl * 7 / 10)
        .try_acquire()
        .await
        .unwrap()
        .expect("free");
    let lost = timeout(ttl * 3, guard.lost()).await;
    assert!(lost.is_err(), "lost: {:?}", guard.loss_reason());
    assert!(guard.renewals() >= 2);
}

/// `guard.release()` dropped after its 1st, 2nd, … poll (a caller's timeout or `select!`) still
/// releases the lock: the rest of the release goes to the background, as a dropped guard's does.
#[tokio::test(start_paused = true)]
async fn a_release_dropped_at_any_poll_still_releases() {
    let mut completed = false;
    for polls in 1..=16 {
        let coordinator = InMemoryLock::new();
        // The release request takes 10 ms to get through.
        let lock = Arc::new(Faulty {
            release_delay: Duration::from_millis(10),
            ..Faulty::new(coordinator.client())
        });
        let guard = lock
            .lock("faults/release-dropped")
            .ttl(Duration::from_secs(30))
            .try_acquire()
            .await
            .unwrap()
            .expect("free");
        let key = guard.key().clone();
        let mut release = Box::pin(guard.release());
        let mut done = false;
        for _ in 0..polls {
            if futures::poll!(release.as_mut()).is_ready() {
                done = true;
                break;
            }
            sleep(Duration::from_millis(1)).await;
        }
        drop(release);
        completed |= done;
        // The effect, not `cleanup::finish` (a process-wide count: another test's real-time
        // clean-up makes this paused clock jump past any limit at once).
        let client = coordinator.client();
        let freed = timeout(Duration::from_secs(5), async {
            while client.inspect(&key).await.unwrap().is_some() {
                sleep(Duration::from_millis(1)).await;
            }
        })
        .await;
        assert!(
            freed.is_ok(),
            "release() dropped after {polls} polls left the lock held"
        );
    }
    assert!(completed, "the last case lets the release complete");
}

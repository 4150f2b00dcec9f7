//! Background clean-ups, and waiting for them before a process exits.
//!
//! Some clean-ups cannot be awaited by whoever causes them, because they start in a `Drop`: a
//! dropped `acquire` future leaves its lock's wait queue (and passes on a grant that crossed
//! its leaving), a dropped [`crate::LockGuard`] releases its lease, a grant whose reply was
//! lost is undone. Drivers start them with [`spawn`]; a program that is about to exit — the
//! `distlock` CLI interrupted while it waits, a service shutting down — calls [`finish`] so
//! that they get done instead of being dropped with the runtime. A clean-up that never runs
//! costs others time: a waiter that left no trace of leaving may still be handed the lock, which
//! then stays unused until its TTL runs out.

use std::{
    future::Future,
    sync::{
        OnceLock,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use tokio::{
    sync::Notify,
    time::{Instant, sleep_until},
};

use crate::raw::Backoff;

static PENDING: AtomicUsize = AtomicUsize::new(0);

fn finished() -> &'static Notify {
    static FINISHED: OnceLock<Notify> = OnceLock::new();
    FINISHED.get_or_init(Notify::new)
}

/// Counts one clean-up as pending until dropped (when its task completes or is cancelled with
/// its runtime).
struct Pending;

impl Drop for Pending {
    fn drop(&mut self) {
        PENDING.fetch_sub(1, Ordering::AcqRel);
        finished().notify_waiters();
    }
}

/// Runs `task` in the background on the current tokio runtime, counted by [`pending`] and
/// awaited by [`finish`]. Returns `false`, dropping `task`, outside a runtime.
pub fn spawn(task: impl Future<Output = ()> + Send + 'static) -> bool {
    let Ok(rt) = tokio::runtime::Handle::try_current() else {
        return false;
    };
    PENDING.fetch_add(1, Ordering::AcqRel);
    let pending = Pending;
    rt.spawn(async move {
        let _pending = pending;
        task.await;
    });
    true
}

/// How many clean-ups started by [`spawn`] have not finished yet (in this process).
pub fn pending() -> usize {
    PENDING.load(Ordering::Acquire)
}

/// Waits until every clean-up started by [`spawn`] so far (and any they start) has finished,
/// or `limit` has passed. Returns whether none is pending. Some clean-ups retry until the grant
/// they undo would have expired anyway, so bound the wait by what exiting later is worth.
pub async fn finish(limit: Duration) -> bool {
    let until = Instant::now() + limit;
    loop {
        let notified = finished().notified();
        tokio::pin!(notified);
        // Registered before the check, so a clean-up finishing in between still wakes us.
        notified.as_mut().enable();
        if pending() == 0 {
            return true;
        }
        if tokio::time::timeout_at(until, notified).await.is_err() {
            return pending() == 0;
        }
    }
}

/// The pacing of a background clean-up's attempts, one policy for every driver: the first
/// attempt at once, then a jittered backoff from [`Retries::FIRST_PAUSE`] growing to
/// [`Retries::LONGEST_PAUSE`], never sleeping past the end, and no attempt once the end has
/// passed. Most clean-ups end where the grant they undo would have expired anyway; those bound by
/// something else (a session that deletes what they would delete when it ends) run
/// [`Retries::unbounded`] and stop themselves.
///
/// ```
/// # use lock_core::raw::cleanup::Retries;
/// # use tokio::time::{Duration, Instant};
/// # async fn undo() -> bool { true }
/// # async fn demo() {
/// let mut retries = Retries::until(Instant::now() + Duration::from_secs(30));
/// while retries.next().await {
///     if undo().await {
///         break;
///     }
/// }
/// # }
/// ```
#[derive(Debug)]
pub struct Retries {
    until: Option<Instant>,
    backoff: Backoff,
    started: bool,
}

impl Retries {
    /// The pause after the first failed attempt (about; jittered).
    pub const FIRST_PAUSE: Duration = Duration::from_millis(50);
    /// The longest pause between two attempts.
    pub const LONGEST_PAUSE: Duration = Duration::from_secs(1);

    /// Attempts until `until`.
    pub fn until(until: Instant) -> Self {
        Self::new(Some(until))
    }

    /// Attempts until the caller stops.
    pub fn unbounded() -> Self {
        Self::new(None)
    }

    fn new(until: Option<Instant>) -> Self {
        Self {
            until,
            backoff: Backoff::new(Self::FIRST_PAUSE, Self::LONGEST_PAUSE),
            started: false,
        }
    }

    /// When this clean-up ends, if it has an end.
    pub fn end(&self) -> Option<Instant> {
        self.until
    }

    /// Waits before the next attempt (not before the first) and says whether one is due:
    /// `false` once the end has passed.
    pub async fn next(&mut self) -> bool {
        self.next_or(std::future::pending::<()>()).await
    }

    /// As [`Retries::next`], but the pause also ends when `early` completes (a session that
    /// came back, a push that says to look again).
    pub async fn next_or(&mut self, early: impl Future<Output = ()>) -> bool {
        if self.started {
            let mut wake = Instant::now() + self.backoff.next_delay();
            if let Some(until) = self.until {
                wake = wake.min(until);
            }
            tokio::select! {
                () = sleep_until(wake) => {}
                () = early => {}
            }
        }
        self.started = true;
        self.until.is_none_or(|until| Instant::now() < until)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn finish_waits_for_the_clean_ups_in_flight_and_no_longer_than_its_limit() {
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
        assert!(spawn(async move {
            let _ = rx.await;
            let _ = done_tx.send(());
        }));
        assert!(pending() >= 1);
        assert!(
            !finish(Duration::from_millis(50)).await,
            "a clean-up is still waiting"
        );
        tx.send(()).unwrap();
        assert!(finish(Duration::from_secs(10)).await);
        done_rx.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn retries_start_at_once_pause_within_the_policy_and_stop_at_the_end() {
        let start = Instant::now();
        let mut retries = Retries::until(start + Duration::from_secs(3));
        assert_eq!(retries.end(), Some(start + Duration::from_secs(3)));
        assert!(retries.next().await);
        assert_eq!(Instant::now(), start, "the first attempt does not wait");
        let mut last = Instant::now();
        let mut attempts = 1;
        while retries.next().await {
            let pause = Instant::now() - last;
            assert!(pause >= Retries::FIRST_PAUSE / 2, "{pause:?}");
            assert!(pause <= Retries::LONGEST_PAUSE, "{pause:?}");
            last = Instant::now();
            attempts += 1;
        }
        assert!(
            Instant::now() <= start + Duration::from_secs(3),
            "never sleeps past the end"
        );
        assert!((4..60).contains(&attempts), "{attempts} attempts in 3 s");
        assert!(!retries.next().await, "no attempt after the end");
    }

    #[tokio::test(start_paused = true)]
    async fn a_pause_ends_early_when_told() {
        let start = Instant::now();
        let mut retries = Retries::unbounded();
        assert!(retries.next().await);
        for _ in 0..20 {
            assert!(retries.next_or(std::future::ready(())).await);
        }
        assert_eq!(Instant::now(), start);
        assert_eq!(retries.end(), None);
    }

    #[test]
    fn outside_a_runtime_nothing_is_spawned() {
        assert!(!spawn(async {}));
    }
}

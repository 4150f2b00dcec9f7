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

use tokio::{sync::Notify, time::Instant};

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

    #[test]
    fn outside_a_runtime_nothing_is_spawned() {
        assert!(!spawn(async {}));
    }
}

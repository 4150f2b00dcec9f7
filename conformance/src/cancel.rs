//! Cancellation at every poll: each operation's future is dropped after its 1st, 2nd, … poll
//! (until it completes uncancelled, at most [`MAX_POLLS`]), and after each drop the same client
//! and a second one check that nothing was left behind: the key becomes acquirable within its
//! TTL plus slack, nobody stays queued, a lease that was released or revoked renews as
//! `NotHeld` (and releases as `false`) without touching the new holder, fences still increase,
//! and every background clean-up finishes.
//!
//! Declared as a child of `properties` (which re-exports the properties), so that it shares the
//! helpers there.

use std::{
    future::Future,
    pin::{Pin, pin},
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    task::Poll,
    time::Duration,
};

use futures::future::poll_fn;
use lock_core::{DistributedLockExt, DynLock, Error, FencingToken, Lease, LockKey, LockOptions};
use tokio::time::{Instant, sleep, timeout};

use super::{LONG_TTL, SLACK, release, take};
use crate::{Harness, Outcome};

/// The most polls after which an operation is dropped (an operation that needs more is covered
/// up to here).
const MAX_POLLS: usize = 64;

/// Polls `fut` until it completes (`Some`) or until `*polls` — its `Pending` answers so far,
/// counted across calls — reaches `n` (`None`; the caller then drops it, or polls on).
async fn poll_up_to<F: Future + ?Sized>(
    mut fut: Pin<&mut F>,
    n: usize,
    polls: &mut usize,
) -> Option<F::Output> {
    if *polls >= n {
        return None;
    }
    poll_fn(|cx| match fut.as_mut().poll(cx) {
        Poll::Ready(out) => Poll::Ready(Some(out)),
        Poll::Pending => {
            *polls += 1;
            if *polls >= n {
                Poll::Ready(None)
            } else {
                Poll::Pending
            }
        }
    })
    .await
}

/// Runs `fut`, dropping it after its `n`th poll: `Some` when it completed within `n` polls.
async fn drop_after<F: Future>(fut: F, n: usize) -> Option<F::Output> {
    let mut polls = 0;
    poll_up_to(pin!(fut), n, &mut polls).await
}

/// The TTL of the operations whose future is dropped: a grant left behind lives this long.
fn cancel_ttl(h: &Harness, client: &DynLock) -> Duration {
    client.capabilities().effective_ttl(h.short_ttl())
}

/// The TTL asked for by the dropped acquisitions: longer than the wait for the key
/// ([`cancel_ttl`] + slack), so that a grant the drop leaks, rather than gives back or passes on,
/// fails the check instead of expiring in time; short enough that the clean-ups which retry
/// until such a grant would have expired (PostgreSQL's) finish within [`CLEANUP_LIMIT`].
fn telling_ttl(h: &Harness) -> Duration {
    h.short_ttl() + SLACK * 2
}

/// A key's fence so far: `client` takes and releases it (`None` without fencing).
async fn fence_of_a_grant(client: &DynLock, key: &LockKey) -> Option<FencingToken> {
    let lease = take(client, key, LONG_TTL).await;
    assert!(release(client, &lease).await);
    lease.fencing_token()
}

fn assert_fence_increased(what: &str, before: Option<FencingToken>, lease: &Lease) {
    if let (Some(before), Some(now)) = (before, lease.fencing_token()) {
        assert!(now > before, "{what}: fence {now:?} after {before:?}");
    }
}

/// A lease of `owner` that must no longer be held when the check runs (released, revoked, or
/// never granted).
struct Stale<'a> {
    owner: &'a DynLock,
    lease: Lease,
}

/// What every property checks after a drop. `same` ran the dropped operation; `other` is a
/// second client. The key must be acquirable by `other` within `ttl` + slack of `since` (a grant
/// left behind by the dropped future may live one TTL), with no waiter queued behind it; `stale`
/// (if any) neither renews nor releases the new holder's lock; `same` acquires right after;
/// fences increase; the clean-ups the drop started finish.
async fn assert_left_nothing(
    what: &str,
    (same, other): (&DynLock, &DynLock),
    key: &LockKey,
    ttl: Duration,
    since: Instant,
    before: Option<FencingToken>,
    stale: Option<Stale<'_>>,
) {
    let granted = match other.acquire(key, LONG_TTL, since + ttl + SLACK).await {
        Ok(lease) => lease,
        Err(e) => panic!("{what}: the key was not acquirable within ttl {ttl:?} + slack: {e}"),
    };
    assert_fence_increased(what, before, &granted);
    // A queue entry the dropped call left may take its clean-up a moment to go (ZooKeeper's
    // sequential node, deleted in the background), but not longer than the grant it could get.
    loop {
        let info = same.inspect(key).await.unwrap();
        let waiters = info.as_ref().and_then(|i| i.waiters);
        if matches!(waiters, None | Some(0)) {
            break;
        }
        assert!(
            Instant::now() < since + ttl + SLACK,
            "{what}: {waiters:?} waiters still queued behind the new holder"
        );
        sleep(Duration::from_millis(10)).await;
    }
    if let Some(Stale { owner, mut lease }) = stale {
        if owner.capabilities().renew {
            let ttl = lease.ttl();
            match owner.renew(&mut lease, ttl).await {
                Err(Error::NotHeld { .. }) => {}
                other => panic!("{what}: renew of a lease no longer held: {other:?}, not NotHeld"),
            }
        }
        assert!(
            !release(owner, &lease).await,
            "{what}: release of a lease no longer held reported true"
        );
    }
    assert!(
        release(other, &granted).await,
        "{what}: the new holder lost its lock (to a stale renew or release?)"
    );
    let again = match same.try_acquire(key, LONG_TTL).await {
        Ok(Some(lease)) => lease,
        Ok(None) => panic!("{what}: the client whose future was dropped cannot acquire a free key"),
        Err(e) => panic!("{what}: try_acquire after the drop failed: {e}"),
    };
    assert_fence_increased(what, granted.fencing_token(), &again);
    assert!(release(same, &again).await);
}

/// How long the clean-ups may take before one counts as leaked. Some retry until the grant they
/// undo would have expired (a backend's request timeout plus the TTL: 5 s + [`telling_ttl`] for
/// PostgreSQL), so they are awaited once per property, where they have run side by side; and
/// the count is the process's, so it includes those of properties running alongside, whose
/// grants may be [`LONG_TTL`] ones. A clean-up that never ends still fails it.
const CLEANUP_LIMIT: Duration = Duration::from_secs(LONG_TTL.as_secs() + 3 * SLACK.as_secs());

/// How far the drops went (printed, so a run shows which polls were covered), once every
/// clean-up they started has finished. An operation still pending after [`MAX_POLLS`] polls is
/// not a cancellation defect; its later polls go uncovered.
async fn covered(op: &str, completed_at: Option<usize>) -> Outcome {
    let started = Instant::now();
    assert!(
        lock_core::cleanup::finish(CLEANUP_LIMIT).await,
        "{op}: {} clean-ups still pending {CLEANUP_LIMIT:?} after the last drop",
        lock_core::cleanup::pending()
    );
    let waited = started.elapsed();
    match completed_at {
        Some(n) => eprintln!(
            "{op}: completes at poll {n}; dropped after each poll before it; clean-ups done in {waited:?}"
        ),
        None => eprintln!("{op}: still pending after {MAX_POLLS} polls; dropped after each"),
    }
    Outcome::Passed
}

/// A `try_acquire` dropped after any of its polls leaves nothing behind: a grant it got stops
/// blocking others within one TTL.
pub async fn try_acquire_dropped_at_any_poll_leaves_nothing_behind(h: Harness) -> Outcome {
    let [a, b] = <[DynLock; 2]>::try_from(h.clients(2).await).ok().unwrap();
    let ttl = cancel_ttl(&h, &a);
    let mut completed_at = None;
    for n in 1..=MAX_POLLS {
        let key = h.key("cancel-try-acquire");
        let before = fence_of_a_grant(&a, &key).await;
        match drop_after(a.try_acquire(&key, telling_ttl(&h)), n).await {
            Some(Ok(Some(lease))) => {
                assert!(release(&a, &lease).await);
                completed_at = Some(n);
                break;
            }
            Some(other) => panic!("try_acquire of a free key: {other:?}"),
            None => {
                let what = format!("try_acquire dropped after poll {n}");
                assert_left_nothing(&what, (&a, &b), &key, ttl, Instant::now(), before, None).await;
            }
        }
    }
    covered("try_acquire", completed_at).await
}

/// Returns once `inspect` shows a waiter behind the holder (or a while, where the backend does
/// not count them, or at most the slack).
async fn queued(client: &DynLock, key: &LockKey) {
    let until = Instant::now() + SLACK;
    while Instant::now() < until {
        match client.inspect(key).await {
            Ok(Some(info)) => match info.waiters {
                Some(w) if w >= 1 => return,
                Some(_) => sleep(Duration::from_millis(5)).await,
                None => {
                    sleep(Duration::from_millis(100)).await;
                    return;
                }
            },
            _ => sleep(Duration::from_millis(5)).await,
        }
    }
}

/// An `acquire` queued behind a holder and dropped after any of its polls — while it waits, or
/// after the holder released with the grant on its way to it — leaves nothing behind: nobody
/// stays queued and the key is acquirable within the waiter's TTL.
pub async fn acquire_dropped_at_any_poll_leaves_nothing_behind(h: Harness) -> Outcome {
    let [a, b, holder] = <[DynLock; 3]>::try_from(h.clients(3).await).ok().unwrap();
    let ttl = cancel_ttl(&h, &a);
    let mut completed_at = None;
    for n in 1..=MAX_POLLS {
        let key = h.key("cancel-acquire");
        let before = fence_of_a_grant(&a, &key).await;
        let held = take(&holder, &key, LONG_TTL).await;
        let mut polls = 0;
        // Boxed (as every `DistributedLock` future is), so that `drop` below really drops it.
        let mut attempt = a.acquire(&key, telling_ttl(&h), Instant::now() + LONG_TTL);
        // Polled until its nth poll or until it is queued, whichever comes first; then the
        // holder releases; then it is polled on up to its nth poll and dropped — with the grant
        // possibly in flight to it.
        let early = tokio::select! {
            out = poll_up_to(attempt.as_mut(), n, &mut polls) => out,
            () = queued(&holder, &key) => None,
        };
        if let Some(out) = early {
            panic!("acquire completed while the key was held: {out:?}");
        }
        assert!(release(&holder, &held).await);
        let late = timeout(SLACK, poll_up_to(attempt.as_mut(), n, &mut polls))
            .await
            .unwrap_or(None);
        drop(attempt);
        let since = Instant::now();
        match late {
            Some(Ok(lease)) => {
                assert_fence_increased("acquire", before, &lease);
                assert!(release(&a, &lease).await);
                completed_at = Some(n);
                break;
            }
            Some(Err(e)) => panic!("acquire of a released key failed: {e}"),
            None => {
                let what = format!("acquire dropped after poll {n} ({polls} polls)");
                assert_left_nothing(&what, (&a, &b), &key, ttl, since, before, None).await;
            }
        }
    }
    covered("acquire", completed_at).await
}

/// A `renew` dropped after any of its polls leaves the lease held and releasable; once it is
/// released, renewing it answers `NotHeld` and does not extend the next holder.
pub async fn renew_dropped_at_any_poll_leaves_nothing_behind(h: Harness) -> Outcome {
    let [a, b] = <[DynLock; 2]>::try_from(h.clients(2).await).ok().unwrap();
    if !a.capabilities().renew {
        return Outcome::Skipped("renew not claimed");
    }
    let ttl = cancel_ttl(&h, &a);
    let mut completed_at = None;
    for n in 1..=MAX_POLLS {
        let key = h.key("cancel-renew");
        let before = fence_of_a_grant(&a, &key).await;
        let mut lease = take(&a, &key, LONG_TTL).await;
        let out = drop_after(a.renew(&mut lease, ttl), n).await;
        if let Some(Err(e)) = out {
            panic!("renew of a held lease failed: {e}");
        }
        let what = format!("renew dropped after poll {n}");
        assert!(
            release(&a, &lease).await,
            "{what}: the lease is no longer held (or no longer releasable)"
        );
        let stale = Stale {
            owner: &a,
            lease: lease.clone(),
        };
        assert_left_nothing(
            &what,
            (&a, &b),
            &key,
            ttl,
            Instant::now(),
            before,
            Some(stale),
        )
        .await;
        if out.is_some() {
            completed_at = Some(n);
            break;
        }
    }
    covered("renew", completed_at).await
}

/// Where the coordinator does not expire a lease by its TTL (the lease is the holder's session),
/// a dropped `release` or `force_release` that never reached it leaves the lease as it was:
/// then its holder must still hold it and release it.
async fn release_if_left_in_place(what: &str, owner: &DynLock, other: &DynLock, lease: &Lease) {
    if owner.capabilities().lease_ttl || !super::is_held_elsewhere(other, lease.key()).await {
        return;
    }
    assert!(
        release(owner, lease).await,
        "{what}: the key stays held, and not by the lease the dropped call left in place"
    );
}

/// A `release` dropped after any of its polls leaves nothing behind: the key is acquirable
/// within one TTL, and the lease then neither renews nor releases the new holder's lock.
pub async fn release_dropped_at_any_poll_leaves_nothing_behind(h: Harness) -> Outcome {
    let [a, b] = <[DynLock; 2]>::try_from(h.clients(2).await).ok().unwrap();
    let ttl = cancel_ttl(&h, &a);
    let mut completed_at = None;
    for n in 1..=MAX_POLLS {
        let key = h.key("cancel-release");
        let before = fence_of_a_grant(&a, &key).await;
        let lease = take(&a, &key, ttl).await;
        let out = drop_after(a.release(&lease), n).await;
        match &out {
            Some(Ok(true)) | None => {}
            Some(other) => panic!("release of a held lease: {other:?}"),
        }
        let what = format!("release dropped after poll {n}");
        release_if_left_in_place(&what, &a, &b, &lease).await;
        let stale = Stale { owner: &a, lease };
        assert_left_nothing(
            &what,
            (&a, &b),
            &key,
            ttl,
            Instant::now(),
            before,
            Some(stale),
        )
        .await;
        if out.is_some() {
            completed_at = Some(n);
            break;
        }
    }
    covered("release", completed_at).await
}

/// Where `force_release` is claimed, one dropped after any of its polls leaves nothing behind:
/// the key is acquirable within the holder's TTL, and the holder's lease then neither renews
/// nor releases the new holder's lock.
pub async fn force_release_dropped_at_any_poll_leaves_nothing_behind(h: Harness) -> Outcome {
    let [a, b, operator] = <[DynLock; 3]>::try_from(h.clients(3).await).ok().unwrap();
    if !a.capabilities().force_release {
        return Outcome::Skipped("force_release not claimed");
    }
    let ttl = cancel_ttl(&h, &a);
    let mut completed_at = None;
    for n in 1..=MAX_POLLS {
        let key = h.key("cancel-force-release");
        let before = fence_of_a_grant(&a, &key).await;
        let lease = take(&a, &key, ttl).await;
        let out = drop_after(operator.force_release(&key), n).await;
        match &out {
            Some(Ok(true)) | None => {}
            Some(other) => panic!("force_release of a held key: {other:?}"),
        }
        let what = format!("force_release dropped after poll {n}");
        release_if_left_in_place(&what, &a, &b, &lease).await;
        let stale = Stale { owner: &a, lease };
        assert_left_nothing(
            &what,
            (&operator, &b),
            &key,
            ttl,
            Instant::now(),
            before,
            Some(stale),
        )
        .await;
        if out.is_some() {
            completed_at = Some(n);
            break;
        }
    }
    covered("force_release", completed_at).await
}

/// An `inspect` dropped after any of its polls changes nothing: the holder keeps its lock and
/// releases it, after which the key is free at once.
pub async fn inspect_dropped_at_any_poll_leaves_nothing_behind(h: Harness) -> Outcome {
    let [a, b] = <[DynLock; 2]>::try_from(h.clients(2).await).ok().unwrap();
    let ttl = cancel_ttl(&h, &a);
    let mut completed_at = None;
    for n in 1..=MAX_POLLS {
        let key = h.key("cancel-inspect");
        let before = fence_of_a_grant(&a, &key).await;
        let lease = take(&a, &key, LONG_TTL).await;
        let out = drop_after(b.inspect(&key), n).await;
        if let Some(Err(e)) = &out {
            panic!("inspect of a held key failed: {e}");
        }
        let what = format!("inspect dropped after poll {n}");
        assert!(
            b.try_acquire(&key, LONG_TTL).await.unwrap().is_none(),
            "{what}: the holder lost its lock"
        );
        assert!(
            release(&a, &lease).await,
            "{what}: the holder lost its lock"
        );
        let stale = Stale { owner: &a, lease };
        assert_left_nothing(
            &what,
            (&b, &a),
            &key,
            ttl,
            Instant::now(),
            before,
            Some(stale),
        )
        .await;
        if out.is_some() {
            completed_at = Some(n);
            break;
        }
    }
    covered("inspect", completed_at).await
}

/// Found a real defect: on ZooKeeper a `run_exclusive` dropped after its 6th poll (its job
/// done, inside the guard's final release) left the key held for as long as the client lived
/// (the lease is the session): `LockGuard::release` took the watchdog out of the guard before
/// it awaited, so the guard's `Drop` no longer released anything. lock-core c855e28 made that
/// release cancellation safe.
///
/// A `run_exclusive` dropped after any of its polls — acquiring, in its job, or releasing —
/// leaves nothing behind: the key is acquirable within its TTL.
pub async fn run_exclusive_dropped_at_any_poll_leaves_nothing_behind(h: Harness) -> Outcome {
    let [a, b] = <[DynLock; 2]>::try_from(h.clients(2).await).ok().unwrap();
    let ttl = cancel_ttl(&h, &a);
    let mut completed_at = None;
    for n in 1..=MAX_POLLS {
        let key = h.key("cancel-run-exclusive");
        let before = fence_of_a_grant(&a, &key).await;
        let steps = Arc::new(AtomicUsize::new(0));
        let job_steps = steps.clone();
        let run = a.run_exclusive(
            &key,
            LockOptions::with_ttl(telling_ttl(&h)),
            move |_ctx| async move {
                // A job that yields a few times, so that drops land inside it too.
                for _ in 0..3 {
                    job_steps.fetch_add(1, Ordering::SeqCst);
                    tokio::task::yield_now().await;
                }
            },
        );
        let out = drop_after(run, n).await;
        let what = format!(
            "run_exclusive dropped after poll {n} ({} job steps)",
            steps.load(Ordering::SeqCst)
        );
        match out {
            Some(Ok(Some(()))) => {
                completed_at = Some(n);
                break;
            }
            Some(other) => panic!("run_exclusive on a free key: {other:?}"),
            None => {
                assert_left_nothing(&what, (&a, &b), &key, ttl, Instant::now(), before, None).await;
            }
        }
    }
    covered("run_exclusive", completed_at).await
}

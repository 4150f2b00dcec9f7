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

// Elections' operations (a child, sharing the helpers below).
#[path = "cancel_election.rs"]
mod election;
pub use election::{
    campaign_dropped_at_any_poll_leaves_nothing_behind,
    proclaim_dropped_at_any_poll_keeps_the_leader,
    resign_dropped_at_any_poll_leaves_nothing_behind,
};

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
/// (if any) neither renews nor releases the new holder's lock; `same` acquires right after
/// (or, while clean-ups are pending, once they are done, still within `ttl` + slack of
/// `since`: a grant the dropped call's request made late is theirs to undo); fences increase;
/// the clean-ups the drop started finish.
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
    // Counted before the look: a key held while none is pending is a leak.
    let cleaning = lock_core::raw::cleanup::pending() > 0;
    let mut again = same.try_acquire(key, LONG_TTL).await;
    if matches!(again, Ok(None)) && cleaning {
        // A request the dropped call had sent may reach the coordinator only now, after the new
        // holder's release: PostgreSQL runs a statement whose connection was closed under it,
        // and under load that can come several statements later. Its grant is the driver's
        // background clean-up to undo, so the key is looked at again once the clean-ups are
        // done, but no later than `since` + ttl + slack: a grant that the drop leaked lives
        // `telling_ttl`, longer, and still fails the look.
        let limit = (since + ttl + SLACK).saturating_duration_since(Instant::now());
        lock_core::raw::cleanup::finish(limit).await;
        again = same.try_acquire(key, LONG_TTL).await;
    }
    let again = match again {
        Ok(Some(lease)) => lease,
        Ok(None) => panic!(
            "{what}: the client whose future was dropped cannot acquire a free key ({} \
             clean-ups still pending)",
            lock_core::raw::cleanup::pending()
        ),
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
        lock_core::raw::cleanup::finish(CLEANUP_LIMIT).await,
        "{op}: {} clean-ups still pending {CLEANUP_LIMIT:?} after the last drop",
        lock_core::raw::cleanup::pending()
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

/// Cancellation timing variants: each operation dropped while its request or its reply is on a
/// slow link, so that the drop lands while the coordinator has the request (or is about to get
/// it), not between polls at server speed.
///
/// A [`delayed::Delayed`] setup is a client behind a [`delayed::Link`] (the drill proxy for the network backends,
/// a delaying wrapper for the in-memory one) and a second, direct client. Each operation is
/// dropped at `(k + ½)·delay` after it starts, for k = 0, 1, … until it completes uncancelled
/// (at most [`delayed::MAX_ROUNDS`]), once with the replies delayed (the request applied, its answer in
/// flight: the k-th round trip's) and once with the requests delayed (the request still on its
/// way; it reaches the coordinator after the drop). After each drop the link heals and the same
/// checks as for the drops at every poll run.
pub mod delayed {
    use super::*;

    /// The most round trips after which an operation is dropped.
    pub const MAX_ROUNDS: u32 = 6;

    /// A client's slow link, switchable at run time.
    pub trait Link: Send + Sync {
        /// Requests reach the coordinator at once; each reply takes `delay` longer.
        fn delay_replies(&self, delay: Duration);
        /// Each request takes `delay` longer to reach the coordinator.
        fn delay_requests(&self, delay: Duration);
        /// Heals: everything at full speed.
        fn pass(&self);
        /// A count that grows whenever the client sends a request.
        fn requests(&self) -> u64;
        /// Whether replies can be delayed below the client's cancellation point (not for an
        /// in-process coordinator, whose answer is the completed call itself: holding it back
        /// in a wrapper would test the wrapper).
        fn delays_replies(&self) -> bool {
            true
        }
    }

    impl Link for crate::drill::Proxy {
        fn delay_replies(&self, delay: Duration) {
            crate::drill::Proxy::delay_replies(self, delay);
        }
        fn delay_requests(&self, delay: Duration) {
            crate::drill::Proxy::delay_requests(self, delay);
        }
        fn pass(&self) {
            crate::drill::Proxy::pass(self);
        }
        fn requests(&self) -> u64 {
            self.request_chunks()
        }
    }

    /// What the timing variants run on.
    pub struct Delayed {
        /// The backend's name, for messages.
        pub name: &'static str,
        /// The client behind the link.
        pub slow: DynLock,
        /// Its link.
        pub link: Arc<dyn Link>,
        /// A second client, connected directly.
        pub other: DynLock,
        /// A third, direct client (the holder a waiter queues behind, the operator).
        pub third: DynLock,
        /// The shortest reliable TTL (as [`crate::TestBackend::short_ttl`]).
        pub short_ttl: Duration,
        /// The link's delay: a round trip's worth, well under the clients' request timeouts.
        pub delay: Duration,
    }

    impl std::fmt::Debug for Delayed {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("Delayed")
                .field("name", &self.name)
                .field("delay", &self.delay)
                .finish_non_exhaustive()
        }
    }

    /// Which direction is slow.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Slow {
        /// The reply is in flight when the future is dropped.
        Replies,
        /// The request is in flight when the future is dropped.
        Requests,
    }

    impl Delayed {
        fn slow_down(&self, slow: Slow) {
            match slow {
                Slow::Replies => self.link.delay_replies(self.delay),
                Slow::Requests => self.link.delay_requests(self.delay),
            }
        }

        fn variants(&self) -> Vec<Slow> {
            if self.link.delays_replies() {
                vec![Slow::Replies, Slow::Requests]
            } else {
                vec![Slow::Requests]
            }
        }

        fn ttl(&self) -> Duration {
            self.slow.capabilities().effective_ttl(self.short_ttl)
        }

        fn telling_ttl(&self) -> Duration {
            self.short_ttl + SLACK * 2
        }

        /// Waits until a request still on the slow link when it healed has reached the
        /// coordinator (each chunk waits one delay), so that "did the dropped call apply?" has
        /// one answer from then on.
        async fn settle(&self) {
            sleep(self.delay * 2).await;
        }

        /// When the k-th drop lands.
        fn drop_at(&self, k: u32) -> Duration {
            self.delay * (2 * k + 1) / 2
        }
    }

    /// Runs `fut` with the link slowed down, dropping it `after`: `Some` when it completed
    /// before. The link heals right after.
    async fn drop_in_flight<F: Future>(
        d: &Delayed,
        slow: Slow,
        after: Duration,
        fut: F,
    ) -> Option<F::Output> {
        d.slow_down(slow);
        let out = timeout(after, fut).await.ok();
        d.link.pass();
        if out.is_none() && slow == Slow::Requests {
            // The request lands after the drop: check once it has, or a grant it makes after
            // the checks began (and the driver's undo then removes) would look like a leak.
            d.settle().await;
        }
        out
    }

    fn report(d: &Delayed, op: &str, slow: Slow, completed: Option<u32>, started: Instant) {
        let took = started.elapsed();
        match completed {
            Some(k) => eprintln!(
                "{} {op} ({slow:?} delayed {:?}): completes within {} round trips; dropped in each before ({took:?})",
                d.name,
                d.delay,
                k + 1
            ),
            None => eprintln!(
                "{} {op} ({slow:?} delayed {:?}): still pending after {MAX_ROUNDS} round trips; dropped in each ({took:?})",
                d.name, d.delay
            ),
        }
    }

    /// `try_acquire` dropped with its request or reply in flight leaves nothing behind.
    pub async fn try_acquire(d: &Delayed) {
        let ttl = d.ttl();
        for slow in d.variants() {
            let (mut completed, started) = (None, Instant::now());
            for k in 0..MAX_ROUNDS {
                let key = crate::fresh_key("cancel-delayed-try-acquire");
                let before = fence_of_a_grant(&d.slow, &key).await;
                let out = drop_in_flight(
                    d,
                    slow,
                    d.drop_at(k),
                    d.slow.try_acquire(&key, d.telling_ttl()),
                )
                .await;
                match out {
                    Some(Ok(Some(lease))) => {
                        assert!(release(&d.slow, &lease).await);
                        completed = Some(k);
                        break;
                    }
                    Some(other) => panic!("{} try_acquire of a free key: {other:?}", d.name),
                    None => {
                        let what = format!(
                            "{} try_acquire dropped in round trip {} ({slow:?} delayed)",
                            d.name,
                            k + 1
                        );
                        let since = Instant::now();
                        assert_left_nothing(
                            &what,
                            (&d.slow, &d.other),
                            &key,
                            ttl,
                            since,
                            before,
                            None,
                        )
                        .await;
                    }
                }
            }
            report(d, "try_acquire", slow, completed, started);
        }
    }

    /// `acquire` queued behind a holder that releases as the drop's round trip begins: the
    /// grant (or the waiter's next step) is in flight when it is dropped.
    pub async fn acquire(d: &Delayed) {
        let ttl = d.ttl();
        for slow in d.variants() {
            let (mut completed, started) = (None, Instant::now());
            for k in 0..MAX_ROUNDS {
                let key = crate::fresh_key("cancel-delayed-acquire");
                let before = fence_of_a_grant(&d.slow, &key).await;
                let held = take(&d.third, &key, LONG_TTL).await;
                let mut attempt = d
                    .slow
                    .acquire(&key, d.telling_ttl(), Instant::now() + LONG_TTL);
                // Queued at full speed first.
                let early = tokio::select! {
                    out = attempt.as_mut() => Some(out),
                    () = queued(&d.third, &key) => None,
                };
                if let Some(out) = early {
                    panic!(
                        "{} acquire completed while the key was held: {out:?}",
                        d.name
                    );
                }
                // The holder releases (directly); the waiter's wake-up, grant or retry goes over
                // the slow link.
                d.slow_down(slow);
                assert!(release(&d.third, &held).await);
                let late = timeout(d.drop_at(k), attempt.as_mut()).await.ok();
                drop(attempt);
                d.link.pass();
                if late.is_none() && slow == Slow::Requests {
                    d.settle().await;
                }
                let since = Instant::now();
                match late {
                    Some(Ok(lease)) => {
                        assert_fence_increased("acquire", before, &lease);
                        assert!(release(&d.slow, &lease).await);
                        completed = Some(k);
                        break;
                    }
                    Some(Err(e)) => panic!("{} acquire of a released key failed: {e}", d.name),
                    None => {
                        let what = format!(
                            "{} acquire dropped in round trip {} after the release ({slow:?} delayed)",
                            d.name,
                            k + 1
                        );
                        assert_left_nothing(
                            &what,
                            (&d.slow, &d.other),
                            &key,
                            ttl,
                            since,
                            before,
                            None,
                        )
                        .await;
                    }
                }
            }
            report(d, "acquire", slow, completed, started);
        }
    }

    /// `renew` dropped in flight leaves the lease held; the next renew answers from the
    /// coordinator's real state: `Ok` while held, `NotHeld` once an operator removed it (an
    /// answer left over from the dropped renew must not be taken for it), and after a release.
    pub async fn renew(d: &Delayed) {
        if !d.slow.capabilities().renew {
            eprintln!("{} renew: skipped, renew not claimed", d.name);
            return;
        }
        let ttl = d.ttl();
        for slow in d.variants() {
            let (mut completed, started) = (None, Instant::now());
            for k in 0..MAX_ROUNDS {
                let key = crate::fresh_key("cancel-delayed-renew");
                let before = fence_of_a_grant(&d.slow, &key).await;
                let mut lease = take(&d.slow, &key, LONG_TTL).await;
                let out =
                    drop_in_flight(d, slow, d.drop_at(k), d.slow.renew(&mut lease, LONG_TTL)).await;
                if let Some(Err(e)) = &out {
                    panic!("{} renew of a held lease failed: {e}", d.name);
                }
                let what = format!(
                    "{} renew dropped in round trip {} ({slow:?} delayed)",
                    d.name,
                    k + 1
                );
                if let Err(e) = d.slow.renew(&mut lease, LONG_TTL).await {
                    panic!("{what}: the next renew of the held lease failed: {e}");
                }
                if d.slow.capabilities().force_release {
                    let fence = lease.fencing_token();
                    let removed = match fence {
                        Some(f) => d.third.force_release_grant(&key, f).await,
                        None => d.third.force_release(&key).await,
                    };
                    assert!(
                        matches!(removed, Ok(true)),
                        "{what}: force_release: {removed:?}"
                    );
                    match d.slow.renew(&mut lease, ttl).await {
                        Err(Error::NotHeld { .. }) => {}
                        other => panic!(
                            "{what}: renew after an operator removed the lease: {other:?}, not NotHeld"
                        ),
                    }
                } else {
                    assert!(release(&d.slow, &lease).await, "{what}: not releasable");
                }
                let stale = Stale {
                    owner: &d.slow,
                    lease: lease.clone(),
                };
                assert_left_nothing(
                    &what,
                    (&d.slow, &d.other),
                    &key,
                    ttl,
                    Instant::now(),
                    before,
                    Some(stale),
                )
                .await;
                if out.is_some() {
                    completed = Some(k);
                    break;
                }
            }
            report(d, "renew", slow, completed, started);
        }
    }

    /// `release` dropped in flight leaves nothing behind (the key is free within one TTL; the
    /// lease then neither renews nor releases the next holder's lock).
    pub async fn release_op(d: &Delayed) {
        let ttl = d.ttl();
        for slow in d.variants() {
            let (mut completed, started) = (None, Instant::now());
            for k in 0..MAX_ROUNDS {
                let key = crate::fresh_key("cancel-delayed-release");
                let before = fence_of_a_grant(&d.slow, &key).await;
                let lease = take(&d.slow, &key, ttl).await;
                let out = drop_in_flight(d, slow, d.drop_at(k), d.slow.release(&lease)).await;
                match &out {
                    Some(Ok(true)) | None => {}
                    Some(other) => panic!("{} release of a held lease: {other:?}", d.name),
                }
                let what = format!(
                    "{} release dropped in round trip {} ({slow:?} delayed)",
                    d.name,
                    k + 1
                );
                // Landed or not, the lease's own release is safe (`false` once it applied), and
                // frees a lease the dropped call left in place without waiting for its TTL.
                d.settle().await;
                let _ = release(&d.slow, &lease).await;
                let stale = Stale {
                    owner: &d.slow,
                    lease,
                };
                assert_left_nothing(
                    &what,
                    (&d.slow, &d.other),
                    &key,
                    ttl,
                    Instant::now(),
                    before,
                    Some(stale),
                )
                .await;
                if out.is_some() {
                    completed = Some(k);
                    break;
                }
            }
            report(d, "release", slow, completed, started);
        }
    }

    /// `force_release` (by the client behind the link) dropped in flight leaves nothing behind.
    pub async fn force_release(d: &Delayed) {
        if !d.slow.capabilities().force_release {
            eprintln!("{} force_release: skipped, not claimed", d.name);
            return;
        }
        let ttl = d.ttl();
        for slow in d.variants() {
            let (mut completed, started) = (None, Instant::now());
            for k in 0..MAX_ROUNDS {
                let key = crate::fresh_key("cancel-delayed-force-release");
                let before = fence_of_a_grant(&d.third, &key).await;
                let lease = take(&d.third, &key, ttl).await;
                let out = drop_in_flight(d, slow, d.drop_at(k), d.slow.force_release(&key)).await;
                match &out {
                    Some(Ok(true)) | None => {}
                    Some(other) => panic!("{} force_release of a held key: {other:?}", d.name),
                }
                let what = format!(
                    "{} force_release dropped in round trip {} ({slow:?} delayed)",
                    d.name,
                    k + 1
                );
                d.settle().await;
                let _ = release(&d.third, &lease).await;
                let stale = Stale {
                    owner: &d.third,
                    lease,
                };
                assert_left_nothing(
                    &what,
                    (&d.slow, &d.other),
                    &key,
                    ttl,
                    Instant::now(),
                    before,
                    Some(stale),
                )
                .await;
                if out.is_some() {
                    completed = Some(k);
                    break;
                }
            }
            report(d, "force_release", slow, completed, started);
        }
    }

    /// `inspect` dropped in flight changes nothing, and the client's next answers are its own
    /// (not the dropped call's, arriving late).
    pub async fn inspect(d: &Delayed) {
        let ttl = d.ttl();
        for slow in d.variants() {
            let (mut completed, started) = (None, Instant::now());
            for k in 0..MAX_ROUNDS {
                let key = crate::fresh_key("cancel-delayed-inspect");
                let before = fence_of_a_grant(&d.other, &key).await;
                let lease = take(&d.other, &key, LONG_TTL).await;
                let out = drop_in_flight(d, slow, d.drop_at(k), d.slow.inspect(&key)).await;
                if let Some(Err(e)) = &out {
                    panic!("{} inspect of a held key failed: {e}", d.name);
                }
                let what = format!(
                    "{} inspect dropped in round trip {} ({slow:?} delayed)",
                    d.name,
                    k + 1
                );
                // Another key, free: the answer must be about it.
                let free = crate::fresh_key("cancel-delayed-inspect-free");
                assert!(
                    d.slow.inspect(&free).await.unwrap().is_none(),
                    "{what}: the next inspect of a free key shows a holder"
                );
                assert!(
                    d.slow.try_acquire(&key, LONG_TTL).await.unwrap().is_none(),
                    "{what}: the holder lost its lock"
                );
                assert!(
                    release(&d.other, &lease).await,
                    "{what}: the holder lost its lock"
                );
                let stale = Stale {
                    owner: &d.other,
                    lease,
                };
                assert_left_nothing(
                    &what,
                    (&d.slow, &d.other),
                    &key,
                    ttl,
                    Instant::now(),
                    before,
                    Some(stale),
                )
                .await;
                if out.is_some() {
                    completed = Some(k);
                    break;
                }
            }
            report(d, "inspect", slow, completed, started);
        }
    }

    /// `run_exclusive` dropped in flight (acquiring, or releasing after its job) leaves nothing
    /// behind.
    pub async fn run_exclusive(d: &Delayed) {
        let ttl = d.ttl();
        for slow in d.variants() {
            let (mut completed, started) = (None, Instant::now());
            for k in 0..MAX_ROUNDS {
                let key = crate::fresh_key("cancel-delayed-run-exclusive");
                let before = fence_of_a_grant(&d.slow, &key).await;
                let run = d.slow.run_exclusive(
                    &key,
                    LockOptions::with_ttl(d.telling_ttl()),
                    |_ctx| async {},
                );
                let out = drop_in_flight(d, slow, d.drop_at(k), run).await;
                match out {
                    Some(Ok(Some(()))) => {
                        completed = Some(k);
                        break;
                    }
                    Some(other) => panic!("{} run_exclusive on a free key: {other:?}", d.name),
                    None => {
                        let what = format!(
                            "{} run_exclusive dropped in round trip {} ({slow:?} delayed)",
                            d.name,
                            k + 1
                        );
                        let since = Instant::now();
                        assert_left_nothing(
                            &what,
                            (&d.slow, &d.other),
                            &key,
                            ttl,
                            since,
                            before,
                            None,
                        )
                        .await;
                    }
                }
            }
            report(d, "run_exclusive", slow, completed, started);
        }
    }

    /// Returns once the client behind the link has sent a request after `since` (the guard's
    /// renewal, nothing else running on it), or fails after `within`.
    async fn next_request(d: &Delayed, since: u64, within: Duration, what: &str) {
        let until = Instant::now() + within;
        while d.link.requests() <= since {
            assert!(
                Instant::now() < until,
                "{what}: no renewal sent within {within:?}"
            );
            sleep(Duration::from_millis(2)).await;
        }
    }

    /// The guard's background renewal cut short: with the renewal's request (or reply) in flight
    /// the guard is dropped (its release then runs in the background), a `run_exclusive`'s
    /// future is dropped (job running), or the guard is released. Each leaves nothing behind:
    /// the key is free within one TTL, the guard's lease renews `NotHeld`, fences increase, the
    /// clean-ups finish.
    pub async fn guard_renewal(d: &Delayed) {
        // Renewed every third of the TTL: the TTL the watchdog properties use (≥ 1 s).
        let gttl = d.short_ttl.max(Duration::from_secs(1));
        let ttl = d.slow.capabilities().effective_ttl(gttl);
        for slow in d.variants() {
            for how in ["guard dropped", "run_exclusive dropped", "guard released"] {
                let key = crate::fresh_key("cancel-delayed-guard");
                let before = fence_of_a_grant(&d.slow, &key).await;
                let what = format!("{} {how} during a renewal ({slow:?} delayed)", d.name);
                let stale = if how == "run_exclusive dropped" {
                    let (lease_tx, lease_rx) = tokio::sync::oneshot::channel();
                    let run = d.slow.run_exclusive(
                        &key,
                        LockOptions::with_ttl(gttl),
                        move |ctx| async move {
                            let _ = lease_tx.send(ctx.fencing_token());
                            std::future::pending::<()>().await;
                        },
                    );
                    // Boxed (as every `run_exclusive` future is), so that `drop` below drops it.
                    let mut run = run;
                    let fence = tokio::select! {
                        out = run.as_mut() => panic!("{what}: run_exclusive ended: {out:?}"),
                        fence = lease_rx => fence.unwrap(),
                    };
                    let since = d.link.requests();
                    d.slow_down(slow);
                    next_request(d, since, gttl, &what).await;
                    drop(run);
                    d.link.pass();
                    // The job's lease is not exposed; its fence tells it apart from the next.
                    if let Some(f) = fence {
                        assert!(
                            before.is_none_or(|b| f > b),
                            "{what}: fence {f:?} after {before:?}"
                        );
                    }
                    None
                } else {
                    let guard = match d.slow.lock(key.as_str()).ttl(gttl).acquire().await {
                        Ok(guard) => guard,
                        Err(e) => panic!("{what}: acquire: {e}"),
                    };
                    let lease = guard.granted_lease().clone();
                    let since = d.link.requests();
                    d.slow_down(slow);
                    next_request(d, since, gttl, &what).await;
                    if how == "guard dropped" {
                        drop(guard);
                        d.link.pass();
                    } else {
                        let released = timeout(SLACK, guard.release()).await;
                        d.link.pass();
                        match released {
                            Ok(Ok(true)) => {}
                            other => panic!("{what}: release: {other:?}"),
                        }
                    }
                    Some(Stale {
                        owner: &d.slow,
                        lease,
                    })
                };
                let since = Instant::now();
                assert_left_nothing(&what, (&d.slow, &d.other), &key, ttl, since, before, stale)
                    .await;
                eprintln!("{what}: nothing left behind ({:?})", since.elapsed());
            }
        }
    }

    /// Every timing variant, then the clean-ups they started must finish.
    pub async fn all(d: &Delayed) {
        let started = Instant::now();
        try_acquire(d).await;
        acquire(d).await;
        renew(d).await;
        release_op(d).await;
        force_release(d).await;
        inspect(d).await;
        run_exclusive(d).await;
        guard_renewal(d).await;
        assert!(
            lock_core::raw::cleanup::finish(CLEANUP_LIMIT).await,
            "{}: {} clean-ups still pending {CLEANUP_LIMIT:?} after the last drop",
            d.name,
            lock_core::raw::cleanup::pending()
        );
        eprintln!("{}: delayed drops done in {:?}", d.name, started.elapsed());
    }
}

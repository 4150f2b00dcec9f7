//! The properties. Each is a `pub async fn(Harness) -> Outcome` whose doc line states what it
//! checks; `conformance_tests!` turns each into a named test.

/// The list of properties, kept next to them: `$callback!($setup, property)` for each (what
/// [`crate::conformance_tests!`] expands). A property added below must be added here.
#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_properties {
    ($callback:path, $setup:path) => {
        $callback!($setup, exclusive_try_acquire);
        $callback!($setup, concurrent_first_acquire_has_one_winner);
        $callback!($setup, independent_keys);
        $callback!($setup, release_then_reacquire);
        $callback!($setup, release_by_stale_token_is_a_no_op);
        $callback!($setup, renew_extends_the_lease);
        $callback!(
            $setup,
            renew_after_expiry_fails_and_does_not_extend_the_new_holder
        );
        $callback!($setup, abandoned_lease_becomes_acquirable_after_ttl);
        $callback!($setup, fencing_tokens_strictly_increase);
        $callback!($setup, stale_holder_write_is_rejected);
        $callback!($setup, mutual_exclusion_under_contention);
        $callback!($setup, acquire_times_out_at_its_deadline);
        $callback!($setup, waiter_is_woken_promptly_by_release);
        $callback!($setup, waiters_are_served_in_fifo_order);
        $callback!($setup, dropped_acquire_leaves_nothing_behind);
        $callback!($setup, watchdog_keeps_the_lease_alive);
        $callback!($setup, lost_fires_when_the_lock_is_taken_away);
        $callback!(
            $setup,
            lost_fires_at_the_local_deadline_before_anyone_else_is_granted
        );
        $callback!($setup, run_exclusive_skips_when_held_and_releases_after);
        $callback!($setup, dropped_guard_releases_the_lock);
        $callback!($setup, inspect_reports_the_holder);
        $callback!($setup, bad_input_is_rejected_before_io);
        $callback!($setup, capabilities_are_honest);
        $callback!($setup, force_release_removes_any_holder);
        $callback!(
            $setup,
            try_acquire_dropped_at_any_poll_leaves_nothing_behind
        );
        $callback!($setup, acquire_dropped_at_any_poll_leaves_nothing_behind);
        $callback!($setup, renew_dropped_at_any_poll_leaves_nothing_behind);
        $callback!($setup, release_dropped_at_any_poll_leaves_nothing_behind);
        $callback!(
            $setup,
            force_release_dropped_at_any_poll_leaves_nothing_behind
        );
        $callback!($setup, inspect_dropped_at_any_poll_leaves_nothing_behind);
        $callback!(
            $setup,
            run_exclusive_dropped_at_any_poll_leaves_nothing_behind
        );
        $callback!($setup, ttl_limits_are_honoured_or_refused_before_io);
        $callback!($setup, ttl_at_the_minimum_works_end_to_end);
        $callback!(
            $setup,
            keys_at_the_length_limit_and_of_every_character_class_are_distinct
        );
        $callback!($setup, past_deadlines_still_make_one_attempt);
        $callback!($setup, zero_length_waits_return_promptly);
        $callback!($setup, fences_stay_exact_across_2_pow_53_and_up_to_i64_max);
        $callback!($setup, a_release_hands_the_lock_to_the_first_waiter);
        $callback!($setup, a_grant_to_a_waiter_that_gave_up_is_given_back);
        $callback!(
            $setup,
            a_waiter_that_gives_up_leaves_the_queue_and_delays_nobody
        );
        $callback!($setup, many_guards_on_one_client_keep_their_leases_alive);
        $callback!(
            $setup,
            a_grant_at_the_waiters_deadline_is_kept_or_given_back
        );
        $callback!($setup, at_least_outlives_the_job_and_the_holders_exit);
        $callback!($setup, at_most_cancels_a_hung_job_and_frees_the_lock);
        $callback!($setup, election_never_two_leaders);
        $callback!($setup, election_resign_hands_over_promptly);
        $callback!($setup, election_leader_agrees_with_the_handle);
        $callback!($setup, election_observe_reports_every_term_in_order);
        $callback!($setup, election_deposed_leader_is_fenced_out);
        $callback!($setup, election_proclaim_changes_the_value_not_the_term);
        $callback!($setup, campaign_dropped_at_any_poll_leaves_nothing_behind);
        $callback!($setup, resign_dropped_at_any_poll_leaves_nothing_behind);
        $callback!($setup, proclaim_dropped_at_any_poll_keeps_the_leader);
    };
}

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
    time::Duration,
};

use lock_core::{
    DistributedLockExt, DynLock, Election, Error, FencedRegister, FencingGuarantee, FencingToken,
    HolderIdentity, Lease, LockKey, LockOptions,
};
use tokio::time::{Instant, sleep, timeout};

use crate::{Harness, Outcome};

// Cancellation at every poll (its own file; a child module so that it shares the helpers here).
#[path = "cancel.rs"]
mod cancel;
/// Cancellation timing variants (each op dropped with its request or reply in flight), run by
/// `tests/cancel_delayed.rs` on every backend.
pub use cancel::delayed;
pub use cancel::{
    acquire_dropped_at_any_poll_leaves_nothing_behind,
    campaign_dropped_at_any_poll_leaves_nothing_behind,
    force_release_dropped_at_any_poll_leaves_nothing_behind,
    inspect_dropped_at_any_poll_leaves_nothing_behind,
    proclaim_dropped_at_any_poll_keeps_the_leader,
    release_dropped_at_any_poll_leaves_nothing_behind,
    renew_dropped_at_any_poll_leaves_nothing_behind,
    resign_dropped_at_any_poll_leaves_nothing_behind,
    run_exclusive_dropped_at_any_poll_leaves_nothing_behind,
    try_acquire_dropped_at_any_poll_leaves_nothing_behind,
};

// Boundary values (its own file, a child module like `cancel`).
#[path = "boundary.rs"]
mod boundary;
pub use boundary::{
    fences_stay_exact_across_2_pow_53_and_up_to_i64_max,
    keys_at_the_length_limit_and_of_every_character_class_are_distinct,
    past_deadlines_still_make_one_attempt, ttl_at_the_minimum_works_end_to_end,
    ttl_limits_are_honoured_or_refused_before_io, zero_length_waits_return_promptly,
};

// Behaviours once tested per driver (its own file, a child module like `cancel`).
#[path = "shared.rs"]
mod shared;
pub use shared::{
    a_grant_at_the_waiters_deadline_is_kept_or_given_back,
    a_grant_to_a_waiter_that_gave_up_is_given_back, a_release_hands_the_lock_to_the_first_waiter,
    a_waiter_that_gives_up_leaves_the_queue_and_delays_nobody,
    many_guards_on_one_client_keep_their_leases_alive,
};

/// A TTL long enough that nothing expires during a test unless a test makes it.
const LONG_TTL: Duration = Duration::from_secs(30);
/// Slack for a loaded 2-core machine on top of any expected duration.
const SLACK: Duration = Duration::from_secs(3);

/// The TTL of properties that must keep a lease alive by renewing it: the backend's short TTL,
/// but at least 1 s, so that one scheduling stall of a loaded 2-core machine (a few hundred ms)
/// cannot outlast the gap between renewals (at 300 ms a 200 ms stall did).
fn stall_proof_ttl(h: &Harness) -> Duration {
    h.short_ttl().max(Duration::from_secs(1))
}

async fn take(client: &DynLock, key: &LockKey, ttl: Duration) -> Lease {
    match client.try_acquire(key, ttl).await {
        Ok(Some(lease)) => lease,
        Ok(None) => panic!("{key} should have been free"),
        Err(e) => panic!("try_acquire({key}) failed: {e}"),
    }
}

async fn is_held_elsewhere(client: &DynLock, key: &LockKey) -> bool {
    match client.try_acquire(key, LONG_TTL).await {
        Ok(None) => true,
        Ok(Some(lease)) => {
            let _ = client.release(&lease).await;
            false
        }
        Err(e) => panic!("try_acquire({key}) failed: {e}"),
    }
}

async fn release(client: &DynLock, lease: &Lease) -> bool {
    match client.release(lease).await {
        Ok(released) => released,
        Err(e) => panic!("release({}) failed: {e}", lease.key()),
    }
}

fn fencing_claimed(client: &DynLock) -> bool {
    client.capabilities().fencing != FencingGuarantee::None
}

/// Only one client holds a key at a time: a second client's `try_acquire` (and the holder's
/// own second attempt — locks are not reentrant) returns `None` until the holder releases.
pub async fn exclusive_try_acquire(h: Harness) -> Outcome {
    let [a, b] = <[DynLock; 2]>::try_from(h.clients(2).await).ok().unwrap();
    let key = h.key("exclusive");
    let lease = take(&a, &key, LONG_TTL).await;
    assert!(b.try_acquire(&key, LONG_TTL).await.unwrap().is_none());
    assert!(a.try_acquire(&key, LONG_TTL).await.unwrap().is_none());
    assert!(release(&a, &lease).await);
    let lease = take(&b, &key, LONG_TTL).await;
    release(&b, &lease).await;
    Outcome::Passed
}

/// Many clients racing for a fresh key at the same instant: exactly one wins.
pub async fn concurrent_first_acquire_has_one_winner(h: Harness) -> Outcome {
    let clients = h.clients(8).await;
    let key = h.key("race");
    let barrier = Arc::new(tokio::sync::Barrier::new(clients.len()));
    let tasks: Vec<_> = clients
        .iter()
        .cloned()
        .map(|c| {
            let key = key.clone();
            let barrier = barrier.clone();
            tokio::spawn(async move {
                barrier.wait().await;
                c.try_acquire(&key, LONG_TTL).await.unwrap().map(|l| (c, l))
            })
        })
        .collect();
    let mut winners = Vec::new();
    for t in tasks {
        if let Some(w) = t.await.unwrap() {
            winners.push(w);
        }
    }
    assert_eq!(winners.len(), 1, "exactly one client must win the race");
    let (c, l) = &winners[0];
    assert!(release(c, l).await);
    Outcome::Passed
}

/// Distinct keys are independent, including "a" vs "a/b", keys that differ only in case or
/// punctuation, and keys with spaces, braces, dots, slashes and Unicode.
pub async fn independent_keys(h: Harness) -> Outcome {
    let [a, b] = <[DynLock; 2]>::try_from(h.clients(2).await).ok().unwrap();
    let base = h.key("indep");
    let names = [
        "a",
        "a/b",
        "a/b/c",
        "A",
        "a.b",
        "a_b",
        "a-b",
        "a b",
        "a:b",
        "{a}",
        "a{b}c",
        "a/",
        "/a",
        ".",
        "..",
        "a%2Fb",
        "zookeeper",
        "ünï/çødé",
        "\u{1F512}",
    ];
    let keys: Vec<LockKey> = names
        .iter()
        .map(|n| LockKey::new(format!("{base}/{n}")).unwrap())
        .collect();
    let mut leases = Vec::new();
    for key in &keys {
        leases.push(take(&a, key, LONG_TTL).await);
    }
    for key in &keys {
        assert!(is_held_elsewhere(&b, key).await, "{key} should be held");
    }
    // Releasing one key leaves every other held.
    assert!(release(&a, &leases[0]).await);
    let l0 = take(&b, &keys[0], LONG_TTL).await;
    for key in &keys[1..] {
        assert!(
            is_held_elsewhere(&b, key).await,
            "{key} lost when another key was released"
        );
    }
    release(&b, &l0).await;
    for lease in &leases[1..] {
        assert!(release(&a, lease).await, "{} was not released", lease.key());
    }
    Outcome::Passed
}

/// After a release, another client acquires at once; releasing twice returns `true` then `false`.
pub async fn release_then_reacquire(h: Harness) -> Outcome {
    let [a, b] = <[DynLock; 2]>::try_from(h.clients(2).await).ok().unwrap();
    let key = h.key("reacquire");
    for _ in 0..3 {
        let lease = take(&a, &key, LONG_TTL).await;
        assert!(release(&a, &lease).await);
        assert!(
            !release(&a, &lease).await,
            "a second release must report false"
        );
        let lease = take(&b, &key, LONG_TTL).await;
        assert!(release(&b, &lease).await);
    }
    Outcome::Passed
}

/// Releasing with a stale token (the lease expired and another client took the key) is a
/// no-op that returns `false`; the new holder keeps the lock.
pub async fn release_by_stale_token_is_a_no_op(h: Harness) -> Outcome {
    let [a, b, c] = <[DynLock; 3]>::try_from(h.clients(3).await).ok().unwrap();
    let key = h.key("stale-release");
    let old = take(&a, &key, LONG_TTL).await;
    h.force_expire(&old).await;
    let new = take(&b, &key, LONG_TTL).await;
    assert!(
        !release(&a, &old).await,
        "a stale release must report false"
    );
    assert!(
        is_held_elsewhere(&c, &key).await,
        "the stale release removed the new holder"
    );
    assert!(release(&b, &new).await, "the new holder lost its lock");
    Outcome::Passed
}

/// `renew` keeps a lease alive past its original TTL and moves its local deadline forward.
pub async fn renew_extends_the_lease(h: Harness) -> Outcome {
    let [a, b] = <[DynLock; 2]>::try_from(h.clients(2).await).ok().unwrap();
    if !a.capabilities().renew {
        return Outcome::Skipped("renew not claimed");
    }
    let ttl = stall_proof_ttl(&h);
    let key = h.key("renew");
    let mut lease = take(&a, &key, ttl).await;
    let first_deadline = lease.local_deadline();
    let until = Instant::now() + ttl * 2;
    while Instant::now() < until {
        sleep(ttl / 4).await;
        a.renew(&mut lease, ttl)
            .await
            .expect("renewing a held lease");
        assert!(is_held_elsewhere(&b, &key).await);
    }
    assert!(lease.local_deadline() > first_deadline);
    assert!(
        release(&a, &lease).await,
        "renewed lease should still be held"
    );
    Outcome::Passed
}

/// After expiry and takeover, `renew` fails with `NotHeld` and does not extend the new holder,
/// whose lease still runs out on its own TTL.
pub async fn renew_after_expiry_fails_and_does_not_extend_the_new_holder(h: Harness) -> Outcome {
    let [a, b, c] = <[DynLock; 3]>::try_from(h.clients(3).await).ok().unwrap();
    let caps = a.capabilities();
    if !caps.renew {
        return Outcome::Skipped("renew not claimed");
    }
    let ttl = h.short_ttl();
    let key = h.key("renew-stale");
    let mut old = take(&a, &key, LONG_TTL).await;
    h.force_expire(&old).await;
    let new = take(&b, &key, ttl).await;
    let err = a.renew(&mut old, LONG_TTL).await.unwrap_err();
    assert!(
        matches!(err, Error::NotHeld { .. }),
        "expected NotHeld, got {err}"
    );
    if caps.lease_ttl {
        // b never renews: its lease must lapse on b's TTL, not a's.
        let got = c
            .acquire(&key, LONG_TTL, Instant::now() + ttl + SLACK)
            .await
            .expect("the new holder's lease was extended by a stale renew");
        release(&c, &got).await;
    } else {
        assert!(release(&b, &new).await);
    }
    Outcome::Passed
}

/// A lease that is never released (its holder vanished) becomes acquirable after its TTL
/// (or session timeout) — not before, where the coordinator expires leases by TTL.
pub async fn abandoned_lease_becomes_acquirable_after_ttl(h: Harness) -> Outcome {
    let [a, b] = <[DynLock; 2]>::try_from(h.clients(2).await).ok().unwrap();
    let caps = a.capabilities();
    if !caps.lease_ttl && !caps.session_bound {
        return Outcome::Skipped("neither lease_ttl nor session_bound claimed");
    }
    let ttl = h.short_ttl();
    let key = h.key("abandoned");
    let sent = Instant::now();
    let lease = take(&a, &key, ttl).await;
    drop(lease);
    h.abandon(a).await;
    if caps.lease_ttl {
        assert!(is_held_elsewhere(&b, &key).await, "freed before its ttl");
    }
    let got = b
        .acquire(&key, LONG_TTL, Instant::now() + ttl * 3 + SLACK)
        .await
        .expect("an abandoned lease must become acquirable after its ttl");
    if caps.lease_ttl {
        let waited = sent.elapsed();
        assert!(
            waited >= ttl * 9 / 10,
            "granted again after {waited:?} < ttl {ttl:?}"
        );
    }
    release(&b, &got).await;
    Outcome::Passed
}

/// Fencing tokens strictly increase across holders, across releases and across expiry
/// takeovers, on the same key.
pub async fn fencing_tokens_strictly_increase(h: Harness) -> Outcome {
    let clients = h.clients(3).await;
    if !fencing_claimed(&clients[0]) {
        return Outcome::Skipped("fencing not claimed");
    }
    let key = h.key("fencing");
    let mut tokens: Vec<FencingToken> = Vec::new();
    for round in 0..6 {
        let c = &clients[round % clients.len()];
        let lease = take(c, &key, LONG_TTL).await;
        tokens.push(lease.fencing_token().expect("fencing claimed but no token"));
        if round % 2 == 0 {
            h.force_expire(&lease).await;
        } else {
            assert!(release(c, &lease).await);
        }
    }
    assert!(
        tokens.windows(2).all(|w| w[0] < w[1]),
        "not strictly increasing: {tokens:?}"
    );
    Outcome::Passed
}

/// A holder whose lease expired (paused process) has its late writes — with the token its guard
/// handed to the job — rejected by the fenced resource once the new holder wrote, and still
/// after the new holder released; the resource keeps the new holder's value.
pub async fn stale_holder_write_is_rejected(h: Harness) -> Outcome {
    let [a, b] = <[DynLock; 2]>::try_from(h.clients(2).await).ok().unwrap();
    if !fencing_claimed(&a) {
        return Outcome::Skipped("fencing not claimed");
    }
    let key = h.key("fenced-write");
    let register = FencedRegister::new();
    let guard = a
        .lock(&key)
        .ttl(LONG_TTL)
        .try_acquire()
        .await
        .unwrap()
        .expect("free");
    let stale_token = guard.fencing_token().expect("fencing claimed but no token");
    register
        .write(stale_token, "a#1")
        .expect("the holder's own write");
    h.force_expire(guard.granted_lease()).await; // a is "paused" past its ttl
    let new = take(&b, &key, LONG_TTL).await;
    register
        .write(new.fencing_token().unwrap(), "b")
        .expect("the new holder's write");
    // a resumes and writes before it has noticed anything.
    assert!(
        register.write(stale_token, "a#2 (stale)").is_err(),
        "a stale holder's write was accepted"
    );
    // The new holder's release does not make the old token good again.
    assert!(release(&b, &new).await);
    assert!(
        register.write(stale_token, "a#3 (stale)").is_err(),
        "a stale holder's write was accepted after the new holder released"
    );
    assert_eq!((register.value(), register.rejected()), (Some("b"), 2));
    assert!(
        !guard.release().await.unwrap_or(false),
        "the stale guard's release must not report success"
    );
    Outcome::Passed
}

/// Under contention (8 independent clients × many iterations) critical sections never overlap:
/// an unprotected read-modify-write counter ends exact, an "inside" counter never exceeds 1, and
/// fencing tokens increase in critical-section order.
pub async fn mutual_exclusion_under_contention(h: Harness) -> Outcome {
    const CLIENTS: usize = 8;
    const ITERATIONS: usize = 12;
    let clients = h.clients(CLIENTS).await;
    let key = h.key("contention");
    let counter = Arc::new(AtomicU64::new(0));
    let inside = Arc::new(AtomicUsize::new(0));
    let tokens = Arc::new(std::sync::Mutex::new(Vec::new()));
    let tasks: Vec<_> = clients
        .into_iter()
        .map(|c| {
            let (key, counter, inside, tokens) =
                (key.clone(), counter.clone(), inside.clone(), tokens.clone());
            tokio::spawn(async move {
                for _ in 0..ITERATIONS {
                    let deadline = Instant::now() + Duration::from_secs(60);
                    let lease = c.acquire(&key, LONG_TTL, deadline).await.expect("acquire");
                    assert_eq!(
                        inside.fetch_add(1, Ordering::SeqCst),
                        0,
                        "two holders at once"
                    );
                    tokens.lock().unwrap().push(lease.fencing_token());
                    let seen = counter.load(Ordering::SeqCst);
                    tokio::task::yield_now().await;
                    sleep(Duration::from_millis(1)).await;
                    counter.store(seen + 1, Ordering::SeqCst);
                    inside.fetch_sub(1, Ordering::SeqCst);
                    assert!(
                        c.release(&lease).await.expect("release"),
                        "lost while holding"
                    );
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(
        counter.load(Ordering::SeqCst),
        (CLIENTS * ITERATIONS) as u64
    );
    let tokens = tokens.lock().unwrap();
    if tokens.iter().all(Option::is_some) {
        assert!(
            tokens.windows(2).all(|w| w[0] < w[1]),
            "tokens out of order: {tokens:?}"
        );
    }
    Outcome::Passed
}

/// `acquire` on a held key fails with `Timeout` at its deadline — not long before, not long after.
pub async fn acquire_times_out_at_its_deadline(h: Harness) -> Outcome {
    let [a, b] = <[DynLock; 2]>::try_from(h.clients(2).await).ok().unwrap();
    let key = h.key("timeout");
    let lease = take(&a, &key, LONG_TTL).await;
    let wait = Duration::from_millis(800);
    let start = Instant::now();
    let err = b.acquire(&key, LONG_TTL, start + wait).await.unwrap_err();
    let waited = start.elapsed();
    assert!(
        matches!(err, Error::Timeout { .. }),
        "expected Timeout, got {err}"
    );
    assert!(
        waited >= wait - Duration::from_millis(20),
        "gave up early after {waited:?}"
    );
    assert!(waited <= wait + SLACK, "gave up late after {waited:?}");
    assert!(release(&a, &lease).await);
    Outcome::Passed
}

/// Where `wait_notify` is claimed, a waiter is woken promptly by a release (well before any
/// fallback poll would fire).
///
/// Eight hand-offs on eight keys, waiting in parallel (one settling time for all): at least
/// seven must take under 200 ms. A waiter that only polls (notifications broken) is woken
/// within 200 ms by luck with a probability of about half for Redis's 250–500 ms polls and a
/// quarter for PostgreSQL's 0.5–1 s ones, so it passes this about 5 % (Redis) or 0.1 % of the
/// time (the median of three it replaced: 55 % and 18 %); one slow hand-off on a loaded machine
/// is tolerated.
pub async fn waiter_is_woken_promptly_by_release(h: Harness) -> Outcome {
    const HANDOFFS: usize = 8;
    const PROMPT: Duration = Duration::from_millis(200);
    let [a, b] = <[DynLock; 2]>::try_from(h.clients(2).await).ok().unwrap();
    if !a.capabilities().wait_notify {
        return Outcome::Skipped("wait_notify not claimed");
    }
    let mut held = Vec::new();
    let mut waiters = Vec::new();
    for _ in 0..HANDOFFS {
        let key = h.key("notify");
        held.push(take(&a, &key, LONG_TTL).await);
        let (b, key) = (b.clone(), key.clone());
        waiters.push(tokio::spawn(async move {
            let l = b.acquire(&key, LONG_TTL, Instant::now() + LONG_TTL).await;
            (Instant::now(), l)
        }));
    }
    // Let the waiters settle into their longest fallback-poll interval first.
    sleep(Duration::from_millis(1500)).await;
    let mut handoffs = Vec::new();
    for (lease, waiter) in held.iter().zip(waiters) {
        let released_at = Instant::now();
        assert!(release(&a, lease).await);
        let (got_at, got) = waiter.await.unwrap();
        let got = got.expect("the waiter should get the lock");
        handoffs.push(got_at.saturating_duration_since(released_at));
        release(&b, &got).await;
    }
    handoffs.sort();
    let prompt = handoffs.iter().filter(|d| **d < PROMPT).count();
    assert!(
        prompt >= HANDOFFS - 1,
        "only {prompt} of {HANDOFFS} hand-offs under {PROMPT:?} (all {handoffs:?}): not a wake-up"
    );
    Outcome::Passed
}

/// Where `fair_queue` is claimed, waiters get the lock in the order they started waiting.
pub async fn waiters_are_served_in_fifo_order(h: Harness) -> Outcome {
    let clients = h.clients(5).await;
    if !clients[0].capabilities().fair_queue {
        return Outcome::Skipped("fair_queue not claimed");
    }
    let key = h.key("fifo");
    let holder = take(&clients[0], &key, LONG_TTL).await;
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for (i, c) in clients.iter().enumerate().skip(1) {
        let (c, k, order) = (c.clone(), key.clone(), order.clone());
        tasks.push(tokio::spawn(async move {
            let lease = c
                .acquire(&k, LONG_TTL, Instant::now() + LONG_TTL)
                .await
                .expect("waiter acquire");
            order.lock().unwrap().push(i);
            assert!(c.release(&lease).await.unwrap());
            drop(k);
        }));
        wait_until_queued(&clients[0], &key, i).await;
    }
    assert!(release(&clients[0], &holder).await);
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(*order.lock().unwrap(), vec![1, 2, 3, 4]);
    Outcome::Passed
}

/// Waits until `inspect` shows `n` waiters (or, where the backend cannot count them, a while).
async fn wait_until_queued(client: &DynLock, key: &LockKey, n: usize) {
    let until = Instant::now() + SLACK;
    loop {
        match client.inspect(key).await.unwrap().and_then(|i| i.waiters) {
            Some(w) if w >= n => return,
            Some(_) if Instant::now() < until => sleep(Duration::from_millis(10)).await,
            Some(w) => panic!("only {w} of {n} waiters queued"),
            None => {
                sleep(Duration::from_millis(300)).await;
                return;
            }
        }
    }
}

/// Dropping an `acquire` future while it waits leaves nothing behind: after the holder releases,
/// a third client acquires promptly (the dropped waiter's client stays alive meanwhile).
pub async fn dropped_acquire_leaves_nothing_behind(h: Harness) -> Outcome {
    let [a, b, c] = <[DynLock; 3]>::try_from(h.clients(3).await).ok().unwrap();
    let key = h.key("dropped-waiter");
    let lease = take(&a, &key, LONG_TTL).await;
    for _ in 0..3 {
        let attempt = b.acquire(&key, LONG_TTL, Instant::now() + LONG_TTL);
        assert!(timeout(Duration::from_millis(300), attempt).await.is_err());
    }
    assert!(release(&a, &lease).await);
    let got = c
        .acquire(&key, LONG_TTL, Instant::now() + SLACK)
        .await
        .expect("a dropped waiter blocks others");
    release(&c, &got).await;
    drop(b);
    Outcome::Passed
}

/// The guard's watchdog keeps a lease alive well past its TTL while `lost()` stays quiet.
pub async fn watchdog_keeps_the_lease_alive(h: Harness) -> Outcome {
    let [a, b] = <[DynLock; 2]>::try_from(h.clients(2).await).ok().unwrap();
    if !a.capabilities().renew {
        return Outcome::Skipped("renew not claimed");
    }
    let ttl = stall_proof_ttl(&h);
    let key = h.key("watchdog");
    let guard = a
        .lock(&key)
        .ttl(ttl)
        .try_acquire()
        .await
        .unwrap()
        .expect("free");
    let until = Instant::now() + ttl * 3;
    while Instant::now() < until {
        tokio::select! {
            () = guard.lost() => panic!("lost() fired: {:?}", guard.loss_reason()),
            () = sleep(ttl / 2) => {}
        }
        assert!(
            is_held_elsewhere(&b, &key).await,
            "the watchdog let the lease lapse"
        );
    }
    assert!(guard.renewals() >= 3, "only {} renewals", guard.renewals());
    assert!(!guard.is_lost());
    assert!(guard.release().await.unwrap());
    Outcome::Passed
}

/// `lost()` fires when the lock is taken away from the holder (expired at the coordinator and
/// granted to another client), within about one TTL.
pub async fn lost_fires_when_the_lock_is_taken_away(h: Harness) -> Outcome {
    let [a, b] = <[DynLock; 2]>::try_from(h.clients(2).await).ok().unwrap();
    if !a.capabilities().lost_notify {
        return Outcome::Skipped("lost_notify not claimed");
    }
    let ttl = h.short_ttl();
    let key = h.key("lost");
    let guard = a
        .lock(&key)
        .ttl(ttl)
        .try_acquire()
        .await
        .unwrap()
        .expect("free");
    h.force_expire(guard.granted_lease()).await;
    let taken = take(&b, &key, LONG_TTL).await;
    // The bound is the timeout itself: within one TTL (plus a loaded machine's slack) of the
    // takeover.
    timeout(ttl + SLACK, guard.lost())
        .await
        .expect("lost() did not fire within ttl + slack after the lock was taken away");
    assert!(guard.is_lost() && guard.loss_reason().is_some());
    assert!(
        !guard.release().await.unwrap(),
        "release of a lost lock must report false"
    );
    assert!(
        is_held_elsewhere(&a, &key).await,
        "the new holder must keep the lock"
    );
    release(&b, &taken).await;
    Outcome::Passed
}

/// Without renewals, `lost()` fires at the lease's local deadline — before the coordinator can
/// grant the key to anyone else.
pub async fn lost_fires_at_the_local_deadline_before_anyone_else_is_granted(h: Harness) -> Outcome {
    let [a, b] = <[DynLock; 2]>::try_from(h.clients(2).await).ok().unwrap();
    if !a.capabilities().lease_ttl {
        return Outcome::Skipped("lease_ttl not claimed");
    }
    let ttl = h.short_ttl();
    let key = h.key("deadline");
    let guard = a
        .lock(&key)
        .ttl(ttl)
        .no_watchdog()
        .try_acquire()
        .await
        .unwrap()
        .expect("free");
    // Without a watchdog the deadline never moves, and `is_lost()` turns true at it even before
    // the guard's task runs: the claim is that this deadline precedes the contender's grant. (When
    // this task wakes up from `lost()` on a loaded machine says nothing about that order: the
    // margin is the drift margin, a few ms.)
    let deadline = guard.local_deadline();
    let contender = {
        let (b, key) = (b.clone(), key.clone());
        tokio::spawn(async move {
            let l = b
                .acquire(&key, LONG_TTL, Instant::now() + ttl * 3 + SLACK)
                .await;
            (Instant::now(), l)
        })
    };
    timeout(ttl + SLACK, guard.lost())
        .await
        .expect("lost() at the deadline");
    let (granted_at, lease) = contender.await.unwrap();
    let lease = lease.expect("the contender gets the key after the ttl");
    assert_eq!(
        guard.local_deadline(),
        deadline,
        "no renewal without a watchdog"
    );
    assert!(
        deadline <= granted_at,
        "the holder trusted its lease until {:?} after the contender got it",
        deadline - granted_at
    );
    release(&b, &lease).await;
    Outcome::Passed
}

/// `run_exclusive` skips when the key is held, otherwise runs the job with its fencing token
/// and releases at the end.
pub async fn run_exclusive_skips_when_held_and_releases_after(h: Harness) -> Outcome {
    let [a, b] = <[DynLock; 2]>::try_from(h.clients(2).await).ok().unwrap();
    let key = h.key("run-exclusive");
    let held = take(&a, &key, LONG_TTL).await;
    let ran = AtomicUsize::new(0);
    let skipped = b
        .run_exclusive(&key, LockOptions::with_ttl(LONG_TTL), |_| async {
            ran.fetch_add(1, Ordering::SeqCst);
        })
        .await
        .unwrap();
    assert_eq!((skipped, ran.load(Ordering::SeqCst)), (None, 0));
    assert!(release(&a, &held).await);
    let fencing = fencing_claimed(&b);
    let out = b
        .run_exclusive(&key, LockOptions::with_ttl(LONG_TTL), |ctx| async move {
            assert_eq!(ctx.fencing_token().is_some(), fencing);
            assert!(!ctx.is_lost());
            7
        })
        .await
        .unwrap();
    assert_eq!(out, Some(7));
    let again = take(&a, &key, LONG_TTL).await; // released at the end of the job
    release(&a, &again).await;
    Outcome::Passed
}

/// Dropping a guard releases the lock in the background well before its TTL.
pub async fn dropped_guard_releases_the_lock(h: Harness) -> Outcome {
    let [a, b] = <[DynLock; 2]>::try_from(h.clients(2).await).ok().unwrap();
    let key = h.key("guard-drop");
    let guard = a
        .lock(&key)
        .ttl(LONG_TTL)
        .try_acquire()
        .await
        .unwrap()
        .expect("free");
    drop(guard);
    let got = b
        .acquire(&key, LONG_TTL, Instant::now() + SLACK)
        .await
        .expect("a dropped guard must release");
    release(&b, &got).await;
    Outcome::Passed
}

/// `inspect` reports no holder for a free key, the holder's token digest, fencing token,
/// remaining TTL and identity (host, pid) while held, and none again after release.
pub async fn inspect_reports_the_holder(h: Harness) -> Outcome {
    let [a, b] = <[DynLock; 2]>::try_from(h.clients(2).await).ok().unwrap();
    let key = h.key("inspect");
    assert_eq!(b.inspect(&key).await.unwrap(), None);
    let lease = take(&a, &key, LONG_TTL).await;
    let info = b.inspect(&key).await.unwrap().expect("a holder");
    if let Some(digest) = info.token_digest {
        assert_eq!(digest, lease.token().digest());
    }
    assert_eq!(info.fencing_token, lease.fencing_token());
    if let Some(left) = info.ttl_remaining {
        assert!(
            left <= a.capabilities().effective_ttl(LONG_TTL) && !left.is_zero(),
            "{left:?}"
        );
    }
    // Every backend records who holds the lock next to its grant (issue 25, C13): this
    // process, as the holder client made it.
    let who = info.holder.as_ref().map(|h| h.as_str().to_owned());
    assert!(
        who.as_deref().is_some_and(
            |w| w.starts_with("host=") && w.contains(&format!(" pid={} ", std::process::id()))
        ),
        "inspect does not say who holds the lock: {who:?}"
    );
    let shown = format!("{info:?} {lease:?}");
    assert!(
        !shown.contains(&lease.token().expose_hex()),
        "Debug output leaks the token"
    );
    assert!(release(&a, &lease).await);
    assert_eq!(b.inspect(&key).await.unwrap(), None);
    Outcome::Passed
}

/// Bad input (invalid keys, zero TTL, TTL below the backend's minimum, a watchdog interval not
/// below the TTL) gets a typed error before any I/O — also from a client whose coordinator is
/// unreachable — while a valid request to an unreachable coordinator fails with an error instead
/// of hanging. A deadline in the past is not bad input: it still makes one attempt.
pub async fn bad_input_is_rejected_before_io(h: Harness) -> Outcome {
    let mut clients = vec![h.client().await];
    let reachable = clients.len();
    clients.extend(h.unreachable_client().await);
    for (i, c) in clients.iter().enumerate() {
        let offline = i >= reachable;
        let key = h.key("bad-input");
        let caps = c.capabilities();
        for bad in ["", "a\0b", "line\nbreak"] {
            let err = c.lock(bad).try_acquire().await.unwrap_err();
            assert!(matches!(err, Error::InvalidKey { .. }), "{bad:?}: {err}");
        }
        let long = "k".repeat(LockKey::MAX_LEN + 1);
        assert!(matches!(
            c.lock(long.as_str()).acquire().await,
            Err(Error::InvalidKey { .. })
        ));
        let zero = c.try_acquire(&key, Duration::ZERO).await.unwrap_err();
        assert!(matches!(zero, Error::InvalidTtl { .. }), "{zero}");
        let zero = c
            .acquire(&key, Duration::ZERO, Instant::now() + SLACK)
            .await
            .unwrap_err();
        assert!(matches!(zero, Error::InvalidTtl { .. }), "{zero}");
        assert!(matches!(
            c.lock(&key).ttl(Duration::ZERO).try_acquire().await,
            Err(Error::InvalidTtl { .. })
        ));
        if caps.min_ttl > Duration::from_millis(1) {
            let below = caps.min_ttl - Duration::from_millis(1);
            let err = c.try_acquire(&key, below).await.unwrap_err();
            assert!(matches!(err, Error::InvalidTtl { .. }), "{err}");
        }
        // A deadline already past is no bad input: it still allows one attempt, which takes
        // the free key (past_deadlines_still_make_one_attempt has the rest).
        let start = Instant::now();
        let past = timeout(
            Duration::from_secs(30),
            c.acquire(&key, LONG_TTL, start - Duration::from_millis(1)),
        )
        .await
        .expect("a past-deadline acquire hung");
        match past {
            Ok(lease) if !offline => assert!(release(c, &lease).await),
            Ok(_) => panic!("an unreachable coordinator granted a lock"),
            Err(e) => assert!(offline && e.is_temporary(), "a past deadline: {e}"),
        }
        let err = c
            .lock(&key)
            .ttl(LONG_TTL)
            .watchdog(LONG_TTL)
            .try_acquire()
            .await
            .unwrap_err();
        assert!(
            matches!(err, Error::Config(_) | Error::Unsupported { .. }),
            "{err}"
        );
        if offline {
            let res = timeout(Duration::from_secs(30), c.try_acquire(&key, LONG_TTL))
                .await
                .expect("a request to an unreachable coordinator must fail, not hang");
            let err = res.expect_err("an unreachable coordinator cannot grant a lock");
            assert!(
                err.is_temporary(),
                "unreachable should be a temporary error: {err}"
            );
        }
    }
    Outcome::Passed
}

/// Every claimed capability is real and every unclaimed one is refused with `Unsupported`
/// before any I/O: fencing tokens exist exactly when fencing is claimed, a stronger fencing
/// requirement is refused, and `renew` is refused where it is not claimed.
pub async fn capabilities_are_honest(h: Harness) -> Outcome {
    let a = h.client().await;
    let caps = a.capabilities();
    let key = h.key("caps");
    assert!(
        caps.check_ttl(LONG_TTL).is_ok(),
        "the suite's long ttl must be allowed"
    );
    assert!(
        caps.check_ttl(h.short_ttl()).is_ok(),
        "short_ttl below the backend's minimum"
    );
    if caps.fencing < FencingGuarantee::Quorum {
        let stronger = if caps.fencing == FencingGuarantee::None {
            FencingGuarantee::SingleNode
        } else {
            FencingGuarantee::Quorum
        };
        let err = a
            .lock(&key)
            .require_fencing(stronger)
            .try_acquire()
            .await
            .unwrap_err();
        assert!(matches!(err, Error::Unsupported { .. }), "{err}");
    }
    let guard = a
        .lock(&key)
        .ttl(LONG_TTL)
        .require_fencing(caps.fencing)
        .try_acquire()
        .await
        .unwrap()
        .expect("free");
    assert_eq!(
        guard.fencing_token().is_some(),
        caps.fencing != FencingGuarantee::None
    );
    let mut lease = guard.granted_lease().clone();
    let renewed = a.renew(&mut lease, LONG_TTL).await;
    if caps.renew {
        renewed.expect("renew is claimed");
    } else {
        assert!(matches!(renewed, Err(Error::Unsupported { .. })));
        let err = a
            .lock(&key)
            .watchdog(Duration::from_secs(1))
            .try_acquire()
            .await
            .unwrap_err();
        assert!(matches!(err, Error::Unsupported { .. }), "{err}");
    }
    assert!(
        caps.lease_ttl || caps.session_bound,
        "a lock must end when its holder vanishes"
    );
    if caps.fair_queue {
        assert!(
            caps.wait_notify || caps.lease_ttl,
            "a fair queue needs waiters to be woken"
        );
    }
    assert!(guard.release().await.unwrap());
    Outcome::Passed
}

/// Where `force_release` is claimed, the operator override removes any holder (the holder's
/// guard reports the loss and its own release then returns `false`) and reports `false` on a
/// free key; where it is not claimed it is refused with `Unsupported`.
pub async fn force_release_removes_any_holder(h: Harness) -> Outcome {
    let [a, b] = <[DynLock; 2]>::try_from(h.clients(2).await).ok().unwrap();
    let key = h.key("force-release");
    if !a.capabilities().force_release {
        let err = b.force_release(&key).await.unwrap_err();
        assert!(matches!(err, Error::Unsupported { .. }), "{err}");
        return Outcome::Skipped("force_release not claimed");
    }
    assert!(
        !b.force_release(&key).await.unwrap(),
        "nothing to remove on a free key"
    );
    let ttl = h.short_ttl();
    let guard = a
        .lock(&key)
        .ttl(ttl)
        .try_acquire()
        .await
        .unwrap()
        .expect("free");
    let guard_fence = guard.fencing_token();
    assert!(b.force_release(&key).await.unwrap());
    let lease = b
        .acquire(&key, LONG_TTL, Instant::now() + SLACK)
        .await
        .expect("the key is free after a forced release");
    if a.capabilities().lost_notify {
        timeout(ttl + SLACK, guard.lost())
            .await
            .expect("the old holder learns it lost");
    }
    assert!(
        !guard.release().await.unwrap(),
        "the old holder must not release the new lock"
    );
    // Removing one grant by its fencing token: the earlier grant's token removes nothing now
    // (the holder changed), the current one's removes exactly it.
    let (Some(old), Some(current)) = (guard_fence, lease.fencing_token()) else {
        assert!(release(&b, &lease).await);
        return Outcome::Passed;
    };
    assert!(
        !b.force_release_grant(&key, old).await.unwrap(),
        "a stale grant's token must not remove the current holder"
    );
    assert!(
        b.inspect(&key).await.unwrap().is_some(),
        "the current holder is still there"
    );
    assert!(b.force_release_grant(&key, current).await.unwrap());
    assert!(b.inspect(&key).await.unwrap().is_none());
    assert!(
        !release(&b, &lease).await,
        "the removed grant no longer releases"
    );
    Outcome::Passed
}

/// Job mode's `at_least` (issue 21): a job that ends early keeps the lock until grant +
/// `at_least` — after the holder's client is gone without a goodbye, as when its process exits
/// or dies right after the job — and nobody is granted it before then; after, it is free with
/// nobody having renewed it. Backends without `keep_until` skip (they refuse `at_least`).
pub async fn at_least_outlives_the_job_and_the_holders_exit(h: Harness) -> Outcome {
    let [a, b] = <[DynLock; 2]>::try_from(h.clients(2).await).ok().unwrap();
    let caps = a.capabilities();
    if !(caps.keep_until && caps.renew) {
        let got = a
            .run_exclusive(
                &h.key("at-least-refused"),
                LockOptions::with_ttl(LONG_TTL).at_least(Duration::from_secs(5)),
                |_| async {},
            )
            .await;
        assert!(
            matches!(got, Err(Error::Unsupported { .. })),
            "at_least without keep_until must be refused: {got:?}"
        );
        return Outcome::Skipped("keep_until not claimed");
    }
    let key = h.key("at-least");
    let window = (h.short_ttl() * 4).max(Duration::from_secs(4));
    let start = Instant::now();
    let ran = a
        .run_exclusive(
            &key,
            LockOptions::with_ttl(h.short_ttl().max(Duration::from_secs(1))).at_least(window),
            |_| async {},
        )
        .await
        .unwrap();
    assert_eq!(ran, Some(()));
    h.abandon(a).await;
    // Inside the window: held, by nobody's renewals.
    assert!(
        is_held_elsewhere(&b, &key).await,
        "free right after a job with at_least"
    );
    sleep(window / 2).await;
    let halfway = Instant::now();
    if halfway < start + window {
        assert!(
            is_held_elsewhere(&b, &key).await,
            "free {:?} after the grant, inside at_least {window:?}",
            halfway - start
        );
    }
    // Granted to a waiter once the window is over, never before.
    let lease = b
        .acquire(&key, LONG_TTL, Instant::now() + window + SLACK)
        .await
        .expect("granted after the at_least window");
    assert!(
        Instant::now() >= start + window,
        "granted {:?} after the start, inside at_least {window:?}",
        start.elapsed()
    );
    assert!(release(&b, &lease).await);
    Outcome::Passed
}

/// Job mode's `at_most` (issue 21): a hung job is cancelled as lost at grant + `at_most`
/// (not long before: the watchdog kept the lease past its TTL until then), and the lock is
/// free right after.
pub async fn at_most_cancels_a_hung_job_and_frees_the_lock(h: Harness) -> Outcome {
    let [a, b] = <[DynLock; 2]>::try_from(h.clients(2).await).ok().unwrap();
    if !a.capabilities().renew {
        return Outcome::Skipped("renew not claimed");
    }
    let key = h.key("at-most");
    let ttl = stall_proof_ttl(&h);
    let at_most = ttl * 2;
    let start = Instant::now();
    let got = timeout(
        at_most + SLACK * 4,
        a.run_exclusive(&key, LockOptions::with_ttl(ttl).at_most(at_most), |_| {
            std::future::pending::<()>()
        }),
    )
    .await
    .expect("at_most never cancelled the hung job");
    assert!(matches!(got, Err(Error::NotHeld { .. })), "{got:?}");
    // at_most counts from the lease's own start, which a session-bound backend puts before the
    // call (ZooKeeper counts from the session's last leader-proved moment); past 1.5 TTL the
    // watchdog must have renewed it.
    assert!(
        Instant::now() >= start + at_most - ttl / 2,
        "cancelled {:?} after the start, long before at_most {at_most:?}",
        start.elapsed()
    );
    let lease = timeout(SLACK, b.try_acquire(&key, LONG_TTL))
        .await
        .expect("try_acquire returns")
        .unwrap()
        .expect("the lock is free once at_most cancelled the job");
    assert!(release(&b, &lease).await);
    Outcome::Passed
}

/// The election of the properties below on `client`, or `None` (after checking that a
/// campaign is refused before any I/O) when the backend mints no fencing tokens.
async fn election_on(client: &DynLock, name: &str, ttl: Duration) -> Option<Election> {
    let election = Election::new(client.clone(), name)
        .expect("a valid election name")
        .ttl(ttl);
    if fencing_claimed(client) {
        return Some(election);
    }
    let refused = election.try_campaign().await;
    assert!(
        matches!(refused, Err(Error::Unsupported { .. })),
        "a campaign without fencing tokens must be refused: {refused:?}"
    );
    None
}

/// Leader election (issue 21): three campaigners on separate clients take turns leading,
/// waiting for each other; never two lead at once, each leader's write to a resource fenced by
/// its term is accepted (terms strictly increase in leadership order), and every deposed
/// leader's late write is refused.
pub async fn election_never_two_leaders(h: Harness) -> Outcome {
    const CAMPAIGNERS: usize = 3;
    const TERMS_EACH: usize = 3;
    let clients = h.clients(CAMPAIGNERS).await;
    let name = h.key("election-exclusive");
    let ttl = stall_proof_ttl(&h);
    let mut elections = Vec::new();
    for client in &clients {
        match election_on(client, name.as_str(), ttl).await {
            Some(election) => elections.push(election),
            None => return Outcome::Skipped("fencing not claimed: an election without terms"),
        }
    }
    let register = Arc::new(FencedRegister::new());
    let inside = Arc::new(AtomicUsize::new(0));
    let terms = Arc::new(std::sync::Mutex::new(Vec::new()));
    let tasks: Vec<_> = elections
        .into_iter()
        .enumerate()
        .map(|(i, election)| {
            let (register, inside, terms) = (register.clone(), inside.clone(), terms.clone());
            tokio::spawn(async move {
                for round in 0..TERMS_EACH {
                    let lead = election.campaign(LONG_TTL).await.expect("campaign");
                    assert_eq!(
                        inside.fetch_add(1, Ordering::SeqCst),
                        0,
                        "two leaders at once"
                    );
                    let term = lead.term();
                    terms.lock().unwrap().push(term);
                    if let Err(stale) = register.write(term, format!("c{i} round {round}")) {
                        panic!("the leader's write was refused (an older term led after a newer one): {stale}");
                    }
                    sleep(Duration::from_millis(5)).await;
                    assert!(!lead.is_lost(), "lost while leading: {:?}", lead.loss_reason());
                    inside.fetch_sub(1, Ordering::SeqCst);
                    assert!(lead.resign().await.expect("resign"), "lost before resigning");
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    let terms = terms.lock().unwrap().clone();
    assert_eq!(terms.len(), CAMPAIGNERS * TERMS_EACH);
    assert!(
        terms.windows(2).all(|w| w[0] < w[1]),
        "terms not strictly increasing in leadership order: {terms:?}"
    );
    // Every deposed leader comes back late with its term: refused, the last leader's value kept.
    let last = register.value();
    for term in &terms[..terms.len() - 1] {
        assert!(
            register
                .write(*term, "late write of a deposed leader".into())
                .is_err(),
            "a deposed leader's write (term {term}) was accepted"
        );
    }
    assert_eq!(register.value(), last);
    assert_eq!(register.accepted(), terms.len() as u64);
    Outcome::Passed
}

/// Leader election (issue 21): a campaigner waiting behind the leader is leader soon after the
/// leader resigns — well before the leadership's 30 s lease could have run out — with a
/// greater term.
pub async fn election_resign_hands_over_promptly(h: Harness) -> Outcome {
    let [a, b] = <[DynLock; 2]>::try_from(h.clients(2).await).ok().unwrap();
    let name = h.key("election-handover");
    let (Some(first), Some(second)) = (
        election_on(&a, name.as_str(), LONG_TTL).await,
        election_on(&b, name.as_str(), LONG_TTL).await,
    ) else {
        return Outcome::Skipped("fencing not claimed: an election without terms");
    };
    let lead = first.campaign(SLACK).await.expect("the first campaign");
    let waiter = tokio::spawn(async move { second.campaign(LONG_TTL).await });
    wait_until_queued(&a, first.key(), 1).await;
    assert!(
        !waiter.is_finished(),
        "a second leader while the first leads"
    );
    let old = lead.term();
    let resigned_at = Instant::now();
    assert!(lead.resign().await.expect("resign"));
    let next = timeout(LONG_TTL, waiter)
        .await
        .expect("the waiting campaigner was never elected")
        .unwrap()
        .expect("the waiting campaign");
    let took = resigned_at.elapsed();
    assert!(
        took < SLACK,
        "elected {took:?} after the resign (the lease is {LONG_TTL:?}): not a prompt hand-over"
    );
    assert!(next.term() > old, "term {} after {old}", next.term());
    assert!(next.resign().await.expect("resign"));
    Outcome::Passed
}

/// Leader election (issue 21): `leader()`, asked through the leader's own client and another,
/// reports the handle's term and this process as the holder while it leads, and nobody once it
/// has resigned; the next leader's term is greater.
pub async fn election_leader_agrees_with_the_handle(h: Harness) -> Outcome {
    let [a, b] = <[DynLock; 2]>::try_from(h.clients(2).await).ok().unwrap();
    let name = h.key("election-leader");
    let (Some(ea), Some(eb)) = (
        election_on(&a, name.as_str(), LONG_TTL).await,
        election_on(&b, name.as_str(), LONG_TTL).await,
    ) else {
        return Outcome::Skipped("fencing not claimed: an election without terms");
    };
    assert_eq!(
        eb.leader().await.unwrap(),
        None,
        "a leader before any campaign"
    );
    let mut previous = None;
    for (leading, other) in [(&ea, &eb), (&eb, &ea)] {
        let lead = leading.campaign(SLACK).await.expect("campaign");
        assert!(
            previous < Some(lead.term()),
            "{previous:?} then {}",
            lead.term()
        );
        previous = Some(lead.term());
        for asked in [leading, other] {
            let leader = asked
                .leader()
                .await
                .unwrap()
                .expect("a leader while one leads");
            assert_eq!(
                leader.term,
                Some(lead.term()),
                "leader() disagrees with the handle"
            );
            let who = leader.holder.as_ref().map(|w| w.as_str().to_owned());
            assert!(
                who.as_deref().is_some_and(|w| w.starts_with("host=")
                    && w.contains(&format!(" pid={} ", std::process::id()))),
                "leader() does not say who leads: {who:?}"
            );
            if let Some(left) = leader.ttl_remaining {
                assert!(
                    !left.is_zero() && left <= a.capabilities().effective_ttl(LONG_TTL),
                    "{left:?}"
                );
            }
        }
        assert!(lead.resign().await.expect("resign"));
        assert_eq!(
            other.leader().await.unwrap(),
            None,
            "a leader after the resign"
        );
        assert_eq!(
            leading.leader().await.unwrap(),
            None,
            "a leader after the resign"
        );
    }
    Outcome::Passed
}

/// Leader election (issue 21): `observe` reports each leadership's term, in order, and a
/// `None` once nobody leads — here each leadership lasts until the observer has reported it, so
/// no term may be missed, and no term is reported twice or out of order.
pub async fn election_observe_reports_every_term_in_order(h: Harness) -> Outcome {
    let [a, b, watcher] = <[DynLock; 3]>::try_from(h.clients(3).await).ok().unwrap();
    let name = h.key("election-observe");
    let (Some(ea), Some(eb), Some(ew)) = (
        election_on(&a, name.as_str(), LONG_TTL).await,
        election_on(&b, name.as_str(), LONG_TTL).await,
        election_on(&watcher, name.as_str(), LONG_TTL).await,
    ) else {
        return Outcome::Skipped("fencing not claimed: an election without terms");
    };
    let (tx, mut seen) = tokio::sync::mpsc::unbounded_channel();
    let observer = tokio::spawn(futures::StreamExt::for_each(
        ew.observe(Duration::from_millis(20)),
        move |item| {
            let _ = tx.send(item.expect("a poll of the leader"));
            async {}
        },
    ));
    async fn next(
        seen: &mut tokio::sync::mpsc::UnboundedReceiver<Option<lock_core::Leader>>,
    ) -> Option<FencingToken> {
        timeout(SLACK, seen.recv())
            .await
            .expect("observe reported nothing")
            .expect("the stream ended")
            .map(|leader| leader.term.expect("a leader without a term"))
    }
    assert_eq!(next(&mut seen).await, None, "a leader before any campaign");
    for election in [&ea, &eb, &ea, &eb] {
        let lead = election.campaign(SLACK).await.expect("campaign");
        assert_eq!(
            next(&mut seen).await,
            Some(lead.term()),
            "the next item is not the new term"
        );
        assert!(lead.resign().await.expect("resign"));
        assert_eq!(
            next(&mut seen).await,
            None,
            "the next item after a resign is not `None`"
        );
    }
    observer.abort();
    Outcome::Passed
}

/// Leader election (issue 21): terms fence. A leader whose lease the coordinator dropped while
/// it was paused is replaced by a campaigner with a greater term, whom `leader()` reports;
/// the deposed leader's late write with its old term is refused by the resource once the new
/// leader wrote, and its resign does not report success.
pub async fn election_deposed_leader_is_fenced_out(h: Harness) -> Outcome {
    let [a, b] = <[DynLock; 2]>::try_from(h.clients(2).await).ok().unwrap();
    let name = h.key("election-deposed");
    let (Some(ea), Some(eb)) = (
        election_on(&a, name.as_str(), LONG_TTL).await,
        election_on(&b, name.as_str(), LONG_TTL).await,
    ) else {
        return Outcome::Skipped("fencing not claimed: an election without terms");
    };
    let register = FencedRegister::new();
    let deposed = ea.campaign(SLACK).await.expect("the first campaign");
    let old = deposed.term();
    register.write(old, "a").expect("the leader's own write");
    h.force_expire(deposed.granted_lease()).await; // a is "paused" past its lease
    let lead = eb
        .campaign(SLACK)
        .await
        .expect("elected after the old lease is gone");
    assert!(lead.term() > old, "term {} after {old}", lead.term());
    let leader = ea.leader().await.unwrap().expect("a leader");
    assert_eq!(
        leader.term,
        Some(lead.term()),
        "leader() reports the deposed term"
    );
    register
        .write(lead.term(), "b")
        .expect("the new leader's write");
    // a resumes and writes with its term before it has noticed anything.
    assert!(
        register.write(old, "a, late").is_err(),
        "a deposed leader's write was accepted"
    );
    assert_eq!(register.value(), Some("b"));
    assert!(
        !deposed.resign().await.unwrap_or(false),
        "the deposed leader's resign must not report success"
    );
    assert_eq!(
        eb.leader().await.unwrap().and_then(|l| l.term),
        Some(lead.term()),
        "the deposed leader's resign removed the new leader"
    );
    assert!(lead.resign().await.expect("resign"));
    Outcome::Passed
}

/// Leader election (issue 21): the leader proclaims a new value — `leader()`, asked through
/// another client, shows it with the same term, twice over — and a deposed leader's proclaim
/// (its lease expired, another leading) is refused and changes nothing. Skipped where the
/// backend does not claim `relabel` (its proclaim is then refused before any I/O).
pub async fn election_proclaim_changes_the_value_not_the_term(h: Harness) -> Outcome {
    let [a, b] = <[DynLock; 2]>::try_from(h.clients(2).await).ok().unwrap();
    let name = h.key("election-proclaim");
    let (Some(ea), Some(eb)) = (
        election_on(&a, name.as_str(), LONG_TTL).await,
        election_on(&b, name.as_str(), LONG_TTL).await,
    ) else {
        return Outcome::Skipped("fencing not claimed: an election without terms");
    };
    let lead = ea.campaign(SLACK).await.expect("campaign");
    for value in ["proclaimed-1", "proclaimed-2"] {
        let shown = match lead.proclaim(value).await {
            Ok(shown) => shown,
            Err(Error::Unsupported { .. }) => {
                assert!(
                    !a.capabilities().relabel,
                    "relabel is claimed but proclaim answers Unsupported"
                );
                assert!(lead.resign().await.expect("resign"));
                return Outcome::Skipped("relabel not claimed: no proclaim");
            }
            Err(e) => panic!("the leader's proclaim failed: {e}"),
        };
        let leader = eb.leader().await.unwrap().expect("a leader");
        assert_eq!(
            leader.term,
            Some(lead.term()),
            "a proclaim changed the term"
        );
        assert_eq!(
            leader.holder,
            Some(shown),
            "leader() does not show the proclaimed value"
        );
    }
    // Still the same grant: it renews as before.
    if a.capabilities().renew {
        let mut lease = lead.granted_lease().clone();
        a.renew(&mut lease, LONG_TTL)
            .await
            .expect("the proclaimed grant renews");
    }
    h.force_expire(lead.granted_lease()).await;
    let next = eb.campaign(SLACK).await.expect("campaign after the expiry");
    let before = eb.leader().await.unwrap().map(|l| (l.term, l.holder));
    let refused = lead.proclaim("deposed").await;
    assert!(
        matches!(refused, Err(Error::NotHeld { .. })),
        "a deposed leader's proclaim: {refused:?}"
    );
    // The same through the client, past the handle's own check (a handle that already saw its
    // loss refuses without asking the coordinator): the coordinator's compare must refuse it.
    let deposed = HolderIdentity::process(Some("deposed")).expect("a valid label");
    let refused = a.relabel(lead.granted_lease(), &deposed).await;
    assert!(
        matches!(refused, Err(Error::NotHeld { .. })),
        "the coordinator let a deposed grant relabel: {refused:?}"
    );
    let after = eb.leader().await.unwrap().map(|l| (l.term, l.holder));
    assert_eq!(
        after, before,
        "a deposed leader's proclaim changed the leader"
    );
    assert!(next.resign().await.expect("resign"));
    Outcome::Passed
}

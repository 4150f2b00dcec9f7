//! Behaviours each driver used to test on its own, as shared properties (issue 19): the direct
//! hand-off on release, a grant that reaches a waiter after it gave up, a waiter giving up in the
//! middle of the queue, many guards renewing on one client, and a grant that falls on the
//! waiter's deadline.
//!
//! Every check here is on the coordinator's state (`inspect`, a third client's `try_acquire`)
//! right after an operation returned, not on how long something took, so none of them depends on
//! the machine's load beyond a generous bound.
//!
//! Declared as a child of `properties` (which re-exports the properties), so that it shares the
//! helpers there.

use std::time::Duration;

use lock_core::{DistributedLockExt, DynLock, Error, FencingToken, Lease, LockKey};
use tokio::time::{Instant, sleep, sleep_until, timeout};

use super::{LONG_TTL, SLACK, release, stall_proof_ttl, take, wait_until_queued};
use crate::{Harness, Outcome};

/// Spawns `client.acquire(key, LONG_TTL, deadline)`.
fn spawn_acquire(
    client: &DynLock,
    key: &LockKey,
    deadline: Instant,
) -> tokio::task::JoinHandle<lock_core::Result<Lease>> {
    let (client, key) = (client.clone(), key.clone());
    tokio::spawn(async move { client.acquire(&key, LONG_TTL, deadline).await })
}

/// Who `inspect` says holds `key` right now, as (token digest, fence); `None` when it is free.
async fn holder_of(client: &DynLock, key: &LockKey) -> Option<HolderSeen> {
    match client.inspect(key).await {
        Ok(info) => info.map(|i| HolderSeen {
            digest: i.token_digest,
            fence: i.fencing_token,
        }),
        Err(e) => panic!("inspect({key}) failed: {e}"),
    }
}

#[derive(Debug)]
struct HolderSeen {
    digest: Option<lock_core::TokenDigest>,
    fence: Option<FencingToken>,
}

impl HolderSeen {
    /// `true` unless the coordinator named a holder other than `lease` (a backend that does not
    /// report digests or fences cannot contradict it).
    fn may_be(&self, lease: &Lease) -> bool {
        self.digest.is_none_or(|d| d == lease.token().digest())
            && (self.fence.is_none() || self.fence == lease.fencing_token())
    }

    /// `true` when the coordinator names `lease` as the holder, by its digest or its fence.
    fn names(&self, lease: &Lease) -> bool {
        self.digest.is_some_and(|d| d == lease.token().digest())
            || self.fence.is_some() && self.fence == lease.fencing_token()
    }
}

/// Waits until `inspect` shows exactly `n` waiters behind the holder, within `limit`.
async fn wait_for_waiters(what: &str, client: &DynLock, key: &LockKey, n: usize, limit: Duration) {
    let until = Instant::now() + limit;
    loop {
        let waiters = client
            .inspect(key)
            .await
            .unwrap_or_else(|e| panic!("{what}: inspect({key}) failed: {e}"))
            .and_then(|i| i.waiters);
        match waiters {
            None => return, // the backend does not count waiters
            Some(w) if w == n => return,
            Some(w) => assert!(
                Instant::now() < until,
                "{what}: {w} waiters queued, expected {n} within {limit:?}"
            ),
        }
        sleep(Duration::from_millis(10)).await;
    }
}

/// A release hands the lock to the first queued waiter: as soon as `release` returns, the
/// coordinator names a new holder (never "free", which a third client could take), the third
/// client's `try_acquire` gets nothing, and the waiter's `acquire` returns exactly that grant,
/// with its full TTL ahead of it. Gated by `wait_notify` (a backend whose waiters poll finds the
/// lock free between the release and the next poll).
pub async fn a_release_hands_the_lock_to_the_first_waiter(h: Harness) -> Outcome {
    let [holder, waiter, other] = <[DynLock; 3]>::try_from(h.clients(3).await).ok().unwrap();
    if !waiter.capabilities().wait_notify {
        return Outcome::Skipped(
            "wait_notify not claimed: waiters poll, a release hands nothing over",
        );
    }
    let key = h.key("hand-off");
    let lease = take(&holder, &key, LONG_TTL).await;
    let waits = spawn_acquire(&waiter, &key, Instant::now() + LONG_TTL);
    wait_until_queued(&holder, &key, 1).await;
    assert!(release(&holder, &lease).await);
    let seen = holder_of(&other, &key)
        .await
        .expect("the lock was free after the release: it was not handed to the waiter");
    assert!(
        !seen.names(&lease),
        "the released lease is still named the holder: {seen:?}"
    );
    if let Some(barged) = other.try_acquire(&key, LONG_TTL).await.unwrap() {
        panic!(
            "a third client took the lock the release should have handed to the waiter: {:?}",
            barged.fencing_token()
        );
    }
    let got = timeout(SLACK, waits)
        .await
        .expect("the waiter did not learn of the grant the release made")
        .unwrap()
        .expect("the waiter's acquire failed");
    assert!(
        seen.may_be(&got),
        "the waiter returned {:?}, but the release granted {seen:?}",
        got.fencing_token()
    );
    if let (Some(before), Some(now)) = (lease.fencing_token(), got.fencing_token()) {
        assert!(now > before, "fence {now:?} after {before:?}");
    }
    // Compared with a fresh grant of the same TTL to the same client (a backend may cap what a
    // lease trusts, ZooKeeper at its session): the hand-off must not have used up half of it.
    let fresh = take(&waiter, &h.key("hand-off-reference"), LONG_TTL).await;
    assert!(
        got.remaining() > fresh.remaining() / 2,
        "the handed-over lease has {:?} left, a fresh one {:?}",
        got.remaining(),
        fresh.remaining()
    );
    assert!(release(&waiter, &fresh).await);
    assert!(
        !release(&holder, &lease).await,
        "the old lease released the new holder's lock"
    );
    assert!(release(&waiter, &got).await);
    assert!(
        holder_of(&other, &key).await.is_none(),
        "released, yet held"
    );
    Outcome::Passed
}

/// A grant that reaches a waiter after it gave up (its `acquire` future dropped while the release
/// was handing the lock to it, never polled again) is given back: a third client acquires within
/// the slack, long before the grant's 30 s TTL could run out, nobody stays queued, and the
/// waiter's client acquires the key again afterwards.
pub async fn a_grant_to_a_waiter_that_gave_up_is_given_back(h: Harness) -> Outcome {
    let [holder, quitter, next] = <[DynLock; 3]>::try_from(h.clients(3).await).ok().unwrap();
    let what = "a grant to a waiter that gave up";
    let key = h.key("late-grant");
    let lease = take(&holder, &key, LONG_TTL).await;
    let mut quits = quitter.acquire(&key, LONG_TTL, Instant::now() + LONG_TTL);
    tokio::select! {
        got = &mut quits => panic!("{what}: acquired a held key: {got:?}"),
        () = wait_until_queued(&holder, &key, 1) => {}
    }
    assert!(release(&holder, &lease).await);
    // Where the release grants the waiter directly, the grant is now on its way to a future
    // that will never be polled again.
    drop(quits);
    let got = match next
        .acquire(&key, LONG_TTL, Instant::now() + SLACK * 3)
        .await
    {
        Ok(got) => got,
        Err(e) => panic!("{what}: it blocks the key (the grant was not given back): {e}"),
    };
    if let (Some(before), Some(now)) = (lease.fencing_token(), got.fencing_token()) {
        assert!(now > before, "{what}: fence {now:?} after {before:?}");
    }
    wait_for_waiters(what, &next, &key, 0, SLACK).await;
    assert!(
        release(&next, &got).await,
        "{what}: the next holder lost the lock"
    );
    let again = match quitter.try_acquire(&key, LONG_TTL).await {
        Ok(Some(again)) => again,
        Ok(None) => panic!("{what}: the waiter's own client cannot take the free key"),
        Err(e) => panic!("{what}: the waiter's own client cannot acquire any more: {e}"),
    };
    assert!(release(&quitter, &again).await);
    Outcome::Passed
}

/// A waiter in the middle of the queue that gives up (its deadline passes) leaves the queue by
/// the time its `acquire` returns `Timeout` (or a moment later, where the clean-up runs in the
/// background); the waiter behind it does not jump the holder; and the holder's release hands the
/// lock to that waiter, not to the entry that left.
pub async fn a_waiter_that_gives_up_leaves_the_queue_and_delays_nobody(h: Harness) -> Outcome {
    let [holder, quitter, stayer] = <[DynLock; 3]>::try_from(h.clients(3).await).ok().unwrap();
    let what = "a waiter that gives up";
    let key = h.key("give-up");
    let lease = take(&holder, &key, LONG_TTL).await;
    // Queued, and the waiter behind it too, long before its deadline even on a loaded machine:
    // queueing takes a few round trips.
    let quits = spawn_acquire(&quitter, &key, Instant::now() + SLACK * 2);
    wait_until_queued(&holder, &key, 1).await;
    let stays = spawn_acquire(&stayer, &key, Instant::now() + LONG_TTL);
    wait_until_queued(&holder, &key, 2).await;
    match timeout(SLACK * 3, quits).await {
        Ok(Ok(Err(Error::Timeout { .. }))) => {}
        Ok(Ok(other)) => {
            panic!("{what}: the holder keeps the lock, yet acquire returned {other:?}")
        }
        Ok(Err(e)) => panic!("{what}: the acquire task failed: {e}"),
        Err(_) => panic!(
            "{what}: acquire with a {:?} wait did not return within {:?}",
            SLACK * 2,
            SLACK * 3
        ),
    }
    wait_for_waiters(what, &holder, &key, 1, SLACK).await;
    let seen = holder_of(&holder, &key)
        .await
        .expect("the holder keeps the lock");
    assert!(
        seen.may_be(&lease),
        "{what}: the waiter behind jumped the holder: {seen:?}"
    );
    assert!(
        !stays.is_finished(),
        "{what}: the waiter behind returned while the lock was held"
    );
    assert!(release(&holder, &lease).await);
    let handed = holder_of(&holder, &key).await;
    let got = timeout(SLACK, stays)
        .await
        .expect("the release did not reach the waiter behind the one that gave up")
        .unwrap()
        .expect("the waiter behind failed");
    if stayer.capabilities().wait_notify {
        // The release granted the next live entry at once: the waiter behind, not the one gone.
        let handed = handed.expect("the release left the lock free although a waiter was queued");
        assert!(
            handed.may_be(&got),
            "{what}: the release granted {handed:?}, not the waiter that stayed ({:?})",
            got.fencing_token()
        );
    }
    if let (Some(before), Some(now)) = (lease.fencing_token(), got.fencing_token()) {
        assert!(now > before, "{what}: fence {now:?} after {before:?}");
    }
    assert!(release(&stayer, &got).await);
    Outcome::Passed
}

/// Many guards on one client (one connection, one session) keep all their leases alive through
/// several TTLs: every watchdog renews, none reports a loss, and another client finds each key
/// held throughout. (The drivers that batch these renewals count their requests in their own
/// tests; here the point is that batching loses none.)
pub async fn many_guards_on_one_client_keep_their_leases_alive(h: Harness) -> Outcome {
    const GUARDS: usize = 24;
    let [a, b] = <[DynLock; 2]>::try_from(h.clients(2).await).ok().unwrap();
    if !a.capabilities().renew {
        return Outcome::Skipped("renew not claimed");
    }
    let ttl = stall_proof_ttl(&h);
    let base = h.key("many-guards");
    let mut guards = Vec::with_capacity(GUARDS);
    for i in 0..GUARDS {
        let key = LockKey::new(format!("{base}/{i}")).unwrap();
        let guard = a
            .lock(&key)
            .ttl(ttl)
            .try_acquire()
            .await
            .unwrap()
            .expect("a fresh key is free");
        guards.push(guard);
    }
    let until = Instant::now() + ttl * 3;
    while Instant::now() < until {
        for guard in &guards {
            assert!(
                !guard.is_lost(),
                "guard {} lost its lease: {:?}",
                guard.key(),
                guard.loss_reason()
            );
            if let Some(lease) = b.try_acquire(guard.key(), LONG_TTL).await.unwrap() {
                panic!(
                    "{} was free while its guard held it (fence {:?})",
                    guard.key(),
                    lease.fencing_token()
                );
            }
        }
        sleep(ttl / 2).await;
    }
    for guard in guards {
        assert!(
            guard.renewals() >= 2,
            "{}: only {} renewals in three TTLs",
            guard.key(),
            guard.renewals()
        );
        assert!(
            !guard.is_lost(),
            "{}: {:?}",
            guard.key(),
            guard.loss_reason()
        );
        let key = guard.key().clone();
        assert!(guard.release().await.unwrap(), "{key}: not held at the end");
    }
    Outcome::Passed
}

/// An `acquire` whose deadline falls during the hand-off (the holder releases a little before,
/// at, or a little after the waiter's deadline) either returns `Ok` with a lease the coordinator
/// names as the holder, or `Timeout` with no grant left behind for nobody: a third client then
/// acquires within the slack (the waiter asked for a 30 s TTL). Never both, never neither.
pub async fn a_grant_at_the_waiters_deadline_is_kept_or_given_back(h: Harness) -> Outcome {
    let [holder, waiter, other] = <[DynLock; 3]>::try_from(h.clients(3).await).ok().unwrap();
    // Release offsets around the deadline; the waiter is queued well before it.
    const OFFSETS_MS: [i64; 4] = [-30, -5, 0, 15];
    let wait = Duration::from_millis(1500);
    let (mut kept, mut timed_out) = (0, 0);
    for offset in OFFSETS_MS {
        let what = format!("release {offset} ms from the waiter's deadline");
        let key = h.key("deadline-grant");
        let lease = take(&holder, &key, LONG_TTL).await;
        let deadline = Instant::now() + wait;
        let waits = spawn_acquire(&waiter, &key, deadline);
        // Normally queued within milliseconds; a machine stalled past the deadline only makes
        // the round a plain timeout (the checks below hold either way).
        while !waits.is_finished() && Instant::now() < deadline {
            let info = holder.inspect(&key).await.unwrap();
            if info.and_then(|i| i.waiters).is_none_or(|w| w >= 1) {
                break;
            }
            sleep(Duration::from_millis(5)).await;
        }
        let at = if offset < 0 {
            deadline - Duration::from_millis(offset.unsigned_abs())
        } else {
            deadline + Duration::from_millis(offset.unsigned_abs())
        };
        sleep_until(at).await;
        assert!(
            release(&holder, &lease).await,
            "{what}: the holder lost its lock"
        );
        let result = timeout(SLACK * 2, waits)
            .await
            .unwrap_or_else(|_| panic!("{what}: acquire did not return near its deadline"))
            .unwrap();
        match result {
            Ok(got) => {
                kept += 1;
                let seen = holder_of(&other, &key)
                    .await
                    .unwrap_or_else(|| panic!("{what}: acquire returned Ok, but the key is free"));
                assert!(seen.may_be(&got), "{what}: Ok, but {seen:?} holds the key");
                assert!(
                    other.try_acquire(&key, LONG_TTL).await.unwrap().is_none(),
                    "{what}: Ok, but a third client took the key"
                );
                if let (Some(before), Some(now)) = (lease.fencing_token(), got.fencing_token()) {
                    assert!(now > before, "{what}: fence {now:?} after {before:?}");
                }
                assert!(
                    release(&waiter, &got).await,
                    "{what}: Ok, but not releasable"
                );
            }
            Err(Error::Timeout { .. }) => {
                timed_out += 1;
                let got = match other.acquire(&key, LONG_TTL, Instant::now() + SLACK).await {
                    Ok(got) => got,
                    Err(e) => panic!(
                        "{what}: Timeout, but the key stays blocked (a grant nobody holds): {e}"
                    ),
                };
                if let (Some(before), Some(now)) = (lease.fencing_token(), got.fencing_token()) {
                    assert!(now > before, "{what}: fence {now:?} after {before:?}");
                }
                assert!(release(&other, &got).await);
            }
            Err(e) => panic!("{what}: acquire failed: {e}"),
        }
    }
    eprintln!("grant at the deadline: {kept} kept, {timed_out} timed out");
    Outcome::Passed
}
